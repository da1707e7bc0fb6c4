"""Apache Iceberg tables through pyiceberg: a source (histories read at one snapshot) and a sink (a published run's
recommendations committed to a table partitioned by run_date). docs/architecture.md compares the two table formats.

Catalog. `iceberg+CATALOG/NAMESPACE.TABLE` names a table of the catalog CATALOG as pyiceberg configures it:
~/.pyiceberg.yaml (or $PYICEBERG_HOME/.pyiceberg.yaml) or PYICEBERG_CATALOG__<CATALOG>__<PROPERTY> variables (a REST
catalog, Glue, SQL on Postgres, ...; its FileIO's s3.* properties with it). Only the driver talks to the catalog; the
Ray tasks read and write data files with the product's own object store client (storage.*, AWS_* credentials). None
of the catalog's properties is in the run's config, manifest or logs: an error is shown with its secrets masked.

Input. `input: iceberg+...` pins a snapshot (input_version: its id; else a resume's, the snapshot its run started on;
else the table's current one) and reads the data files pyiceberg plans for it as it reads parquet: their row groups
are the run's units, the files in sorted order, so a resume cuts the same positions. The columns are the snapshot's
schema's, matched in each file by field id (`file_names`): a column renamed since a file was written is read from
that file's column of its id, one added later reads as nulls in older files, one dropped and added again never reads
the dropped one's values; a file without field ids is matched by the table's name mapping. Refused, naming it: a
snapshot gone from the table's metadata (expired) or never made, data files gone, delete files that apply to the
snapshot's data files (position deletes, equality deletes, deletion vectors: never read as if absent), data files
that are not parquet or not on S3 or a local disk, a file lacking an identity partition column (its values would be
in the manifests only).

Output. `table.uri`, or `genrec-batch export RUN --to iceberg+...`. After the run is published, Ray tasks write its
recommendations as parquet data files where the table's location provider puts the date's partition (run_date=D/,
table.rows_per_file rows a file, the table's field ids, run_date in every row) and return their footers; the driver
makes their DataFiles from them and commits ONE snapshot that deletes the date's data files and adds these (an
OVERWRITE; the first commit of a table, an APPEND), its summary naming the run (genrec_batch.run_id) and the call
(genrec_batch.commit, a nonce). The catalog's compare-and-swap fences it: a commit that lost to another
(CommitFailedException; pyiceberg's own retry, which would rebase it unplanned, is off: `overwrite`) reloads the table,
plans the date's files again and checks again. A call reports "committed" only when the snapshot holding the run names
it; a run already committed (its snapshot in the main branch's history: a retry after a lost answer finds it), or no
longer its date's published run, is skipped, and the files the call wrote are deleted. A table created here (with its
namespace, when absent) is partitioned by run_date (identity): two calls creating it at once leave one table.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.parse

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from pipeline import runs
from pipeline import storage as S
from pipeline.config import Config, Table
from pipeline.signals import hold_for_test
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

PREFIX = "iceberg+"  # iceberg+CATALOG/NAMESPACE.TABLE (NAMESPACE: one or more levels, dotted)
VERSIONED = True
NAME, SECTION, BEFORE = "Iceberg table", "table", "the date's rows before"
FIELD_ID = b"PARQUET:field_id"  # a parquet column's Iceberg field id, in its arrow field's metadata
SECRET = re.compile(r"pass|secret|token|credential|key|auth", re.I)  # catalog properties whose values are never shown
DELETES = {1: "position deletes", 2: "equality deletes"}  # a delete file's content -> what it deletes


# ------------------------------------------------------------------ the catalog


def parse(uri: str) -> tuple[str, tuple[str, ...], str]:
    """iceberg+CATALOG/NS1.NS2.TABLE -> (CATALOG, (NS1, NS2), TABLE)."""
    catalog, _, name = uri.removeprefix(PREFIX).partition("/")
    *namespace, table = name.split(".")
    return catalog, tuple(namespace), table


CATALOG_NAME = re.compile(r"[A-Za-z0-9_-]+")  # a name pyiceberg configures (PYICEBERG_CATALOG__NAME__...)


def check_uri(uri: str) -> str | None:
    """Why `uri` names no Iceberg table, or None. The catalog is a name pyiceberg configures, never a connection
    string: a URI, user or password in the run's config would be recorded in its manifest."""
    catalog, namespace, table = parse(uri)
    if catalog and not CATALOG_NAME.fullmatch(catalog):
        return (
            "must name an Iceberg catalog by its pyiceberg name (letters, digits, _ and -), not a connection: its "
            "URI and credentials go in ~/.pyiceberg.yaml or PYICEBERG_CATALOG__<NAME>__* variables (docs/deploy.md)"
        )
    if catalog and namespace and table and all(namespace):
        return None
    return f"must be an Iceberg table: {PREFIX}CATALOG/NAMESPACE.TABLE, the catalog as pyiceberg configures it"


