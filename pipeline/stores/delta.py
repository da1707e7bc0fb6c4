"""Delta Lake tables through delta-rs (`deltalake`): a source (histories read at one table version) and a sink (a
published run's recommendations committed to a table partitioned by run_date). docs/architecture.md compares the
two table formats.

Input. `input: delta+URI` names a Delta table. The plan pins one version (input_version; else a resume's, the version
its run started on, _RUN.json `identity.input_version`; else the newest) and reads that version's data files as it
reads parquet: their row groups are the run's units, the files in sorted order, so a resume cuts the same positions.
A version whose log or files are gone (expired, vacuumed) is refused naming it (FileNotFoundError: exit 2), as is a
table whose version needs what reading its files does not apply (deletion vectors, column mapping).

Output. `table.uri`, or `genrec-batch export RUN --to delta+URI`. After the run is published, Ray tasks copy its
recommendation files into the table's folder `run_date=D/` (table.rows_per_file rows a file, each row with its
run_id), then the driver commits them in one Delta transaction: an overwrite whose predicate is run_date = D, so the
date's earlier rows go out in the same commit. The commit info records the run (genrec_batch.run_id). Two app
transactions fence it: one per date (two commits of one date conflict: the later one reloads and checks again) and
one per run (a commit tried again after an answer was lost finds it made). Each call names itself in its commit info
(genrec_batch.commit, a nonce): a call reports "committed" only when the version that holds the run names it; two
calls committing one run at once leave one version, and the other call reports `skipped` and deletes the files it
wrote. Only the date's published run (_LATEST) is committed: a run superseded since is skipped, its successor
commits itself. A new table is created by one commit of version 0 (never retried over another's creation): two calls
creating it at once leave one table, one table id.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.parse
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads

from pipeline import runs
from pipeline import storage as S
from pipeline.config import Config, Table
from pipeline.storage import Storage
from pipeline.stores.base import Commit, Input, check_present, read_footers
from pipeline.stores.lake import (
    CALL,
    CONFLICT_TRIES,
    DENIED_WORDS,
    PARTITION,
    RUN_ID,
    TRANSIENT_WORDS,
    delete_written,
    file_name,
    group,
    refusals,  # noqa: F401 -- the Sink protocol's
    rows,
    table_schema,
    target,  # noqa: F401 -- the Sink protocol's
    whose,
    worded,
    write_parts,
)

log = logging.getLogger("genrec.tables")

PREFIX = "delta+"  # a URI that names a Delta table: delta+s3://bucket/prefix, delta+/local/path
VERSIONED = True
NAME, SECTION, BEFORE = "Delta table", "table", "the date's rows before"

READABLE = frozenset({"timestampNtz", "v2Checkpoint", "vacuumProtocolCheck"})  # reader features that change nothing
# about reading a version's files as they are (deletion vectors and column mapping do)


def location(uri: str) -> str:
    """delta+s3://b/p -> s3://b/p; delta+/path -> /path."""
    return uri.removeprefix(PREFIX)


def check_uri(uri: str) -> str | None:
    where = location(uri)
    if where and ("://" not in where or where.startswith("s3://")):
        return None
    return f"must be a Delta table: {PREFIX}s3://bucket/prefix or {PREFIX}/local/path"


