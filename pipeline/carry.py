"""Incremental runs: a user whose list's inputs are unchanged since a base run is carried (its list copied from the
base), every other user decoded.

Every run records its fingerprint (pipeline/lineage.py: every input but the users' own) in its manifest and each
user's input hash in its `users` table. A run with `incremental` on picks a base (`choose_base`: by default the newest
published run of its output root up to its date); when the two fingerprints are equal:
- `start_indexes`: Ray tasks build three objects in Ray's store, the driver holding their references only: the
  base's users with a list (`index_part` per group of base shards, then `merge`: sorted by key), tonight's pending
  users (`tonight_part` per input unit, then `merge`) and each input position's fate (`decide`: CARRIED, IN_BASE);
- the decode's read tasks keep the positions not carried (`Lookup`) and pass them on to the recommender actors at
  once; beside the decode, a second execution (`carried_shards`), one task per group of base shards, copies that
  group's carried users' lists into one carried shard (`carry_part`: recommendations copied, `users` rows marked
  carried). No shuffle and no join: both sides apply the same rule, so the decoded and carried positions are exact
  complements.
When the fingerprints differ, the run is a full one and its manifest names the parts that differ.

While a run reads its base, the base is pinned (`runs.pin`) against `--gc` and the grace deletion; a base file gone
while it is read stops the run (BaseGone, exit 2), which publishes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipeline import cluster, runs, shards
from pipeline import storage as S
from pipeline.lineage import check_code, differences, sha256_of
from pipeline.storage import Storage

log = logging.getLogger("genrec.nightly")


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
    for date in reversed([d for d in runs.dates(output, storage) if d <= run_date]):
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


def base_lists(base: str, stems: list[str], storage: Storage) -> pa.Table:
    """The base's shards `stems` -> one row per user with a list: key, base_items [k] int64 and base_scores [k]
    float32 in rank order. A file gone raises BaseGone naming it."""
    return user_lists(_read(base, "recommendations", stems, ["user_id", "rank", "item_id", "score"], storage))


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


def first_rows(ids: pa.Array) -> np.ndarray:
    """Rows' user ids [R] -> where a run of one user's rows begins [R] bool."""
    return np.r_[True, ~pc.equal(ids[1:], ids[:-1]).to_numpy(zero_copy_only=False)] if len(ids) else np.zeros(0, bool)


def list_starts(recs: pa.Table) -> np.ndarray | None:
    """Where each user's rows begin [U]; None unless every user's rows are together, ranks 1, 2, .."""
    if not recs.num_rows:
        return np.zeros(0, np.int64)
    ids = recs["user_id"].combine_chunks()
    new = first_rows(ids)  # [R]
    starts = np.flatnonzero(new)
    rank = recs["rank"].to_numpy()
    ok = (rank[new] == 1).all() and (np.diff(rank)[~new[1:]] == 1).all()
    return starts if ok and pc.count_distinct(ids.take(pa.array(starts))).as_py() == len(starts) else None


def user_lists(recs: pa.Table) -> pa.Table:
    """Shards' recommendations (user_id, rank, item_id, score) -> one row per user: key, base_items, base_scores,
    in rank order. Shards are written a user's ranks 1, 2, .. together; anything else is sorted first."""
    starts = list_starts(recs)
    if starts is None:  # a user in pieces (never carried: `index_part`) is one row here, of all its pieces
        recs = recs.sort_by([("user_id", "ascending"), ("rank", "ascending")])
        ids = recs["user_id"].combine_chunks()
        starts = np.flatnonzero(first_rows(ids))
    ids, n = recs["user_id"].combine_chunks(), recs.num_rows
    offsets = pa.array(np.r_[starts, n].astype(np.int32))
    return pa.table(
        {
            "key": key_of(ids.take(pa.array(starts, pa.int64()))),
            "base_items": pa.ListArray.from_arrays(offsets, recs["item_id"].combine_chunks().cast(pa.int64())),
            "base_scores": pa.ListArray.from_arrays(offsets, recs["score"].combine_chunks().cast(pa.float32())),
        }
    )


def key_hash(keys: pa.Array) -> np.ndarray:
    """Join keys (`key_of`) -> what an index sorts them by [N] int64: an integer key itself, a string or bytes key
    the first 8 bytes of its blake2b (keys that share a hash are told apart by `find`). A null key hashes to 0."""
    if pa.types.is_int64(keys.type):
        return pc.fill_null(keys, 0).to_numpy(zero_copy_only=False)
    from hashlib import blake2b

    values = (v if isinstance(v, bytes) else (v or "").encode() for v in keys.to_pylist())
    return np.frombuffer(b"".join(blake2b(v, digest_size=8).digest() for v in values), "<i8").copy()