def location(uri: str) -> None:
    """None: the catalog is checked by `open` (an Iceberg table is no path)."""
    return None


def shown(uri: str) -> str:
    return uri


def export_flags(t: Table) -> str:
    return ""


def properties(name: str) -> dict:
    """The catalog `name`'s properties as pyiceberg reads them now (~/.pyiceberg.yaml, $PYICEBERG_HOME, the
    PYICEBERG_CATALOG__* variables); ValueError naming where to configure it when there are none."""
    from pyiceberg.utils.config import Config as IcebergConfig

    found = IcebergConfig().get_catalog_config(name)
    if not found:
        raise ValueError(
            f"Iceberg catalog {name!r} is not configured: pyiceberg reads it from ~/.pyiceberg.yaml ($PYICEBERG_HOME) "
            f"or PYICEBERG_CATALOG__{name.upper().replace('-', '_')}__<PROPERTY> variables (docs/deploy.md)"
        )
    return dict(found)


def secrets(props: dict) -> list[str]:
    """The values an error must not show: secret properties' (SECRET), and the passwords in URI properties."""
    out = [str(v) for k, v in props.items() if SECRET.search(k) and v]
    for v in props.values():
        try:
            out += [urllib.parse.unquote(p) for p in [urllib.parse.urlsplit(str(v)).password] if p]
        except ValueError:
            pass
    return sorted({s for s in out if len(s) >= 3}, key=len, reverse=True)


class CatalogError(Exception):
    """A catalog call's error, its text with the catalog's secrets masked (`calling`)."""

    def __init__(self, message: str, transient: bool, denied: bool):
        super().__init__(message)
        self.transient, self.denied = transient, denied


def calling(call, storage: Storage, what: str, name: str):
    """call() on the catalog `name` (pyiceberg) -> its result. Transient errors (the catalog's server or database
    unreachable, a timeout, 5xx) are tried again for storage.retry_s, then StoreUnavailable (exit 4); a refused
    credential is PermissionError, any other error ValueError (exit 2), naming `what`, the secrets masked.
    pyiceberg's own answers (no such table or namespace, a table that exists, a commit that lost) pass as they are."""
    from pyiceberg import exceptions as ie

    passed = (ie.NoSuchTableError, ie.NoSuchNamespaceError, ie.TableAlreadyExistsError, ie.CommitFailedException)
    passed += (ie.ValidationException, ie.CommitStateUnknownException, ie.NamespaceAlreadyExistsError)

    def once():
        try:
            return call()
        except passed:
            raise
        except Exception as e:
            raise catalog_error(e, name) from None

    store = (f"Iceberg catalog {name}", lambda e: isinstance(e, CatalogError) and e.transient, "storage.retry_s")
    try:
        return S.retrying(once, storage, what, store=store)
    except CatalogError as e:
        raise refused(e, what) from None


def catalog_error(e: BaseException, name: str) -> CatalogError:
    """An error of a call to the catalog `name` -> CatalogError: its text with the catalog's secrets masked,
    transient or not (`transient`), a refused credential or permission or not."""
    from pyiceberg import exceptions as ie

    text = " ".join(f"{type(e).__name__}: {e}".split())
    for secret in secrets(properties(name)):
        text = text.replace(secret, "***")
    denied = isinstance(e, (ie.ForbiddenError, ie.UnauthorizedError)) or worded(text, DENIED_WORDS)
    return CatalogError(text[:800], transient(e) and not denied, denied)


