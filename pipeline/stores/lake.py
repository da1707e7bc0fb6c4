"""What the table sinks (pipeline/stores/delta.py, iceberg.py) share: a published run's rows as a table holds them
(run_date, run_id, the recommendation columns in types every table format has), the Ray tasks that copy the run's
files into the table's data files (table.writers at once, about table.rows_per_file rows a file), how a commit tells
its own from another call's, and the words of a store's transient and refused errors."""

from __future__ import annotations

import json

import pyarrow as pa

from pipeline import storage as S
from pipeline.config import Table
from pipeline.storage import Storage

PARTITION = "run_date"
RUN_ID = "genrec_batch.run_id"  # a commit's info (Delta) or snapshot summary (Iceberg) key naming the run it committed
CALL = "genrec_batch.commit"  # its key naming the call that made it (a nonce per commit_run)
CONFLICT_TRIES = 20  # commits of one table that lost to another (they reload and try again)

TRANSIENT_WORDS = (
    "connection refused",
    "connection reset",
    "connection closed",
    "closed the connection",
    "could not connect",
    "terminating connection",
    "the database system is starting up",
    "the database system is shutting down",
    "broken pipe",
    "timed out",
    "timeout",
    "error sending request",
    "service unavailable",
    "slowdown",
    "slow down",
    "internal server error",
    "bad gateway",
    "gateway timeout",
)  # a store's words for a fault that passes (a client library's message, when its error has no kind of its own)

DENIED_WORDS = (
    "privileges",
    "access denied",
    "accessdenied",
    "forbidden",
    "invalidaccesskeyid",
    "signaturedoesnotmatch",
    "password authentication failed",
    "not authorized",
)  # and for a refused credential or permission


def worded(text: str, words: tuple[str, ...]) -> bool:
    text = text.lower()
    return any(w in text for w in words)


def target(uri: str, options: dict) -> Table:
    """`genrec-batch export --to URI` -> the table section it commits with (the command's flags)."""
    return Table(uri, options.get("rows_per_file", Table.rows_per_file), options.get("writers", Table.writers))


def refusals() -> list:
    """A table sink's exit codes in `genrec-batch export`: 4 the store stayed unavailable, 2 refused."""
    return [(S.StoreUnavailable, 4), ((FileNotFoundError, ValueError, PermissionError), 2)]


def table_schema(run, narrowest: int = 8) -> pa.Schema:
    """The table's schema for a run: run_date (the partition), run_id, then the run's recommendation columns, in
    types the table has (`table_type`)."""
    recs = run.dataset("recommendations").schema
    fields = [pa.field(f.name, table_type(f.type, narrowest)) for f in recs if f.name not in (PARTITION, "run_id")]
    return pa.schema([pa.field(PARTITION, pa.string()), pa.field("run_id", pa.string()), *fields])


def table_type(kind: pa.DataType, narrowest: int = 8) -> pa.DataType:
    """An arrow type -> the one a table stores: dictionaries decoded, unsigned integers widened (uint64 as
    decimal(20, 0): no table format has unsigned types, and no narrower type holds every uint64), integers narrower
    than `narrowest` bits widened to it (Iceberg has none below 32), large strings and binaries plain."""
    t = pa.types
    if t.is_dictionary(kind):
        return table_type(kind.value_type, narrowest)
    if t.is_unsigned_integer(kind):
        kind = {8: pa.int16(), 16: pa.int32(), 32: pa.int64()}.get(kind.bit_width, pa.decimal128(20, 0))
    if t.is_integer(kind) and kind.bit_width < narrowest:
        return {16: pa.int16(), 32: pa.int32()}[narrowest]
    if t.is_large_string(kind):
        return pa.string()
    if t.is_large_binary(kind) or t.is_fixed_size_binary(kind):
        return pa.binary()
    return kind


def rows(files: list[str], run_id: str, run_date: str, schema: pa.Schema, storage: Storage) -> pa.Table:
    """A group of a run's recommendation files -> their rows in the table's columns and types, each with its
    run_date and run_id."""
    tables = []
    for f in files:
        t = S.read_parquet(f, storage)
        n = t.num_rows
        added = {PARTITION: pa.array([run_date] * n, pa.string()), "run_id": pa.array([run_id] * n, pa.string())}
        columns = [added[c.name] if c.name in added else t[c.name].cast(c.type) for c in schema]
        tables.append(pa.table(columns, schema=schema))
    return pa.concat_tables(tables) if tables else schema.empty_table()


def write_parts(run, t: Table, write_part, **kwargs) -> pa.Table | None:
    """The run's recommendation files in groups of about t.rows_per_file rows, each group written as one data file
    by `write_part` (Ray Data map over the groups, one a row: part, files as JSON; table.writers tasks at once; its
    kwargs: `kwargs`) -> the rows the tasks returned, one a group, or None for a run without a file."""
    import ray

    files = run.files("recommendations")
    n = int(run.manifest["counts"]["recommendations"])
    per = max(1, round(t.rows_per_file / max(n / max(len(files), 1), 1)))  # recommendation files per table file
    groups = [{"part": i, "files": json.dumps(files[lo : lo + per])} for i, lo in enumerate(range(0, len(files), per))]
    if not groups:
        return None
    ds = ray.data.from_items(groups).map_batches(
        write_part,
        batch_size=1,
        batch_format="pyarrow",
        compute=ray.data.TaskPoolStrategy(size=min(t.writers, len(groups))),
        fn_kwargs={"run_id": run.run_id, "run_date": run.run_date, "storage": run.storage, **kwargs},
    )
    ds.context.raise_original_map_exception = True
    return pa.concat_tables(list(ds.iter_batches(batch_size=None, batch_format="pyarrow")))


def group(batch: pa.Table) -> tuple[int, list[str]]:
    """A `write_parts` task's group: (its part number, its recommendation files)."""
    return batch["part"][0].as_py(), json.loads(batch["files"][0].as_py())


def file_name(run_id: str, call: str, part: int) -> str:
    """A table data file's name: the run, the call (a task run again writes the same file; two commits of one run at
    once never write over each other's, which a version may name) and the group."""
    return f"part-{run_id}-{call}-{part:05d}.parquet"


def delete_written(paths: list[str], storage: Storage) -> None:
    """Deletes data files a call wrote that no table version names (local paths or s3:// URIs)."""
    folders: dict[str, list[str]] = {}
    for path in paths:
        folder, _, name = path.rpartition("/")
        folders.setdefault(folder, []).append(name)
    for folder, names in folders.items():
        S.delete_files(folder, names, storage)


def whose(done: tuple[int, str | None] | None, call: str) -> tuple[int | None, str | None]:
    """The version found holding the run (a sink's `committed`: its version or snapshot, the call that made it) ->
    (it, None) when this call made it, else (it, why not)."""
    if done is None:
        raise ValueError("a commit that succeeded is not in the table's history")
    version, by = done
    if by == call:
        return version, None
    return version, f"already committed by another call (version {version})"
