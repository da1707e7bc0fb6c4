"""Incremental runs: a user whose list's inputs are unchanged since a base run is carried (its list copied from the
base), every other user decoded.

Every run records its fingerprint (pipeline/lineage.py: every input but the users' own) in its manifest and each
user's input hash in its `users` table. A run with `incremental` on picks a base (`choose_base`: by default the newest
published run of its output root up to its date); when the two fingerprints are equal, its pending rows are joined
with the base's users by user id (`carry`: a Ray Data hash join, every partition joined on its own node, nothing
about users on the driver). A row whose input hash equals the base's is carried: `split` writes the carried users of
each block of the join's output (a partition, or part of one) as one shard (their recommendations copied from the
base, `users` rows marked carried) and passes the other rows on to the recommender actors, with one note per carried
shard for the driver's progress. When the fingerprints differ, the run is a full one and its manifest names the
parts that differ.

While a run reads its base, the base is pinned (`runs.pin`) against `--gc` and the grace deletion; a base file gone
while it is read stops the run (BaseGone, exit 2), which publishes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import runs, shards
from pipeline import storage as S
from pipeline.lineage import differences, sha256_of
from pipeline.shards import NOTE
from pipeline.storage import Storage

log = logging.getLogger("genrec.nightly")
USERS_PER_PARTITION = 500_000  # the join's partitions when incremental.partitions is not set (each partition is one
# aggregator process of Ray Data's hash shuffle)
BASE_SHARDS_PER_TASK = 256  # base shards one task reads, as one dataset of their files (a task costs more than a file)


class BaseGone(FileNotFoundError):
    """A file of the base run went missing while the run read it: the run stops (exit 2) and publishes nothing."""


@dataclass(frozen=True)
class Base:
    """The published run an incremental run carries from."""

    uri: str  # its run folder
    run_id: str
    stems: list[str]  # its shards (each has a users and a recommendations file)
    users: int  # its users with a list
    decoded_on: dict  # the dtypes and devices its lists were decoded in and on (`lineage.decoded_on`)

    def record(self) -> dict:
        return {"base": self.uri, "base_run_id": self.run_id}


def newest_run(output: str, run_date: str, storage: Storage) -> str | None:
    """The newest published run of `output` dated on or before `run_date` (its folder), or None."""
    dates = [c.removeprefix("run_date=") for c in S.list_children(output, storage) if c.startswith("run_date=")]
    for date in sorted((d for d in dates if d <= run_date), reverse=True):
        run = runs.latest_run(output, date, storage)
        if run is not None:
            return run
    return None


def choose_base(cfg, parts: dict) -> tuple[Base | None, dict]:
    """The base an incremental run carries from, or None, and the manifest's `incremental` record (`mode`: carry or
    full, and for a full run `full_because`). No published run to start from makes a full run; a base named or found
    that cannot be read raises FileNotFoundError naming it (exit 2)."""
    inc = cfg.incremental
    if not inc.enabled:
        return None, {"enabled": False, "mode": "full"}
    uri = inc.base or newest_run(cfg.output, cfg.run_date, cfg.storage)
    if uri is None:
        return None, {"enabled": True, "mode": "full", "base": None, "full_because": ["no published run to carry from"]}
    from pipeline.output import open_run

    try:
        run = open_run(uri, cfg.storage)
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"incremental base {uri}: {e}") from None
    record = {"enabled": True, "base": run.uri, "base_run_id": run.run_id}
    base_parts = (run.manifest.get("lineage") or {}).get("fingerprint")
    if not base_parts or "users" not in run.manifest["files"]:
        why = ["the base records no fingerprint or input hashes (written by an older version)"]
        return None, {**record, "mode": "full", "full_because": why}
    diff = differences(base_parts, parts)
    if diff:
        why = [f"{part} differs from the base's" for part in diff]
        return None, {**record, "mode": "full", "parts_differ": diff, "full_because": why}
    committed = {name.removesuffix(".parquet") for name in run.manifest["files"].get("metrics", [])}
    stems = sorted(committed & {name.removesuffix(".parquet") for name in run.manifest["files"]["users"]})
    if not stems:
        return None, {**record, "mode": "full", "full_because": ["the base has no shard to carry from"]}
    decoded_on = run.manifest["lineage"].get("decoded_on") or {}
    base = Base(run.uri, run.run_id, stems, int(run.manifest["counts"]["users_ok"]), decoded_on)
    return base, {**record, "mode": "carry", "base_fingerprint": sha256_of(base_parts)}


def key_of(ids: pa.Array) -> pa.Array:
    """User ids -> the join's key: one type per kind of id (int64, large string, large binary), whatever type each
    night's files hold."""
    t = ids.type
    if pa.types.is_integer(t):  # uint64 ids past 2^63: their bits as int64 (one id is one key, every night)
        return ids.cast(pa.int64(), safe=not pa.types.is_uint64(t))
    return ids.cast(pa.large_string() if pa.types.is_string(t) or pa.types.is_large_string(t) else pa.large_binary())