def refused(e: CatalogError, what: str) -> Exception:
    """A catalog's error that trying again does not mend -> PermissionError (a refused credential or permission),
    else ValueError, naming `what`: exit 2."""
    return (PermissionError if e.denied else ValueError)(f"{what}: {e}")


def transient(e: BaseException) -> bool:
    """A catalog error worth trying again: the object store's transient errors, a REST catalog's 5xx, or a
    database's or client's words for a connection that failed."""
    from pyiceberg.exceptions import ServerError, ServiceUnavailableError

    return S.transient(e) or isinstance(e, (ServerError, ServiceUnavailableError)) or worded(str(e), TRANSIENT_WORDS)


CATALOGS: dict = {}  # (name, its properties) -> the loaded catalog, for this process


def catalog(name: str, storage: Storage):
    """The catalog `name` (`properties`), loaded once per process and configuration."""
    from pyiceberg.catalog import load_catalog

    props = properties(name)
    key = (name, json.dumps(props, sort_keys=True, default=str))
    if key not in CATALOGS:
        CATALOGS[key] = calling(lambda: load_catalog(name, **props), storage, f"load Iceberg catalog {name}", name)
    return CATALOGS[key]


def load(uri: str, storage: Storage, missing_ok: bool = False):
    """The table `uri` names -> pyiceberg's Table (its current metadata); FileNotFoundError naming it when it is not
    there (None with `missing_ok`)."""
    from pyiceberg.exceptions import NoSuchNamespaceError, NoSuchTableError

    name, namespace, table = parse(uri)
    cat = catalog(name, storage)
    try:
        return calling(lambda: cat.load_table((*namespace, table)), storage, f"load Iceberg table {uri}", name)
    except (NoSuchTableError, NoSuchNamespaceError):
        if missing_ok:
            return None
        raise FileNotFoundError(f"{uri}: no such table in Iceberg catalog {name}") from None


def check(t: Table, storage: Storage) -> None:
    """The plan's check of the output table: its catalog configured and reachable."""
    catalog(parse(t.uri)[0], storage)


# ------------------------------------------------------------------ input: one snapshot's files


def open(cfg: Config, version: int | None = None) -> Input:
    """cfg.input at snapshot `version` (None: the current one) -> its data files, footers read, in the snapshot
    schema's columns and types, with each file's names for them (`file_names`). See the module docstring for what
    is refused."""
    uri, storage = cfg.input, cfg.storage
    table = load(uri, storage)
    snapshot = table.current_snapshot() if version is None else table.snapshot_by_id(version)
    if version is not None and snapshot is None:
        raise FileNotFoundError(
            f"input {uri}: snapshot {version} is not in the table's metadata: it was expired (expire_snapshots), "
            "or never made"
        )
    sid = snapshot.snapshot_id if snapshot is not None else None
    schema = table.schema() if snapshot is None else table.metadata.schema_by_id(snapshot.schema_id) or table.schema()
    names = [f.name for f in schema.fields]
    missing = [c for c in (cfg.columns.user_id, cfg.columns.history) if c not in names]
    if missing:
        raise ValueError(
            f"input {uri} snapshot {sid}: missing column(s) {missing} (the snapshot's schema has {names}); "
            "columns.user_id and columns.history name the input's columns"
        )
    tasks = plan_files(table, uri, sid, storage)
    files = sorted(local(t.file.file_path) for t in tasks)
    fs = S.filesystem(files[0], storage)[0] if files else pafs.LocalFileSystem()
    paths = [S.filesystem(f, storage)[1] for f in files]
    check_present(fs, paths, f"input {uri} snapshot {sid}", storage, " (removed from the table's location)")
    data = S.retrying(
        lambda: pads.dataset(paths, filesystem=fs, format="parquet", schema=arrow_schema(schema)),
        storage,
        f"open {uri} snapshot {sid}",
    )
    read_footers(data, storage)
    specs = {S.filesystem(local(t.file.file_path), storage)[1]: t.file.spec_id for t in tasks}
    held = {}
    for fragment in data.get_fragments():
        mine = file_names(fragment, schema, table.metadata.name_mapping(), uri)
        check_partitions(mine, table.metadata.specs()[specs[fragment.path]], schema, fragment.path, uri)
        if mine:
            held[fragment.path] = mine
    return Input(data, fs, sid, held)


