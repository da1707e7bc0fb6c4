"""speculative: AtSpeed speculative beam search (strict and relaxed) with every trained draft against `beam_search`
of the same target on the same Amazon Beauty prompts, in the layout of the AtSpeed paper's Table 1 (WS@K = walltime
speed-up over beam_search from the medians of interleaved repeats, AS@K = accepted steps per target verification),
at batch size 1 and at a throughput batch size. Per batch size and K, beam_search, every draft x {strict, relaxed}
(and at batch size 1 `transformers` beam search) run interleaved.
"""

from __future__ import annotations

from itertools import chain

import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.models import load_model
from decoding.reference import cpu_trie, generate_beam_search
from decoding.speculative import speculative_beam_search
from pipeline.bench.common import Interleaved, aligned, fmt_ratio, fmt_spread, footer, progress, ratio
from pipeline.bench.inputs import (
    beauty_section,
    interleaved_in_batches,
    load_drafts,
    parameters,
    ranked,
    require_models,
)
from pipeline.bench.params import SpeculativeParams
from pipeline.markdown import table

MODES = ("strict", "relaxed")


def run_speculative(p: SpeculativeParams) -> dict:
    """The speculative section's figures."""
    require_models(p.target, p.drafts)
    device, _, catalog, ids, mask = beauty_section(p, p.target, max(p.users, p.throughput_users))
    target = load_model(p.target, device=str(device), dtype=p.dtype)
    drafts = load_drafts(p.drafts, device)
    return {
        "speculative": {
            "target_parameters": parameters(target),
            "repeats": p.repeats,
            "draft_parameters": {name: parameters(d) for name, d in drafts.items()},
            "batches": [
                bench_table(p, target, drafts, catalog, ids[:users], mask[:users], batch)
                for batch, users in ((1, p.users), (p.batch, p.throughput_users))
            ],
        }
    }


def bench_table(
    p: SpeculativeParams, target, drafts: dict, catalog: Catalog, ids: torch.Tensor, mask: torch.Tensor, batch: int
) -> dict:
    """One batch size over the users [U, S]: a row per K."""
    trie = cpu_trie(catalog.to("cpu")) if batch == 1 and p.with_transformers else None
    rows = {
        k: bench_row(p, target, drafts, catalog, ids, mask, batch, k, trie)
        for k in progress(p.ks, f"speculative: batch {batch}, K")
    }
    return {"batch": batch, "users": ids.shape[0], "k": rows}


def bench_row(
    p: SpeculativeParams,
    target,
    drafts: dict,
    catalog: Catalog,
    ids: torch.Tensor,
    mask: torch.Tensor,
    batch: int,
    k: int,
    trie: dict | None,
) -> dict:
    """One K: beam_search, (transformers,) every draft x mode, interleaved over the same batches -> the row."""
    g = torch.Generator(device=ids.device)
    fns = row_decoders(p, target, drafts, catalog, k, trie, g)
    run = interleaved_in_batches(fns, ids, mask, batch, p.repeats, g, p.seed, f"speculative: batch {batch}, K={k}")
    row = beam_search_row(run, ids.shape[0])
    if trie is not None:
        t_hf, t_beam = run.timings["transformers"], run.timings["beam_search"]
        row.update(transformers=t_hf.to_dict(), beam_search_vs_transformers=ratio(t_hf, t_beam))
    ref_items = ranked(run.outputs["beam_search"])[0]  # [U, k]
    row["drafts"] = {key: draft_cell(run, key, ref_items) for key in fns if "|" in key}
    return row


def row_decoders(
    p: SpeculativeParams, target, drafts: dict, catalog: Catalog, k: int, trie: dict | None, g: torch.Generator
) -> dict:
    """name -> fn(ids, mask): beam_search, transformers (given a trie), and every draft x verification mode, named
    "draft|mode", the relaxed ones drawing from `g`."""
    fns = {"beam_search": lambda i, m: beam_search(target, i, m, catalog, k)}
    if trie is not None:
        fns["transformers"] = lambda i, m: generate_beam_search(target, i, m, catalog, k, trie)
    for name, draft in drafts.items():
        for mode in MODES:
            fns[f"{name}|{mode}"] = lambda i, m, d=draft, v=mode: speculative_beam_search(
                target,
                d,
                i,
                m,
                catalog,
                k,
                draft_beams=max(p.draft_beams, k) if v == "strict" else None,
                gamma=p.gamma,
                verification=v,
                temperature=p.temperature,
                generator=g,
            )
    return fns


def beam_search_row(run: Interleaved, users: int) -> dict:
    """A K's row as far as beam_search goes: its timing, users/s and target forwards, the run order; drafts to come."""
    t_beam, ref = run.timings["beam_search"], run.outputs["beam_search"]
    return {
        "beam_search": t_beam.to_dict(),
        "beam_search_users_per_s": t_beam.per(lambda s: users / s),
        "beam_search_target_forwards": sum(r.stats["target_forwards"] for r in ref),
        "order": run.order,
        "drafts": {},
    }


