"""The nightly job's output side: how decoded shards are written and committed, what lets one streaming execution
write as it goes and a killed run resume (the input side, units and positions: pipeline/units.py).

Decoding: `ShardRecommender` wraps the Recommender actor; every batch it decodes is a shard, named by its first
position (`s000000012345`): unique within a run and across its resumes, whatever actor restarts happen.
Writing: the actor writes (`write_shard`) a shard's recommendations, then its rejects, then its metrics row, which
lists the position ranges the shard covers, each as `<table>/<shard>-<attempt>.parquet`: `attempt` is the driver
execution (a run's first start, each resume) whose actors wrote it. A shard is committed when its metrics file exists.

Fencing: each attempt records, when it starts (`begin_attempt`, under the date's lease), the shards it trusts: those
its predecessor trusted plus those its predecessor committed. It decodes only the positions they do not cover, and its
manifest lists exactly those shards and its own (`manifest["files"]`), which is all readers read. A driver that paused
past its lease while another took the run over may have actors still writing: their files carry the old attempt,
no later attempt trusts them, and a resume or the publish deletes them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decoding.stats import BASE_KEYS, PHASES
from operators.outputs import TABLES, table_schema
from pipeline import runs
from pipeline import storage as S
from pipeline.lineage import code_refusal, decoded_on
from pipeline.storage import Storage
from pipeline.units import merge

if TYPE_CHECKING:
    from operators.recommender import Recommender
    from operators.spec import ActorSpec
    from pipeline.items import ItemsRef

DUPLICATE = ("duplicate_user", "user_id appears more than once; the first row is kept")
_INT = pa.int64()
METRIC_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("shard", pa.string()),
        ("attempt", pa.string()),
        ("actor", pa.string()),
        ("batch", _INT),
        ("host", pa.string()),
        ("accelerator", pa.string()),
        ("device", pa.string()),
        ("mode", pa.string()),
        ("decoder", pa.string()),
        ("k", _INT),
        ("users_in", _INT),
        ("users_ok", _INT),
        ("users_short", _INT),  # of them, users whose list holds fewer than k items (fewer are left to them)
        ("users_rejected", _INT),
        ("users_non_finite", _INT),
        ("users_duplicate", _INT),
        ("users_carried", _INT),  # of users_ok, users whose list was copied from the base run (pipeline/carry.py)
        ("users_changed", _INT),  # users decoded whose list the base run holds, with other inputs (incremental runs)
        ("users_prompted", _INT),  # users whose prompt was rendered and decoded (their prompt_tokens)
        ("users_truncated", _INT),  # of them, prompts that dropped their oldest history items to fit max_prompt_tokens
        ("users_too_long", _INT),  # of users_rejected, prompt_too_long: no fit (decoding.too_long)
        ("recommendations", _INT),
        ("prompt_tokens", _INT),
        ("prefix_tokens_saved", _INT),
        ("prompt_positions", _INT),  # prompt positions the prefills computed (users x columns, the prefix left out)
        ("prompt_padding", _INT),  # of them, left padding (the rest: the rendered items and template)
        ("prompt_padding_fraction", pa.float64()),
        ("kv_padding_tokens", _INT),  # KV tokens of left padding held at the peak (every model holding the prompts)
        ("wall_s", pa.float64()),
        ("other_s", pa.float64()),
    ]
    + [(key, pa.float64() if key in PHASES else _INT) for key in BASE_KEYS]
    + [
        ("mean_accepted_steps", pa.float64()),
        ("accepted_hist", pa.list_(_INT)),
        ("peak_memory_bytes", _INT),
        ("decode_batch", _INT),
        ("actor_ready_at", pa.float64()),
        ("committed_at", pa.float64()),
        ("users_per_s", pa.float64()),
        ("auto", pa.string()),
        ("dtype", pa.string()),
        ("audit_users", _INT),
        ("audit_identical_lists", _INT),
        ("audit_topk_overlap_sum", pa.float64()),
        ("audit_max_abs_score_diff", pa.float64()),
        ("audit_s", pa.float64()),
        ("audit_device", pa.string()),  # where the audit's float32 copies ran: gpu (the actor's, beside the run) or cpu
        ("audit_skipped", pa.string()),  # why an actor skipped its audit (its float32 copies fit neither)
        ("engine", pa.string()),
        ("engine_note", pa.string()),  # why a batch under a compiled or auto engine decoded eager (null: none)
        ("compile_s", pa.float64()),
        ("graphs_compiled", _INT),
        ("graphs_cold", _INT),  # compiled from scratch at the warm-up (not loaded from a compile cache)
        ("compile_cache", pa.string()),  # the warm-up's compile store: key, fetched, uploaded (JSON)
        ("compile_errors", pa.string()),  # buckets that failed to compile since the last row -> why (JSON)
        ("ranges", pa.list_(pa.list_(_INT))),
        ("exclude_users", _INT),
        ("excluded_items", _INT),
        ("excluded_max", _INT),
        ("exclude_unknown_ids", _INT),
    ]
)
AUDIT = ("audit_users", "audit_identical_lists", "audit_topk_overlap_sum", "audit_s")  # summed over shards
EXCLUDED = ("exclude_users", "excluded_items", "exclude_unknown_ids")  # summed over shards (excluded_max: the max)


def begin_attempt(run: str, storage: Storage, attempt: str) -> list[str]:
    """Records this attempt of the run (`_ATTEMPTS/<n>-<attempt>.json`) with the shards it trusts -> their stems
    (`<shard>-<attempt>`), sorted; deletes every other file of the run's tables (uncommitted shards, the files of
    attempts no one trusts, writes cut short)."""
    folder = S.join(run, "_ATTEMPTS")
    records = [f for f in S.list_files(folder, storage) if f.endswith(".json")]
    trusted: set[str] = set()
    if records:
        last = json.loads(S.read_bytes(S.join(folder, records[-1]), storage))
        mine = f"-{last['attempt']}.parquet"
        trusted = set(last["trusted"]) | {
            n.removesuffix(".parquet")
            for n in S.list_files(runs.table_dir(run, "metrics"), storage)
            if n.endswith(mine)
        }
    trusted = sorted(trusted)
    S.write_bytes(
        S.join(folder, f"{len(records):06d}-{attempt}.json"),
        json.dumps({"attempt": attempt, "started": time.time(), "trusted": trusted}).encode(),
        storage,
    )
    keep = set(trusted)
    for table in runs.TABLES:
        folder = runs.table_dir(run, table)
        S.delete_files(
            folder, [f for f in S.list_files(folder, storage) if f.removesuffix(".parquet") not in keep], storage
        )
    return trusted


def committed(run: str, storage: Storage, stems: list[str]) -> np.ndarray:
    """The position ranges [M, 2] the shards `stems` cover, merged: numpy, 16 bytes a range (an incremental run's
    shards hold about one range per user: the join scatters positions)."""
    ranges = [
        pc.list_flatten(pc.list_flatten(t["ranges"])).to_numpy().reshape(-1, 2)
        for t in runs.read_files(run, "metrics", storage, ["ranges"], files=stems)
    ]
    return merge(np.concatenate(ranges) if ranges else np.zeros((0, 2), np.int64))


def attempt_shards(run: str, storage: Storage, trusted: list[str], attempt: str) -> list[str]:
    """The shards a run publishes: those its attempt trusted when it started, and those it committed itself."""
    mine = f"-{attempt}.parquet"
    own = [
        n.removesuffix(".parquet") for n in S.list_files(runs.table_dir(run, "metrics"), storage) if n.endswith(mine)
    ]
    return sorted(set(trusted) | set(own))


SUMS = ("users_in", "users_ok", "users_short", "users_rejected", "users_non_finite", "recommendations")
SUMS += ("users_duplicate", "users_carried", "users_changed", "users_truncated", "users_too_long")
TIMES = ("actor_ready_at", "committed_at")  # epoch seconds
TALLIED = [*SUMS, "actor", "batch", "auto", "decode_batch", *TIMES, "dtype", *AUDIT, "audit_max_abs_score_diff"]
TALLIED += ["audit_device", "audit_skipped", "device", "engine"]
TALLIED += [
    *EXCLUDED,
    "excluded_max",
    "compile_s",
    "graphs_compiled",
    "graphs_cold",
]  # the metrics columns `tally` reads


def tally(run: str, storage: Storage, stems: list[str], since: float = 0.0) -> dict:
    """The totals of the shards `stems`, read file by file: {SUMS..., "batches", "decode_batch": the smallest and
    largest users per decode (compute.decode_batch, or what the GPU actors found to fit), "actor_ready_s" and
    "first_commit_s": seconds from `since` (epoch) until the first actor started after it was ready to decode and
    until the first shard written after it was committed (None: none; the actors' clocks: on one machine exact),
    "auto": each actor's last auto state (decoding.mode = auto: its choice and the trial timings behind it) or None,
    "precision_audit": `precision_audit` of the dtypes and audit sums, "exclusions": the EXCLUDED sums and the
    largest excluded_max, "compile_s": each actor's compile seconds (compute.engine compiled; None when nothing
    compiled), "graphs_compiled": how many graphs they compiled}."""
    totals = Tally(since)
    for t in runs.read_files(run, "metrics", storage, TALLIED, files=stems):
        totals.add(t)
    return totals.result()


def _sum(column: pa.ChunkedArray):
    return pc.sum(column).as_py() or 0


@dataclass
class Tally:
    """The running totals of `tally`, one metrics file at a time."""

    since: float  # epoch: TIMES before it are not this run's
    sums: dict = field(default_factory=lambda: dict.fromkeys(SUMS, 0))
    batches: int = 0
    times: dict = field(default_factory=lambda: {key: [] for key in TIMES})  # seconds since `since`
    audit: dict = field(default_factory=lambda: dict.fromkeys(AUDIT, 0))
    worst: list = field(default_factory=list)  # audit_max_abs_score_diff of every audited batch
    audit_notes: dict = field(default_factory=lambda: {"audit_device": set(), "audit_skipped": set()})
    dtypes: set = field(default_factory=set)
    devices: set = field(default_factory=set)  # what the decoded shards ran on (a carried shard has none)
    engines: set = field(default_factory=set)  # the engines whose lists they published
    excluded: dict = field(default_factory=lambda: {**dict.fromkeys(EXCLUDED, 0), "excluded_max": 0})
    sizes: list = field(default_factory=list)  # every file's smallest and largest decode_batch
    compile_s: dict = field(default_factory=dict)  # actor -> its compile seconds
    graphs: int = 0
    cold: int = 0  # graphs compiled from scratch at warm-ups
    last: dict = field(default_factory=dict)  # actor -> (its last batch with an auto state, that state)
    actors: set = field(default_factory=set)  # the actors that committed shards since `since` (restarts included)

    def add(self, t: pa.Table) -> None:
        """One metrics file's rows (TALLIED columns)."""
        for key, seen in self.times.items():
            seen += [v - self.since for v in t[key].to_pylist() if v is not None and v >= self.since]
        self.batches += t.num_rows
        for key in SUMS:
            self.sums[key] += int(_sum(t[key]))
        for key in AUDIT:
            self.audit[key] += _sum(t[key])
        for key in EXCLUDED:
            self.excluded[key] += _sum(t[key])
        self.excluded["excluded_max"] = max(self.excluded["excluded_max"], pc.max(t["excluded_max"]).as_py() or 0)
        self.worst += [v for v in t["audit_max_abs_score_diff"].to_pylist() if v is not None]
        for key, seen in self.audit_notes.items():
            seen |= {v for v in t[key].to_pylist() if v}
        self.dtypes |= {v for v in t["dtype"].to_pylist() if v}
        self.devices |= {v for v in t["device"].to_pylist() if v}
        self.engines |= {v for v in t["engine"].to_pylist() if v}
        self.sizes += [v.as_py() for v in pc.min_max(t["decode_batch"]).values() if v.as_py() is not None]
        self.graphs += _sum(t["graphs_compiled"])
        self.cold += _sum(t["graphs_cold"])
        self.add_actors(t)

    def add_actors(self, t: pa.Table) -> None:
        """The actors that committed since `since`, each one's compile seconds and its last auto state."""
        self.actors |= {  # a carried shard has no actor
            r["actor"]
            for r in t.select(["actor", "committed_at"]).to_pylist()
            if r["actor"] and r["committed_at"] >= self.since
        }
        for r in t.select(["actor", "compile_s"]).filter(pc.is_valid(t["compile_s"])).to_pylist():
            self.compile_s[r["actor"]] = self.compile_s.get(r["actor"], 0.0) + r["compile_s"]
        for r in t.select(["actor", "batch", "auto"]).to_pylist():
            if r["auto"] and r["batch"] >= self.last.get(r["actor"], (-1, None))[0]:
                self.last[r["actor"]] = (r["batch"], json.loads(r["auto"]))

    def result(self) -> dict:
        """`tally`'s totals."""
        return {
            **self.sums,
            "batches": self.batches,
            "decode_batch": {"min": min(self.sizes), "max": max(self.sizes)} if self.sizes else None,
            "actor_ready_s": min(self.times["actor_ready_at"], default=None),
            "first_commit_s": min(self.times["committed_at"], default=None),
            "auto": {actor: state for actor, (_, state) in sorted(self.last.items())} or None,
            "precision_audit": precision_audit(sorted(self.dtypes), self.audit, self.worst, self.audit_notes),
            "exclusions": self.excluded,
            "compile_s": dict(sorted(self.compile_s.items())) if self.graphs else None,
            "graphs_compiled": self.graphs,
            "graphs_cold": self.cold,
            "compute_actors": sorted(self.actors),
            "decoded_on": decoded_on(self.dtypes, self.devices, self.engines),
        }


