"""Delta Lake tables on a real S3 server (SeaweedFS): histories read from a table at one version, its columns named by
the config; a published run committed to a table partitioned by run_date, read back whole by delta-rs and by pyarrow,
a rerun of the date replacing the date's rows in one commit; versions that cannot be read refused, exit 2."""

import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from jobs import export
from jobs import nightly as nightly_job
from pipeline.config import load_config
from pipeline.output import open_run
from pipeline.storage import Storage
from pipeline.stores import delta
from tests.servers import seaweedfs
from tests.test_nightly import direct_beam_search, make_world

DATE, OTHER_DATE = "2026-11-21", "2026-11-20"
K = 5


@pytest.fixture(scope="module")
def lake(tmp_path_factory):
    """SeaweedFS, a local Ray whose workers get its credentials, the test world, and a Delta history table on the
    store whose columns are named customer and items (three appends: version 2, three files; the last one user
    whose history names an item the catalog lacks)."""
    import ray

    root = tmp_path_factory.mktemp("lake")
    world = make_world(root / "world", n_users=60)
    with seaweedfs(root / "s3") as s3:
        saved = dict(os.environ)
        os.environ.update(s3.env())
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            storage = Storage(s3.endpoint)
            users = pq.read_table(world / "data" / "test.parquet")
            renamed = users.rename_columns(
                [{"user_id": "customer", "history": "items"}.get(n, n) for n in users.column_names]
            )
            history = s3.uri("lake", "histories")
            write(history, renamed.slice(0, 25), storage, "overwrite")
            write(history, renamed.slice(25), storage, "append")
            unknown = renamed.slice(0, 1).set_column(0, "customer", pa.array([10**6], renamed["customer"].type))
            unknown = unknown.set_column(1, "items", pa.array([[999_999]], renamed["items"].type))
            write(history, unknown, storage, "append")  # version 2: a user whose history names an unknown item
            yield world, s3, storage, history, users
        finally:
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved)


def write(uri: str, t: pa.Table, storage: Storage, mode: str) -> None:
    from deltalake import write_deltalake

    write_deltalake(uri, t, mode=mode, storage_options=delta.storage_options(storage))


def settings(world, s3, history: str, out: str, *extra) -> list[str]:
    return [
        f"input=delta+{history}",
        "columns.user_id=customer",
        "columns.history=items",
        f"catalog={world / 'data' / 'items.parquet'}",
        f"output={out}",
        f"models.target={world / 'target'}",
        f"decoding.k={K}",
        "compute.batch_size=16",
        f"run_date={DATE}",
        f"models.cache_dir={world / 'cache'}",
        f"storage.endpoint={s3.endpoint}",
        *extra,
    ]


def night(items: list[str]) -> tuple[dict, dict]:
    """One nightly run in this process, then its commit -> (manifest, what after_publish did)."""
    from pipeline.nightly import after_publish, run_nightly

    cfg = load_config(None, items)
    manifest = run_nightly(cfg)
    return manifest, after_publish(cfg, manifest)


def rows(t: pa.Table) -> list[tuple]:
    return sorted(zip(*(t[c].to_pylist() for c in ("user_id", "rank", "item_id", "score")), strict=True))


