"""`bench delisted`: a night with items delisted, two ways, on the demo nightly (Amazon Beauty, the demo models).

A `fraction` of the catalog's items, drawn at random, are delisted tonight. The nightly then runs twice on a local Ray,
the same users, models and config:

- `removed`: the delisted items taken out of the catalog, which is then both the item index and the constraint (what
  a catalog of tonight's items alone gives): every user whose prompt window holds one is rejected as `unknown_item`;
- `recommendable`: the catalog kept whole as the item index, the delisted items left out of the recommendable set
  (`recommendable`): histories render them, lists never hold them.

Each run's users with a list, its rejects by reason and the delisted items found in its lists.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.bench.common import footer
from pipeline.bench.params import DelistedParams
from pipeline.markdown import table

WAYS = ("removed", "recommendable")


def run_delisted(p: DelistedParams) -> dict:
    """Both runs, on one local Ray -> each run's counts."""
    import ray

    from pipeline.config import load_config
    from pipeline.nightly import run_nightly

    root = Path(p.out) / "delisted"
    base = load_config(p.config, list(p.overrides))
    files, delisted = night(base.catalog, root, p.fraction, p.seed)
    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        rows = []
        for way in WAYS:
            sets = [f"catalog={files['catalog']}"] if way == "removed" else [f"recommendable={files['recommendable']}"]
            cfg = load_config(p.config, [*p.overrides, *sets, f"output={root / way}", "runs.grace_s=0"])
            rows.append({"way": way, **counts(run_nightly(cfg), cfg, delisted)})
    finally:
        ray.shutdown()
    return {"items": int(pq.read_metadata(base.catalog).num_rows), "delisted": len(delisted), "rows": rows}


def night(catalog: str, root: Path, fraction: float, seed: int) -> tuple[dict, np.ndarray]:
    """The catalog less a random `fraction` of its items, and the recommendable set of the same items -> (their
    paths, the delisted ids)."""
    items = pq.read_table(catalog)
    ids = items["item_id"].to_numpy()
    gone = np.sort(np.random.default_rng(seed).choice(ids, round(fraction * len(ids)), replace=False))
    keep = ~np.isin(ids, gone)
    root.mkdir(parents=True, exist_ok=True)
    files = {"catalog": root / "items-tonight.parquet", "recommendable": root / "recommendable.parquet"}
    pq.write_table(items.filter(pa.array(keep)), files["catalog"])
    pq.write_table(pa.table({"item_id": ids[keep]}), files["recommendable"])
    return {k: str(v) for k, v in files.items()}, gone


def counts(manifest: dict, cfg, delisted: np.ndarray) -> dict:
    """A run's users with a list, its rejects by reason and the delisted items its lists hold (read through its
    manifest)."""
    from pipeline.output import open_run

    run = open_run(cfg.output, cfg.storage)
    reasons = run.table("rejects", ["reason"])["reason"].value_counts().to_pylist()
    items = run.table("recommendations", ["item_id"])["item_id"].to_numpy()
    return {
        "input_rows": manifest["counts"]["input_rows"],
        "users_ok": manifest["counts"]["users_ok"],
        "rejects": {r["values"]: r["counts"] for r in reasons},
        "delisted_in_lists": int(np.isin(items, delisted).sum()),
        "decode_s": manifest["timings"]["decode_s"],
    }


def markdown_delisted(r: dict) -> str:
    rows = [
        [
            x["way"],
            f"{x['input_rows']:,}",
            f"{x['users_ok']:,}",
            ", ".join(f"{k} {v:,}" for k, v in sorted(x["rejects"].items())) or "none",
            f"{sum(x['rejects'].values()) / x['input_rows']:.1%}",
            f"{x['delisted_in_lists']:,}",
        ]
        for x in r["rows"]
    ]
    head = ["way", "input rows", "users with a list", "rejects", "rejected", "delisted items in lists"]
    return (
        f"## A night with {r['delisted']:,} of {r['items']:,} items delisted\n\n"
        f"{table(head, rows)}\n\n{footer(r['environment'])}\n"
    )