def precision_audit(dtypes: list[str], audit: dict, worst: list[float], notes: dict | None = None) -> dict:
    """The manifest's `precision_audit`: users re-decoded in float32, how many got identical top-K lists, the mean
    top-K set overlap, the largest score difference, the seconds it cost, where the float32 copies ran (`device`:
    gpu, cpu) and why actors skipped it (`skipped`: their float32 copies fit neither the GPU nor the host); in
    float32 a note that there is nothing to audit."""
    notes = notes or {}
    placed = {
        name: sorted(notes[key])
        for name, key in (("device", "audit_device"), ("skipped", "audit_skipped"))
        if notes.get(key)
    }
    out = {"dtype": ", ".join(dtypes) or None, "users": int(audit["audit_users"])}
    if dtypes and set(dtypes) <= {"float32"}:
        return {**out, "note": "float32 is exact (top-K identical to transformers); nothing to audit"}
    n = out["users"]
    return {
        **out,
        "identical_lists": int(audit["audit_identical_lists"]),
        "topk_overlap": audit["audit_topk_overlap_sum"] / n if n else None,
        "max_abs_score_diff": max(worst, default=None),
        "seconds": float(audit["audit_s"]),
        **placed,
        **({} if n or placed else {"note": "half precision without an audit (compute.audit_users = 0)"}),
    }