def with_key(batch: pa.Table) -> pa.Table:
    """Ray Data map: the pending rows with their join key."""
    return batch.append_column("key", key_of(batch["user_id"]))


def read_base(batch: pa.Table, base: str, storage: Storage) -> pa.Table:
    """Ray Data map over the base's shard stems -> one row per base user with a list: key, base_hash, base_items
    [k] int64 and base_scores [k] float32 in rank order. A file gone raises BaseGone naming it."""
    stems = batch["stem"].to_pylist()
    users = _read(base, "users", stems, ["user_id", "input_hash"], storage)
    lists = user_lists(_read(base, "recommendations", stems, ["user_id", "rank", "item_id", "score"], storage))
    at = pc.index_in(lists["key"], key_of(users["user_id"]))  # [U] each listed user's row of the users table
    lists = lists.append_column("base_hash", users["input_hash"].take(at)).filter(pc.is_valid(at))
    return lists.select(_view_schema().names)


def _view_schema() -> pa.Schema:
    return pa.schema(
        [
            ("key", pa.int64()),
            ("base_hash", pa.binary()),
            ("base_items", pa.list_(pa.int64())),
            ("base_scores", pa.list_(pa.float32())),
        ]
    )


def _read(base: str, table: str, stems: list[str], columns: list[str], storage: Storage) -> pa.Table:
    """One table's files of the base's shards `stems`, scanned as one dataset (threads, many files at a time)."""
    import pyarrow.dataset as pads

    fs, root = S.filesystem(base, storage)
    paths = [f"{root}/{table}/{stem}.parquet" for stem in stems]
    try:
        return S.retrying(
            lambda: pads.dataset(paths, format="parquet", filesystem=fs).to_table(columns=columns),
            storage,
            f"GET {S.join(base, table)}",
        )
    except OSError:
        gone = next(
            (s for s in stems if not S.exists(S.join(runs.table_dir(base, table), f"{s}.parquet"), storage)), None
        )
        if gone is None:
            raise
        raise BaseGone(
            f"incremental base {base}: {S.join(runs.table_dir(base, table), f'{gone}.parquet')} is gone (deleted "
            "while this run read it); this run stops and publishes nothing. Run the night again: a new run carries "
            "from the newest published run it can read"
        ) from None


def list_starts(recs: pa.Table, checked: bool = True) -> np.ndarray | None:
    """Where each user's rows begin [U]; `checked`: None unless every user's rows are together, ranks 1, 2, .."""
    if not recs.num_rows:
        return np.zeros(0, np.int64)
    ids = recs["user_id"].combine_chunks()
    new = np.r_[True, ~pc.equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)]  # [R] a user's first row
    starts = np.flatnonzero(new)
    if not checked:
        return starts
    rank = recs["rank"].to_numpy()
    ok = (rank[new] == 1).all() and (np.diff(rank)[~new[1:]] == 1).all()
    return starts if ok and pc.count_distinct(ids.take(pa.array(starts))).as_py() == len(starts) else None


def user_lists(recs: pa.Table) -> pa.Table:
    """Shards' recommendations (user_id, rank, item_id, score) -> one row per user: key, base_items, base_scores,
    in rank order. Shards are written a user's ranks 1, 2, .. together; anything else is sorted first."""
    starts = list_starts(recs)
    if starts is None:
        recs = recs.sort_by([("user_id", "ascending"), ("rank", "ascending")])
        starts = list_starts(recs, checked=False)
    ids, n = recs["user_id"].combine_chunks(), recs.num_rows
    offsets = pa.array(np.r_[starts, n].astype(np.int32))
    return pa.table(
        {
            "key": key_of(ids.take(pa.array(starts, pa.int64()))),
            "base_items": pa.ListArray.from_arrays(offsets, recs["item_id"].combine_chunks().cast(pa.int64())),
            "base_scores": pa.ListArray.from_arrays(offsets, recs["score"].combine_chunks().cast(pa.float32())),
        }
    )


