"""shapes: `beam_search` against `transformers` beam search at the shapes real LLM recommenders have: vocabulary x
prompt length x K, a random Llama of layers x hidden, Amazon Beauty's catalog with its 1,024 code tokens appended after
a text vocabulary, random text prompts of the given length. `--methods` picks the methods: beam_search (the eager
engine), beam_search_compiled (decoding/compiled.py: its cold run compiles, compile_s records it) and transformers.

Every (cell, method, repeat) runs in its own process (`python -m pipeline.bench.shapes WORKER_JSON`), the methods
alternating (A B, B A, ...): the process builds the model, notes its peak RSS, decodes every user once (cold: its peak
RSS minus the one after building the model is the decode's working memory; on CUDA the allocator's peak instead),
then again (warm: the users/s). Cells report medians with (min-max) over the repeats, the speed-up as a ratio of
medians, and whether the two methods returned the same items in the same order for every user.
"""

from __future__ import annotations

import itertools
import json
import resource
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.compiled import compile_totals
from decoding.models import pick_device, pick_dtype, tiny_model
from decoding.reference import cpu_trie, generate_beam_search
from pipeline.bench.common import (
    PeakMemory,
    Timing,
    fmt_ratio,
    fmt_spread,
    footer,
    in_fresh_process,
    progress,
    ratio,
    run_order,
    timed,
)
from pipeline.bench.inputs import in_batches, llama, random_prompts, ranked
from pipeline.bench.params import ShapesParams
from pipeline.markdown import table

METHODS = ("beam_search", "beam_search_compiled", "transformers")
CODE_TOKENS = 1024  # 4 levels x 256 codes: Beauty's semantic IDs
WORKER_PARAMS = ("users", "batch", "layers", "hidden", "heads", "seed", "device", "dtype")  # what a worker is given


def run_shapes(p: ShapesParams) -> dict:
    return {"shapes": bench_shapes(p)}


def bench_shapes(p: ShapesParams) -> dict:
    items = Path(p.data) / "items.parquet"
    if not items.is_file():
        raise FileNotFoundError(f"{items} not found: run `python -m jobs.prepare_data --out {p.data}` first")
    unknown = sorted(set(p.methods) - set(METHODS))
    if unknown or not p.methods:
        raise ValueError(f"bench shapes: unknown methods {unknown}; choose from {list(METHODS)}")
    methods = [m for m in METHODS if m in p.methods]
    cells = list(itertools.product(p.vocabs, p.prompts, p.ks))
    bar = progress(desc="shapes: cells x methods x repeats", total=len(cells) * len(methods) * p.repeats, leave=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_cell(p, cell, methods, str(items), tmp, bar) for cell in cells]
    bar.close()
    return {
        "model": {"layers": p.layers, "hidden": p.hidden, "heads": p.heads},
        "users": p.users,
        "batch": p.batch,
        "repeats": p.repeats,
        "cells": rows,
    }


def bench_cell(p: ShapesParams, cell: tuple, methods: list[str], items: str, tmp: str, bar) -> dict:
    """One (vocabulary, prompt, K) cell: every method in a fresh process, p.repeats times, the order rotated."""
    vocab, prompt, k = cell
    runs = {m: [] for m in methods}
    for order in run_order(methods, p.repeats):
        for method in order:
            bar.set_postfix_str(f"V={vocab} S={prompt} K={k} {method}")
            spec = {key: getattr(p, key) for key in WORKER_PARAMS}
            spec.update(vocab=vocab, prompt=prompt, k=k, items=items, method=method, out=f"{tmp}/{method}.npz")
            runs[method].append(in_fresh_process("pipeline.bench.shapes", spec, f"shapes worker {method}"))
            bar.update()
    return cell_row(vocab, prompt, k, p.users, runs, tmp)


def cell_row(vocab: int, prompt: int, k: int, users: int, runs: dict, tmp: str) -> dict:
    """One cell: each method's users/s and working memory (median, min, max over the repeats), the speed-ups
    (beam_search over transformers, compiled over eager) and each method's agreement with the reference (transformers
    when it ran, else beam_search) on the last repeat: same items in the same order, largest score difference."""
    methods = list(runs)
    timing = {m: Timing([r["seconds"] for r in runs[m]]) for m in methods}
    memory = {m: [r["working_mb"] for r in runs[m]] for m in methods}
    out = {m: np.load(f"{tmp}/{m}.npz") for m in methods}  # the last repeat's outputs
    ref = "transformers" if "transformers" in out else "beam_search"
    row = {
        "vocab": vocab,
        "prompt": prompt,
        "k": k,
        "reference": ref,
        "users_per_s": {m: timing[m].per(lambda s: users / s) for m in methods},
        "working_mb": {
            m: {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v))} for m, v in memory.items()
        },
        "seconds": {m: timing[m].to_dict() for m in methods},
        "agreement": {
            m: {
                "same_items_same_order": float((out[m]["items"] == out[ref]["items"]).all(1).mean()),
                "max_abs_score_diff": float(np.abs(out[m]["scores"] - out[ref]["scores"]).max()),
            }
            for m in methods
            if m != ref
        },
    }
    if {"beam_search", "transformers"} <= set(methods):
        row["speedup"] = ratio(timing["transformers"], timing["beam_search"])
        row.update(row["agreement"]["beam_search"])  # the columns the grid has always had
    if {"beam_search", "beam_search_compiled"} <= set(methods):
        row["compiled_speedup"] = ratio(timing["beam_search"], timing["beam_search_compiled"])
        row["compile_s"] = [r["compile_s"] for r in runs["beam_search_compiled"]]  # each repeat's cold run
    return row