class ShardRecommender:
    """The actor of the graph: each batch it gets is one shard (named by its first position). Duplicate rows go to
    rejects, the rest to the Recommender; the actor writes the shard itself (no output rows cross the object store)
    and returns one summary row for the driver's progress."""

    def __init__(self, spec: ActorSpec, items: ItemsRef, run: str, storage: Storage, attempt: str, code: str = ""):
        self.run, self.storage, self.attempt = run, storage, attempt
        self.written: dict[str, dict] = {}  # shard -> its summary row: the batches this actor committed
        self.gave_up: dict[str, int] = {}  # shard -> its StoreUnavailable errors on this actor
        # `code`: the driver's (lineage.code_identity): other code here is refused like a model it cannot read
        other = code_refusal(code, "a recommender actor")
        self.refused: Exception | None = ValueError(other) if other else None  # why it cannot decode: first batch
        self.recommender = None
        if other is None:
            try:
                self.recommender = recommender_of(spec, items, storage)
            except Exception as e:  # noqa: BLE001 -- raised from __call__, where Ray keeps it whole
                self.refused = S.StoreGaveUp(e.message) if isinstance(e, S.StoreUnavailable) else e

    def __call__(self, batch: pa.Table) -> pa.Table:
        """One batch -> its shard committed -> its summary row. A StoreUnavailable is Ray's to retry (the actors'
        retry_exceptions: Ray runs the task again on this actor) until this shard has had BATCH_RETRIES + 1 of them
        here; then StoreGaveUp, which Ray does not retry. A lost actor's tasks are retried on its restart, without
        limit: that is a system failure, which no application retry count spends.
        An actor that could not start (other code than the driver's, a model it cannot read or that changed, a store
        that gave out) raises why on its first batch, before decoding any: an error in a task reaches the driver as
        itself (its exit code, one line), where one in the actor's constructor would reach it as the actor's death,
        its cause a traceback's text; a store that gave out there is StoreGaveUp, never retried on this actor."""
        if self.refused is not None:
            raise self.refused
        return pa.Table.from_pylist([self.shard(batch)], schema=SUMMARY)

    def shard(self, batch: pa.Table) -> dict:
        shard = f"s{int(pc.min(batch['pos']).as_py()):012d}"
        if shard in self.written:  # Ray retries a task whose later batch gave up on the store: this one is committed
            return self.written[shard]
        try:
            with S.on_node("the run's shards under", self.run, "write"):
                return self.commit(shard, batch)
        except S.StoreUnavailable as e:
            self.gave_up[shard] = self.gave_up.get(shard, 0) + 1
            if self.gave_up[shard] > S.BATCH_RETRIES:
                raise S.StoreGaveUp(e.message) from None
            raise

    def commit(self, shard: str, batch: pa.Table) -> dict:
        """Decodes the batch, writes and commits its shard -> its summary row. Its rows are taken in input order
        (the read side may have ordered them by length), which the recommender keeps in its output."""
        batch = batch.take(pc.sort_indices(batch["pos"]))
        pos = batch["pos"].to_numpy()
        dup = batch["duplicate"].to_numpy(zero_copy_only=False)
        distinct = users_of(batch.filter(pa.array(~dup)), "decoded")
        extra = [c for c in ("pos", "duplicate", "input_hash", "in_base") if c in batch.column_names]
        out = self.recommender(batch.filter(pa.array(~dup)).drop_columns(extra))
        kind = out["kind"]
        metric = json.loads(out["metrics"].filter(pc.equal(kind, "metric"))[0].as_py())
        n_dup = int(dup.sum())
        metric.update(
            shard=shard,
            attempt=self.attempt,
            users_in=metric["users_in"] + n_dup,
            users_duplicate=n_dup,
            users_rejected=metric["users_rejected"] + n_dup,
            users_carried=0,
            users_changed=changed(batch, dup),
            ranges=ranges_of(pos),
        )
        user_type = batch.schema.field("user_id").type
        rejects = out.filter(pc.equal(kind, "reject")).select(TABLES["reject"])
        rejects = with_duplicates(rejects.cast(table_schema("reject", user_type)), batch["user_id"], dup)
        metric["committed_at"] = time.time()  # the shard commits with the metrics row written next
        recs = out.filter(pc.equal(kind, "rec")).select(TABLES["rec"]).cast(table_schema("rec", user_type))
        write_shard(f"{shard}-{self.attempt}", recs, rejects, metric, self.run, self.storage, distinct)
        self.written[shard] = {
            key: metric[key] for key in ("users_in", "users_ok", "users_rejected", "recommendations")
        }
        self.written[shard]["restarted"] = restarted()
        return self.written[shard]


