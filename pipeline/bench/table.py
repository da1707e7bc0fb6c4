"""table: a published run committed to a Delta and an Iceberg table, against the publish it follows. For each size,
`repeats` nightlies of synthetic users (`nightly-scale`'s world, a tiny model, one CPU actor, as `bench export` builds
its run), each followed by the commit of its run (the nightly's own `table.uri` step, and `genrec-batch export RUN
--to URI`'s: the sink's `commit_run`) into a fresh local table of each format in turn (interleaved: every night
commits to each), then a re-commit into the same table (a no-op: `already committed`): seconds of the nightly's
publish step (`publish_run`: the lease checked, the manifest, _SUCCESS, _LATEST), of the commit and of the re-commit,
side by side per night (medians, min-max), rows/s, the files the commit added, and the nightly's total. The Iceberg
tables are a SQLite catalog's, their files on the local disk. Once per size and format, the first table read back
whole against the run's rows."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from pipeline.bench.common import fmt_spread, spread
from pipeline.bench.export import runs_dir
from pipeline.bench.params import ScaleParams, TableParams
from pipeline.bench.scale import overrides, world
from pipeline.markdown import table

KEY = ["user_id", "rank", "item_id"]  # what a reader of the table joins on
CATALOG = "genrec-bench"  # the Iceberg tables' SQLite catalog (configured for this process only)


def run_table(p: TableParams) -> dict:
    """Each size -> its rows, one a format."""
    import deltalake
    import pyiceberg
    import ray

    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        rows = [row for n in p.users for row in bench_one(p, n)]
        return {"rows": rows, "deltalake": deltalake.__version__, "pyiceberg": pyiceberg.__version__}
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


def table_uri(fmt: str, folder: Path, i: int) -> str:
    """The fresh table of night i in format `fmt`: a Delta folder, or a table of the bench's SQLite catalog (its
    properties set in this process's environment, as pyiceberg reads them)."""
    if fmt == "delta":
        return f"delta+{folder / f'delta-{i}'}"
    name = CATALOG.upper().replace("-", "_")
    os.environ[f"PYICEBERG_CATALOG__{name}__URI"] = f"sqlite:///{folder / 'catalog.db'}"
    os.environ[f"PYICEBERG_CATALOG__{name}__WAREHOUSE"] = f"file://{folder / 'warehouse'}"
    return f"iceberg+{CATALOG}/bench.recommendations_{i}"


def bench_one(p: TableParams, n: int) -> list[dict]:
    """`repeats` nightlies of n users, each committed into a fresh table of each format, then re-committed (a
    no-op) -> one row a format."""
    from pipeline import stores
    from pipeline.config import Table

    folder = Path(p.out).resolve() / "table" / f"users-{n}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    nights, same = [], {}
    for i in range(p.repeats):
        run, manifest, publish_s = published_run(p, n)
        night = {"publish_s": publish_s, "timings": manifest["timings"], "counts": manifest["counts"],
                 "files": len(run.files("recommendations")), "commits": {}}  # fmt: skip
        for fmt in p.format:
            t = Table(uri=table_uri(fmt, folder, i), rows_per_file=p.rows_per_file, writers=p.writers)
            sink = stores.sink(t.uri)
            done, again = sink.commit_run(run, t), sink.commit_run(run, t)
            if done.skipped is not None or done.version is None:
                raise RuntimeError(f"bench table: the commit into {t.uri} committed nothing ({done.skipped})")
            if again.skipped != "already committed" or again.version != done.version:
                raise RuntimeError(f"bench table: the re-commit into {t.uri} was not a no-op ({again.record()})")
            same.setdefault(fmt, same_rows(run, read_back(fmt, t.uri, run.storage)))
            night["commits"][fmt] = {"commit": done.record(), "recommit": again.record()}
        nights.append(night)
    return [row_of(p, fmt, nights, same[fmt]) for fmt in p.format]