def markdown_shapes(result: dict) -> str:
    s, env = result["shapes"], result["environment"]
    m = s["model"]
    methods = list(s["cells"][0]["users_per_s"]) if s["cells"] else []
    header = [
        "vocabulary",
        "prompt",
        "K",
        *(f"{x} users/s" for x in methods),
        "speed-up",
        f"working memory (MB) {' / '.join(methods)}",
        f"same items, same order as {s['cells'][0]['reference'] if methods else '-'}",
    ]
    lines = [
        f"## shapes: {' vs '.join(methods)}, {s['users']} users in batches of {s['batch']}, a random Llama "
        f"{m['layers']} x {m['hidden']} ({m['heads']} heads), Amazon Beauty's catalog after a text vocabulary; "
        f"each method in its own process, alternating; median (min-max) of {s['repeats']} repeats; working "
        "memory = peak RSS after decoding minus peak after building the model; compile: the compiled engine's "
        "cold run, first repeat (later repeats load the inductor cache)",
        "",
        table(header, [shape_cells(c, methods) for c in s["cells"]]),
    ]
    return "\n".join(lines + ["", footer(env)])


def shape_cells(c: dict, methods: list[str]) -> list[str]:
    """One cell's row: users/s per method, the speed-ups, working memory per method, agreement with the reference."""
    speed = [f"beam_search / transformers {fmt_ratio(c['speedup'], 1)}"] if "speedup" in c else []
    if "compiled_speedup" in c:
        speed.append(f"compiled / eager {fmt_ratio(c['compiled_speedup'])} (compile {c['compile_s'][0]:.0f} s)")
    agree = "; ".join(
        f"{x}: {a['same_items_same_order']:.0%} (max score diff {a['max_abs_score_diff']:.1e})"
        for x, a in c["agreement"].items()
    )
    return [
        f"{c['vocab']:,}",
        c["prompt"],
        c["k"],
        *(fmt_spread(c["users_per_s"][x], 2) for x in methods),
        "; ".join(speed) or "-",
        " / ".join(f"{c['working_mb'][x]['median']:.0f}" for x in methods),
        agree,
    ]


# ------------------------------------------------------------------ the worker (its own process)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def catalog_after_text(items: str, vocab: int, device) -> Catalog:
    """A prepared catalog's semantic IDs (L levels x 256 codes) as the last L * 256 token ids of a `vocab`-token
    vocabulary, as an LLM's added code tokens sit after its text vocabulary."""
    table = pq.read_table(items, columns=["item_id", "semantic_id"])
    sid = np.asarray(table["semantic_id"].to_pylist(), dtype=np.int64)  # [N, L]
    tokens = vocab - sid.shape[1] * 256 + np.arange(sid.shape[1]) * 256 + sid
    return Catalog.from_token_ids(table["item_id"].to_numpy(), tokens, vocab, on_duplicate="first", device=device)


def worker(spec: dict) -> dict:
    """One method on one cell, in this (fresh) process: decodes every user once cold (its working memory), then
    again warm (its seconds); writes the warm run's items and scores to spec["out"]."""
    device = pick_device(spec["device"])
    torch.manual_seed(spec["seed"])
    vocab, prompt = spec["vocab"], spec["prompt"]
    catalog = catalog_after_text(spec["items"], vocab, device)
    model = tiny_model(
        "llama",
        vocab,
        seed=spec["seed"],
        max_position_embeddings=max(2048, prompt + 8),
        dtype=pick_dtype(spec["dtype"], device),
        **llama(spec["hidden"], spec["layers"], spec["heads"]),
    ).to(device)
    ids = random_prompts(spec["users"], prompt, vocab - CODE_TOKENS, spec["seed"] + 1, device)
    mask = torch.ones_like(ids)
    decode = partial(in_batches, worker_decoder(spec["method"], model, catalog, spec["k"]), ids, mask, spec["batch"])
    working = working_memory(decode, device)  # cold
    out, seconds, _ = timed(decode, device)  # warm: the time
    items, scores = ranked(out)
    np.savez(spec["out"], items=items.cpu().numpy(), scores=scores.float().cpu().numpy())
    return {"seconds": seconds, "working_mb": working, "compile_s": compile_totals(model)[0]}


def worker_decoder(method: str, model, catalog: Catalog, k: int):
    """The method as fn(ids, mask): beam_search's eager or compiled engine, or transformers over a CPU trie."""
    if method.startswith("beam_search"):
        engine = "compiled" if method == "beam_search_compiled" else "eager"
        return lambda i, m: beam_search(model, i, m, catalog, k, engine=engine)
    trie = cpu_trie(catalog.to("cpu"))
    return lambda i, m: generate_beam_search(model, i, m, catalog, k, trie)


def working_memory(fn, device: torch.device) -> float:
    """MB that fn() needs above what the process held before it: on CUDA the allocator's peak above its start; on
    the CPU the process's peak RSS after the call minus the one before (the model's, in a fresh process)."""
    if device.type == "cuda":
        with PeakMemory(device) as mem:
            fn()
        return mem.peak / 2**20
    before = peak_rss_mb()
    fn()
    return peak_rss_mb() - before


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