def plan_files(table, uri: str, sid: int | None, storage: Storage) -> list:
    """The snapshot's data files as pyiceberg plans a scan of it (its manifests; each with the position delete files
    that apply to it) -> their FileScanTasks. Refused naming them: delete files that apply (position deletes,
    deletion vectors, equality deletes: their rows would be read as if present), data files not in parquet, or not
    on S3 or a local disk."""
    if sid is None:
        return []
    name = parse(uri)[0]
    tasks, equality = calling(lambda: planned(table, sid), storage, f"plan {uri} snapshot {sid}", name)
    deletes = {d.file_path: d for t in tasks for d in t.delete_files} | {d.file_path: d for d in equality}
    if deletes:
        kinds = sorted({"deletion vectors" if d.file_format.name == "PUFFIN" else DELETES[d.content] for d in
                        deletes.values()})  # fmt: skip
        raise ValueError(
            f"input {uri} snapshot {sid}: {len(deletes)} delete file(s) ({', '.join(kinds)}) delete rows of its data "
            f"files, e.g. {min(deletes)}; genrec-batch reads data files whole and does not apply them. Rewrite the "
            "data files they apply to (Spark: CALL <catalog>.system.rewrite_data_files(table => '...', options => "
            "map('delete-file-threshold', '1'))), then read the new snapshot, or export the snapshot to parquet"
        )
    for t in tasks:
        path = t.file.file_path
        if t.file.file_format.name != "PARQUET":
            raise ValueError(f"input {uri} snapshot {sid}: data file {path} is {t.file.file_format.name}, not parquet")
        if "://" in local(path) and not local(path).startswith("s3://"):
            raise ValueError(f"input {uri} snapshot {sid}: data file {path}: only s3:// and local files are read")
    return tasks


def planned(table, sid: int) -> tuple[list, list]:
    """pyiceberg's plan of the snapshot's files, read from its manifests here (pyiceberg's scan refuses any equality
    delete file, even one that applies to no data file) -> (its FileScanTasks, the equality delete files that apply
    to one of them: `applying`)."""
    from pyiceberg.manifest import DataFileContent
    from pyiceberg.table import ManifestGroupPlanner

    data, equality = [], []

    def kept(entry) -> bool:
        content = entry.data_file.content
        if content == DataFileContent.DATA:
            data.append(entry)
        elif content == DataFileContent.EQUALITY_DELETES:
            equality.append(entry)
        return content != DataFileContent.EQUALITY_DELETES

    manifests = table.snapshot_by_id(sid).manifests(table.io)
    tasks = list(ManifestGroupPlanner(table.metadata, table.io).plan_files(manifests, manifest_entry_filter=kept))
    return tasks, applying(equality, data, table.metadata.specs())


def applying(deletes: list, data: list, specs: dict) -> list:
    """The equality delete files (manifest entries) that apply to a data file, as the Iceberg spec says: the data
    file's sequence number below the delete file's, and the delete file's partition spec unpartitioned or its spec
    and partition the data file's -> their DataFiles."""
    first, by_partition = None, {}  # the lowest data sequence number, overall and per (spec, partition)
    for e in data:
        seq, key = e.sequence_number or 0, (e.data_file.spec_id, e.data_file.partition)
        first = seq if first is None else min(first, seq)
        by_partition[key] = min(by_partition.get(key, seq), seq)
    out = []
    for d in deletes:
        f, seq = d.data_file, d.sequence_number or 0
        lowest = first if specs[f.spec_id].is_unpartitioned() else by_partition.get((f.spec_id, f.partition))
        if lowest is not None and lowest < seq:
            out.append(f)
    return out