def changed(batch: pa.Table, dup: np.ndarray) -> int:
    """Of a batch's first rows of their user (dup [B] bool: the repeats), those whose list the base run holds
    (`in_base`, an incremental run's; 0 otherwise)."""
    if "in_base" not in batch.column_names:
        return 0
    return int(pc.sum(batch["in_base"].filter(pa.array(~dup))).as_py() or 0)


def with_duplicates(rejects: pa.Table, users: pa.ChunkedArray, dup: np.ndarray) -> pa.Table:
    """A shard's rejects and one `duplicate_user` reject per repeated row (dup [B] bool over `users`)."""
    n = int(dup.sum())
    if not n:
        return rejects
    repeats = pa.table(
        {"user_id": users.filter(pa.array(dup)), "reason": [DUPLICATE[0]] * n, "detail": [DUPLICATE[1]] * n},
        schema=rejects.schema,
    )
    return pa.concat_tables([rejects, repeats])


def recommender_of(spec: ActorSpec, items: ItemsRef, storage: Storage) -> Recommender:
    """The actor's Recommender over the run's items, read here; the catalog table dropped once parsed, and what it
    and the index build freed handed back to the operating system (what the actor holds: docs/sizing.md). Imported
    here: the carry's tasks read this module's shard layout without the decoders."""
    from decoding.memory import trim_host_heap
    from operators.recommender import Recommender

    with S.on_node("the items", items.sources.catalog):
        got = items.read(storage)
    recommender = Recommender(replace(spec, catalog=got.table, recommendable=got.served))
    del got
    pa.default_memory_pool().release_unused()
    trim_host_heap()
    return recommender