def storage_options(storage: Storage) -> dict[str, str]:
    """delta-rs's object-store settings from the storage section and the environment. Credentials come from the
    environment (AWS_ACCESS_KEY_ID, ...), as for the product's other S3 clients."""
    endpoint = storage.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    options = {"AWS_REGION": storage.region, "timeout": f"{S.REQUEST_S:g}s", "connect_timeout": f"{S.CONNECT_S:g}s"}
    if endpoint:
        options["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            options["AWS_ALLOW_HTTP"] = "true"
    return options


def transient(e: BaseException, uri: str = "") -> bool:
    """A delta-rs error worth trying again: the object store's own transient errors, or delta-rs's words for them in
    its message (the table's own URI left out: a path may hold any word)."""
    from deltalake.exceptions import CommitFailedError, TableNotFoundError

    if S.transient(e):
        return True
    if isinstance(e, (FileNotFoundError, PermissionError, TableNotFoundError, CommitFailedError)):
        return False
    return worded(str(e).replace(uri, "").replace(location(uri) if uri else "", ""), TRANSIENT_WORDS)


def retrying(call, storage: Storage, what: str, uri: str):
    """`storage.retrying` with delta-rs's transient errors (`uri`: the table's)."""
    where = location(uri)
    name = f"object store {S.store_name(storage)}" if S.is_s3(where) else f"the filesystem of {where}"
    store = (name, lambda e: transient(e, uri), "storage.retry_s")
    return S.retrying(call, storage, what, store=store)


def load(uri: str, storage: Storage, version: int | None = None):
    """The Delta table at `uri` (a delta+ URI) at `version` (None: the newest) -> deltalake.DeltaTable.
    FileNotFoundError naming it when there is no table, or the version's log is gone or never was."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    where = location(uri)
    at = "" if version is None else f" version {version}"
    try:
        return retrying(
            lambda: DeltaTable(where, version=version, storage_options=storage_options(storage)),
            storage,
            f"read the log of Delta table {uri}{at}",
            uri,
        )
    except TableNotFoundError:
        raise FileNotFoundError(f"{uri}: no Delta table there (no _delta_log)") from None
    except S.StoreUnavailable:
        raise
    except Exception as e:
        if worded(str(e), DENIED_WORDS):
            raise PermissionError(
                f"{uri}: the object store refused access ({' '.join(str(e).split())[:300]}); check the credentials "
                "in the environment and storage.endpoint"
            ) from None
        if version is None:
            raise ValueError(f"{uri}: not readable as a Delta table ({' '.join(str(e).split())})") from None
        raise FileNotFoundError(
            f"{uri}: version {version} cannot be read; its log entries are gone (expired) or it was never written "
            f"({' '.join(str(e).split())[:300]})"
        ) from None


# ------------------------------------------------------------------ input: one version's files


@dataclass(frozen=True)
class Snapshot:
    """A Delta input pinned to a version: what the plan reads."""

    uri: str  # delta+...
    version: int
    files: list[str]  # its data files, as the input's filesystem names them, sorted (the units' scan order)
    schema: pa.Schema  # the table's schema at that version (an empty table has no file to read it from)


def snapshot(uri: str, storage: Storage, version: int | None, columns: list[str]) -> Snapshot:
    """The input table at `version` (None: the newest) -> its Snapshot. Refused naming the table and version: a
    version that cannot be read (FileNotFoundError), one whose files are gone (vacuumed: FileNotFoundError), one
    that needs a reader feature, lacks the user id or history column (the first two of `columns`: the user id,
    history and exclusion columns) or holds `columns` as partition columns (ValueError)."""
    table = load(uri, storage, version)
    version = table.version()
    check_readable(table, uri, version, columns)
    names = table.schema().to_arrow().names
    missing = [c for c in columns[:2] if c not in names]
    if missing:
        raise ValueError(
            f"input {uri} version {version}: missing column(s) {missing} (the table has {names}); columns.user_id "
            "and columns.history name the input's columns"
        )
    fs, _ = S.filesystem(location(uri), storage)
    files = data_files(table, uri, storage)
    check_present(fs, files, f"input {uri} version {version}", storage, " (the table was vacuumed past this version)")
    return Snapshot(uri, version, files, pa.schema(table.schema().to_arrow()))


def open(cfg: Config, version: int | None = None) -> Input:
    """cfg.input at `version` (None: the newest; `snapshot`) -> its files, footers read, in the table's schema: a
    column added later (schema evolution) is in it, read as nulls in the files older than it."""
    columns = [cfg.columns.user_id, cfg.columns.history, cfg.decoding.exclude_column]
    snap = snapshot(cfg.input, cfg.storage, version, columns)
    fs, _ = S.filesystem(location(cfg.input), cfg.storage)
    data = S.retrying(
        lambda: pads.dataset(snap.files, filesystem=fs, format="parquet", schema=snap.schema),
        cfg.storage,
        f"open {cfg.input} version {snap.version}",
    )
    read_footers(data, cfg.storage)
    return Input(data, fs, snap.version)


def data_files(table, uri: str, storage: Storage) -> list[str]:
    """A version's data files as the input's filesystem names them, sorted. Read from the log's add actions: their
    paths are URI-encoded, relative to the table's root (or absolute URIs, as a shallow clone writes), so each is
    decoded once, then joined to the root as configured."""
    paths = pa.table(table.get_add_actions(flatten=True))["path"].to_pylist()
    root = location(uri)
    out = []
    for path in map(urllib.parse.unquote, paths):
        absolute = "://" in path or path.startswith("/")
        out.append(S.filesystem(path.removeprefix("file://") if absolute else S.join(root, path), storage)[1])
    return sorted(out)


def check_readable(table, uri: str, version: int, columns: list[str]) -> None:
    """A version whose rows are its files' rows, and whose columns the run reads are in its files."""
    protocol, metadata = table.protocol(), table.metadata()
    features = set(protocol.reader_features or []) - READABLE
    mapping = metadata.configuration.get("delta.columnMapping.mode", "none")
    if features or protocol.min_reader_version == 2 and mapping != "none":
        named = sorted(features) or [f"columnMapping ({mapping})"]
        raise ValueError(
            f"input {uri} version {version} needs the reader feature(s) {', '.join(named)}, which reading its "
            "files as they are does not apply (deleted rows, renamed columns). Rewrite the table without them, or "
            "export the version to parquet and read that"
        )
    partitioned = sorted(set(columns) & set(metadata.partition_columns))
    if partitioned:
        raise ValueError(
            f"input {uri}: column(s) {partitioned} are partition columns of the table; the user id, history and "
            "exclusion columns must be data columns"
        )


# ------------------------------------------------------------------ output: a published run committed


def check(t: Table, storage: Storage) -> None:
    """The plan's checks of the output table: its folder reachable with these credentials and, on S3, a store
    that honours conditional writes (delta-rs's commits rest on them)."""
    where = location(t.uri)
    S.check_access(where, storage)
    if S.is_s3(where):
        S.check_store_once(where, storage)


def shown(uri: str) -> str:
    return uri


def export_flags(t: Table) -> str:
    return ""


def commit_run(run, t: Table) -> Commit:
    """A published run (pipeline.output.PublishedRun) -> its recommendations committed to the Delta table t.uri (see
    the module docstring); created partitioned by run_date if absent. A call that finds the run committed (before it
    writes, or by another call while it wrote) or superseded commits nothing, says why (`skipped`) and deletes the
    files it wrote. Raises StoreUnavailable (the store gave out for storage.retry_s), ValueError (a table whose schema
    is not the run's, a run that is not its date's published run)."""
    import uuid

    start, storage = time.perf_counter(), run.storage
    schema = table_schema(run)  # in Delta's types
    done = committed(t.uri, storage, run.run_id)
    if done is not None:
        return Commit(t.uri, run.run_id, run.run_date, done[0], 0, 0, time.perf_counter() - start, "already committed")
    why = runs.unpublished(run.uri, storage)
    if why is not None:
        return Commit(t.uri, run.run_id, run.run_date, None, 0, 0, time.perf_counter() - start, f"not published: {why}")
    created = create(t.uri, storage, schema)
    check_schema(created, t.uri, schema)
    call = uuid.uuid4().hex[:12]
    adds = write_files(run, t, schema, call)
    version, skipped = transact(run, t, adds, schema, call)
    if skipped is not None:  # another call's files hold the run, or none may: this call's are in no version
        delete_written([S.join(location(t.uri), a.path) for a in adds], storage)
        log.info("table %s: run %s not committed by this call (%s)", t.uri, run.run_id, skipped)
        return Commit(t.uri, run.run_id, run.run_date, version, 0, 0, time.perf_counter() - start, skipped)
    count = sum(json.loads(a.stats)["numRecords"] for a in adds)
    took = time.perf_counter() - start
    log.info("table %s: run %s of %s committed as version %s (%d files, %d rows, %.1f s)", t.uri, run.run_id,
             run.run_date, version, len(adds), count, took)  # fmt: skip
    return Commit(t.uri, run.run_id, run.run_date, version, len(adds), count, took, None)


def run_app(run_id: str) -> str:
    return f"genrec-batch/run/{run_id}"


def date_app(run_date: str) -> str:
    return f"genrec-batch/{PARTITION}/{run_date}"


def committed(uri: str, storage: Storage, run_id: str, table=None) -> tuple[int, str | None] | None:
    """The table version whose commit made `run_id`'s rows and the call that made it (its CALL; None when its commit
    entry is beyond the history delta-rs kept), if one did (its app transaction), else None."""
    try:
        table = table or load(uri, storage)
    except FileNotFoundError:
        return None
    if table.transaction_version(run_app(run_id)) is None:
        return None
    for entry in table.history():  # newest first
        if entry.get(RUN_ID) == run_id:
            return int(entry["version"]), entry.get(CALL)
    return table.version(), None


def create(uri: str, storage: Storage, schema: pa.Schema):
    """The table, created empty and partitioned by run_date if there is none -> its DeltaTable. The creation is one
    commit of version 0, never retried by delta-rs: of calls creating the table at once one writes it, the others
    fail that commit and read the table it made (delta-rs's own retry would commit a second CREATE TABLE, a second
    table id, as version 1)."""
    from deltalake import DeltaTable
    from deltalake.exceptions import CommitFailedError
    from deltalake.transaction import CommitProperties

    try:
        retrying(
            lambda: DeltaTable.create(
                location(uri),
                schema=schema,
                mode="ignore",
                partition_by=[PARTITION],
                name="recommendations",
                description="genrec-batch: each run_date's published recommendation lists",
                storage_options=storage_options(storage),
                commit_properties=CommitProperties(max_commit_retries=0),
            ),
            storage,
            f"create Delta table {uri}",
            uri,
        )
    except CommitFailedError as e:  # another call created it first: theirs is the table
        log.info("table %s: created by another call meanwhile (%s)", uri, e)
    return load(uri, storage)


def check_schema(table, uri: str, schema: pa.Schema) -> None:
    """A table whose columns or partitioning are not the run's -> ValueError naming the difference."""
    have = table.schema().to_arrow()
    mine = {f.name: f.type for f in schema}
    theirs = {f.name: f.type for f in have}
    if table.metadata().configuration.get("delta.appendOnly", "false").lower() == "true":
        raise ValueError(f"table {uri} is append-only (delta.appendOnly): a rerun could not replace its date's rows")
    if table.metadata().partition_columns != [PARTITION] or mine != theirs:
        raise ValueError(
            f"table {uri}: its columns {describe(have)} partitioned by {table.metadata().partition_columns} are not "
            f"the run's {describe(schema)} partitioned by ['{PARTITION}']: commit to another table, or migrate it"
        )


def describe(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name} {f.type}" for f in schema) + ")"


