"""The nightly job's input side: units of work, their rows with positions, and the duplicated user ids.

Every input row has a position `pos`, its index in scan order (files in order, rows in order). A `Unit` is one row
group of one input file; its read task yields its rows with their positions, minus those a resumed run has already
committed, each flagged if it repeats an earlier row's user id.
Duplicate user ids: found before decoding starts, by the driver itself from the id column when that fits a memory
budget (milliseconds per million rows), else by one Ray Data aggregation over (user_id, pos); only the duplicated
ids, with their first position, reach the read tasks.
Nothing here imports torch: the read tasks' workers start in a fraction of a second (pipeline/shards.py, the output
side, imports the recommender).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from pipeline import storage as S
from pipeline.lineage import check_code, input_hashes


@dataclass(frozen=True)
class Unit:
    """One row group of one input file."""

    path: str  # inside the input's filesystem
    row_group: int
    rows: int
    offset: int  # the position of its first row


def plan_units(data: pads.Dataset) -> list[Unit]:
    """The input's row groups in scan order, from the footers (already read and checked by the graph)."""
    units, offset = [], 0
    for fragment in data.get_fragments():
        meta = fragment.metadata
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            units.append(Unit(fragment.path, g, n, offset))
            offset += n
    return units


def merge(ranges) -> np.ndarray:
    """Position ranges [(start, end)] (any order, overlapping or touching) -> the same positions as sorted, disjoint
    ranges [M, 2] int64."""
    r = np.asarray(ranges, np.int64).reshape(-1, 2)
    if not len(r):
        return r
    r = r[np.argsort(r[:, 0], kind="stable")]
    ends = np.maximum.accumulate(r[:, 1])  # [R] the furthest end so far
    first = np.flatnonzero(np.r_[True, r[1:, 0] > ends[:-1]])  # [M] where a range starts past every earlier end
    return np.stack([r[first, 0], ends[np.r_[first[1:] - 1, len(r) - 1]]], axis=1)


def todo(units: list[Unit], done) -> list[dict]:
    """The units with positions left to decode, each with the committed ranges inside it (plain dicts: Ray rows).
    `done`: committed ranges [(start, end)]; two binary searches per unit."""
    done = merge(done)  # [M, 2]
    out = []
    for u in units:
        lo, hi = u.offset, u.offset + u.rows
        inside = np.clip(done[np.searchsorted(done[:, 1], lo, "right") : np.searchsorted(done[:, 0], hi)], lo, hi)
        if int((inside[:, 1] - inside[:, 0]).sum()) < u.rows:
            out.append({**asdict(u), "done": json.dumps(inside.tolist())})
    return out


def positions(unit: dict) -> np.ndarray:
    """The positions of a unit (a row of `todo`) still to decode."""
    pos = np.arange(unit["offset"], unit["offset"] + unit["rows"], dtype=np.int64)
    keep = np.ones(len(pos), bool)
    for a, b in json.loads(unit["done"]) if isinstance(unit["done"], str) else unit["done"]:
        keep[a - unit["offset"] : b - unit["offset"]] = False
    return pos[keep]


@dataclass(frozen=True)
class Hashing:
    """How the read tasks compute each row's input hash (`lineage.input_hashes`)."""

    history_len: int  # the prompt's window: the template's max_items, or decoding.history_len
    exclude_column: str | None  # the exclusion column, when the input has it
    whole_history: bool  # decoding.exclude history: every item of the history is excluded
    windows: tuple = ()  # ((column, window), ...): the other histories the prompt writes
    texts: tuple = ()  # the user fields the prompt writes

    def of(self, t: pa.Table) -> pa.Array:
        column = t[self.exclude_column] if self.exclude_column else None
        others = [(t[c], w) for c, w in self.windows]
        return input_hashes(
            t["history"], column, self.history_len, self.whole_history, others, [t[c] for c in self.texts]
        )


def read_retrying(batch: pa.Table, storage, uri: str, code: str = "", **kwargs) -> pa.Table:
    """`read_units` with its reads tried again as a whole while the store fails transiently (the nightly's read
    tasks: their processes import this module, pyarrow and storage's, not the decoders); `code`: the driver's code
    identity, which this node's must be (`lineage.check_code`: the input hashes are computed here)."""
    check_code(code, "a read task")
    with S.on_node("the input", uri):
        return S.retrying(lambda: read_units(batch, **kwargs), storage, f"read {uri}")