def restarted() -> bool:
    """Whether this actor is a restart (Ray brought it back after its process or node was lost)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed


def ranges_of(pos: np.ndarray) -> list[list[int]]:
    """Sorted positions -> their runs [[start, end)]."""
    pos = np.sort(pos)
    cut = np.nonzero(np.diff(pos) != 1)[0] + 1
    return [[int(p[0]), int(p[-1]) + 1] for p in np.split(pos, cut)]


def metric_table(rows: list[dict]) -> pa.Table:
    rows = [{**r, "auto": json.dumps(r["auto"]) if r.get("auto") else None} for r in rows]
    return pa.Table.from_pylist(rows, schema=METRIC_SCHEMA)


def users_of(rows: pa.Table, source: str) -> pa.Table:
    """A shard's distinct input users (user_id, input_hash) -> its users table (USERS_COLUMNS; no row without an
    id)."""
    rows = rows.filter(pc.is_valid(rows["user_id"]))
    hashes = rows["input_hash"] if "input_hash" in rows.column_names else pa.nulls(rows.num_rows, pa.binary())
    return pa.table(
        {"user_id": rows["user_id"], "input_hash": hashes, "source": pa.array([source] * rows.num_rows, pa.string())}
    )


def users_schema(user_type: pa.DataType) -> pa.Schema:
    """The `users` table: each input user of the run (but repeats and rows without an id), the hash of what its list
    read (pipeline/lineage.py) and whether it was decoded or carried."""
    return pa.schema([("user_id", user_type), ("input_hash", pa.binary()), ("source", pa.string())])


SUMMARY = pa.schema(
    [
        ("users_in", _INT),
        ("users_ok", _INT),
        ("users_rejected", _INT),
        ("recommendations", _INT),
        ("restarted", pa.bool_()),
    ]
)  # what each shard tells the driver (pipeline/follow.py)


def write_shard(
    stem: str, recs: pa.Table, rejects: pa.Table, metric: dict, run: str, storage: Storage, users: pa.Table
) -> None:
    """A shard's recommendations, rejects, users and then its metrics row (its commit), as `<table>/<stem>.parquet`:
    on S3 four PUTs and nothing else (`S.write_parquet`). Empty tables are written too: a retried shard's files replace
    every file of its earlier attempt (a retry without rejects must not leave the first attempt's rejects beside its
    recommendations).
    Retries are safe, whoever makes them (the store call's own within storage.retry_s, Ray's of the whole batch, a
    restarted actor's): `stem` is the shard (its first position, the same whenever the batch is decoded again) and the
    attempt (this driver execution), so a retry writes the same three names, each put replaces a file whole, and
    nothing is committed until the metrics file exists; no other batch and no other attempt writes these names."""
    users = users.cast(users_schema(recs.schema.field("user_id").type))
    tables = (("recommendations", recs), ("rejects", rejects), ("users", users), ("metrics", metric_table([metric])))
    for name, rows in tables:
        S.write_parquet(rows, S.join(runs.table_dir(run, name), f"{stem}.parquet"), storage)
