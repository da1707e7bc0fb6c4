"""Incremental runs: a user whose list's inputs are unchanged since a base run is carried (its list copied from the
base), every other user decoded.

Every run records its fingerprint (pipeline/lineage.py: every input but the users' own) in its manifest and each
user's input hash in its `users` table. A run with `incremental` on picks a base (`choose_base`: by default the newest
published run of its output root up to its date); when the two fingerprints are equal, its pending rows are joined
with the base's users by user id (`carry`: a Ray Data hash join, every partition joined on its own node, nothing
about users on the driver). A row whose input hash equals the base's is carried: `split` writes each join
partition's carried users as one shard (their recommendations copied from the base, `users` rows marked carried)
and passes the other rows on to the recommender actors, with one note per carried shard for the driver's progress.
When the fingerprints differ, the run is a full one and its manifest names the parts that differ.

While a run reads its base, the base is pinned (`runs.pin`) against `--gc` and the grace deletion; a base file gone
while it is read stops the run (BaseGone, exit 2), which publishes nothing.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import runs
from pipeline import storage as S
from pipeline.lineage import differences, sha256_of
from pipeline.storage import Storage

log = logging.getLogger("genrec.nightly")
NOTE = "carried"  # the column of the notes `split` passes to the actors: a carried shard's summary row (JSON)
USERS_PER_PARTITION = 200_000  # the join's partitions when incremental.partitions is not set


class BaseGone(FileNotFoundError):
    """A file of the base run went missing while the run read it: the run stops (exit 2) and publishes nothing."""


@dataclass(frozen=True)
class Base:
    """The published run an incremental run carries from."""

    uri: str  # its run folder
    run_id: str
    stems: list[str]  # its shards (each has a users and a recommendations file)
    users: int  # its users with a list

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
    stems = [name.removesuffix(".parquet") for name in run.manifest["files"]["users"]]
    base = Base(run.uri, run.run_id, stems, int(run.manifest["counts"]["users_ok"]))
    return base, {**record, "mode": "carry", "base_fingerprint": sha256_of(base_parts)}


def key_of(ids: pa.Array) -> pa.Array:
    """User ids -> the join's key: one type per kind of id (int64, large string, large binary), whatever type each
    night's files hold."""
    t = ids.type
    kind = (
        pa.int64()
        if pa.types.is_integer(t)
        else pa.large_string()
        if pa.types.is_string(t) or pa.types.is_large_string(t)
        else pa.large_binary()
    )
    return ids.cast(kind)


def with_key(batch: pa.Table) -> pa.Table:
    """Ray Data map: the pending rows with their join key."""
    return batch.append_column("key", key_of(batch["user_id"]))


def read_base(batch: pa.Table, base: str, storage: Storage) -> pa.Table:
    """Ray Data map over the base's shard stems -> one row per base user with a list: key, base_hash, base_items
    [k] int64 and base_scores [k] float32 in rank order. A file gone raises BaseGone naming it."""
    out = []
    for stem in batch["stem"].to_pylist():
        users = _read(base, "users", stem, ["user_id", "input_hash"], storage)
        recs = _read(base, "recommendations", stem, ["user_id", "rank", "item_id", "score"], storage)
        lists = user_lists(recs)  # [U] users with a list
        at = pc.index_in(lists["key"], key_of(users["user_id"]))  # [U] each one's row of the users table
        lists = lists.append_column("base_hash", users["input_hash"].take(at)).filter(pc.is_valid(at))
        out.append(lists.select(_view_schema().names))
    return pa.concat_tables(out) if out else _view_schema().empty_table()


def _view_schema() -> pa.Schema:
    return pa.schema(
        [
            ("key", pa.int64()),
            ("base_hash", pa.binary()),
            ("base_items", pa.list_(pa.int64())),
            ("base_scores", pa.list_(pa.float32())),
        ]
    )


def _read(base: str, table: str, stem: str, columns: list[str], storage: Storage) -> pa.Table:
    uri = S.join(runs.table_dir(base, table), f"{stem}.parquet")
    try:
        return S.read_parquet(uri, storage, columns)
    except OSError:
        if S.exists(uri, storage):
            raise
        raise BaseGone(
            f"incremental base {base}: {uri} is gone (deleted while this run read it); this run stops and publishes "
            "nothing. Rerun it (--resume latest): it carries from the newest published run it can read"
        ) from None