def conformed(t: pa.Table, columns: list[str], schema: pa.Schema | None) -> pa.Table:
    """A row group's columns -> in the input's types (`schema`: a table's schema, or every file's unified), those of
    `columns` that its file lacks as nulls: every file's rows in one schema."""
    missing = [c for c in columns if c not in t.column_names]
    if missing and schema is None:
        raise KeyError(f"column(s) {missing} not in the input file")
    for c in missing:
        t = t.append_column(schema.field(c), pa.nulls(t.num_rows, schema.field(c).type))
    if schema is None:
        return t
    kinds = [schema.field(c).type if c in schema.names else t.schema.field(c).type for c in t.column_names]
    return t.cast(pa.schema([pa.field(c, k) for c, k in zip(t.column_names, kinds)]))


def read_group(f: pq.ParquetFile, group: int, columns: list[str], schema: pa.Schema | None, names=None) -> pa.Table:
    """One row group of a file's `columns` (the input's names) -> in the input's types (`conformed`), each read from
    the file's column of its name, or the one `names` gives ({the input's column: the file's, None where the file
    lacks it}: an Iceberg file's, matched by field id); a column the file lacks as nulls."""
    names, held = names or {}, set(f.schema_arrow.names)
    found = {c: names.get(c, c) for c in columns}
    found = {c: name for c, name in found.items() if name is not None and name in held}
    t = f.read_row_group(group, columns=list(found.values()))
    return conformed(t.select(list(found.values())).rename_columns(list(found)), columns, schema)


def head(units: list[Unit], fs, columns: dict[str, str], n: int, schema: pa.Schema | None, names=None) -> pa.Table:
    """The input's first `n` rows in scan order, `columns` ({name in the rows: the input's column}) under their
    names in the rows; `names`: per file, `read_group`'s."""
    read, tables, got = list(dict.fromkeys(columns.values())), [], 0
    for u in units:
        if got >= n:
            break
        t = read_group(pq.ParquetFile(u.path, filesystem=fs), u.row_group, read, schema, (names or {}).get(u.path))
        tables.append(t)
        got += t.num_rows
    rows = pa.concat_tables(tables).slice(0, n) if tables else conformed(pa.table({}), read, schema)
    return renamed(rows, columns)


def renamed(t: pa.Table, columns: dict[str, str]) -> pa.Table:
    """An input table's columns -> {name in the rows: the input's column} under their names in the rows."""
    return pa.table({name: t[column] for name, column in columns.items()})


def read_units(
    batch: pa.Table,
    fs,
    columns: dict[str, str],
    duplicates: pa.Table | None = None,
    order: bool = False,
    hashing: Hashing | None = None,
    lookup=None,
    schema: pa.Schema | None = None,
    names: dict | None = None,
) -> pa.Table:
    """Ray Data map over units (rows of `todo`, "done" as JSON): the rows still to decode (`columns`: {name in the
    rows: the input's column}, `plan.input_columns`; `schema`: the input's, which each file's rows are cast to, a
    column a file lacks read as nulls; `names`: per file whose columns are named otherwise, `read_group`'s), with
    `pos`, a `duplicate` flag (the user id was seen at an earlier position)
    and, with `hashing`, each row's `input_hash` (pipeline/lineage.py); `lookup` (an incremental run's
    `carry.Lookup`): the rows it keeps, the carried ones or the rest; `order`: each unit's rows by history length
    (`by_length`), so that the shards cut from them hold users of like prompt lengths."""
    tables = []
    for unit in batch.to_pylist():
        unit["done"] = json.loads(unit["done"])
        read = list(dict.fromkeys(columns.values()))
        f = pq.ParquetFile(unit["path"], filesystem=fs)
        t = renamed(read_group(f, unit["row_group"], read, schema, (names or {}).get(unit["path"])), columns)
        pos = positions(unit)
        t = t.take(pa.array(pos - unit["offset"])).append_column("pos", pa.array(pos))
        dup = pa.array(np.zeros(t.num_rows, bool))
        if duplicates is not None and duplicates.num_rows:
            at = pc.index_in(t["user_id"], duplicates["user_id"])
            first = pc.take(duplicates["first"], at)
            dup = pc.fill_null(pc.not_equal(first, t["pos"]), False)  # a repeat of an earlier row's user id
        t = t.append_column("duplicate", dup)
        if lookup is not None:
            t = lookup.keep(t)
        if hashing is not None:
            t = t.append_column("input_hash", hashing.of(t))
        tables.append(by_length(t) if order else t)
    return pa.concat_tables(tables)