def draft_cell(run: Interleaved, key: str, ref_items: torch.Tensor) -> dict:
    """One draft x mode: WS (beam_search's time over its own, ratio of medians with the range), AS (accepted steps
    per target verification), forwards; WS over transformers when it ran; strict: the share of users whose items
    are beam_search's `ref_items` [U, k]."""
    t, recs = run.timings[key], run.outputs[key]
    ws = ratio(run.timings["beam_search"], t)
    accepted = torch.cat([r.stats["accepted_steps"] for r in recs]).float()  # [U]
    rounds = torch.cat([r.stats["rounds"] for r in recs]).float().clamp(min=1)  # [U]
    cell = {
        "timing": t.to_dict(),
        "ws": ws["median"],
        "ws_range": [ws["low"], ws["high"]],
        "within_noise": ws["within_noise"],
        "as": float((accepted / rounds).mean()),
        "target_forwards": sum(r.stats["target_forwards"] for r in recs),
        "draft_forwards": sum(r.stats["draft_forwards"] for r in recs),
    }
    if "transformers" in run.timings:
        cell["ws_vs_transformers"] = ratio(run.timings["transformers"], t)["median"]
    if key.endswith("|strict"):
        same = (ranked(recs)[0] == ref_items).all(1)  # [U]
        cell["same_as_beam_search"] = float(same.float().mean())
    return cell


def markdown_speculative(result: dict) -> str:
    env, s = result["environment"], result["speculative"]
    lines = [
        f"## speculative beam search vs beam_search ({env['device']}; target {s['target_parameters']:,} "
        f"parameters; WS@K = walltime speed-up over beam_search, ratio of medians (range) of {s['repeats']} "
        "interleaved repeats, ≈ where the ranges overlap; AS@K = accepted steps per target verification)"
    ]
    for batch in s["batches"]:
        lines += [
            "",
            f"### batch size {batch['batch']}, {batch['users']} Amazon Beauty users",
            "",
            table1(batch),
            f"\nstrict results identical to beam_search for {strict_same([batch]):.0%} of users or more "
            "(every draft, every K).",
        ]
    lines += ["", footer(env)]
    return "\n".join(lines)


def table1(batch: dict) -> str:
    """One batch size in the AtSpeed paper's Table 1 layout: a row per draft x verification with WS@K and AS@K per
    K; beam_search's users/s, and (batch size 1) WS over transformers of beam_search and of the best draft."""
    ks, rows = list(batch["k"]), list(batch["k"].values())
    body = [[*key.split("|"), *chain(*(_ws_as(r["drafts"][key]) for r in rows))] for key in rows[0]["drafts"]]
    body.append(["beam_search users/s", "", *chain(*((fmt_spread(r["beam_search_users_per_s"], 1), "") for r in rows))])
    if "transformers" in rows[0]:
        body.append(["WS vs transformers (beam_search / best draft)", "", *chain(*((_vs_hf(r), "") for r in rows))])
    header = ["draft", "verification", *chain(*((f"WS@{k}", f"AS@{k}") for k in ks))]
    return table(header, body, aligned(2, 2 * len(ks)))


def _ws_as(cell: dict) -> tuple[str, str]:
    """A draft x mode at one K -> its WS@K cell ('≈' when the range holds 1) and its AS@K cell."""
    return f"{'≈' if cell['within_noise'] else ''}{fmt_ratio(_ws(cell))}", f"{cell['as']:.2f}"


def _vs_hf(row: dict) -> str:
    """'3.1 / 4.2': WS over transformers of beam_search and of the best draft at one K."""
    best = max(row["drafts"].values(), key=lambda c: c["ws"])
    return f"{row['beam_search_vs_transformers']['median']:.1f} / {best['ws_vs_transformers']:.1f}"


def strict_same(batches: list[dict]) -> float:
    """The smallest share of users for whom strict speculative returned beam_search's items, over every draft, K and
    batch size of `batches`."""
    return min(
        c["same_as_beam_search"]
        for t in batches
        for row in t["k"].values()
        for c in row["drafts"].values()
        if "same_as_beam_search" in c
    )


def _ws(cell: dict) -> dict:
    return {"median": cell["ws"], "low": cell["ws_range"][0], "high": cell["ws_range"][1]}


def verdict_speculative(r: dict) -> str:
    """Strict agreement, and per batch size the best WS@K by median ('within noise' if its range holds 1)."""
    s = r["speculative"]
    best = []
    for t in s["batches"]:
        cell, k, key = max(
            ((c, k, key) for k, row in t["k"].items() for key, c in row["drafts"].items()), key=lambda x: x[0]["ws"]
        )
        noise = ", within noise of beam_search" if cell["within_noise"] else ""
        best.append(f"batch {t['batch']} {fmt_ratio(_ws(cell))} ({key.replace('|', ' ')}, K={k}{noise})")
    return (
        f"strict speculative identical to beam_search on {strict_same(s['batches']):.0%} of users (every draft, "
        f"every K); best WS@K over beam_search by median: {', '.join(best)}"
    )
