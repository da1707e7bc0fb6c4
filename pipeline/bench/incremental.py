"""incremental: what an incremental night costs against a full one, on synthetic users (`bench nightly-scale`'s world:
a tiny model, one CPU actor). For each size, a base night; then for each share of users changed (their last item
replaced), a full night and an incremental night on the same input, each in its own driver process, interleaved
(full, incremental; then incremental, full) `repeats` times: wall seconds, users decoded and carried, the carry's
seconds per carried user (the incremental night's decode less its decoded users at the full night's rate), the
driver's peak memory, and whether the two nights published the same lists."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipeline import runs
from pipeline.bench.common import fmt_spread, spread
from pipeline.bench.params import IncrementalParams, ScaleParams
from pipeline.bench.scale import overrides, run_driver, world
from pipeline.markdown import table
from pipeline.storage import Storage

BASE, NIGHT = "2026-01-01", "2026-01-02"


def run_incremental(p: IncrementalParams) -> dict:
    """Each size and share changed -> its row."""
    import ray

    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        rows = []
        for n in p.users:
            root = world(scale_params(p), n)
            base = night(p, root, root / "out", BASE, root / "data" / "test.parquet", incremental=False)
            for share in p.changed:
                rows.append(bench_share(p, root, n, share, base))
        return {"rows": rows}
    finally:
        ray.shutdown()


def scale_params(p: IncrementalParams) -> ScaleParams:
    return ScaleParams(users=p.users, k=p.k, batch=p.batch, cpus=p.cpus, out=p.out)


def changed_input(root, share: float, seed: int):
    """The base input with `share` of its users' last item replaced by another catalog item -> its path."""
    path = root / f"night-{share:g}.parquet"
    f = pq.ParquetFile(root / "data" / "test.parquet")
    items = pq.read_table(root / "data" / "items.parquet", columns=["item_id"])["item_id"].to_numpy()
    rng = np.random.default_rng(seed)
    with pq.ParquetWriter(path, f.schema_arrow) as out:
        for g in range(f.num_row_groups):
            t = f.read_row_group(g)
            h = t["history"].combine_chunks()
            values = h.values.to_numpy().copy()
            last = h.offsets.to_numpy()[1:] - 1  # [B] each history's last item
            pick = rng.random(len(last)) < share
            values[last[pick]] = rng.choice(items, int(pick.sum()))
            history = pa.ListArray.from_arrays(h.offsets, pa.array(values))
            out.write_table(t.set_column(t.schema.get_field_index("history"), "history", history))
    return path


def night(p: IncrementalParams, root, out, date: str, data, incremental: bool) -> dict:
    """One night in its own driver process -> its manifest, wall seconds and the driver's peak memory."""
    import json

    import ray

    sets = [*overrides(scale_params(p), root), f"input={data}", f"output={out}", f"run_date={date}"]
    cmd = [sys.executable, "-m", "jobs.nightly", *(x for o in sets for x in ("--set", o))]
    cmd += ["--incremental", str(root / "out" / f"run_date={BASE}")] if incremental else []
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    stdout, wall, usage, samples = run_driver(cmd, env, f"incremental bench night {date} {out.name}")
    summary = json.loads(stdout[stdout.index("{") :])
    run = runs.run_dir(str(out), date, summary["run_id"])
    manifest = json.loads((Path(run) / "manifest.json").read_text())
    return {
        "manifest": manifest,
        "run": run,
        "wall_s": wall,
        "driver_peak_rss_mib": usage.ru_maxrss / 1024,
        "driver_peak_anon_mib": max((x["anon_mib"] for x in samples), default=0.0),
    }


def bench_share(p: IncrementalParams, root, n: int, share: float, base: dict) -> dict:
    """One size and share: full and incremental nights interleaved -> the row."""
    data = changed_input(root, share, seed=int(share * 1000))
    walls = {"full": [], "incremental": []}
    last = {}
    for r in range(p.repeats):
        order = ("full", "incremental") if r % 2 == 0 else ("incremental", "full")
        for kind in order:
            out = root / f"out-{kind}"
            if kind == "incremental":  # tonight's incremental nights write beside the base, in a copy of its root
                shutil.rmtree(out, ignore_errors=True)
                shutil.copytree(root / "out", out)
            else:
                shutil.rmtree(out, ignore_errors=True)
            last[kind] = night(p, root, out, NIGHT, data, incremental=kind == "incremental")
            walls[kind].append(last[kind]["wall_s"])
    inc, full = last["incremental"]["manifest"], last["full"]["manifest"]
    decoded, carried = inc["counts"]["users_decoded"], inc["counts"]["users_carried"]
    full_rate = full["counts"]["users"] / full["timings"]["decode_s"]
    carry_s = inc["timings"]["decode_s"] - decoded / full_rate
    return {
        "users": n,
        "changed": share,
        "full_wall_s": spread(walls["full"]),
        "incremental_wall_s": spread(walls["incremental"]),
        "ratio": {k: spread(walls["incremental"])[k] / spread(walls["full"])["median"] for k in ("median",)},
        "users_decoded": decoded,
        "users_carried": carried,
        "mode": inc["incremental"]["mode"],
        "carry_us_per_user": 1e6 * carry_s / carried if carried else None,
        "driver_peak_anon_mib": {k: last[k]["driver_peak_anon_mib"] for k in last},
        "driver_peak_rss_mib": {k: last[k]["driver_peak_rss_mib"] for k in last},
        "same_lists": same_lists(last["incremental"]["run"], last["full"]["run"]),
    }


def same_lists(a: str, b: str) -> bool:
    """Whether two runs published the same users, ranks and items (read through their manifests)."""
    cols = ["user_id", "rank", "item_id"]
    ta, tb = (
        runs.read_table(r, "recommendations", Storage(), cols).sort_by([(c, "ascending") for c in cols[:2]])
        for r in (a, b)
    )
    return ta.equals(tb)


def markdown_incremental(result: dict) -> str:
    rows = [
        [
            f"{r['users']:,}",
            f"{r['changed']:.0%}",
            r["mode"],
            fmt_spread(r["full_wall_s"], 1),
            fmt_spread(r["incremental_wall_s"], 1),
            f"{r['ratio']['median']:.2f}",
            f"{r['users_decoded']:,}",
            f"{r['users_carried']:,}",
            "-" if r["carry_us_per_user"] is None else f"{r['carry_us_per_user']:.1f}",
            f"{r['driver_peak_rss_mib']['incremental']:.0f} / {r['driver_peak_rss_mib']['full']:.0f}",
            "yes" if r["same_lists"] else "NO",
        ]
        for r in result["rows"]
    ]
    head = [
        "users",
        "changed",
        "night",
        "full s",
        "incremental s",
        "incremental / full",
        "decoded",
        "carried",
        "carry µs per carried user",
        "driver peak RSS MiB (incremental / full)",
        "same lists",
    ]
    return "## Incremental nights\n\n" + table(head, rows) + "\n"