def by_length(t: pa.Table) -> pa.Table:
    """Rows with `history` and `pos` -> by the history's length, then position (the same order whenever the same
    rows are read: a resume cuts the rest into shards the same way). A history that is not a list (a row the actor
    rejects) counts as empty."""
    kind = t.schema.field("history").type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        return t
    length = pc.fill_null(pc.list_value_length(t["history"]), 0)
    key = pa.table({"length": length, "pos": t["pos"]})
    return t.take(pc.sort_indices(key, sort_keys=[("length", "ascending"), ("pos", "ascending")]))


def find_duplicates(
    units: list[Unit], fs, budget_mb: float = 1024, user: str = "user_id", schema: pa.Schema | None = None, names=None
) -> tuple[pa.Table | None, str]:
    """The user ids seen more than once in the whole input, with the position of their first row [user_id, first]
    (None: no duplicates), and where they were found: "driver" when the id column (uncompressed, with positions and
    the hash table: `id_bytes`) takes at most `budget_mb`, read and grouped by pyarrow in this process (milliseconds
    per million rows); else "ray", an aggregation over the cluster. `user`: the input's user id column; `schema`:
    the input's, whose id type every file's ids are read in (`conformed`); `names`: per file, `read_group`'s."""
    if id_bytes(units, fs, user, names) <= budget_mb * 2**20:
        return duplicates_on_driver(units, fs, user, schema, names), "driver"
    return duplicates_on_ray(units, fs, user, schema, names), "ray"


def id_bytes(units: list[Unit], fs, user: str = "user_id", names=None) -> int:
    """Working memory of the driver-side check, from the footers: 3 x (the user_id column's uncompressed size + 8-byte
    positions), for the ids, the positions and pyarrow's hash grouping."""
    total = 0
    for path, group in itertools.groupby(units, key=lambda u: u.path):
        meta = pq.ParquetFile(path, filesystem=fs).metadata
        held = (names or {}).get(path, {}).get(user, user)  # the file's name for the user id column
        for u in group:
            rg = meta.row_group(u.row_group)
            col = next(rg.column(j) for j in range(rg.num_columns) if rg.column(j).path_in_schema == held)
            total += col.total_uncompressed_size + 8 * u.rows
    return 3 * total


def duplicates_on_driver(units: list[Unit], fs, user: str = "user_id", schema=None, names=None) -> pa.Table | None:
    """`find_duplicates` in this process: every row group's user_id column with its positions, grouped by pyarrow."""
    tables = []
    for path, group in itertools.groupby(units, key=lambda u: u.path):
        f = pq.ParquetFile(path, filesystem=fs)
        for u in group:
            ids = read_group(f, u.row_group, [user], schema, (names or {}).get(path))[user]
            tables.append(pa.table({"user_id": ids, "pos": np.arange(u.offset, u.offset + u.rows, dtype=np.int64)}))
    if not tables:
        return None
    grouped = pa.concat_tables(tables).group_by("user_id").aggregate([("pos", "count"), ("pos", "min")])
    found = grouped.filter(pc.greater(grouped["pos_count"], 1))
    return pa.table({"user_id": found["user_id"], "first": found["pos_min"]}) if found.num_rows else None


def duplicates_on_ray(units: list[Unit], fs, user: str = "user_id", schema=None, names=None) -> pa.Table | None:
    """`find_duplicates` as a Ray Data aggregation (inputs whose ids do not fit the driver's budget)."""
    import ray
    from ray.data.aggregate import Count, Min
    from ray.data.expressions import col

    ids = ray.data.from_items(todo(units, [])).map_batches(
        read_units,
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={"fs": fs, "columns": {"user_id": user}, "schema": schema, "names": names},
    )
    rows = sum(u.rows for u in units)
    grouped = ids.groupby("user_id", num_partitions=max(1, min(64, rows // 500_000 + 1))).aggregate(
        Count(alias_name="n"), Min("pos", alias_name="first")
    )
    found = [
        b.select(["user_id", "first"])
        for b in grouped.filter(expr=col("n") > 1).iter_batches(batch_size=None, batch_format="pyarrow")
        if b.num_rows
    ]  # one execution
    return pa.concat_tables(found) if found else None
