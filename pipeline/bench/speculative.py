"""speculative: AtSpeed speculative beam search (strict and relaxed) with every trained draft against `beam_search`
of the same target on the same Amazon Beauty prompts, in the layout of the AtSpeed paper's Table 1 (WS@K = walltime
speed-up over beam_search from the medians of interleaved repeats, AS@K = accepted steps per target verification),
at batch size 1 and at a throughput batch size. Per batch size and K, beam_search, every draft x {strict, relaxed}
(and at batch size 1 `transformers` beam search) run interleaved.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.models import load_model, pick_device
from decoding.reference import cpu_trie, generate_beam_search
from decoding.speculative import speculative_beam_search
from pipeline.bench.common import environment, fmt_ratio, fmt_spread, footer, interleaved, progress, ratio
from pipeline.bench.inputs import in_batches, load_beauty, load_drafts, parameters, require_models
from pipeline.bench.params import SpeculativeParams

MODES = ("strict", "relaxed")


def run_speculative(p: SpeculativeParams, command: str) -> tuple[dict, str]:
    """The speculative section -> (result, Markdown)."""
    require_models(p.target, p.drafts)
    device = pick_device(p.device)
    torch.manual_seed(p.seed)
    target = load_model(p.target, device=str(device), dtype=p.dtype)
    drafts = load_drafts(p.drafts, device)
    _, catalog, ids, mask = load_beauty(
        Path(p.data), max(p.users, p.throughput_users), p.history_len, device, Path(p.target)
    )
    body = {
        "target_parameters": parameters(target),
        "repeats": p.repeats,
        "draft_parameters": {name: parameters(d) for name, d in drafts.items()},
        "batches": [
            bench_table(p, target, drafts, catalog, ids[:users], mask[:users], batch)
            for batch, users in ((1, p.users), (p.batch, p.throughput_users))
        ],
    }
    result = {"args": asdict(p), "environment": environment(p.device, command), "speculative": body}
    return result, markdown_speculative(result)


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
    device, users = ids.device, ids.shape[0]
    g = torch.Generator(device=device)
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

    def seeded(fn, i, m):  # every call draws the same: relaxed outputs are the same in every repeat
        g.manual_seed(p.seed)
        return in_batches(fn, i, m, batch)

    run = interleaved(
        {n: lambda f=f: seeded(f, ids, mask) for n, f in fns.items()},
        p.repeats,
        device,
        warmup={n: lambda f=f: seeded(f, ids[:batch], mask[:batch]) for n, f in fns.items()},
        desc=f"speculative: batch {batch}, K={k}",
    )
    t_beam, ref = run.timings["beam_search"], run.outputs["beam_search"]
    ref_items = torch.cat([r.item_ids for r in ref])  # [U, k]
    row = {
        "beam_search": t_beam.to_dict(),
        "beam_search_users_per_s": t_beam.per(lambda s: users / s),
        "beam_search_target_forwards": sum(r.stats["target_forwards"] for r in ref),
        "order": run.order,
        "drafts": {},
    }
    if trie is not None:
        row.update(
            transformers=run.timings["transformers"].to_dict(),
            beam_search_vs_transformers=ratio(run.timings["transformers"], t_beam),
        )
    for key in fns:
        if "|" not in key:
            continue
        t, recs = run.timings[key], run.outputs[key]
        ws = ratio(t_beam, t)
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
        if trie is not None:
            cell["ws_vs_transformers"] = ratio(run.timings["transformers"], t)["median"]
        if key.endswith("|strict"):
            same = (torch.cat([r.item_ids for r in recs]) == ref_items).all(1)  # [U]
            cell["same_as_beam_search"] = float(same.float().mean())
        row["drafts"][key] = cell
    return row


def markdown_speculative(result: dict) -> str:
    env, s = result["environment"], result["speculative"]
    lines = [
        f"## speculative beam search vs beam_search ({env['device']}; target {s['target_parameters']:,} "
        f"parameters; WS@K = walltime speed-up over beam_search, ratio of medians (range) of {s['repeats']} "
        "interleaved repeats, ≈ where the ranges overlap; AS@K = accepted steps per target verification)"
    ]
    for table in s["batches"]:
        ks = list(table["k"])
        first = table["k"][ks[0]]
        lines += [
            "",
            f"### batch size {table['batch']}, {table['users']} Amazon Beauty users",
            "",
            "| draft | verification | " + " | ".join(f"WS@{k} | AS@{k}" for k in ks) + " |",
            "|---|---|" + "---:|---:|" * len(ks),
        ]
        for key in first["drafts"]:
            name, mode = key.split("|")
            cells = [table["k"][k]["drafts"][key] for k in ks]
            lines.append(
                f"| {name} | {mode} | "
                + " | ".join(f"{'≈' if c['within_noise'] else ''}{fmt_ratio(_ws(c))} | {c['as']:.2f}" for c in cells)
                + " |"
            )
        lines.append(
            "| beam_search users/s | | "
            + " | ".join(f"{fmt_spread(table['k'][k]['beam_search_users_per_s'], 1)} | " for k in ks)
            + " |"
        )
        if "transformers" in first:
            best = {k: max(table["k"][k]["drafts"].values(), key=lambda c: c["ws"]) for k in ks}
            lines.append(
                "| WS vs transformers (beam_search / best draft) | | "
                + " | ".join(
                    f"{table['k'][k]['beam_search_vs_transformers']['median']:.1f} / "
                    f"{best[k]['ws_vs_transformers']:.1f} | "
                    for k in ks
                )
                + " |"
            )
        strict_same = [
            c["same_as_beam_search"] for k in ks for c in table["k"][k]["drafts"].values() if "same_as_beam_search" in c
        ]
        lines.append(
            f"\nstrict results identical to beam_search for {min(strict_same):.0%} of users or more "
            "(every draft, every K)."
        )
    lines += ["", footer(env)]
    return "\n".join(lines)


def _ws(cell: dict) -> dict:
    return {"median": cell["ws"], "low": cell["ws_range"][0], "high": cell["ws_range"][1]}


def verdict_speculative(r: dict) -> str:
    """Strict agreement, and per batch size the best WS@K by median ('within noise' if its range holds 1)."""
    s = r["speculative"]
    strict = [
        c["same_as_beam_search"]
        for t in s["batches"]
        for row in t["k"].values()
        for c in row["drafts"].values()
        if "same_as_beam_search" in c
    ]
    best = []
    for t in s["batches"]:
        cell, k, key = max(
            ((c, k, key) for k, row in t["k"].items() for key, c in row["drafts"].items()), key=lambda x: x[0]["ws"]
        )
        noise = ", within noise of beam_search" if cell["within_noise"] else ""
        best.append(f"batch {t['batch']} {fmt_ratio(_ws(cell))} ({key.replace('|', ' ')}, K={k}{noise})")
    return (
        f"strict speculative identical to beam_search on {min(strict):.0%} of users (every draft, every K); "
        f"best WS@K over beam_search by median: {', '.join(best)}"
    )
