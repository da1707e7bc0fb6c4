"""Iceberg tables through pyiceberg: a SQL catalog on a real PostgreSQL with its data files on SeaweedFS and, where a
test needs one writer only, a SQLite catalog on the local disk. A night from an Iceberg history table equals the
night from the same users' parquet, its resume reading the snapshot the run started on; a published run committed to
a table partitioned by run_date reads back equal, a rerun of the date replaces its rows in one snapshot, commits at
once end with one date's rows and one commit per run; columns are matched by field id; snapshots gone, delete files
and unknown catalogs are refused (exit 2), the catalog's password never shown."""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from jobs import export
from jobs import nightly as nightly_job
from pipeline import runs, units
from pipeline import storage as S
from pipeline.config import Table, load_config
from pipeline.output import open_run
from pipeline.storage import Storage
from pipeline.stores import iceberg
from pipeline.stores.lake import CALL, RUN_ID, table_schema
from tests.helpers import float32_atol
from tests.postgres_server import postgres
from tests.servers import seaweedfs
from tests.test_nightly import make_world

DATE, OTHER_DATE, K = "2026-11-21", "2026-11-20", 5
SHARED, LOCAL = "lake", "local"  # the Postgres catalog (data files on SeaweedFS) and the SQLite one (local files)
KEY = ["user_id", "rank", "item_id"]


@dataclass
class Lake:
    world: Path
    s3: object
    pg: object
    root: Path
    storage: Storage
    users: pa.Table  # the world's histories: user_id, history, target_items


def catalog_env(name: str, props: dict) -> dict:
    """A catalog's properties as the PYICEBERG_CATALOG__<NAME>__<PROPERTY> variables pyiceberg reads."""
    return {f"PYICEBERG_CATALOG__{name.upper()}__{k.upper().replace('.', '__').replace('-', '_')}": v
            for k, v in props.items()}  # fmt: skip


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """SeaweedFS, PostgreSQL, the two catalogs configured in the environment only (as a deployment configures
    pyiceberg), a local Ray whose workers get the store's credentials, and the test world (40 users)."""
    import ray

    root = tmp_path_factory.mktemp("iceberg")
    world = make_world(root / "world", n_users=40)
    with seaweedfs(root / "s3") as s3, postgres() as pg:
        saved = dict(os.environ)
        os.environ.update(s3.env())
        s3_props = {"s3.endpoint": s3.endpoint, "s3.access-key-id": s3.access_key}
        s3_props |= {"s3.secret-access-key": s3.secret_key, "s3.region": s3.region}
        os.environ.update(catalog_env(SHARED, {"uri": pg.url, "warehouse": s3.uri("warehouse"), **s3_props}))
        os.environ.update(catalog_env(LOCAL, {"uri": f"sqlite:///{root / 'local.db'}", "warehouse": f"file://{root}"}))
        os.environ["PYICEBERG_HOME"] = str(root)
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            users = pq.read_table(world / "data" / "test.parquet")
            yield Lake(world, s3, pg, root, Storage(s3.endpoint), users)
        finally:
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved)


def settings(lake: Lake, source: str, out: str, *extra) -> list[str]:
    w = lake.world
    return [
        f"input={source}",
        f"catalog={w / 'data' / 'items.parquet'}",
        f"output={out}",
        f"models.target={w / 'target'}",
        f"decoding.k={K}",
        "compute.batch_size=16",
        f"run_date={DATE}",
        f"models.cache_dir={w / 'cache'}",
        f"storage.endpoint={lake.s3.endpoint}",
        *extra,
    ]


def catalog(name: str, lake: Lake):
    return iceberg.catalog(name, lake.storage)


def renamed(t: pa.Table, names: dict) -> pa.Table:
    return t.rename_columns([names.get(n, n) for n in t.column_names])


def rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t[c].to_pylist() for c in KEY), strict=True))


def date_rows(table, run_date: str, snapshot_id: int | None = None) -> pa.Table:
    from pyiceberg.expressions import EqualTo

    return table.scan(row_filter=EqualTo("run_date", run_date), snapshot_id=snapshot_id).to_arrow()