def test_a_night_from_a_delta_table_commits_its_lists_and_a_rerun_replaces_its_date_in_one_commit(lake, tmp_path):
    """The input table's newest version (2) is read with its columns renamed; every user's list is beam search's on
    the table's histories, and a user whose history names an unknown item is a reject. The run's commit reads back
    equal to the published run with delta-rs's reader and with pyarrow over the files the log names (its run_date
    from the Hive-style paths); a rerun of the date replaces the date's rows in one commit (history: an overwrite
    naming the run), leaving another date's rows; committing a run again does nothing; a table whose columns are not
    the run's is refused, exit 2."""
    from deltalake import DeltaTable

    world, s3, storage, history, users = lake
    out, table = s3.uri("lake", "out"), f"delta+{s3.uri('lake', 'recommendations')}"
    items = settings(world, s3, history, out, f"table.uri={table}", "table.rows_per_file=120")
    other, _ = night([*items, f"run_date={OTHER_DATE}"])  # another date's run first
    manifest, done = night(items)
    assert manifest["input"] == {"uri": f"delta+{history}", "version": 2, "files": 3}
    rejects = open_run(f"{out}/run_date={DATE}", storage).table("rejects")
    assert rejects["user_id"].to_pylist() == [10**6] and rejects["reason"].to_pylist() == ["unknown_item"]
    run = open_run(f"{out}/run_date={DATE}", storage)
    published = run.table("recommendations")
    ref, _ = direct_beam_search(world, users["history"].to_pylist(), k=K)
    want = dict(zip(users["user_id"].to_pylist(), ref.item_ids.tolist(), strict=True))
    got = published.to_pandas().sort_values(["user_id", "rank"]).groupby("user_id").item_id.apply(list).to_dict()
    assert got == want

    commit = done["table"]
    assert commit["run_id"] == manifest["run_id"] and commit["rows"] == published.num_rows == len(users) * K
    assert commit["files"] == -(-published.num_rows // 120) and commit["skipped"] is None
    options = delta.storage_options(storage)
    dt = DeltaTable(delta.location(table), storage_options=options)
    assert dt.version() == commit["version"] and dt.metadata().partition_columns == ["run_date"]
    read = dt.to_pyarrow_table(filters=[("run_date", "=", DATE)])
    assert rows(read) == rows(published) and set(read["run_id"].to_pylist()) == {manifest["run_id"]}
    fs = s3.filesystem()
    files = delta.data_files(dt, table, storage)
    by_pyarrow = pads.dataset(files, filesystem=fs, format="parquet", partitioning="hive").to_table()
    assert sorted(by_pyarrow["run_date"].unique().to_pylist()) == [OTHER_DATE, DATE]
    assert rows(by_pyarrow.filter(pads.field("run_date") == DATE)) == rows(published)

    again, redone = night(items)  # a rerun of the date: its rows replace the first run's, in one commit
    assert again["run_id"] != manifest["run_id"]
    dt = DeltaTable(delta.location(table), storage_options=options)
    assert dt.version() == commit["version"] + 1 == redone["table"]["version"]
    last = dt.history(1)[0]
    assert last["operation"] == "WRITE" and last["operationParameters"]["mode"] == "Overwrite"
    assert last[delta.RUN_ID] == again["run_id"]
    now = dt.to_pyarrow_table()
    assert set(now.filter(pads.field("run_date") == DATE)["run_id"].to_pylist()) == {again["run_id"]}
    assert rows(now.filter(pads.field("run_date") == DATE)) == rows(
        open_run(f"{out}/run_date={DATE}", storage).table("recommendations")
    )
    assert set(now.filter(pads.field("run_date") == OTHER_DATE)["run_id"].to_pylist()) == {other["run_id"]}
    assert DeltaTable(delta.location(table), version=commit["version"], storage_options=options).to_pyarrow_table(
        filters=[("run_date", "=", DATE)]
    )["run_id"].unique().to_pylist() == [manifest["run_id"]]  # time travel: the first run's rows

    run_dir = f"{out}/run_date={DATE}/run_id={again['run_id']}"
    assert export.main([run_dir, "--to", table, "--endpoint", s3.endpoint]) == 0  # committed already: nothing done
    assert DeltaTable(delta.location(table), storage_options=options).version() == dt.version()
    old = f"{out}/run_date={DATE}/run_id={manifest['run_id']}"
    assert export.main([old, "--to", table, "--endpoint", s3.endpoint]) == 0  # superseded: never committed over
    assert DeltaTable(delta.location(table), storage_options=options).version() == dt.version()

    write(s3.uri("lake", "foreign"), pa.table({"x": [1]}), storage, "overwrite")
    assert export.main([run_dir, "--to", f"delta+{s3.uri('lake', 'foreign')}", "--endpoint", s3.endpoint]) == 2


def test_a_pinned_input_version_reads_that_version_and_one_gone_is_refused(lake, tmp_path, capsys):
    """input_version pins an older version (its users, not the newest's); a version the log no longer has, or whose
    files were vacuumed, is refused before any work, naming the table and the version: exit 2."""
    from deltalake import DeltaTable

    from pipeline.plan import plan_run

    world, s3, storage, _, users = lake
    uri = s3.uri("lake", "pinned")
    first = users.rename_columns([{"user_id": "customer", "history": "items"}.get(n, n) for n in users.column_names])
    write(uri, first.slice(0, 10), storage, "overwrite")  # version 0: 10 users
    write(uri, first.slice(10, 30), storage, "overwrite")  # version 1: 30 others
    items = settings(world, s3, uri, s3.uri("lake", "pinned-out"))
    assert sum(u.rows for u in plan_run(load_config(None, items)).units) == 30
    plan = plan_run(load_config(None, [*items, "input_version=0"]))
    assert plan.input_version == 0 and sum(u.rows for u in plan.units) == 10
    assert plan.identity["input_version"] == 0

    DeltaTable(uri, storage_options=delta.storage_options(storage)).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False
    )
    for version, words in ((0, "vacuumed"), (7, "cannot be read")):
        with pytest.raises(FileNotFoundError, match=rf"version {version}.*{words}|{words}.*version {version}"):
            plan_run(load_config(None, [*items, f"input_version={version}"]))
        config = tmp_path / f"v{version}.json"
        config.write_text(json.dumps({}))
        flags = [x for item in [*items, f"input_version={version}"] for x in ("--set", item)]
        assert nightly_job.main(["--check", "--config", str(config), *flags]) == 2
        assert f"version {version}" in capsys.readouterr().err