def local(path: str) -> str:
    """A data file's location as the product's storage names it: s3a:// and s3n:// as s3://, file: URIs as paths."""
    if path.startswith(("s3a://", "s3n://")):
        return "s3://" + path.split("://", 1)[1]
    return re.sub(r"^file:(//)?", "", path)


def arrow_schema(schema) -> pa.Schema:
    """An Iceberg schema -> the arrow schema the run reads its rows in (plain strings, binaries and lists: a parquet
    input's types; every column nullable)."""
    from pyiceberg.io.pyarrow import schema_to_pyarrow

    return pa.schema([pa.field(f.name, plain(f.type)) for f in schema_to_pyarrow(schema, include_field_ids=False)])


def plain(kind: pa.DataType) -> pa.DataType:
    t = pa.types
    if t.is_large_string(kind):
        return pa.string()
    if t.is_large_binary(kind):
        return pa.binary()
    if t.is_large_list(kind) or t.is_list(kind):
        return pa.list_(plain(kind.value_type))
    if t.is_struct(kind):
        return pa.struct([pa.field(f.name, plain(f.type)) for f in kind])
    if t.is_map(kind):
        return pa.map_(plain(kind.key_type), plain(kind.item_type))
    return kind


def file_names(fragment, schema, mapping, uri: str) -> dict:
    """A data file's names for the schema's columns, matched by field id -> {column: the file's name, None where the
    file lacks it}, for the columns the file names otherwise. A file written without field ids is matched by the
    table's name mapping (schema.name-mapping.default); without one it is refused, named."""
    physical = fragment.physical_schema
    ids = {int(f.metadata[FIELD_ID]): f.name for f in physical if f.metadata and FIELD_ID in f.metadata}
    if not ids:
        if mapping is None:
            raise ValueError(
                f"input {uri}: data file {fragment.path} has no field ids and the table no name mapping "
                "(schema.name-mapping.default): its columns cannot be matched to the table's"
            )
        by_name = {name: m.field_id for m in mapping for name in m.names if m.field_id is not None}
        ids = {by_name[f.name]: f.name for f in physical if f.name in by_name}
    return {f.name: ids.get(f.field_id) for f in schema.fields if ids.get(f.field_id) != f.name}


def check_partitions(names: dict, spec, schema, path: str, uri: str) -> None:
    """A data file that lacks a column its partition spec takes as it is (identity): its values are in the
    manifests only, which the read tasks do not read -> ValueError naming them."""
    from pyiceberg.transforms import IdentityTransform

    ids = {f.field_id: f.name for f in schema.fields}
    sources = {
        ids[f.source_id] for f in spec.fields if isinstance(f.transform, IdentityTransform) and f.source_id in ids
    }
    lacking = sorted(c for c in sources if c in names and names[c] is None)
    if lacking:
        raise ValueError(
            f"input {uri}: data file {path} lacks the identity partition column(s) {lacking} (their values are in the "
            "table's manifests only, as a table imported from Hive-style files has them); rewrite the table's files"
        )


# ------------------------------------------------------------------ output: a published run committed


