"""`bench items`: what the run's items cost an actor, and the constraint index over a recommendable subset.

For each catalog size N, a synthetic item index (L levels of `codes` codes: items.parquet with item_id, semantic_id
and code_tokens, as `genrec-batch prepare` writes it) and a recommendable set of a `recommendable` share of its
items. Each measurement runs in a fresh process (its peak RSS is its own), the kinds interleaved per repeat:

- `index`: the constraint index over the whole catalog (read, parse, build): seconds and peak RSS;
- `subset`: the same over the recommendable set (the whole index still parsed: prompts render from every item);
- `actor`: what a nightly actor holds for its items, built as it builds them (pipeline/items.ItemsRef.read, then
  decoding.catalog.Catalog.from_table with the recommendable mask, the table dropped): its peak and steady RSS.

Peak RSS is the build's own (the process's peak reset before it); bytes per item are the slope between the two
smallest sizes (the interpreter, torch and pyarrow cancel out).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pipeline.bench.common import fmt_spread, footer, in_fresh_process, run_order, spread
from pipeline.bench.params import ItemsParams
from pipeline.markdown import table

KINDS = ("index", "subset", "actor")


def run_items(p: ItemsParams) -> dict:
    """Each size's catalog written once, then every kind in a fresh process, `repeats` times interleaved."""
    runs = {(n, kind): [] for n in p.sizes for kind in KINDS}
    files = {n: catalog_files(p, n) for n in p.sizes}
    for order in run_order([(n, kind) for n in p.sizes for kind in KINDS], p.repeats):
        for n, kind in order:
            spec = {"kind": kind, **files[n], "levels": p.levels, "codes": p.codes}
            runs[(n, kind)].append(in_fresh_process("pipeline.bench.items", spec, f"items worker ({kind}, {n})"))
    rows = [
        {
            "items": n,
            "kind": kind,
            "seconds": spread([r["seconds"] for r in runs[(n, kind)]]),
            "peak_mib": spread([r["peak_mib"] for r in runs[(n, kind)]]),
            "held_mib": spread([r["held_mib"] for r in runs[(n, kind)]]),
            "indexed": runs[(n, kind)][0]["indexed"],
        }
        for n in p.sizes
        for kind in KINDS
    ]
    return {"rows": rows, "per_item": per_item(rows, p.sizes)}


def catalog_files(p: ItemsParams, n: int) -> dict:
    """The synthetic index of n items and its recommendable set (written once, kept under p.out) -> their paths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.prepare.synthetic import synthetic_catalog

    root = Path(p.out) / "items-bench" / f"{n}-{p.levels}x{p.codes}"
    catalog, recommendable = root / "items.parquet", root / "recommendable.parquet"
    if not recommendable.is_file():  # written last: a folder cut off part-way is written again
        root.mkdir(parents=True, exist_ok=True)
        table = synthetic_catalog(n, p.levels, p.codes, seed=0)
        pq.write_table(table, catalog)
        ids = table["item_id"].to_numpy()
        keep = np.random.default_rng(1).random(n) < p.recommendable
        pq.write_table(pa.table({"item_id": ids[keep]}), recommendable)
    return {"catalog": str(catalog), "recommendable": str(recommendable)}


def per_item(rows: list[dict], sizes: list[int]) -> dict:
    """Bytes per item of each kind's peak and held RSS: the slope of the medians between the two smallest sizes."""
    if len(sizes) < 2:
        return {}
    a, b = sorted(sizes)[:2]
    med = {(r["items"], r["kind"], key): r[key]["median"] for r in rows for key in ("peak_mib", "held_mib")}
    return {
        kind: {key: (med[(b, kind, key)] - med[(a, kind, key)]) * 2**20 / (b - a) for key in ("peak_mib", "held_mib")}
        for kind in KINDS
    }


def worker(spec: dict) -> dict:
    """In this (fresh) process: one kind's build -> its seconds, peak RSS and the RSS it holds after."""
    import gc

    import pyarrow as pa

    from decoding.catalog import Catalog
    from decoding.memory import trim_host_heap
    from pipeline.items import ItemsRef, Sources, read_items
    from pipeline.prepare import build_tokenizer
    from pipeline.storage import Storage

    tok, storage = build_tokenizer(spec["levels"], spec["codes"]), Storage()
    sources = Sources(spec["catalog"], spec["recommendable"] if spec["kind"] != "index" else None)
    identity = read_items(sources, storage, record=False).identity if spec["kind"] == "actor" else {}
    gc.collect()
    pa.default_memory_pool().release_unused()
    trim_host_heap()
    base = _rss_mib()
    _reset_peak()
    t0 = time.perf_counter()
    if spec["kind"] == "actor":  # as pipeline/shards.ShardRecommender and operators/recommender.Recommender do
        items = ItemsRef(sources, _catalog_id(spec["catalog"], storage), identity).read(storage)
        catalog = Catalog.from_table(items.table, tok, on_duplicate="first", recommendable=items.served)
        del items
    else:
        items = read_items(sources, storage, record=False)
        catalog = Catalog.from_table(items.table, tok, on_duplicate="first", recommendable=items.served)
    seconds = time.perf_counter() - t0
    gc.collect()
    pa.default_memory_pool().release_unused()
    trim_host_heap()
    peak = _status_mib("VmHWM")
    return {
        "seconds": seconds,
        "peak_mib": peak - base,
        "held_mib": _rss_mib() - base,
        "indexed": len(catalog),
    }


def _catalog_id(uri: str, storage) -> str:
    from pipeline import storage as S

    fs, path = S.filesystem(uri, storage)
    return S.content_id(path, fs, storage)


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _status_mib(key: str) -> float:
    """/proc/self/status's VmRSS (resident now) or VmHWM (the peak since the process began, or since `_reset_peak`)
    in MiB: this process's own (ru_maxrss would carry the parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def _reset_peak() -> None:
    """The peak RSS reset to the RSS now (Linux >= 4.0: `5` into /proc/self/clear_refs); elsewhere it stays the
    process's peak, which the imports before the build may set."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def markdown_items(r: dict) -> str:
    """The rows (medians, min-max) and the bytes per item."""
    rows = [
        [f"{x['items']:,}", x["kind"], f"{x['indexed']:,}", fmt_spread(x["seconds"]), fmt_spread(x["peak_mib"], 0)]
        + [fmt_spread(x["held_mib"], 0)]
        for x in r["rows"]
    ]
    out = [
        "# The items: the constraint index over the catalog and over a recommendable subset, and an actor's items",
        "",
        table(["items", "kind", "indexed", "seconds", "peak MiB", "held MiB"], rows),
    ]
    if r["per_item"]:
        slope = [[k, f"{v['peak_mib']:.0f}", f"{v['held_mib']:.0f}"] for k, v in r["per_item"].items()]
        out += [
            "",
            "Bytes per item (slope between the two smallest sizes):",
            "",
            table(["kind", "peak", "held"], slope),
        ]
    return "\n".join(out + ["", footer(r["environment"])])


if __name__ == "__main__":  # the worker: one kind at one size, its spec as JSON -> one JSON line
    print(json.dumps(worker(json.loads(sys.argv[1]))))
