"""table: a published run committed to a Delta table, against the publish it follows. For each size, `repeats`
nightlies of synthetic users (`nightly-scale`'s world, a tiny model, one CPU actor, as `bench export` builds its run),
each followed by `tables.commit_run` of its run (the nightly's own `table.uri` step, and `genrec-batch export RUN
--to delta+URI`'s) into a fresh local table, then a re-commit into the same table (a no-op: `already committed`):
seconds of the nightly's publish step (`publish_run`: the lease checked, the manifest, _SUCCESS, _LATEST), of the
commit and of the re-commit, side by side per night (medians, min-max), rows/s, the files the commit added, and the
nightly's total. Once per size, the first table read back whole (`deltalake.DeltaTable(path).to_pyarrow_table()`)
against the run's rows."""

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
    the seconds of its publish step: the nightly's own `publish_run` call, timed around it)."""
    from pipeline import nightly
    from pipeline.config import load_config
    from pipeline.output import open_run

    scale = ScaleParams(users=[n], k=p.k, batch=p.batch, cpus=p.cpus, out=p.out)
    root = world(scale, n)
    out = root / f"out-table-k{p.k}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, [*overrides(scale, root), f"output={out}", "compute.num_actors=1"])
    publish, seconds = nightly.publish_run, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        publish(*args, **kwargs)
        seconds.append(time.perf_counter() - start)

    nightly.publish_run = timed
    try:
        manifest = nightly.run_nightly(cfg)
    finally:
        nightly.publish_run = publish
    run = open_run(str(runs_dir(out, manifest)), cfg.storage, allow_unpublished=True)
    return run, manifest, seconds[0]


def bench_one(p: TableParams, n: int) -> dict:
    """`repeats` nightlies of n users, each committed into a fresh table, then re-committed (a no-op) -> the row."""
    from pipeline import tables
    from pipeline.config import DELTA, Table

    folder = Path(p.out).resolve() / "table" / f"users-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    nights, same = [], None
    for i in range(p.repeats):
        run, manifest, publish_s = published_run(p, n)
        t = Table(uri=f"{DELTA}{folder / f'table-{i}'}", rows_per_file=p.rows_per_file, writers=p.writers)
        done = tables.commit_run(run, t)
        again = tables.commit_run(run, t)
        if done.skipped is not None or done.version is None:
            raise RuntimeError(f"bench table: the commit into {t.uri} committed nothing ({done.skipped})")
        if again.skipped != "already committed" or again.version != done.version:
            raise RuntimeError(f"bench table: the re-commit into {t.uri} was not a no-op ({again.record()})")
        same = same_rows(run, tables.location(t.uri)) if same is None else same
        nights.append({"publish_s": publish_s, "timings": manifest["timings"], "counts": manifest["counts"],
                       "files": len(run.files("recommendations")), "commit": done.record(),
                       "recommit": again.record()})  # fmt: skip
    commits = [x["commit"]["seconds"] for x in nights]
    first = nights[0]
    return {
        "users": int(first["counts"]["users_ok"]),
        "k": p.k,
        "recommendations": int(first["counts"]["recommendations"]),
        "run_files": first["files"],
        "table_files": first["commit"]["files"],
        "publish_s": spread([x["publish_s"] for x in nights]),
        "commit_s": spread(commits),
        "recommit_s": spread([x["recommit"]["seconds"] for x in nights]),
        "rows_per_s": spread([x["commit"]["rows"] / x["commit"]["seconds"] for x in nights]),
        "commit_over_publish": spread([x["commit"]["seconds"] / x["publish_s"] for x in nights]),
        "nightly_total_s": spread([x["timings"]["total_s"] for x in nights]),
        "commit_over_nightly_total": spread([x["commit"]["seconds"] / x["timings"]["total_s"] for x in nights]),
        "same_rows": same,
        "nights": nights,
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
            f"{r['run_files']:,} / {r['table_files']:,}",
            fmt_spread(r["publish_s"], 3),
            fmt_spread(r["commit_s"], 2),
            fmt_spread(r["recommit_s"], 3),
            fmt_count(r["rows_per_s"]),
            fmt_spread(r["commit_over_publish"], 1),
            fmt_spread(r["nightly_total_s"], 1),
            fmt_spread(r["commit_over_nightly_total"], 3),
            "yes" if r["same_rows"] else "**NO**",
        ]
        for r in result["rows"]
    ]


def section_text(result: dict) -> str:
    a = result["args"]
    return (
        f"deltalake {result['deltalake']}, K {a['k']}, table.rows_per_file {a['rows_per_file']:,}, table.writers "
        f"{a['writers']}, local Ray with {a['cpus']} CPUs. Each size: {a['repeats']} nightlies of synthetic users "
        "(`nightly-scale`'s world, a tiny Llama, one CPU actor), each followed at once by `tables.commit_run` of its "
        "published run into a fresh local Delta table and a re-commit into the same table, which finds its app "
        "transaction and commits nothing (`already committed`): medians, min-max over the nights, each ratio taken "
        "within one night. Publish: the nightly's own publish step (`publish_run`: the lease checked, the manifest, "
        "`_SUCCESS`, `_LATEST`). Commit: the run's publication checked, the table created, Ray tasks copying the "
        "run's recommendation files into the table's files, one Delta transaction on the driver. Nightly total: "
        "`timings.total_s`, from the start to the manifest. Same rows: the first table read back whole "
        "(`deltalake.DeltaTable(path).to_pyarrow_table()`) holds as many rows as the run and the same "
        "(user_id, rank, item_id) rows."
    )


HEAD = [
    "users",
    "recommendation rows",
    "run files / table files",
    "publish, s",
    "commit, s",
    "re-commit (no-op), s",
    "rows/s",
    "commit / publish",
    "nightly total, s",
    "commit / nightly total",
    "same rows",
]