@pytest.fixture(scope="module")
def nights(lake):
    """The nights the commits are made of. A history table in the Postgres catalog: snapshot 1 the first 25 users
    (columns customer and basket), then basket renamed items and the other 15 appended (snapshot 2). An Iceberg run
    of DATE starts on snapshot 2 (its _RUN.json), the table gets snapshot 3 (every history cut to one item, a new
    user), and `--resume latest` finishes the run: it reads snapshot 2. Its commit creates the output table. Then
    the same users' parquet, a night of DATE (another output root) and one of OTHER_DATE, the latter committed."""
    from pipeline.attempt import start_run
    from pipeline.nightly import after_publish, run_nightly
    from pipeline.plan import plan_at

    cat = catalog(SHARED, lake)
    cat.create_namespace_if_not_exists("hist")
    first = renamed(lake.users.slice(0, 25), {"user_id": "customer", "history": "basket"})
    history = cat.create_table("hist.users", schema=first.schema)
    history.append(first)
    with history.update_schema() as update:
        update.rename_column("basket", "items")
    history.append(renamed(lake.users.slice(25), {"user_id": "customer", "history": "items"}))
    pinned = history.current_snapshot().snapshot_id
    s3, table = lake.s3, f"iceberg+{SHARED}/recs.daily"
    source = f"iceberg+{SHARED}/hist.users"
    cfg = load_config(None, settings(lake, source, s3.uri("out-ice"), "columns.user_id=customer",
                                     "columns.history=items", f"table.uri={table}"))  # fmt: skip
    run_id = "20261121T000000Z-aaaaaa"
    start_run(plan_at(cfg, None, None), run_id, f"{cfg.output}/run_date={DATE}/run_id={run_id}")
    later = renamed(lake.users, {"user_id": "customer", "history": "items"})
    cut = pa.array([h[-1:] for h in lake.users["history"].to_pylist()], later["items"].type)
    later = later.set_column(later.column_names.index("items"), "items", cut)
    history.append(pa.concat_tables([later.slice(0, 1).set_column(0, "customer", pa.array([10**6])), later]))
    ice = run_nightly(cfg, resume="latest")
    ice_done = after_publish(cfg, ice)
    plain = load_config(None, settings(lake, str(lake.world / "data" / "test.parquet"), s3.uri("out-parquet")))
    parquet = run_nightly(plain)
    other_cfg = load_config(None, [*settings(lake, str(lake.world / "data" / "test.parquet"), s3.uri("out-parquet"),
                                             f"table.uri={table}"), f"run_date={OTHER_DATE}"])  # fmt: skip
    other = run_nightly(other_cfg)
    other_done = after_publish(other_cfg, other)
    return {"pinned": pinned, "ice": ice, "ice_done": ice_done, "parquet": parquet, "other": other,
            "other_done": other_done, "table": table}  # fmt: skip