def user_lists(recs: pa.Table) -> pa.Table:
    """A shard's recommendations (user_id, rank, item_id, score) -> one row per user: key, base_items, base_scores,
    in rank order."""
    recs = recs.sort_by([("user_id", "ascending"), ("rank", "ascending")])
    ids = recs["user_id"].combine_chunks()
    n = len(ids)
    starts = np.flatnonzero(np.r_[True, ~pc.equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)]) if n else []
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
    view = ray.data.from_items([{"stem": s} for s in base.stems] or [{"stem": None}][:0])
    view = view.map_batches(
        read_base, batch_size=4, batch_format="pyarrow", fn_kwargs={"base": base.uri, "storage": cfg.storage}
    )
    partitions = cfg.incremental.partitions or max(1, -(-a.left // USERS_PER_PARTITION))
    joined = ds.map_batches(with_key, batch_format="pyarrow").join(view, "left_outer", partitions, on=("key",))
    spec = Carry(
        a.run, a.run_id, a.id, cfg.storage, schema, cfg.decoding.mode, cfg.decoding.k, cfg.compute.order_by_length
    )
    return joined.map_batches(split, batch_size=None, batch_format="pyarrow", fn_kwargs={"carry": spec})


def split(block: pa.Table, carry: Carry) -> pa.Table:
    """Ray Data map over the join's partitions: the carried rows (not a duplicate, an input hash equal to the base's)
    written as one shard, the rest passed on (with `in_base`: the base holds a list for the user) followed by the
    carried shard's note (pos -1, NOTE: its summary row)."""
    same = pc.fill_null(pc.equal(block["input_hash"], block["base_hash"]), False)
    carried = pc.and_(same, pc.invert(block["duplicate"]))
    out = block.filter(pc.invert(carried))
    in_base = pc.is_valid(out["base_hash"])
    out = out.select(carry.schema.names).cast(carry.schema).append_column("in_base", in_base)
    if carry.order:
        from pipeline.units import by_length

        out = by_length(out)
    rows = block.filter(carried)
    note = pa.nulls(out.num_rows, pa.string())
    if rows.num_rows:
        summary = write_carried(rows.select([*carry.schema.names, "base_items", "base_scores"]), carry)
        extra = {n: pa.nulls(1, out.schema.field(n).type) for n in out.schema.names}
        extra |= {"pos": pa.array([-1], pa.int64()), "duplicate": pa.array([False]), "in_base": pa.array([False])}
        out = pa.concat_tables([out, pa.table(extra, schema=out.schema)])
        note = pa.concat_arrays([note, pa.array([json.dumps(summary)])])
    return out.append_column(NOTE, note)


def write_carried(rows: pa.Table, carry: Carry) -> dict:
    """Carried rows (the read columns, base_items, base_scores) -> their shard written and committed (its
    recommendations copied, its users marked carried) -> its summary row."""
    from operators.outputs import table_schema
    from pipeline import shards

    rows = rows.take(pc.sort_indices(rows["pos"]))
    pos = rows["pos"].to_numpy()
    shard = f"s{int(pos[0]):012d}"
    user_type = carry.schema.field("user_id").type
    items, scores = rows["base_items"].combine_chunks(), rows["base_scores"].combine_chunks()
    lengths = pc.list_value_length(items).to_numpy(zero_copy_only=False)  # [U]
    owner = np.repeat(np.arange(rows.num_rows), lengths)  # [R]
    rank = np.arange(len(owner)) - np.repeat(np.cumsum(lengths) - lengths, lengths) + 1
    recs = pa.table(
        {
            "user_id": rows["user_id"].take(pa.array(owner, pa.int64())),
            "rank": pa.array(rank.astype(np.int32)),
            "item_id": pc.list_flatten(items),
            "score": pc.list_flatten(scores),
            "mode": pa.array([carry.mode] * len(owner), pa.string()),
        }
    ).cast(table_schema("rec", user_type))
    n = rows.num_rows
    users = pa.table({"user_id": rows["user_id"], "input_hash": rows["input_hash"], "source": ["carried"] * n})
    metric = {
        "run_id": carry.run_id,
        "shard": shard,
        "attempt": carry.attempt,
        "mode": carry.mode,
        "decoder": "carried",
        "k": carry.k,
        "users_in": n,
        "users_ok": n,
        "users_short": int((lengths < carry.k).sum()),
        "users_rejected": 0,
        "users_non_finite": 0,
        "users_duplicate": 0,
        "users_carried": n,
        "users_changed": 0,
        "recommendations": len(owner),
        "ranges": shards.ranges_of(pos),
        "committed_at": time.time(),
    }
    rejects = table_schema("reject", user_type).empty_table()
    shards.write_shard(f"{shard}-{carry.attempt}", recs, rejects, metric, carry.run, carry.storage, users)
    return {"users_in": n, "users_ok": n, "users_rejected": 0, "recommendations": len(owner), "restarted": False}


def full_decode_estimate(timings: dict, decoded: int, carried: int) -> float | None:
    """A full night's decode seconds, estimated from this run's: the actors' start (`actor_ready_s`, paid by any
    night) and the rest of its decode at its decoded users' rate, over every user (None: nothing decoded)."""
    decode_s, ready = timings.get("decode_s"), timings.get("actor_ready_s") or 0.0
    if not decode_s or not decoded:
        return None
    return ready + max(decode_s - ready, 0.0) * (decoded + carried) / decoded