def row_of(p: TableParams, fmt: str, nights: list[dict], same: bool) -> dict:
    """One format's row from the nights (each ratio within one night)."""
    commits = [x["commits"][fmt]["commit"] for x in nights]
    first = nights[0]
    return {
        "format": fmt,
        "users": int(first["counts"]["users_ok"]),
        "k": p.k,
        "recommendations": int(first["counts"]["recommendations"]),
        "run_files": first["files"],
        "table_files": commits[0]["files"],
        "publish_s": spread([x["publish_s"] for x in nights]),
        "commit_s": spread([c["seconds"] for c in commits]),
        "recommit_s": spread([x["commits"][fmt]["recommit"]["seconds"] for x in nights]),
        "rows_per_s": spread([c["rows"] / c["seconds"] for c in commits]),
        "commit_over_publish": spread([c["seconds"] / x["publish_s"] for c, x in zip(commits, nights)]),
        "nightly_total_s": spread([x["timings"]["total_s"] for x in nights]),
        "commit_over_nightly_total": spread([c["seconds"] / x["timings"]["total_s"] for c, x in zip(commits, nights)]),
        "same_rows": same,
        "nights": [{**{k: v for k, v in x.items() if k != "commits"}, **x["commits"][fmt]} for x in nights],
    }


def read_back(fmt: str, uri: str, storage):
    """The table's (user_id, rank, item_id) rows, read whole by its format's own reader."""
    if fmt == "delta":
        from deltalake import DeltaTable

        from pipeline.stores.delta import location

        return DeltaTable(location(uri)).to_pyarrow_table(columns=KEY)
    from pipeline.stores.iceberg import load

    return load(uri, storage).scan(selected_fields=tuple(KEY)).to_arrow()


def same_rows(run, theirs) -> bool:
    """Whether a table's rows (`read_back`) are the run's: as many, and the same (user_id, rank, item_id) rows (the
    run's in the table's types, both sorted)."""
    import pyarrow as pa

    from pipeline.stores.lake import table_type

    mine = run.table("recommendations", columns=KEY)
    if theirs.num_rows != mine.num_rows:
        return False
    mine = mine.cast(pa.schema([pa.field(f.name, table_type(f.type)) for f in mine.schema]))
    theirs = theirs.select(KEY).cast(mine.schema)
    order = [(c, "ascending") for c in KEY]
    return theirs.sort_by(order).equals(mine.sort_by(order))


def fmt_count(s: dict) -> str:
    """'1,234 (1,000-1,500)': a spread of counts per second, with thousands separators."""
    return f"{s['median']:,.0f} ({s['min']:,.0f}-{s['max']:,.0f})"


def markdown_table(result: dict) -> str:
    return "## Commit to a table\n\n" + section_text(result) + "\n\n" + table(HEAD, rows_of(result)) + "\n"


def rows_of(result: dict) -> list[list[str]]:
    return [
        [
            r.get("format", "delta"),
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
        f"deltalake {result['deltalake']}, pyiceberg {result.get('pyiceberg')} (a SQLite catalog, files on the "
        f"local disk), K {a['k']}, table.rows_per_file {a['rows_per_file']:,}, table.writers {a['writers']}, local "
        f"Ray with {a['cpus']} CPUs. Each size: {a['repeats']} nightlies of synthetic users (`nightly-scale`'s "
        "world, a tiny Llama, one CPU actor), each followed at once by the commit of its published run into a fresh "
        f"local table of each format in turn ({', '.join(a.get('format', ['delta']))}: the sink's `commit_run`, what "
        "the nightly's `table.uri` step and `genrec-batch export` call) and a re-commit into the same table, which "
        "finds the run committed and commits nothing (`already committed`): medians, min-max over the nights, each "
        "ratio taken within one night. Publish: the nightly's own publish step (`publish_run`: the lease checked, "
        "the manifest, `_SUCCESS`, `_LATEST`). Commit: the run's publication checked, the table created, Ray tasks "
        "copying the run's recommendation files into the table's files, one transaction on the driver (a Delta "
        "commit; an Iceberg snapshot through the catalog). Nightly total: `timings.total_s`, from the start to the "
        "manifest. Same rows: the first table of each format read back whole by its own reader (delta-rs, "
        "pyiceberg's scan) holds as many rows as the run and the same (user_id, rank, item_id) rows."
    )


HEAD = [
    "format",
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
