"""`bench precision`: what half precision costs in ranking, on a trained target and real users.

Reference: `transformers` constrained beam search in float32 (the exact ranking the product promises). Each dtype's
`beam_search` is compared with it user by user (decoding/metrics.py::topk_agreement): identical top-K lists, the
same among users clear of a near-tie (their float32 search's smallest gap between the K-th and (K+1)-th candidate,
stats["tie_gap"], at least --tie), mean top-K set overlap, largest score difference of an item both lists hold. Half
precision runs twice: with the float32 head (as shipped, decoding/head.py) and with logits rounded to the model's
dtype (as transformers computes them), so the table shows what the float32 head buys. Decode times are of one pass
per row (indicative, not an interleaved benchmark).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from decoding.beam import beam_search, head_of
from decoding.metrics import topk_agreement
from decoding.models import load_model, pick_device
from decoding.reference import cpu_trie, generate_beam_search
from pipeline.bench.common import aligned, footer, hardware, progress, synchronize, versions
from pipeline.bench.inputs import load_beauty, ranked, require_models
from pipeline.bench.params import PrecisionParams
from pipeline.markdown import table

HEADS = {"float32": ["float32"], "bfloat16": ["float32", "model"], "float16": ["float32", "model"]}


def run_precision(p: PrecisionParams) -> dict:
    """Each dtype and head against transformers in float32, at every K -> the rows, with hardware and versions."""
    require_models(p.target)
    device = pick_device(p.device)
    _, catalog, ids, mask = load_beauty(Path(p.data), p.users, p.history_len, device, Path(p.target))
    trie = cpu_trie(catalog.to("cpu"))
    t0 = time.perf_counter()
    reference = reference_lists(p, catalog, trie, ids, mask)
    rows = []
    for dtype in p.dtypes:
        model = load_model(p.target, device=str(device), dtype=dtype)
        for head in HEADS[dtype]:
            head_of(model).product = head if head == "model" else head_of(model).product
            row = {"dtype": dtype, "head": "float32" if head != "model" else dtype}
            rows += [compare(model, ids, mask, catalog, k, p, reference[k], device, row) for k in p.ks]
        del model
    return {
        "hardware": hardware(device, "float32"),
        "versions": versions(),
        "users": len(ids),
        "rows": rows,
        "seconds": time.perf_counter() - t0,
    }


def reference_lists(p: PrecisionParams, catalog, trie: dict, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """K -> the reference: transformers' float32 item ids and scores [U, K], and each user's tie gap [U] from
    beam_search in float32."""
    f32 = load_model(p.target, device=str(ids.device), dtype="float32")
    reference = {}
    for k in p.ks:
        outs = [
            generate_beam_search(f32, ids[a : a + p.batch], mask[a : a + p.batch], catalog, k, trie)
            for a in progress(range(0, len(ids), p.batch), f"precision: transformers float32 K={k}")
        ]
        gaps = [
            beam_search(f32, ids[a : a + p.batch], mask[a : a + p.batch], catalog, k).stats["tie_gap"].cpu()
            for a in range(0, len(ids), p.batch)
        ]
        items, scores = ranked(outs)
        reference[k] = (items.cpu(), scores.cpu(), torch.cat(gaps))
    return reference


def compare(model, ids, mask, catalog, k: int, p: PrecisionParams, ref, device, row: dict) -> dict:
    ref_items, ref_scores, gap = ref
    items, scores, seconds = [], [], 0.0
    for a in progress(range(0, len(ids), p.batch), f"precision: {row['dtype']} head {row['head']} K={k}"):
        synchronize(device)
        t = time.perf_counter()
        rec = beam_search(model, ids[a : a + p.batch], mask[a : a + p.batch], catalog, k)
        synchronize(device)
        seconds += time.perf_counter() - t
        items.append(rec.item_ids.cpu())
        scores.append(rec.scores.cpu())
    agree = topk_agreement(ref_items, ref_scores, torch.cat(items), torch.cat(scores))
    clear = gap >= p.tie
    return {
        **row,
        "k": k,
        "users": len(ids),
        "identical": int(agree["identical"].sum()),
        "clear_users": int(clear.sum()),
        "clear_identical": int(agree["identical"][clear].sum()),
        "topk_overlap": float(agree["overlap"].mean()),
        "max_abs_score_diff": float(agree["score_diff"].max()),
        "median_tie_gap": float(gap[torch.isfinite(gap)].median()) if torch.isfinite(gap).any() else None,
        "ms_per_user": 1e3 * seconds / len(ids),
    }


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def markdown(result: dict) -> str:
    p, h = result["args"], result["hardware"]
    header = (
        "engine dtype | head | K | identical top-K lists | of users clear of a near-tie | top-K set overlap | "
        "max score diff | median float32 tie gap | ms/user"
    ).split(" | ")
    rows = [precision_cells(r) for r in result["rows"]]
    lines = [
        f"# What half precision costs in ranking: {Path(p['target']).name}, {result['users']} users "
        f"({h.get('gpu', h['device'])})",
        "",
        "Against transformers beam search in float32 (the exact ranking). *Clear of a near-tie*: the user's "
        f"float32 search never had its K-th and (K+1)-th candidates within {p['tie']:g}. Head float32: the "
        "shipped head (half inputs, float32 products); head in the model's dtype: logits rounded as transformers "
        "rounds them. ms/user: one pass, indicative.",
        "",
        table(header, rows, aligned(2, 7)),
        "",
        f"{result['seconds'] / 60:.1f} min.",
        footer(result["environment"]),
    ]
    return "\n".join(lines) + "\n"


def precision_cells(r: dict) -> list:
    """One dtype x head x K against transformers in float32: a row of the table."""
    return [
        r["dtype"],
        r["head"],
        r["k"],
        pct(r["identical"], r["users"]),
        f"{pct(r['clear_identical'], r['clear_users'])} (of {r['clear_users']})",
        f"{100 * r['topk_overlap']:.1f}%",
        f"{r['max_abs_score_diff']:.3g}",
        f"{r['median_tie_gap']:.3f}" if r["median_tie_gap"] is not None else "-",
        f"{r['ms_per_user']:.2f}",
    ]