def sorted_by_key(t: pa.Table) -> pa.Table:
    """Rows with `key` (no nulls) -> an index: `h` (`key_hash`) added, sorted by it, one chunk; `unique`: no other
    row has the key (a user listed twice by a base: never carried)."""
    t = t.combine_chunks()
    if not t.num_rows:
        return t.append_column("h", pa.array([], pa.int64())).append_column("unique", pa.array([], pa.bool_()))
    t = t.append_column("h", pa.array(key_hash(t["key"].combine_chunks())))
    t = t.take(pa.array(np.argsort(t["h"].to_numpy(), kind="stable"))).combine_chunks()
    return t.append_column("unique", pa.array(find(t["key"].combine_chunks(), t, first=False) >= 0))


def find(keys: pa.Array, index: pa.Table, first: bool = True) -> np.ndarray:
    """keys [N] (`key_of`) -> the row of `index` (`sorted_by_key`) holding each key [N], -1 where none holds it;
    `first`: the first of several rows with the key (else -1 for such a key). Keys sharing a hash are compared one
    by one (a base user listed twice, or blake2b's 64 bits colliding: never in a hot loop)."""
    n = len(keys)
    out = np.full(n, -1, np.int64)
    if not n or not index.num_rows:
        return out
    h, hs = key_hash(keys), index["h"].combine_chunks().to_numpy()  # [N], [U] sorted
    lo, hi = np.searchsorted(hs, h, "left"), np.searchsorted(hs, h, "right")  # [N] the rows of each key's hash
    valid = pc.is_valid(keys).to_numpy(zero_copy_only=False)
    one = np.flatnonzero(valid & (hi - lo == 1))
    same = pc.equal(index["key"].combine_chunks().take(pa.array(lo[one])), keys.take(pa.array(one)))
    held = pc.fill_null(same, False).to_numpy(zero_copy_only=False)  # [O] another key of the same hash: not held
    out[one[held]] = lo[one][held]
    for i in np.flatnonzero(valid & (hi - lo > 1)):
        held = [j for j in range(lo[i], hi[i]) if index["key"][j] == keys[i]]
        out[i] = held[0] if held and (first or len(held) == 1) else -1
    return out


def index_part(part: int, stems: list[str], base: str, storage: Storage) -> pa.Table:
    """Ray task: the base's shards `stems` (its `part`-th group) -> their users with a list: key, base_hash, part. A
    user whose recommendations lie in pieces (in two shards, or apart in one: a run written by hand or another tool)
    is given twice, so that it is never carried (`sorted_by_key`'s `unique`): it is decoded."""
    users = _read(base, "users", stems, ["user_id", "input_hash"], storage)
    recs = _read(base, "recommendations", stems, ["user_id", "rank"], storage)
    ids, first = recs["user_id"].combine_chunks(), pc.equal(recs["rank"], 1).to_numpy(zero_copy_only=False)
    runs_of = ids.filter(pa.array(first_rows(ids) | first))
    listed, pieces = pc.unique(runs_of), pc.value_counts(runs_of)  # [L], each user's runs of rows
    pieces = pieces.field("values").filter(pc.greater(pieces.field("counts"), 1))
    users = users.filter(pc.and_(pc.is_valid(users["user_id"]), pc.is_in(users["user_id"], listed)))
    users = pa.concat_tables([users, users.filter(pc.is_in(users["user_id"], pieces))])
    keys = key_of(users["user_id"].combine_chunks())
    return pa.table({"key": keys, "base_hash": users["input_hash"], "part": pa.array([part] * len(keys), pa.int32())})


def tonight_part(units: pa.Table, storage: Storage, uri: str, **read) -> pa.Table:
    """Ray task: pending units -> their rows' key, user_id, pos and input_hash, but the repeats and rows without an
    id (`units.read_units`' rows: what the decode's read tasks see)."""
    from pipeline.units import read_retrying

    t = read_retrying(units, storage, uri, **read)
    t = t.filter(pc.and_(pc.invert(t["duplicate"]), pc.is_valid(t["user_id"])))
    return pa.table({"key": key_of(t["user_id"].combine_chunks()), **{c: t[c] for c in CARRIED_COLUMNS}})