def test_a_night_from_an_iceberg_snapshot_equals_the_parquet_night_and_a_rerun_of_its_date_replaces_its_rows(
    lake, nights
):
    """The Iceberg night's run started on snapshot 2 and its resume read snapshot 2, whatever snapshot 3 holds: its
    lists are the parquet night's (the same users; scores within float32's reordering bound), a file written
    before the column was renamed read by field id. Its commit created the table (one APPEND snapshot naming the
    run) and reads back equal to the run; the OTHER_DATE night's commit adds its date. Exporting the parquet night's
    run of DATE (a rerun of the date) makes one OVERWRITE snapshot: the date's rows are that run's, the other
    date's untouched, the earlier snapshot still reads the first run's; exporting either run again does nothing, and
    exporting into a table of other columns is refused, exit 2."""
    s3, storage = lake.s3, lake.storage
    ice, parquet = nights["ice"], nights["parquet"]
    assert ice["input"] == {"uri": f"iceberg+{SHARED}/hist.users", "version": nights["pinned"], "files": 2}
    assert ice["resume"]["resumed"] and ice["counts"]["input_rows"] == 40
    mine = open_run(f"{s3.uri('out-ice')}/run_date={DATE}", storage).table("recommendations")
    theirs = open_run(f"{s3.uri('out-parquet')}/run_date={DATE}", storage).table("recommendations")
    assert rows(mine) == rows(theirs) and mine.num_rows == 40 * K
    a, b = (t.sort_by([(c, "ascending") for c in KEY])["score"].to_numpy() for t in (mine, theirs))
    assert np.abs(a - b).max() <= float32_atol(torch.tensor(a)), np.abs(a - b).max()

    done = nights["ice_done"]["table"]
    assert done["skipped"] is None and done["rows"] == mine.num_rows and done["files"] == 1
    table = catalog(SHARED, lake).load_table("recs.daily")
    first = table.snapshot_by_id(done["version"])
    assert first.summary.operation.value == "append" and first.summary[RUN_ID] == ice["run_id"]
    assert rows(date_rows(table, DATE)) == rows(mine)
    assert set(date_rows(table, DATE)["run_id"].to_pylist()) == {ice["run_id"]}
    assert [f.name for f in table.spec().fields] == ["run_date"]
    other = nights["other_done"]["table"]
    assert other["skipped"] is None and table.current_snapshot().snapshot_id == other["version"]

    rerun = f"{s3.uri('out-parquet')}/run_date={DATE}/run_id={parquet['run_id']}"
    flags = ["--endpoint", s3.endpoint]
    assert export.main([rerun, "--to", nights["table"], *flags]) == 0
    table = catalog(SHARED, lake).load_table("recs.daily")
    now = table.current_snapshot()
    assert now.parent_snapshot_id == other["version"] and now.summary.operation.value == "overwrite"
    assert now.summary[RUN_ID] == parquet["run_id"] and now.summary[CALL]
    assert set(date_rows(table, DATE)["run_id"].to_pylist()) == {parquet["run_id"]}
    assert rows(date_rows(table, DATE)) == rows(theirs)
    assert set(date_rows(table, OTHER_DATE)["run_id"].to_pylist()) == {nights["other"]["run_id"]}
    assert set(date_rows(table, DATE, done["version"])["run_id"].to_pylist()) == {ice["run_id"]}  # time travel
    snapshots = len(table.snapshots())
    ice_run = f"{s3.uri('out-ice')}/run_date={DATE}/run_id={ice['run_id']}"
    for again in (rerun, ice_run):  # both committed once already: nothing done
        assert export.main([again, "--to", nights["table"], *flags]) == 0
    assert len(catalog(SHARED, lake).load_table("recs.daily").snapshots()) == snapshots
    catalog(SHARED, lake).create_table("recs.foreign", schema=pa.schema([("x", pa.int64())]))
    assert export.main([rerun, "--to", f"iceberg+{SHARED}/recs.foreign", *flags]) == 2  # not the run's columns

    path = iceberg.local(next(iter(table.scan().plan_files())).file.file_path)
    fs, where = S.filesystem(path, storage)
    schema = pq.read_schema(where, filesystem=fs)
    ids = {f.name: int(f.metadata[b"PARQUET:field_id"]) for f in schema}
    assert ids == {f.name: f.field_id for f in table.schema().fields}  # readers match the columns by field id


def commit_at_once(runs_: list, uri: str) -> list:
    """Each run committed to `uri` by its own thread, released together."""
    barrier = threading.Barrier(len(runs_))

    def call(run):
        barrier.wait()
        return iceberg.commit_run(run, Table(uri, rows_per_file=120))

    with ThreadPoolExecutor(len(runs_)) as pool:
        return list(pool.map(call, runs_))


def test_two_runs_of_one_date_committing_at_once_leave_one_run_of_the_date(lake, nights):
    """The Iceberg night's and the parquet night's runs of DATE (each its own root's published run) commit to a
    table that does not exist yet, at once: one table is created, both commit (the catalog's compare-and-swap
    orders them: the later one reloads, and replaces the earlier's rows), and the date holds the rows of exactly
    one run: the one the current snapshot names."""
    s3, storage = lake.s3, lake.storage
    runs_ = [open_run(f"{s3.uri(out)}/run_date={DATE}", storage) for out in ("out-ice", "out-parquet")]
    done = commit_at_once(runs_, f"iceberg+{SHARED}/recs.race")
    assert [c.skipped for c in done] == [None, None], done
    table = catalog(SHARED, lake).load_table("recs.race")
    assert len(table.snapshots()) == 2 and table.metadata.table_uuid
    last = table.current_snapshot().summary[RUN_ID]
    got = date_rows(table, DATE)
    assert set(got["run_id"].to_pylist()) == {last} and got.num_rows == 40 * K
    assert rows(got) == rows(next(r for r in runs_ if r.run_id == last).table("recommendations"))


