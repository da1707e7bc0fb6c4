"""shapes: `beam_search` against `transformers` beam search at the shapes real LLM recommenders have: vocabulary x prompt
length x K, a random Llama of layers x hidden, Amazon Beauty's catalog with its 1,024 code tokens appended after a
text vocabulary, random text prompts of the given length.

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

METHODS = ("beam_search", "transformers")
CODE_TOKENS = 1024  # 4 levels x 256 codes: Beauty's semantic IDs


def run_shapes(p: ShapesParams, command: str) -> tuple[dict, str]:
    result = {"args": asdict(p), "environment": environment(p.device, command), "shapes": bench_shapes(p)}
    return result, markdown_shapes(result)


def bench_shapes(p: ShapesParams) -> dict:
    items = Path(p.data) / "items.parquet"
    if not items.is_file():
        raise FileNotFoundError(f"{items} not found: run `python -m jobs.prepare_data --out {p.data}` first")
    cells = list(itertools.product(p.vocabs, p.prompts, p.ks))
    rows = []
    bar = progress(desc="shapes: cells x methods x repeats", total=len(cells) * len(METHODS) * p.repeats, leave=True)
    with tempfile.TemporaryDirectory() as tmp:
        for vocab, prompt, k in cells:
            runs = {m: [] for m in METHODS}
            for order in run_order(list(METHODS), p.repeats):
                for method in order:
                    bar.set_postfix_str(f"V={vocab} S={prompt} K={k} {method}")
                    spec = dict(vocab=vocab, prompt=prompt, k=k, users=p.users, batch=p.batch, layers=p.layers,
                                hidden=p.hidden, heads=p.heads, seed=p.seed, device=p.device, dtype=p.dtype,
                                items=str(items), method=method, out=f"{tmp}/{method}.npz")
                    runs[method].append(worker_process(spec))
                    bar.update()
            rows.append(cell_row(vocab, prompt, k, p.users, runs, tmp))
    bar.close()
    return {"model": {"layers": p.layers, "hidden": p.hidden, "heads": p.heads}, "users": p.users, "batch": p.batch,
            "repeats": p.repeats, "cells": rows}


def worker_process(spec: dict) -> dict:
    """One method on one cell in a fresh process -> its JSON line (seconds, working memory)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pipeline.bench.shapes", json.dumps(spec)], cwd=root, env=env,
                         capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"shapes worker {spec['method']} failed: {run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def cell_row(vocab: int, prompt: int, k: int, users: int, runs: dict, tmp: str) -> dict:
    timing = {m: Timing([r["seconds"] for r in runs[m]]) for m in METHODS}
    memory = {m: [r["working_mb"] for r in runs[m]] for m in METHODS}
    ours, ref = (np.load(f"{tmp}/{m}.npz") for m in METHODS)  # the last repeat's outputs
    return {"vocab": vocab, "prompt": prompt, "k": k,
            "users_per_s": {m: timing[m].per(lambda s: users / s) for m in METHODS},
            "working_mb": {m: {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v))}
                           for m, v in memory.items()},
            "seconds": {m: timing[m].to_dict() for m in METHODS},
            "speedup": ratio(timing["transformers"], timing["beam_search"]),
            "same_items_same_order": float((ours["items"] == ref["items"]).all(1).mean()),
            "max_abs_score_diff": float(np.abs(ours["scores"] - ref["scores"]).max())}


def markdown_shapes(result: dict) -> str:
    s, env = result["shapes"], result["environment"]
    m = s["model"]
    lines = [f"## shapes: beam_search vs transformers beam search, {s['users']} users in batches of {s['batch']}, a "
             f"random Llama {m['layers']} x {m['hidden']} ({m['heads']} heads), Amazon Beauty's catalog after a text "
             f"vocabulary; each method in its own process, alternating; median (min-max) of {s['repeats']} repeats; "
             "working memory = peak RSS after decoding minus peak after building the model", "",
             "| vocabulary | prompt | K | beam_search users/s | transformers users/s | speed-up | working memory (MB) "
             "beam_search / transformers | same items, same order |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in s["cells"]:
        u, w = c["users_per_s"], c["working_mb"]
        lines.append(f"| {c['vocab']:,} | {c['prompt']} | {c['k']} | {fmt_spread(u['beam_search'], 1)} | "
                     f"{fmt_spread(u['transformers'], 2)} | {fmt_ratio(c['speedup'], 1)} | "
                     f"{w['beam_search']['median']:.0f} / {w['transformers']['median']:.0f} | "
                     f"{c['same_items_same_order']:.0%} (max score diff {c['max_abs_score_diff']:.1e}) |")
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
    from decoding.models import pick_device, pick_dtype, tiny_model
    from decoding.reference import cpu_trie, generate_beam_search

    device = pick_device(spec["device"])
    torch.manual_seed(spec["seed"])
    vocab, prompt, k = spec["vocab"], spec["prompt"], spec["k"]
    catalog = catalog_after_text(spec["items"], vocab, device)
    model = tiny_model("llama", vocab, seed=spec["seed"], hidden_size=spec["hidden"],
                       intermediate_size=4 * spec["hidden"], num_hidden_layers=spec["layers"],
                       num_attention_heads=spec["heads"], num_key_value_heads=spec["heads"],
                       max_position_embeddings=max(2048, prompt + 8), dtype=pick_dtype(spec["dtype"], device)).to(device)
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(4, vocab - CODE_TOKENS, (spec["users"], prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    if spec["method"] == "beam_search":
        decode = lambda i, m: beam_search(model, i, m, catalog, k)  # noqa: E731
    else:
        trie = cpu_trie(catalog.to("cpu"))
        decode = lambda i, m: generate_beam_search(model, i, m, catalog, k, trie)  # noqa: E731

    def run():
        out = [decode(ids[a:a + spec["batch"]], mask[a:a + spec["batch"]]) for a in range(0, len(ids), spec["batch"])]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    before = peak_rss_mb()
    run()  # cold: the decode's working memory
    working = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20 if device.type == "cuda" else \
        peak_rss_mb() - before
    t0 = time.perf_counter()
    out = run()  # warm: the time
    seconds = time.perf_counter() - t0
    if spec["method"] == "beam_search":
        items = torch.cat([r.item_ids for r in out]).cpu().numpy()
        scores = torch.cat([r.scores for r in out]).float().cpu().numpy()
    else:
        items = torch.cat([r[0] for r in out]).cpu().numpy()
        scores = torch.cat([r[2] for r in out]).float().cpu().numpy()
    np.savez(spec["out"], items=items, scores=scores)
    return {"seconds": seconds, "working_mb": working}


if __name__ == "__main__":
    print(json.dumps(worker(json.loads(sys.argv[1]))))