def test_a_delta_input_is_checked_like_parquet(lake, tmp_path):
    """Columns the config names that the table lacks, a user id column the table partitions by, and settings that
    need a Delta input or a Delta output are refused naming them."""
    from pipeline.plan import plan_run

    world, s3, storage, _, users = lake
    items = settings(world, s3, s3.uri("lake", "histories"), s3.uri("lake", "checked-out"))
    for setting, name in (("columns.user_id=client", "client"), ("columns.history=basket", "basket")):
        with pytest.raises(ValueError, match=rf"^input delta\+\S+ version 2: missing column\(s\) \['{name}'\]"):
            plan_run(load_config(None, [*items, setting]))  # the table and its version named, no data file
    parted = s3.uri("lake", "partitioned")
    from deltalake import write_deltalake

    t = users.rename_columns([{"history": "items"}.get(n, n) for n in users.column_names]).slice(0, 5)
    write_deltalake(parted, t, partition_by=["user_id"], storage_options=delta.storage_options(storage))
    with pytest.raises(ValueError, match=r"\['user_id'\] are partition columns"):
        plan_run(load_config(None, [*settings(world, s3, parted, s3.uri("lake", "x")), "columns.user_id=user_id"]))
    spaced = tmp_path / "a lake" / "histories"  # a space in the root, characters the log URI-encodes in the paths
    t = users.slice(0, 3).append_column("region", pa.array(["São Paulo", "a b", "x%y"]))
    write_deltalake(str(spaced), t, partition_by=["region"])
    snap = delta.snapshot(f"delta+{spaced}", storage, None, ["user_id", "history"])
    assert len(snap.files) == 3 and all(os.path.isfile(f) for f in snap.files)
    for bad, words in (
        ([f"input={world / 'data' / 'test.parquet'}", "input_version=3"], "input_version needs a table input"),
        (["table.uri=delta+http://host/recs"], "table.uri must be a Delta table"),
        (["columns.history=customer"], "columns.history must differ"),
        (["input=delta+"], "input must be a Delta table"),
    ):
        with pytest.raises(ValueError, match=words):
            load_config(None, [*items, *bad])