def test_two_commits_of_one_run_at_once_make_one_snapshot_and_leave_no_orphan(lake, nights):
    """One run committed by two calls at once: exactly one reports it committed, the other `skipped` (committed by
    another call) and deletes the files it wrote; the table has one snapshot, and its data folder only the files
    that snapshot names."""
    s3, storage = lake.s3, lake.storage
    run = open_run(f"{s3.uri('out-ice')}/run_date={DATE}", storage)
    done = commit_at_once([run, run], f"iceberg+{SHARED}/recs.twice")
    assert sorted(c.skipped is None for c in done) == [False, True], done
    won, lost = sorted(done, key=lambda c: c.skipped is not None)
    assert "already committed by another call" in lost.skipped and lost.version == won.version
    assert won.rows == run.table("recommendations").num_rows and (lost.files, lost.rows) == (0, 0)
    table = catalog(SHARED, lake).load_table("recs.twice")
    assert len(table.snapshots()) == 1
    named = {iceberg.local(t.file.file_path).rpartition("/")[2] for t in table.scan().plan_files()}
    prefix = table.location().split("/", 3)[3] + "/data/"
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix)["Contents"]
    assert {o["Key"].rpartition("/")[2] for o in listed} == named and len(named) == won.files


def test_a_commit_that_lost_to_another_reloads_and_commits_against_the_table_now(lake, nights, monkeypatch, caplog):
    """The table moves on between a commit's load and its snapshot (another run of the date commits in between): the
    catalog's compare-and-swap refuses it (CommitFailedException), and the call reloads the table and commits again,
    deleting the date's files as they are now. A SQLite catalog: one snapshot each, the date's rows the later run's
    only."""
    s3, storage = lake.s3, lake.storage
    mine, theirs = (open_run(f"{s3.uri(out)}/run_date={DATE}", storage) for out in ("out-ice", "out-parquet"))
    uri, overwrite, between = f"iceberg+{LOCAL}/db.overtaken", iceberg.overwrite, []

    def overtaken(table, old, new, summary):
        if summary[RUN_ID] == mine.run_id and not between:
            between.append(iceberg.commit_run(theirs, Table(uri)))  # commits after `table` was loaded
        overwrite(table, old, new, summary)

    monkeypatch.setattr(iceberg, "overwrite", overtaken)
    done = iceberg.commit_run(mine, Table(uri))
    assert between[0].skipped is None and done.skipped is None and "lost to another" in caplog.text
    table = catalog(LOCAL, lake).load_table("db.overtaken")
    assert [s.summary[RUN_ID] for s in table.snapshots()] == [theirs.run_id, mine.run_id]
    assert table.current_snapshot().snapshot_id == done.version
    got = date_rows(table, DATE)
    assert set(got["run_id"].to_pylist()) == {mine.run_id} and rows(got) == rows(mine.table("recommendations"))


def test_a_commit_that_lost_is_planned_again_under_any_isolation_level(lake, nights, monkeypatch):
    """A table made elsewhere whose write.delete.isolation-level is snapshot: a commit of the date's first rows that
    loses to another run's (theirs lands between its load and its snapshot) is planned again against the table as
    it is now, not rebased by pyiceberg's own retry as it was planned (which under snapshot isolation checks
    nothing and keeps both runs' rows of the date)."""
    s3, storage = lake.s3, lake.storage
    mine, theirs = (open_run(f"{s3.uri(out)}/run_date={DATE}", storage) for out in ("out-ice", "out-parquet"))
    uri, overwrite, between = f"iceberg+{LOCAL}/db.isolated", iceberg.overwrite, []
    with iceberg.create(uri, storage, table_schema(mine, narrowest=32)).transaction() as txn:
        txn.set_properties({"write.delete.isolation-level": "snapshot"})

    def overtaken(table, old, new, summary):
        if summary[RUN_ID] == mine.run_id and not between:
            between.append(iceberg.commit_run(theirs, Table(uri)))  # the date's first rows, after `table` loaded
        overwrite(table, old, new, summary)

    monkeypatch.setattr(iceberg, "overwrite", overtaken)
    done = iceberg.commit_run(mine, Table(uri))
    assert between[0].skipped is None and done.skipped is None
    got = date_rows(catalog(LOCAL, lake).load_table("db.isolated"), DATE)
    assert set(got["run_id"].to_pylist()) == {mine.run_id} and rows(got) == rows(mine.table("recommendations"))


