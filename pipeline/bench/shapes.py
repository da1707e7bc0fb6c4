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
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pipeline.bench.common import Timing, environment, fmt_ratio, fmt_spread, footer, progress, ratio, run_order
from pipeline.bench.params import ShapesParams

METHODS = ("beam_search", "beam_search_compiled", "transformers")
CODE_TOKENS = 1024  # 4 levels x 256 codes: Beauty's semantic IDs


def run_shapes(p: ShapesParams, command: str) -> tuple[dict, str]:
    result = {"args": asdict(p), "environment": environment(p.device, command), "shapes": bench_shapes(p)}
    return result, markdown_shapes(result)


def bench_shapes(p: ShapesParams) -> dict:
    items = Path(p.data) / "items.parquet"
    if not items.is_file():
        raise FileNotFoundError(f"{items} not found: run `python -m jobs.prepare_data --out {p.data}` first")
    unknown = sorted(set(p.methods) - set(METHODS))
    if unknown or not p.methods:
        raise ValueError(f"bench shapes: unknown methods {unknown}; choose from {list(METHODS)}")
    methods = [m for m in METHODS if m in p.methods]
    cells = list(itertools.product(p.vocabs, p.prompts, p.ks))
    rows = []
    bar = progress(desc="shapes: cells x methods x repeats", total=len(cells) * len(methods) * p.repeats, leave=True)
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, prompt, k in cells:
            runs = {m: [] for m in methods}
            for order in run_order(methods, p.repeats):
                for method in order:
                    bar.set_postfix_str(f"V={vocab} S={prompt} K={k} {method}")
                    spec = dict(
                        vocab=vocab,
                        prompt=prompt,
                        k=k,
                        users=p.users,
                        batch=p.batch,
                        layers=p.layers,
                        hidden=p.hidden,
                        heads=p.heads,
                        seed=p.seed,
                        device=p.device,
                        dtype=p.dtype,
                        items=str(items),
                        method=method,
                        out=f"{tmp}/{method}.npz",
                    )
                    runs[method].append(worker_process(spec))
                    bar.update()
            rows.append(cell_row(vocab, prompt, k, p.users, runs, tmp))
    bar.close()
    return {
        "model": {"layers": p.layers, "hidden": p.hidden, "heads": p.heads},
        "users": p.users,
        "batch": p.batch,
        "repeats": p.repeats,
        "cells": rows,
    }


def worker_process(spec: dict) -> dict:
    """One method on one cell in a fresh process -> its JSON line (seconds, working memory)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "pipeline.bench.shapes", json.dumps(spec)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
    )
    if run.returncode != 0:
        raise RuntimeError(f"shapes worker {spec['method']} failed: {run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


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
    lines = [
        f"## shapes: {' vs '.join(methods)}, {s['users']} users in batches of {s['batch']}, a random Llama "
        f"{m['layers']} x {m['hidden']} ({m['heads']} heads), Amazon Beauty's catalog after a text vocabulary; "
        f"each method in its own process, alternating; median (min-max) of {s['repeats']} repeats; working "
        "memory = peak RSS after decoding minus peak after building the model; compile: the compiled engine's "
        "cold run, first repeat (later repeats load the inductor cache)",
        "",
        "| vocabulary | prompt | K | " + " | ".join(f"{x} users/s" for x in methods) + " | speed-up | working "
        f"memory (MB) {' / '.join(methods)} | same items, same order as "
        f"{s['cells'][0]['reference'] if methods else '-'} |",
        "|---:|---:|---:|" + "---:|" * (len(methods) + 3),
    ]
    for c in s["cells"]:
        u, w = c["users_per_s"], c["working_mb"]
        speed = [f"beam_search / transformers {fmt_ratio(c['speedup'], 1)}"] if "speedup" in c else []
        if "compiled_speedup" in c:
            speed.append(f"compiled / eager {fmt_ratio(c['compiled_speedup'])} (compile {c['compile_s'][0]:.0f} s)")
        agree = "; ".join(
            f"{x}: {a['same_items_same_order']:.0%} (max score diff {a['max_abs_score_diff']:.1e})"
            for x, a in c["agreement"].items()
        )
        lines.append(
            f"| {c['vocab']:,} | {c['prompt']} | {c['k']} | "
            + " | ".join(fmt_spread(u[x], 2) for x in methods)
            + f" | {'; '.join(speed) or '-'} | "
            + " / ".join(f"{w[x]['median']:.0f}" for x in methods)
            + f" | {agree} |"
        )
    return "\n".join(lines + ["", footer(env)])


# ------------------------------------------------------------------ the worker (its own process)


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def catalog_after_text(items: str, vocab: int, device):
    """A prepared catalog's semantic IDs (L levels x 256 codes) as the last L * 256 token ids of a `vocab`-token
    vocabulary, as an LLM's added code tokens sit after its text vocabulary."""
    import pyarrow.parquet as pq

    from decoding.catalog import Catalog

    table = pq.read_table(items, columns=["item_id", "semantic_id"])
    sid = np.asarray(table["semantic_id"].to_pylist(), dtype=np.int64)  # [N, L]
    tokens = vocab - sid.shape[1] * 256 + np.arange(sid.shape[1]) * 256 + sid
    return Catalog.from_token_ids(table["item_id"].to_numpy(), tokens, vocab, on_duplicate="first", device=device)


def worker(spec: dict) -> dict:
    import torch

    from decoding.beam import beam_search
    from decoding.compiled import compile_totals
    from decoding.models import pick_device, pick_dtype, tiny_model
    from decoding.reference import cpu_trie, generate_beam_search

    device = pick_device(spec["device"])
    torch.manual_seed(spec["seed"])
    vocab, prompt, k = spec["vocab"], spec["prompt"], spec["k"]
    catalog = catalog_after_text(spec["items"], vocab, device)
    model = tiny_model(
        "llama",
        vocab,
        seed=spec["seed"],
        hidden_size=spec["hidden"],
        intermediate_size=4 * spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"],
        max_position_embeddings=max(2048, prompt + 8),
        dtype=pick_dtype(spec["dtype"], device),
    ).to(device)
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(4, vocab - CODE_TOKENS, (spec["users"], prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    if spec["method"].startswith("beam_search"):
        engine = "compiled" if spec["method"] == "beam_search_compiled" else "eager"
        decode = lambda i, m: beam_search(model, i, m, catalog, k, engine=engine)  # noqa: E731
    else:
        trie = cpu_trie(catalog.to("cpu"))
        decode = lambda i, m: generate_beam_search(model, i, m, catalog, k, trie)  # noqa: E731

    def run():
        out = [
            decode(ids[a : a + spec["batch"]], mask[a : a + spec["batch"]]) for a in range(0, len(ids), spec["batch"])
        ]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    before = peak_rss_mb()
    run()  # cold: the decode's working memory
    working = (
        (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else peak_rss_mb() - before
    )
    t0 = time.perf_counter()
    out = run()  # warm: the time
    seconds = time.perf_counter() - t0
    if spec["method"].startswith("beam_search"):
        items = torch.cat([r.item_ids for r in out]).cpu().numpy()
        scores = torch.cat([r.scores for r in out]).float().cpu().numpy()
    else:
        items = torch.cat([r[0] for r in out]).cpu().numpy()
        scores = torch.cat([r[2] for r in out]).float().cpu().numpy()
    np.savez(spec["out"], items=items, scores=scores)
    return {"seconds": seconds, "working_mb": working, "compile_s": compile_totals(model)[0]}


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