def commit_run(run, t: Table) -> Commit:
    """A published run (pipeline.output.PublishedRun) -> its recommendations committed to the Iceberg table t.uri
    (see the module docstring); created partitioned by run_date if absent. A call that finds the run committed
    (before it writes, or by another call while it wrote) or superseded commits nothing, says why (`skipped`) and
    deletes the files it wrote. Raises StoreUnavailable (the catalog or the store gave out for storage.retry_s),
    ValueError (a table whose schema or partitioning is not the run's, a catalog that refused the commit) or
    PermissionError (one that refused the credential or permission)."""
    import uuid

    start, storage = time.perf_counter(), run.storage
    schema = table_schema(run, narrowest=32)  # Iceberg has no integer below 32 bits
    table = load(t.uri, storage, missing_ok=True)
    done = committed(table, run.run_id) if table is not None else None
    if done is not None:
        return Commit(t.uri, run.run_id, run.run_date, done[0], 0, 0, time.perf_counter() - start, "already committed")
    why = runs.unpublished(run.uri, storage)
    if why is not None:
        return Commit(t.uri, run.run_id, run.run_date, None, 0, 0, time.perf_counter() - start, f"not published: {why}")
    table = table if table is not None else create(t.uri, storage, schema)
    check_schema(table, t.uri, schema)
    call = uuid.uuid4().hex[:12]
    written = write_files(run, t, table, schema, call)
    files = data_files(table, written)
    hold_for_test("BEFORE_COMMIT")
    snapshot, skipped = transact(run, t, files, call)
    hold_for_test("AFTER_COMMIT")
    if skipped is not None:  # another call's files hold the run, or none may: this call's are in no snapshot
        delete_written([local(f) for f in written["path"].to_pylist()] if written else [], storage)
        log.info("table %s: run %s not committed by this call (%s)", t.uri, run.run_id, skipped)
        return Commit(t.uri, run.run_id, run.run_date, snapshot, 0, 0, time.perf_counter() - start, skipped)
    count, took = sum(f.record_count for f in files), time.perf_counter() - start
    log.info("table %s: run %s of %s committed as snapshot %s (%d files, %d rows, %.1f s)", t.uri, run.run_id,
             run.run_date, snapshot, len(files), count, took)  # fmt: skip
    return Commit(t.uri, run.run_id, run.run_date, snapshot, len(files), count, took, None)


def committed(table, run_id: str) -> tuple[int, str | None] | None:
    """The snapshot of the main branch's history whose summary names `run_id`, and the call that made it (its CALL),
    or None."""
    from pyiceberg.table.snapshots import ancestors_of

    for snapshot in ancestors_of(table.current_snapshot(), table.metadata):
        summary = snapshot.summary
        if summary is not None and summary[RUN_ID] == run_id:
            return snapshot.snapshot_id, summary[CALL]
    return None


def create(uri: str, storage: Storage, schema: pa.Schema):
    """The table created with the run's columns (in Iceberg's types), partitioned by run_date (identity), and its
    namespace when absent -> pyiceberg's Table. Of calls creating it at once one makes it (the catalog's own
    check), the others load that one."""
    from pyiceberg.catalog import Catalog
    from pyiceberg.exceptions import NoSuchNamespaceError, TableAlreadyExistsError
    from pyiceberg.partitioning import PartitionField, PartitionSpec
    from pyiceberg.schema import assign_fresh_schema_ids
    from pyiceberg.transforms import IdentityTransform

    name, namespace, table = parse(uri)
    cat = catalog(name, storage)
    fresh = assign_fresh_schema_ids(Catalog._convert_schema_if_needed(schema))
    spec = PartitionSpec(PartitionField(fresh.find_field(PARTITION).field_id, 1000, IdentityTransform(), PARTITION))
    properties = {"comment": "genrec-batch: each run_date's published recommendation lists"}

    def make():
        return cat.create_table((*namespace, table), schema=fresh, partition_spec=spec, properties=properties)

    try:
        try:
            return calling(make, storage, f"create Iceberg table {uri}", name)
        except NoSuchNamespaceError:
            calling(lambda: cat.create_namespace_if_not_exists(namespace), storage, f"create {namespace}", name)
            return calling(make, storage, f"create Iceberg table {uri}", name)
    except TableAlreadyExistsError:  # another call created it first: theirs is the table
        log.info("table %s: created by another call meanwhile", uri)
        return load(uri, storage)


def check_schema(table, uri: str, schema: pa.Schema) -> None:
    """A table whose columns or partitioning are not the run's -> ValueError naming the difference."""
    have, ice = arrow_schema(table.schema()), table.schema()
    spec = [(ice.find_field(f.source_id).name, str(f.transform)) for f in table.spec().fields]
    if {f.name: f.type for f in have} != {f.name: f.type for f in schema} or spec != [(PARTITION, "identity")]:
        raise ValueError(
            f"table {uri}: its columns {describe(have)} partitioned by {spec} are not the run's {describe(schema)} "
            f"partitioned by [('{PARTITION}', 'identity')]: commit to another table, or migrate it"
        )