def test_a_catalog_that_refuses_the_commit_is_exit_2_its_password_not_shown(lake, nights, monkeypatch, capsys):
    """A SQL catalog whose database role may read the catalog's tables but not update them: the export loads the
    table, writes its files, and the catalog refuses the commit. Exit 2 (docs/output.md: a catalog that refuses the
    commit), one `error:` line naming the table, the role's password in no message. A commit that keeps failing
    transiently is StoreUnavailable (exit 4) after storage.retry_s."""
    import psycopg2

    pg, s3 = lake.pg, lake.s3
    with psycopg2.connect(host="127.0.0.1", port=pg.port, user="genrec", password=pg.password, dbname="postgres") as c:
        with c.cursor() as cur:
            cur.execute("CREATE ROLE reader LOGIN PASSWORD 'reader-password-5678'")
            cur.execute("GRANT SELECT ON ALL TABLES IN SCHEMA public TO reader")
    shared = f"PYICEBERG_CATALOG__{SHARED.upper()}__"
    for k, v in list(os.environ.items()):
        if k.startswith(shared):  # the catalog `reader`: the lake's database and warehouse
            monkeypatch.setenv(k.replace(shared, "PYICEBERG_CATALOG__READER__"), v)
    run = open_run(f"{s3.uri('out-ice')}/run_date={DATE}", lake.storage)
    iceberg.create("iceberg+reader/recs.refused", lake.storage, table_schema(run, narrowest=32))  # by the owner
    monkeypatch.setenv("PYICEBERG_CATALOG__READER__URI", pg.url.replace(pg.password, "reader-password-5678")
                       .replace("genrec:", "reader:"))  # fmt: skip
    capsys.readouterr()
    flags = ["--endpoint", s3.endpoint, "--retry-s", "2"]
    assert export.main([run.uri, "--to", "iceberg+reader/recs.refused", *flags]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "recs.refused" in err and "reader-password-5678" not in err, err

    def down(*_):
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(iceberg, "overwrite", down)  # a catalog whose commits fail transiently, for retry_s
    flaky = open_run(run.uri, Storage(s3.endpoint, retry_s=1))
    with pytest.raises(S.StoreUnavailable, match="Iceberg catalog reader unavailable: commit run"):  # exit 4
        iceberg.transact(flaky, Table("iceberg+reader/recs.refused"), [], "a-call")


def read_all(plan) -> pa.Table:
    """Every row of a plan's input as the read tasks read it (`units.read_units`), in scan order."""
    from pipeline.plan import input_columns

    columns = input_columns(plan.cfg, plan.data.schema)
    return pa.concat_tables(
        units.read_units(
            pa.table({k: [v] for k, v in u.items()}), plan.fs, columns, schema=plan.data.schema, names=plan.names
        )  # fmt: skip
        for u in units.todo(plan.units, [])
    )


def test_columns_are_matched_by_field_id_and_what_cannot_be_read_is_refused(lake, tmp_path, capsys):
    """A SQLite catalog's table: the history column renamed, the exclusion column dropped and added again between
    snapshots, a parquet file without field ids added (matched by the name mapping pyiceberg gave the table): each
    file's columns are read by field id, so the dropped column's values are never read as the new one's. A table
    partitioned by a column (identity) is read file by file, as any other. Refused
    before any work, exit 2, naming them: a snapshot expired from the table's metadata (also as a resume's), a
    table whose data files have position deletes, one whose equality deletes apply to a data file (once the files
    they applied to are rewritten, the table reads whole), a catalog nobody configured and one whose database
    refuses the password (which no message shows)."""
    from pyiceberg.expressions import EqualTo

    from pipeline.attempt import start_run
    from pipeline.plan import plan_at, plan_run

    cat = catalog(LOCAL, lake)
    cat.create_namespace_if_not_exists("db")
    users = lake.users.select(["user_id", "history"])
    exclude = pa.array([[1]] * 10, pa.list_(pa.int64()))
    evolving = cat.create_table("db.evolving", schema=users.slice(0, 10).append_column("exclude_items", exclude).schema)
    evolving.append(users.slice(0, 10).append_column("exclude_items", exclude))
    expired = evolving.current_snapshot().snapshot_id
    with evolving.update_schema() as update:
        update.rename_column("history", "items")
        update.delete_column("exclude_items")
    with evolving.update_schema() as update:
        update.add_column("exclude_items", evolving.schema().find_field("items").field_type)
    later = renamed(users.slice(10, 5), {"history": "items"})
    evolving.append(later.append_column("exclude_items", pa.array([[2]] * 5, pa.list_(pa.int64()))))
    plain = tmp_path / "plain.parquet"  # written by pyarrow: no field ids
    pq.write_table(renamed(users.slice(15, 5), {"history": "items"}), plain)
    evolving.add_files([str(plain)])
    base = settings(lake, f"iceberg+{LOCAL}/db.evolving", str(tmp_path / "out"), "columns.history=items")
    plan = plan_run(load_config(None, base))
    got = read_all(plan)
    ids = users["user_id"].to_pylist()
    assert got.num_rows == 20
    by_user = dict(zip(got["user_id"].to_pylist(), got["exclude_items"].to_pylist(), strict=True))
    assert by_user == {**dict.fromkeys(ids[:10]), **{u: [2] for u in ids[10:15]}, **dict.fromkeys(ids[15:20])}
    histories = dict(zip(got["user_id"].to_pylist(), got["history"].to_pylist(), strict=True))
    assert histories == dict(zip(ids[:20], users["history"].to_pylist()[:20], strict=True))

    regions = users.slice(0, 6).append_column("region", pa.array(["north", "south"] * 3))
    parted = cat.create_table("db.parted", schema=regions.schema)  # identity-partitioned: a file per region
    with parted.update_spec() as spec:
        spec.add_identity("region")
    parted.append(regions)
    parted_cfg = load_config(None, settings(lake, f"iceberg+{LOCAL}/db.parted", str(tmp_path / "out")))
    plan = plan_run(parted_cfg)
    got = read_all(plan)
    assert len(plan.data.files) == 2 and sorted(got["user_id"].to_pylist()) == sorted(ids[:6])

    started = load_config(None, settings(lake, f"iceberg+{LOCAL}/db.evolving", str(tmp_path / "started")))
    run_id = "20261121T000000Z-bbbbbb"  # a run that started on the first snapshot (its columns' names then)
    start_run(plan_at(started, expired, None), run_id, runs.run_dir(started.output, DATE, run_id))
    evolving.maintenance.expire_snapshots().by_id(expired).commit()
    with pytest.raises(FileNotFoundError, match=rf"snapshot {expired} is not in the table's metadata"):
        plan_run(load_config(None, [*base, f"input_version={expired}"]))
    with pytest.raises(FileNotFoundError, match=rf"--resume: run {run_id} started on .* version {expired}, "):
        plan_run(started, resume="latest")  # its resume reads its snapshot or nothing
    config = tmp_path / "empty.json"
    config.write_text(json.dumps({}))
    flags = [x for item in [*base, f"input_version={expired}"] for x in ("--set", item)]
    assert nightly_job.main(["--check", "--config", str(config), *flags]) == 2
    assert f"snapshot {expired}" in capsys.readouterr().err

    deleted = cat.create_table("db.deleted", schema=users.schema)
    deleted.append(users.slice(0, 10))
    delete_rows(deleted, "position", [0, 3])
    assert deleted.scan().to_arrow().num_rows == 8  # pyiceberg applies them: the table is sound
    with pytest.raises(ValueError, match=r"1 delete file\(s\) \(position deletes\) .* does not apply them"):
        plan_run(load_config(None, settings(lake, f"iceberg+{LOCAL}/db.deleted", str(tmp_path / "out"))))
    delete_rows(parted, "equality", [0], EqualTo("region", "north"))  # user ids[0]'s row in north's file
    with pytest.raises(ValueError, match=r"1 delete file\(s\) \(equality deletes\) .* does not apply them"):
        plan_run(parted_cfg)
    north = regions.filter(pc.equal(regions["region"], "north")).slice(1)  # north rewritten, its deletes applied
    parted.overwrite(north, overwrite_filter=EqualTo("region", "north"))  # (a compaction): they apply to no file
    assert sorted(read_all(plan_run(parted_cfg))["user_id"].to_pylist()) == sorted(ids[1:6])

    for source, words, exc in (
        ("iceberg+nowhere/db.t", "Iceberg catalog 'nowhere' is not configured", ValueError),
        ("iceberg+broken/db.t", "password authentication failed", PermissionError),
    ):
        wrong = lake.pg.url.replace(lake.pg.password, "not-the-password-1234")
        os.environ.update(catalog_env("broken", {"uri": wrong}))
        with pytest.raises(exc, match=words) as caught:
            plan_run(load_config(None, settings(lake, source, str(tmp_path / "out"))))
        assert "not-the-password-1234" not in str(caught.value)
    for bad, words in (
        (["input=iceberg+lake"], "must be an Iceberg table: iceberg"),
        (["input=iceberg+postgresql://u:hunter2@h/db.t"], "by its pyiceberg name .* not a connection"),
        (["table.uri=iceberg+sql:x@y/db.t"], "by its pyiceberg name"),
        (["input_version=3"], "input_version needs a table input"),
        (["table.uri=s3://bucket/recs"], "table.uri must name a store: delta\\+... or iceberg\\+..."),
    ):
        with pytest.raises(ValueError, match=words):
            load_config(None, [*settings(lake, str(plain), str(tmp_path / "out")), *bad])


def delete_rows(table, kind: str, rows_: list[int], where=None) -> None:
    """A delete file committed in a delete manifest (as Spark's merge-on-read writes them; pyiceberg writes none of
    its own), deleting rows `rows_` of the table's one data file (`where`: of its one file that matches) in its
    partition: by position ("position"), or by their user_id ("equality")."""
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat, ManifestContent, ManifestWriterV2
    from pyiceberg.table.snapshots import Operation
    from pyiceberg.table.update.snapshot import _FastAppendFiles

    (task,) = table.scan(**({"row_filter": where} if where is not None else {})).plan_files()
    path = f"{table.location()}/data/{kind}-deletes-0.parquet"
    if kind == "position":
        schema = pa.schema([pa.field("file_path", pa.string(), False, {b"PARQUET:field_id": b"2147483546"}),
                            pa.field("pos", pa.int64(), False, {b"PARQUET:field_id": b"2147483545"})])  # fmt: skip
        deletes, content, ids = [[task.file.file_path] * len(rows_), rows_], DataFileContent.POSITION_DELETES, None
    else:
        field = table.schema().find_field("user_id")
        users = pq.read_table(iceberg.local(task.file.file_path))["user_id"].take(rows_)
        schema = pa.schema([pa.field("user_id", users.type, True, {b"PARQUET:field_id": str(field.field_id).encode()})])
        deletes, content, ids = [users], DataFileContent.EQUALITY_DELETES, [field.field_id]
    pq.write_table(pa.table(deletes, schema=schema), iceberg.local(path))

    class DeleteManifest(ManifestWriterV2):
        def content(self) -> ManifestContent:
            return ManifestContent.DELETES

    class AddDeletes(_FastAppendFiles):
        def new_manifest_writer(self, spec):
            return DeleteManifest(spec, self.schema(), self.new_manifest_output(), self._snapshot_id, self._compression)

    delete = DataFile.from_args(
        content=content, file_path=path, file_format=FileFormat.PARQUET, partition=task.file.partition,
        equality_ids=ids, record_count=len(rows_), file_size_in_bytes=os.path.getsize(iceberg.local(path)),
        spec_id=task.file.spec_id,
    )  # fmt: skip
    with table.transaction() as txn:
        with AddDeletes(Operation.DELETE, txn, table.io) as producer:
            producer.append_data_file(delete)