def merge(*parts: pa.Table) -> pa.Table:
    """Ray task: index parts -> one index (`sorted_by_key`)."""
    return sorted_by_key(pa.concat_tables(parts))


CARRIED, IN_BASE = 2, 1  # an input position's fate in an incremental run (`decide`; 0: a user the base lacks)


def decide(index: pa.Table, tonight: pa.Table, total: int) -> np.ndarray:
    """Ray task: the two indexes -> each input position's fate [total] int8: CARRIED (not a repeat, listed once by
    the base, with the same input hash), IN_BASE (decoded; the base holds a list for the user) or 0."""
    state = np.zeros(total, np.int8)
    at = find(tonight["key"].combine_chunks(), index)  # [T] each pending user's row of the base's index
    found = np.flatnonzero(at >= 0)
    taken = pa.array(at[found])
    same = pc.and_(
        pc.equal(index["base_hash"].take(taken), tonight["input_hash"].take(pa.array(found))),
        index["unique"].take(taken),
    )
    pos = tonight["pos"].to_numpy()[found]  # [F]
    state[pos] = IN_BASE
    state[pos[pc.fill_null(same, False).to_numpy(zero_copy_only=False)]] = CARRIED
    return state


@dataclass(frozen=True)
class Indexes:
    """An incremental run's indexes, objects in Ray's store (the driver holds their references, never their rows):
    the base's users with a list (key, base_hash, part: the group of its shards, `parts`), tonight's pending users
    (key, user_id, pos, input_hash) and each input position's fate (`decide`)."""

    base: object
    tonight: object
    fate: object


def start_indexes(base: Base, per_task: int, work: list[dict], total: int, read: dict) -> Indexes:
    """Ray tasks build the indexes (`per_task` base shards, or one input unit, a task; then one merge
    each; then `decide`) -> their references, at once: the tasks that read them wait for them. `read`:
    `units.read_retrying`'s arguments (storage, uri, fs, columns, duplicates, hashing)."""
    import ray

    base_part, night_part, merged = ray.remote(index_part), ray.remote(tonight_part), ray.remote(merge)
    night = {**read, "duplicates": ray.put(read["duplicates"])}  # stored once, each task reads it
    groups = enumerate(parts(base, per_task))
    index = merged.remote(*(base_part.remote(i, g, base.uri, read["storage"]) for i, g in groups))
    tonight = merged.remote(*(night_part.remote(pa.Table.from_pylist([u]), **night) for u in work))
    return Indexes(index, tonight, ray.remote(decide).remote(index, tonight, total))


def parts(base: Base, n: int) -> list[list[str]]:
    """The base's shards in groups of `n` (incremental.base_shards_per_task): what one task reads."""
    return [base.stems[i : i + n] for i in range(0, len(base.stems), n)]


@dataclass(frozen=True)
class Lookup:
    """What the decode's read tasks keep of their rows (with `pos`) in an incremental run: those not carried, with
    `in_base`."""

    fate: object  # `Indexes.fate`

    def keep(self, rows: pa.Table) -> pa.Table:
        import ray

        fate = ray.get(self.fate)[rows["pos"].to_numpy()]  # [N]
        kept = fate != CARRIED
        return rows.filter(pa.array(kept)).append_column("in_base", pa.array(fate[kept] == IN_BASE))


CARRIED_COLUMNS = ("user_id", "pos", "input_hash")  # what a carried shard writes of tonight's row


@dataclass(frozen=True)
class Carry:
    """What `carry_part` needs, small and inline: where the run writes, what its rows are."""

    run: str  # the run folder
    run_id: str
    attempt: str
    storage: Storage
    base: str  # the base run's folder
    user_type: pa.DataType  # the input's user ids
    mode: str
    k: int
    indexes: Indexes
    code: str = ""  # the driver's code identity (`lineage.check_code`)