def write_files(run, t: Table, schema: pa.Schema, call: str) -> list:
    """The run's recommendation files copied into the table's folder by Ray tasks (`lake.write_parts`) -> their
    AddActions."""
    from deltalake.transaction import AddAction

    written = write_parts(run, t, write_part, uri=t.uri, schema=schema, nonce=call)
    if written is None:
        return []
    now = int(time.time() * 1000)
    return [
        AddAction(r["path"], r["size"], {PARTITION: run.run_date}, now, True, r["stats"])
        for r in written.sort_by("path").to_pylist()
        if r["rows"]
    ]


def write_part(
    batch: pa.Table, uri: str, run_id: str, run_date: str, schema: pa.Schema, storage: Storage, nonce: str
) -> pa.Table:
    """`lake.write_parts`' task: a group's rows, each with its run_id, in the table's types, written as one parquet
    file under run_date=D/ (none for a group without a row; run_date is the file's partition value, not a column)
    -> (path in the table, size, rows, Delta stats)."""
    part, files = group(batch)
    found = rows(files, run_id, run_date, schema, storage).drop_columns([PARTITION])
    path = f"{PARTITION}={run_date}/{file_name(run_id, nonce, part)}"
    if not found.num_rows:
        return pa.table({"path": [path], "size": [0], "rows": [0], "stats": [""]})
    dest = S.join(location(uri), path)
    S.write_parquet(found, dest, storage)
    fs, where = S.filesystem(dest, storage)
    size = S.retrying(lambda: fs.get_file_info(where).size, storage, f"HEAD {dest}")
    return pa.table({"path": [path], "size": [size], "rows": [found.num_rows], "stats": [stats_of(found)]})


