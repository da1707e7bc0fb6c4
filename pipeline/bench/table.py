"""table: a published run committed to a Delta table. For each size, a nightly of synthetic users (`nightly-scale`'s
world, a tiny model, one CPU actor, as `bench export` builds its run), then `tables.commit_run` (the nightly's own
`table.uri` step, and `genrec-batch export RUN --to delta+URI`'s) into a fresh local table, `repeats` times, each
commit followed by a re-commit of the same run into the same table (a no-op: `already committed`): seconds of each
(medians, min-max), rows/s, the files the commit added, against the nightly's own seconds (its manifest's
`timings`: total_s until the manifest, decode_s; the manifest holds no figure for the publish itself). Once per
size, the first table read back whole (`deltalake.DeltaTable(path).to_pyarrow_table()`) against the run's rows."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from pipeline.bench.common import fmt_spread, spread
from pipeline.bench.export import runs_dir
from pipeline.bench.params import ScaleParams, TableParams
from pipeline.bench.scale import overrides, world
from pipeline.markdown import table

KEY = ["user_id", "rank", "item_id"]  # what a reader of the table joins on


def run_table(p: TableParams) -> dict:
    """Each size -> its row."""
    import deltalake
    import ray

    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        return {"rows": [bench_one(p, n) for n in p.users], "deltalake": deltalake.__version__}
    finally:
        ray.shutdown()


def published_run(p: TableParams, n: int):
    """A nightly of n users on `nightly-scale`'s world, as `bench export` runs it -> (the PublishedRun, its manifest,
    the nightly's wall seconds in this process: planning, decoding, the manifest, _SUCCESS and _LATEST)."""
    from pipeline.config import load_config
    from pipeline.nightly import run_nightly
    from pipeline.output import open_run

    scale = ScaleParams(users=[n], k=p.k, batch=p.batch, cpus=p.cpus, out=p.out)
    root = world(scale, n)
    out = root / f"out-table-k{p.k}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, [*overrides(scale, root), f"output={out}", "compute.num_actors=1"])
    t0 = time.perf_counter()
    manifest = run_nightly(cfg)
    wall = time.perf_counter() - t0
    run = open_run(str(runs_dir(out, manifest)), cfg.storage, allow_unpublished=True)
    return run, manifest, wall


def bench_one(p: TableParams, n: int) -> dict:
    """A nightly of n users, committed `repeats` times into fresh tables, each followed by a no-op re-commit -> the
    row."""
    from pipeline import tables
    from pipeline.config import DELTA, Table

    run, manifest, nightly_wall = published_run(p, n)
    folder = Path(p.out).resolve() / "table" / f"users-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    commits, recommits, records = [], [], []
    for i in range(p.repeats):
        t = Table(uri=f"{DELTA}{folder / f'table-{i}'}", rows_per_file=p.rows_per_file, writers=p.writers)
        done = tables.commit_run(run, t)
        again = tables.commit_run(run, t)
        if done.skipped is not None or done.version is None:
            raise RuntimeError(f"bench table: the commit into {t.uri} committed nothing ({done.skipped})")
        if again.skipped != "already committed" or again.version != done.version:
            raise RuntimeError(f"bench table: the re-commit into {t.uri} was not a no-op ({again.record()})")
        commits.append(done.seconds)
        recommits.append(again.seconds)
        records.append({"commit": done.record(), "recommit": again.record()})
    first = records[0]["commit"]
    timings = manifest["timings"]
    return {
        "users": int(manifest["counts"]["users_ok"]),
        "k": p.k,
        "recommendations": int(manifest["counts"]["recommendations"]),
        "run_files": len(run.files("recommendations")),
        "table_files": first["files"],
        "table_rows": first["rows"],
        "commit_s": spread(commits),
        "recommit_s": spread(recommits),
        "rows_per_s": spread([first["rows"] / s for s in commits]),
        "nightly_total_s": timings["total_s"],
        "nightly_decode_s": timings["decode_s"],
        "nightly_wall_s": nightly_wall,
        "commit_over_nightly_total": spread([s / timings["total_s"] for s in commits]),
        "same_rows": same_rows(run, tables.location(records[0]["commit"]["table"])),
        "commits": records,
    }


def same_rows(run, path: str) -> bool:
    """Whether the table at `path` holds the run's rows: as many, and the same (user_id, rank, item_id) rows (the
    run's in the table's types, both sorted)."""
    import pyarrow as pa
    from deltalake import DeltaTable

    from pipeline.tables import delta_type

    theirs = DeltaTable(path).to_pyarrow_table(columns=KEY)
    mine = run.table("recommendations", columns=KEY)
    if theirs.num_rows != mine.num_rows:
        return False
    mine = mine.cast(pa.schema([pa.field(f.name, delta_type(f.type)) for f in mine.schema]))
    theirs = theirs.select(KEY).cast(mine.schema)
    order = [(c, "ascending") for c in KEY]
    return theirs.sort_by(order).equals(mine.sort_by(order))


def fmt_count(s: dict) -> str:
    """'1,234 (1,000-1,500)': a spread of counts per second, with thousands separators."""
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def markdown_table(result: dict) -> str:
    return "## Commit to a Delta table\n\n" + section_text(result) + "\n\n" + table(HEAD, rows_of(result)) + "\n"


def rows_of(result: dict) -> list[list[str]]:
    return [
        [
            f"{r['users']:,}",
            f"{r['recommendations']:,}",
            f"{r['run_files']:,}",
            f"{r['table_files']:,}",
            fmt_spread(r["commit_s"], 2),
            fmt_spread(r["recommit_s"], 3),
            fmt_count(r["rows_per_s"]),
            f"{r['nightly_total_s']:.1f} ({r['nightly_decode_s']:.1f})",
            fmt_spread(r["commit_over_nightly_total"], 3),
            "yes" if r["same_rows"] else "**NO**",
        ]
        for r in result["rows"]
    ]


def section_text(result: dict) -> str:
    a = result["args"]
    return (
        f"deltalake {result['deltalake']}, K {a['k']}, table.rows_per_file {a['rows_per_file']:,}, table.writers "
        f"{a['writers']}, local Ray with {a['cpus']} CPUs. Each size: one nightly of synthetic users "
        "(`nightly-scale`'s world, a tiny Llama, one CPU actor), then `tables.commit_run` of its published run into "
        f"a fresh local Delta table, {a['repeats']} times (medians, min-max), each followed by a re-commit of the "
        "same run into the same table, which finds its app transaction and commits nothing (`already committed`); "
        "the first commit also starts Ray Data's first dataset of the process (the JSON keeps every repeat). "
        "A commit: the run's publication checked, the table created, Ray tasks copying the run's recommendation "
        "files into the table's files, one Delta transaction on the driver. The manifest's `timings` hold no figure "
        "for the publish (manifest, `_SUCCESS`, `_LATEST`), so the commit is set against the nightly's own "
        "`timings.total_s` (from the start to the manifest; decode s, its decode phase, in brackets); the JSON also "
        "keeps the nightly's wall seconds in the bench's process. Same rows: the first table read back whole "
        "(`deltalake.DeltaTable(path).to_pyarrow_table()`) holds as many rows as the run and the same "
        "(user_id, rank, item_id) rows."
    )


HEAD = [
    "users",
    "recommendation rows",
    "run files",
    "table files",
    "commit, s",
    "re-commit (no-op), s",
    "rows/s",
    "nightly total, s (decode, s)",
    "commit / nightly total",
    "same rows",
]