@dataclass(frozen=True)
class Carry:
    """What `split` needs, small and inline: where the run writes, what its rows are."""

    run: str  # the run folder
    run_id: str
    attempt: str
    storage: Storage
    schema: pa.Schema  # the read rows' columns and types (the join hands them back in its own)
    mode: str
    k: int
    order: bool  # the pending rows by history length (compute.order_by_length)


def carry(ds, plan, a, base: Base, schema: pa.Schema):
    """The pending rows (Ray Data) -> those to decode, the carried ones written as shards (`split`)."""
    import ray

    cfg = plan.cfg
    view = ray.data.from_items([{"stem": s} for s in base.stems]).map_batches(
        read_base,
        batch_size=BASE_SHARDS_PER_TASK,
        batch_format="pyarrow",
        fn_kwargs={"base": base.uri, "storage": cfg.storage},
    )
    partitions = cfg.incremental.partitions or max(1, -(-a.left // USERS_PER_PARTITION))
    joined = ds.map_batches(with_key, batch_format="pyarrow").join(view, "left_outer", partitions, on=("key",))
    spec = Carry(
        a.run, a.run_id, a.id, cfg.storage, schema, cfg.decoding.mode, cfg.decoding.k, cfg.compute.order_by_length
    )
    return joined.map_batches(split, batch_size=None, batch_format="pyarrow", fn_kwargs={"carry": spec})


def split(block: pa.Table, carry: Carry) -> Iterator[pa.Table]:
    """Ray Data map over the join's output blocks: the rows to decode (with `in_base`: the base holds a list for the
    user), yielded first so that the actors start on them; then the carried rows (not a duplicate, an input hash equal
    to the base's) written as one shard, and its note (pos -1, NOTE: its summary row)."""
    schema = pending_schema(carry)
    if "pos" not in block.column_names:  # a partition that holds base users and no pending row
        return
    block = one_row_per_position(block)
    same = pc.fill_null(pc.equal(block["input_hash"], block["base_hash"]), False)
    carried = pc.and_(same, pc.invert(block["duplicate"]))
    out = block.filter(pc.invert(carried))
    in_base = pc.is_valid(out["base_hash"])
    out = out.select(carry.schema.names).cast(carry.schema).append_column("in_base", in_base)
    if carry.order:
        from pipeline.units import by_length

        out = by_length(out)
    if out.num_rows:
        yield out.append_column(NOTE, pa.nulls(out.num_rows, pa.string()))
    rows = block.filter(carried)
    if rows.num_rows:
        summary = write_carried(rows.select([*carry.schema.names, "base_items", "base_scores"]), carry)
        note = {n: pa.nulls(1, schema.field(n).type) for n in schema.names}
        note |= {"pos": pa.array([-1], pa.int64()), "duplicate": pa.array([False]), "in_base": pa.array([False])}
        yield pa.table({**note, NOTE: pa.array([json.dumps(summary)])}, schema=schema)


def pending_schema(carry: Carry) -> pa.Schema:
    """What `split` passes on: the read rows, `in_base` and the notes' column."""
    return carry.schema.append(pa.field("in_base", pa.bool_())).append(pa.field(NOTE, pa.string()))


def one_row_per_position(block: pa.Table) -> pa.Table:
    """The join's rows, one per input row: a base that lists a user twice would give its row twice (its shards were
    written by another version, or by hand); such a row is kept once, without the base's list (it is decoded)."""
    pos = block["pos"].to_numpy()
    if len(np.unique(pos)) == len(pos):
        return block
    order = np.argsort(pos, kind="stable")
    first = np.r_[True, pos[order][1:] != pos[order][:-1]]  # [N] in pos order
    repeated = np.zeros(len(pos), bool)
    repeated[order] = ~first | np.r_[~first[1:], False]  # both the first and the later copies
    keep = np.sort(order[first])
    base = [c for c in _view_schema().names if c != "key"]
    cleared = {c: pc.if_else(pa.array(repeated), pa.nulls(len(pos), block[c].type), block[c]) for c in base}
    for c, values in cleared.items():
        block = block.set_column(block.schema.get_field_index(c), c, values)
    return block.take(pa.array(keep))


def write_carried(rows: pa.Table, carry: Carry) -> dict:
    """Carried rows (the read columns, base_items, base_scores) -> their shard written and committed (its
    recommendations copied, its users marked carried) -> its summary row."""
    from operators.outputs import table_schema

    rows = rows.take(pc.sort_indices(rows["pos"]))
    pos = rows["pos"].to_numpy()
    shard, n = f"s{int(pos[0]):012d}", rows.num_rows
    user_type = carry.schema.field("user_id").type
    recs = carried_recommendations(rows, carry.mode).cast(table_schema("rec", user_type))
    lengths = pc.list_value_length(rows["base_items"]).to_numpy(zero_copy_only=False)  # [U]
    users = pa.table({"user_id": rows["user_id"], "input_hash": rows["input_hash"], "source": ["carried"] * n})
    metric = {
        "run_id": carry.run_id,
        "shard": shard,
        "attempt": carry.attempt,
        "mode": carry.mode,
        "decoder": "carried",
        "k": carry.k,
        **dict.fromkeys(("users_in", "users_ok", "users_carried"), n),
        **dict.fromkeys(("users_rejected", "users_non_finite", "users_duplicate", "users_changed"), 0),
        "users_short": int((lengths < carry.k).sum()),
        "recommendations": recs.num_rows,
        "ranges": shards.ranges_of(pos),
        "committed_at": time.time(),
    }
    rejects = table_schema("reject", user_type).empty_table()
    shards.write_shard(f"{shard}-{carry.attempt}", recs, rejects, metric, carry.run, carry.storage, users)
    return {"users_in": n, "users_ok": n, "users_rejected": 0, "recommendations": recs.num_rows, "restarted": False}


def carried_recommendations(rows: pa.Table, mode: str) -> pa.Table:
    """Carried rows (user_id, base_items [k], base_scores [k]) -> their recommendations, ranks 1.. in list order."""
    items, scores = rows["base_items"].combine_chunks(), rows["base_scores"].combine_chunks()
    lengths = pc.list_value_length(items).to_numpy(zero_copy_only=False)  # [U]
    owner = np.repeat(np.arange(rows.num_rows), lengths)  # [R]
    rank = np.arange(len(owner)) - np.repeat(np.cumsum(lengths) - lengths, lengths) + 1  # [R]
    return pa.table(
        {
            "user_id": rows["user_id"].take(pa.array(owner, pa.int64())),
            "rank": pa.array(rank.astype(np.int32)),
            "item_id": pc.list_flatten(items),
            "score": pc.list_flatten(scores),
            "mode": pa.array([mode] * len(owner), pa.string()),
        }
    )


def check_decoded_on(base: Base, tonight: dict) -> None:
    """An incremental run's decoded users must have been decoded in the dtypes, on the devices and (outside float32)
    by the engines its base's were (`compute.dtype: auto`, the GPU model and `compute.engine: auto` show only in the
    actors): else its carried and decoded lists would mix two, and it is not published (ValueError, exit 2)."""
    if base.decoded_on.get("dtypes") and tonight.get("dtypes") and base.decoded_on != tonight:
        raise ValueError(
            f"incremental: tonight's users were decoded as {describe_on(tonight)}, the base {base.uri}'s as "
            f"{describe_on(base.decoded_on)}: carried and decoded lists would mix the two, so this run is not "
            "published. Set compute.dtype, compute.engine and the GPUs as the base had them, or run the night full "
            "(incremental.enabled=false)"
        )


def describe_on(on: dict) -> str:
    engines = f" by {on['engines']}" if on.get("engines") else ""
    return f"{on['dtypes']} on {on['devices']}{engines}"


def full_decode_estimate(timings: dict, decoded: int, carried: int) -> float | None:
    """A full night's decode seconds, estimated from this run's: the actors' start (`actor_ready_s`, paid by any
    night) and the rest of its decode at its decoded users' rate, over every user (None: nothing decoded)."""
    decode_s, ready = timings.get("decode_s"), timings.get("actor_ready_s") or 0.0
    if not decode_s or not decoded:
        return None
    return ready + max(decode_s - ready, 0.0) * (decoded + carried) / decoded