def carried_shards(plan, a, base: Base, indexes: Indexes):
    """The base's shards, incremental.base_shards_per_task a task (Ray Data) -> their users that tonight carries,
    written as one shard a task (`carry_part`) -> its summary row (shards.SUMMARY): a function that returns that
    dataset once the indexes are built (`follow.stream`)."""
    import ray

    cfg = plan.cfg
    spec = Carry(
        a.run,
        a.run_id,
        a.id,
        cfg.storage,
        base.uri,
        plan.user_type,
        cfg.decoding.mode,
        cfg.decoding.k,
        indexes,
        plan.identity["code"]["sha256"],
    )
    groups = parts(base, cfg.incremental.base_shards_per_task)
    ds = ray.data.from_items([{"part": i, "stems": g} for i, g in enumerate(groups)])
    ds.context.raise_original_map_exception = True  # BaseGone, a bad base: their exit codes (nightly.exit_code)
    cluster.share(ds.context)
    ds = ds.map_batches(carry_part, batch_size=1, batch_format="pyarrow", fn_kwargs={"carry": spec})

    def ready(stopped):  # the execution starts once both indexes are built: no task of it waits holding a worker
        refs = [indexes.base, indexes.tonight]
        while len(ray.wait(refs, num_returns=2, timeout=1.0, fetch_local=False)[0]) < 2:
            if stopped.is_set():
                return None
        return ds

    return ready


def carry_part(batch: pa.Table, carry: Carry) -> pa.Table:
    """Ray Data map over the groups of the base's shards (`parts`): a group's users that its part of the base's
    index holds once, that tonight's pending users hold, with the same input hash (what `decide` carries) ->
    written as one shard -> its summary row (none when none is carried)."""
    import ray

    from pipeline.shards import SUMMARY

    check_code(carry.code, "a carry task")
    part = batch["part"][0].as_py()
    with S.on_node("the incremental base", carry.base):
        view = base_lists(carry.base, batch["stems"][0].as_py(), carry.storage)  # [U] key, base_items, base_scores
    index, tonight = ray.get([carry.indexes.base, carry.indexes.tonight])
    keys = view["key"].combine_chunks()
    listed, night = find(keys, index), find(keys, tonight)  # [U], [U]
    ok = np.flatnonzero((listed >= 0) & (night >= 0))
    at, there = pa.array(listed[ok]), pa.array(night[ok])
    same = pc.equal(tonight["input_hash"].take(there), index["base_hash"].take(at))
    here = pc.and_(index["unique"].take(at), pc.equal(index["part"].take(at), part))
    ok = ok[pc.fill_null(pc.and_(same, here), False).to_numpy(zero_copy_only=False)]
    if not len(ok):
        return SUMMARY.empty_table()
    rows = tonight.select(list(CARRIED_COLUMNS)).take(pa.array(night[ok]))
    lists = view.select(["base_items", "base_scores"]).take(pa.array(ok))
    columns = [*rows.columns, *lists.columns]
    with S.on_node("the run's shards under", carry.run, "write"):
        summary = write_carried(pa.Table.from_arrays(columns, [*rows.column_names, *lists.column_names]), carry)
    return pa.Table.from_pylist([summary], schema=SUMMARY)


def write_carried(rows: pa.Table, carry: Carry) -> dict:
    """Carried rows (the read columns, base_items, base_scores) -> their shard written and committed (its
    recommendations copied, its users marked carried) -> its summary row."""
    from operators.outputs import table_schema

    rows = rows.take(pc.sort_indices(rows["pos"]))
    pos = rows["pos"].to_numpy()
    shard, n = f"s{int(pos[0]):012d}", rows.num_rows
    user_type = carry.user_type
    recs = carried_recommendations(rows, carry.mode).cast(table_schema("rec", user_type))
    lengths = pc.list_value_length(rows["base_items"]).to_numpy(zero_copy_only=False)  # [U]
    ids = rows["user_id"].cast(user_type)
    users = pa.table({"user_id": ids, "input_hash": rows["input_hash"], "source": ["carried"] * n})
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
            "mode": pa.repeat(pa.scalar(mode, pa.string()), len(owner)),
        }
    )


def check_decoded_on(base: Base, tonight: dict) -> None:
    """An incremental run's decoded users must have been decoded in dtypes, on devices and (outside float32) by
    engines its base's were (`compute.dtype: auto`, the GPU model and `compute.engine: auto` show only in the
    actors): each of tonight's among the base's, since a base decoded on two GPU models already mixes them, and a
    night whose few users all landed on one of them mixes nothing new. Else its carried and decoded lists would mix
    two, and it is not published (ValueError, exit 2)."""
    was = base.decoded_on
    within = all(set(tonight.get(k) or []) <= set(was.get(k) or []) for k in ("dtypes", "devices", "engines"))
    if was.get("dtypes") and tonight.get("dtypes") and not within:
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