def describe(schema: pa.Schema) -> str:
    return "(" + ", ".join(f"{f.name} {f.type}" for f in schema) + ")"


def write_files(run, t: Table, table, schema: pa.Schema, call: str) -> pa.Table | None:
    """The run's recommendation files written as the table's data files by Ray tasks (`lake.write_parts`), each
    where the table's location provider puts a file of the date's partition -> one row a file (location, size,
    rows, its parquet footer); None for a run without a file. A table whose location is not on S3 or a local disk
    is refused (ValueError): the tasks write with the job's own S3 client."""
    from pyiceberg.partitioning import PartitionFieldValue, PartitionKey

    where = local(table.location())
    if "://" in where and not where.startswith("s3://"):
        raise ValueError(f"table {t.uri}: its location {table.location()} is not on S3 or a local disk")
    spec, ice = table.spec(), table.schema()
    key = PartitionKey([PartitionFieldValue(spec.fields[0], run.run_date)], spec, ice)
    ids = {f.name: str(f.field_id).encode() for f in ice.fields}
    schema = pa.schema([f.with_metadata({FIELD_ID: ids[f.name]}) for f in schema])
    provider = table.location_provider()
    return write_parts(run, t, write_part, provider=provider, key=key, schema=schema, nonce=call)


def write_part(
    batch: pa.Table, provider, key, run_id: str, run_date: str, schema: pa.Schema, storage: Storage, nonce: str
) -> pa.Table:
    """`lake.write_parts`' task: a group's rows, each with its run_date and run_id, in the table's types and field
    ids, written as one parquet file where the table's location provider puts it in the partition `key` (none for
    a group without a row) -> (its location, size, rows, footer)."""
    part, files = group(batch)
    found = rows(files, run_id, run_date, schema, storage)
    path = provider.new_data_location(file_name(run_id, nonce, part), key)
    if not found.num_rows:
        return pa.table({"path": [path], "size": [0], "rows": [0], "footer": [b""]})
    data = S.encode_parquet(found)
    S.write_bytes(local(path), data, storage)
    return pa.table({"path": [path], "size": [len(data)], "rows": [found.num_rows], "footer": [footer(data)]})


def footer(data: bytes) -> bytes:
    """A parquet file's footer as a file of its own (the magic, the footer, its length, the magic): what
    `pq.read_metadata` reads of a file, without its data pages."""
    size = int.from_bytes(data[-8:-4], "little")
    return b"PAR1" + data[-(size + 8) :]


def data_files(table, written: pa.Table | None) -> list:
    """The files `write_files` wrote -> their DataFiles (statistics from their footers, as pyiceberg's own writer
    makes them; the partition from run_date's), in path order."""
    from pyiceberg.io.pyarrow import (
        compute_statistics_plan,
        data_file_statistics_from_parquet_metadata,
        parquet_path_to_id_mapping,
    )
    from pyiceberg.manifest import DataFile, DataFileContent, FileFormat

    if written is None:
        return []
    schema, spec = table.schema(), table.spec()
    plan, mapping = compute_statistics_plan(schema, table.metadata.properties), parquet_path_to_id_mapping(schema)
    out = []
    for r in written.sort_by("path").to_pylist():
        if not r["rows"]:
            continue
        stats = data_file_statistics_from_parquet_metadata(
            pq.read_metadata(pa.BufferReader(r["footer"])), plan, mapping
        )
        out.append(
            DataFile.from_args(
                content=DataFileContent.DATA,
                file_path=r["path"],
                file_format=FileFormat.PARQUET,
                partition=stats.partition(spec, schema),
                file_size_in_bytes=r["size"],
                sort_order_id=None,
                spec_id=table.metadata.default_spec_id,
                equality_ids=None,
                key_metadata=None,
                **stats.to_serialized_dict(),
            )
        )
    return out