def stats_of(t: pa.Table) -> str:
    """A data file's Delta statistics: numRecords, and per integer column its min, max and null count (the columns
    readers skip files by: user_id, rank, item_id)."""
    low, high, nulls = {}, {}, {}
    for name in t.column_names:
        column = t[name]
        nulls[name] = column.null_count
        if pa.types.is_integer(column.type) and column.null_count < len(column):
            found = pc.min_max(column).as_py()
            low[name], high[name] = found["min"], found["max"]
    return json.dumps({"numRecords": t.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls})


def transact(run, t: Table, adds: list, schema: pa.Schema, call: str) -> tuple[int | None, str | None]:
    """One Delta transaction: `adds` in, the date's earlier rows out (overwrite where run_date = D), the commit info
    naming the run and the call, the date's and the run's app transactions -> (the table version, None), or (the
    version, why) when another call committed the run first, or (None, why) when the run was superseded before its
    commit. A commit that lost to another's reloads and checks again."""
    from deltalake.exceptions import CommitFailedError

    storage = run.storage
    for _ in range(CONFLICT_TRIES):
        table = load(t.uri, storage)
        done = committed(t.uri, storage, run.run_id, table)
        if done is not None:
            return whose(done, call)
        why = runs.unpublished(run.uri, storage)
        if why is not None:
            return None, f"not published: {why}"
        properties = commit_properties(run, table, call)
        try:
            retrying(
                lambda table=table, properties=properties: table.create_write_transaction(
                    adds,
                    mode="overwrite",
                    schema=schema,
                    partition_by=[PARTITION],
                    partition_filters=[(PARTITION, "=", run.run_date)],
                    commit_properties=properties,
                ),
                storage,
                f"commit run {run.run_id} to Delta table {t.uri}",
                t.uri,
            )
        except CommitFailedError as e:
            if load(t.uri, storage).version() == table.version():  # nobody else committed: delta-rs refused it
                raise ValueError(f"table {t.uri}: the commit of run {run.run_id} was refused: {e}") from None
            log.warning("table %s: the commit of run %s lost to another (%s); checking again", t.uri, run.run_id, e)
            continue
        return whose(committed(t.uri, storage, run.run_id), call)
    raise S.StoreUnavailable(f"table {t.uri}: the commit of run {run.run_id} lost to others {CONFLICT_TRIES} times")


def commit_properties(run, table, call: str):
    """A run's commit: its info naming the run and the call; the date's app transaction (the next of its sequence:
    two commits of the date from one version conflict) and the run's (a commit tried again finds itself made); no
    retry by delta-rs (a conflict comes back to `transact`: the run is checked again on the table it lost to)."""
    from deltalake.transaction import CommitProperties, Transaction

    sequence = (table.transaction_version(date_app(run.run_date)) or 0) + 1
    metadata = {RUN_ID: run.run_id, CALL: call, "genrec_batch.run": run.uri, "genrec_batch.run_date": run.run_date}
    return CommitProperties(
        custom_metadata=metadata,
        app_transactions=[Transaction(date_app(run.run_date), sequence), Transaction(run_app(run.run_id), 1)],
        max_commit_retries=0,
    )