def test_a_resume_reads_its_runs_version_only_when_that_run_continues(lake):
    """`--resume latest` plans on the version its unfinished run started on when that run can continue; when it
    cannot (its config changed) the new run it starts reads the newest version. A column added by schema evolution
    is read, as nulls in the files older than it; an empty table is read as no users."""
    from deltalake import DeltaTable

    from pipeline import units
    from pipeline.attempt import start_run
    from pipeline.plan import input_columns, plan_at, plan_run

    world, s3, storage, _, users = lake
    uri = s3.uri("lake", "evolving")
    first = users.rename_columns([{"user_id": "customer", "history": "items"}.get(n, n) for n in users.column_names])
    first = first.select(["customer", "items"])
    write(uri, first.slice(0, 10), storage, "overwrite")  # version 0: 10 users, no exclusion column
    later = first.slice(10, 5).append_column("exclude_items", pa.array([[1]] * 5, pa.list_(pa.int64())))
    from deltalake import write_deltalake

    write_deltalake(uri, later, mode="append", schema_mode="merge", storage_options=delta.storage_options(storage))
    items = settings(world, s3, uri, s3.uri("lake", "evolving-out"))
    cfg = load_config(None, [*items, "input_version=0"])
    old = plan_at(cfg, 0, None)
    start_run(old, "20261121T000000Z-000000", f"{cfg.output}/run_date={DATE}/run_id=20261121T000000Z-000000")
    resumed = plan_run(load_config(None, items), "latest")
    assert resumed.input_version == 0 and sum(u.rows for u in resumed.units) == 10
    new = plan_run(load_config(None, [*items, "decoding.k=4"]), "latest")  # that run cannot continue: the newest
    assert new.input_version == 1 and sum(u.rows for u in new.units) == 15

    columns = input_columns(new.cfg, new.data.schema)
    assert columns == {"user_id": "customer", "history": "items", "exclude_items": "exclude_items"}
    read = [
        units.read_units(pa.table({k: [v] for k, v in unit.items()}), new.fs, columns, schema=new.data.schema)
        for unit in units.todo(new.units, [])
    ]
    got = pa.concat_tables(read)
    ids = first["customer"].to_pylist()
    want = {**dict.fromkeys(ids[:10]), **{u: [1] for u in ids[10:15]}}  # the files are read in their names' order
    assert dict(zip(got["user_id"].to_pylist(), got["exclude_items"].to_pylist(), strict=True)) == want

    empty = s3.uri("lake", "empty")
    DeltaTable.create(empty, schema=first.schema, storage_options=delta.storage_options(storage))
    plan = plan_run(load_config(None, settings(world, s3, empty, s3.uri("lake", "empty-out"))))
    assert plan.units == [] and plan.input_version == 0


def test_after_the_publish_a_failure_or_a_signal_names_what_is_left(monkeypatch):
    """The table commit and the serving export are both tried: both failing is exit 8 naming both causes; a signal
    during the commit stops the job (exit 6), its `stopped:` line saying the run is published and which commands
    finish it, never a resume (which would decode the date again)."""
    import signal

    from pipeline import nightly
    from pipeline.nightly import SINK_STEPS, TableCommitFailed, after_publish, exit_code
    from pipeline.signals import Interrupted, stop_note

    cfg = load_config(None, ["input=x", "catalog=x", "output=/o", "models.target=x", "run_date=2026-11-21"])
    cfg.table.uri, cfg.serving.url = "delta+/t", "redis://:secret@h:6379/0"
    manifest = {"run_id": "R"}

    def fail(cfg, manifest, section):
        raise dict(SINK_STEPS)[section](f"the {section} step failed")

    monkeypatch.setattr(nightly, "to_sink", fail)
    with pytest.raises(TableCommitFailed, match="the table step failed; and the serving step failed") as caught:
        after_publish(cfg, manifest)
    assert exit_code(caught.value) == 8

    def stopped(cfg, manifest, section):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(nightly, "to_sink", stopped)
    with pytest.raises(Interrupted) as caught:
        after_publish(cfg, manifest)
    note = stop_note(caught.value, resume=False)
    assert "run R is published" in note and "genrec-batch export /o/run_date=2026-11-21/run_id=R --to delta+/t" in note
    assert "--namespace genrec" in note and "secret" not in note and "--resume" not in note