def transact(run, t: Table, files: list, call: str) -> tuple[int | None, str | None]:
    """One snapshot: the date's data files out, `files` in, its summary naming the run and the call -> (its id,
    None), or (the snapshot, why) when another call committed the run first, or (None, why) when the run was
    superseded before its commit. A commit that lost to another's, or whose answer was lost, reloads the table and
    checks again (conflicts CONFLICT_TRIES times, a catalog failing transiently for storage.retry_s)."""
    from pyiceberg.exceptions import CommitFailedException, ValidationException

    storage, name = run.storage, parse(t.uri)[0]
    deadline, conflicts = time.monotonic() + storage.retry_s, 0
    while True:
        table = load(t.uri, storage)
        done = committed(table, run.run_id)
        if done is not None:
            return whose(done, call)
        why = runs.unpublished(run.uri, storage)
        if why is not None:
            return None, f"not published: {why}"
        old = calling(lambda table=table: date_files(table, run.run_date), storage, f"plan {t.uri}", name)
        summary = {RUN_ID: run.run_id, CALL: call, "genrec_batch.run": run.uri, "genrec_batch.run_date": run.run_date}
        try:
            overwrite(table, old, files, summary)
        except (CommitFailedException, ValidationException) as e:
            conflicts += 1
            if conflicts >= CONFLICT_TRIES:
                raise S.StoreUnavailable(
                    f"table {t.uri}: the commit of run {run.run_id} lost to others {CONFLICT_TRIES} times"
                ) from None
            log.warning("table %s: the commit of run %s lost to another (%s); checking again", t.uri, run.run_id, e)
            continue
        except Exception as e:  # an answer lost, or a catalog that fails: whether it landed is read again
            failed(e, f"commit run {run.run_id} to {t.uri}", name, deadline, storage.retry_s)
            continue
        return whose(committed(load(t.uri, storage), run.run_id), call)


def failed(e: Exception, what: str, name: str, deadline: float, retry_s: float) -> None:
    """A commit that raised other than a conflict: raised as refused when the catalog refused it (exit 2, its
    secrets masked), as StoreUnavailable when it still fails past `deadline`; else, after a pause, whether it landed
    is to be read again."""
    from pyiceberg.exceptions import CommitStateUnknownException

    error = catalog_error(e, name)
    if not (isinstance(e, CommitStateUnknownException) or error.transient):
        raise refused(error, what) from None
    if time.monotonic() > deadline:
        raise S.StoreUnavailable(
            f"Iceberg catalog {name} unavailable: {what} failed for storage.retry_s = {retry_s:g} s: {error}"
        ) from None
    log.warning("%s failed (%s); checking whether it landed", what, type(e).__name__)
    time.sleep(1.0)


def date_files(table, run_date: str) -> list:
    """The date's data files in the table's current snapshot (its partition's)."""
    from pyiceberg.expressions import EqualTo

    return [task.file for task in table.scan(row_filter=EqualTo(PARTITION, run_date)).plan_files()]


def overwrite(table, old: list, new: list, summary: dict) -> None:
    """One snapshot of the main branch that deletes `old` and adds `new` (pyiceberg's overwrite producer, one
    transaction: the catalog's compare-and-swap against the snapshot the table was loaded at). pyiceberg's own retry
    of a commit that lost is off (commit.retry.num-retries 0 in this process's copy of the table's metadata, never
    committed): it would rebase the files planned at the load, and under a table's isolation level other than
    serializable check nothing, keeping another run's rows of the date beside these. A commit that lost comes back
    to `transact` (CommitFailedException), which plans the date's files again against the table as it is now."""
    from pyiceberg.table import TableProperties

    props = {**table.metadata.properties, TableProperties.COMMIT_NUM_RETRIES: "0"}
    table.metadata = table.metadata.model_copy(update={"properties": props})
    with table.transaction() as txn:
        with txn.update_snapshot(snapshot_properties=summary).overwrite() as snapshot:
            for f in old:
                snapshot.delete_data_file(f)
            for f in new:
                snapshot.append_data_file(f)