def test_two_commits_of_one_run_at_once_make_one_version_and_leave_no_orphan(lake, tmp_path):
    """Two calls commit one published run to a table that does not exist yet, at once (threads released by a
    barrier): the table is created once (one CREATE TABLE, one table id), the run's rows are in one WRITE, exactly
    one call reports it committed and the other `skipped`, and the date's folder holds only the files the table
    names."""
    import threading

    from deltalake import DeltaTable

    from pipeline.config import Table

    world, s3, storage, history, _ = lake
    out, uri = s3.uri("lake", "twice-out"), f"delta+{s3.uri('lake', 'twice')}"
    manifest, _ = night(settings(world, s3, history, out))
    run = open_run(f"{out}/run_date={DATE}", storage)
    barrier = threading.Barrier(2)

    def call(_):
        barrier.wait()
        return delta.commit_run(run, Table(uri, rows_per_file=120))

    logged = Records()
    logging.getLogger("ray.data").addHandler(logged)
    try:
        with ThreadPoolExecutor(2) as pool:
            done = list(pool.map(call, range(2)))
    finally:
        logging.getLogger("ray.data").removeHandler(logged)
    assert not [m for m in logged.messages if "deprecated" in m]  # e.g. map_batches(concurrency=): Ray Data's warning
    assert sorted(c.skipped is None for c in done) == [False, True], done
    won, lost = sorted(done, key=lambda c: c.skipped is not None)
    assert won.rows == run.table("recommendations").num_rows and (lost.files, lost.rows) == (0, 0)
    assert lost.version == won.version and "already committed" in lost.skipped
    dt = DeltaTable(delta.location(uri), storage_options=delta.storage_options(storage))
    assert [h["operation"] for h in dt.history()] == ["WRITE", "CREATE TABLE"] and dt.version() == won.version == 1
    named = {f.rpartition("/")[2] for f in delta.data_files(dt, uri, storage)}
    held = {o["Key"].rpartition("/")[2] for o in s3.client().list_objects_v2(
        Bucket=s3.bucket, Prefix=f"lake/twice/run_date={DATE}/")["Contents"]}  # fmt: skip
    assert held == named and len(named) == won.files


class Records(logging.Handler):
    """The messages a logger's records carry."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_tables_created_at_once_are_one_table(tmp_path):
    """Four calls create one table at once, five times over (delta-rs's own create raced in nearly every round
    here): every round leaves one CREATE TABLE, version 0."""
    import threading

    from deltalake import DeltaTable

    schema = pa.schema([("run_date", pa.string()), ("user_id", pa.int64())])
    for i in range(5):
        uri, barrier = f"delta+{tmp_path / str(i)}", threading.Barrier(4)

        def call(_, uri=uri, barrier=barrier):
            barrier.wait()
            delta.create(uri, Storage(), schema)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(call, range(4)))
        dt = DeltaTable(delta.location(uri))
        assert dt.version() == 0 and [h["operation"] for h in dt.history()] == ["CREATE TABLE"]


def test_an_error_in_a_ray_task_is_its_cause_on_the_error_line():
    """What a task raised reaches the `error:` line as itself: Ray's task error (the class Ray raises it as, and the
    one Ray Data wraps a UDF's in) unwrapped, the retry context Ray Data appends to its text taken off; its exit
    code the cause's."""
    import ray.exceptions

    from pipeline import storage as S
    from pipeline.nightly import exit_code
    from pipeline.signals import ray_cause

    def raised(e):
        e.args = (e.args[0] + "\nFailed to apply UDF transform after 1/1 attempts (total backoff 0.0s).\nTo change",)
        return ray.exceptions.RayTaskError("MapBatches(f)", "Traceback ...", e).as_instanceof_cause()

    denied = raised(S.NodeDenied("node n cannot read the model s3://b/m: Unable to locate credentials"))
    assert "\x1b[36m" in str(denied) and "pid=" in str(denied)  # what the line printed: Ray's coloured task header
    assert str(ray_cause(denied)) == "node n cannot read the model s3://b/m: Unable to locate credentials"
    assert exit_code(ray_cause(denied)) == 9 and exit_code(ray_cause(raised(S.ModelChanged("m")))) == 2
    wrapped = ray.exceptions.UserCodeException("UDF failed")
    wrapped.__cause__ = S.StoreUnavailable("Redis r unavailable")
    assert str(ray_cause(ray.exceptions.RayTaskError("f", "tb", wrapped))) == "Redis r unavailable"
    assert ray_cause(ValueError("x")).args == ("x",)


def test_a_node_refused_on_a_write_or_a_base_read_is_named_with_the_fix():
    """A worker without credentials fails where it first touches the store: reading the input, items, models or an
    incremental base, or writing its shards; each is NodeDenied (exit 9) naming what it could not reach and how."""
    import botocore.exceptions

    from pipeline import storage as S

    with pytest.raises(
        S.NodeDenied, match=r"cannot write the run's shards under s3://b/out/run: Unable to locate .*IRSA"
    ):
        with S.on_node("the run's shards under", "s3://b/out/run", "write"):
            raise botocore.exceptions.NoCredentialsError()
    with pytest.raises(ValueError, match="not a credential error"):  # anything else passes through as itself
        with S.on_node("the incremental base", "s3://b/base"):
            raise ValueError("not a credential error")
