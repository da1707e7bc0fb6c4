"""One driver execution of a run (its first start or a resume): the run's state checked or recorded, the shards it
takes over, what is left to decode and the input's duplicate user ids; then the streaming Ray Data execution: units
-> read tasks -> the ShardRecommender actor pool (each batch a shard it writes and commits) -> one summary row per
shard (followed by follow.py)."""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from dataclasses import dataclass, field, replace

import pyarrow as pa

from pipeline import cluster, runs, shards, units
from pipeline import storage as S
from pipeline.carry import Lookup, carried_shards, start_indexes
from pipeline.config import Compute
from pipeline.follow import follow
from pipeline.items import ItemsRef, Sources
from pipeline.lease import Lease
from pipeline.plan import Clock, Plan, check_resumable, input_columns
from pipeline.signals import Interrupted

log = logging.getLogger("genrec.nightly")


@dataclass
class Attempt:
    """One driver execution of a run (its first start or a resume): the state its steps share."""

    run_id: str
    run: str  # the run's folder
    resumed: bool
    id: str  # this execution: the shards it writes carry it
    trusted: list[str]  # the committed shards it takes over (their stems)
    work: list[dict]  # the units with positions no trusted shard covers (`units.todo`)
    total: int  # users in the input
    left: int  # users to decode
    pool: cluster.Pool  # the recommender actor pool
    duplicates: pa.Table | None = None  # user ids seen more than once [user_id, first] (None: none)
    checked_on: str = "driver"  # where they were looked for (`units.find_duplicates`)
    shards_decoded: int = 0
    watch: cluster.Watch | None = None  # the nodes lost and joined while it decoded
    interruptions: list = field(default_factory=list)  # the run's earlier attempts stopped by a signal (_RUN.json)


def start_run(plan: Plan, run_id: str, run: str) -> list[dict]:
    """A new run records its start (_RUN.json: what a resume must find unchanged); a resumed one is checked against
    it -> the run's interruptions so far (`record_interruption`)."""
    cfg = plan.cfg
    state = runs.state_of(run, cfg.storage)
    if state is not None:
        check_resumable(plan, run_id, state)
        runs.clear_unfinished(run, cfg.storage)  # under the lease: an earlier attempt's manifest without _SUCCESS
        for stop in state.get("interruptions", []):
            log.info("run %s: attempt %s was stopped by %s at %s", run_id, stop["attempt"], stop["signal"], stop["at"])
        return state.get("interruptions", [])
    record = {"run_id": run_id, "run_date": cfg.run_date, "fingerprint": plan.fingerprint, "started": time.time()}
    runs.start(run, {**record, "config": cfg.to_dict(), "identity": plan.identity}, cfg.storage)
    return []


def record_interruption(plan: Plan, run_id: str, attempt: str | None, stop: Interrupted) -> None:
    """Adds this attempt's stop to the run's state (_RUN.json `interruptions`: the attempt, None if stopped before it
    was recorded, the signal, the time); a resume logs them and its manifest lists them (`resume.interruptions`).
    Best effort, as the lease's release is: a failure is logged, never raised over the stop."""
    cfg = plan.cfg
    entry = {"attempt": attempt, "signal": stop.signal, "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    try:
        runs.record(runs.run_dir(cfg.output, cfg.run_date, run_id), "interruptions", entry, cfg.storage)
    except Exception as e:  # no _RUN.json yet (stopped as it started), or the store is down
        log.error("run %s stopped by %s; could not record it in its _RUN.json: %s", run_id, stop.signal, e)
        return
    log.warning("run %s stopped by %s: the interruption is recorded in its _RUN.json", run_id, stop.signal)


def start_attempt(plan: Plan, run_id: str, resumed: bool, clock: Clock) -> Attempt:
    """Starts (or checks) the run, records this attempt with the shards it trusts, finds what is left to decode and
    the input's duplicate user ids."""
    import ray

    cfg = plan.cfg
    run = runs.run_dir(cfg.output, cfg.run_date, run_id)
    interruptions = start_run(plan, run_id, run)
    with clock.phase("attempt"):
        attempt_id = uuid.uuid4().hex[:8]
        trusted = shards.begin_attempt(run, cfg.storage, attempt_id)
        done = shards.committed(run, cfg.storage, trusted)
    work = units.todo(plan.units, done)
    total, left = sum(u.rows for u in plan.units), sum(len(units.positions(u)) for u in work)
    pool = cluster.actor_pool(cfg.compute, ray.cluster_resources())
    a = Attempt(run_id, run, resumed, attempt_id, trusted, work, total, left, pool, interruptions=interruptions)
    log_pending(plan, a)
    with clock.phase("duplicates"):
        a.duplicates, a.checked_on = find_duplicates(plan) if total else (None, "driver")
    return a


def log_pending(plan: Plan, a: Attempt) -> None:
    log.info(
        "run %s%s: %d users in %d row groups of %s; %d already committed in %d shards, %d to decode by %s",
        a.run_id,
        " (resumed)" if a.resumed else "",
        a.total,
        len(plan.units),
        plan.cfg.input,
        a.total - a.left,
        len(a.trusted),
        a.left,
        a.pool.describe(),
    )


def find_duplicates(plan: Plan) -> tuple[pa.Table | None, str]:
    """`units.find_duplicates` over the whole input, tried again as a whole while the store fails transiently."""
    cfg = plan.cfg
    return S.retrying(
        lambda: units.find_duplicates(
            plan.units, plan.fs, cfg.runs.duplicates_driver_mb, cfg.columns.user_id, plan.data.schema, plan.names
        ),
        cfg.storage,
        f"read the user ids of {cfg.input}",
    )


def decode_pending(plan: Plan, a: Attempt, lease: Lease) -> tuple[int, cluster.Watch | None]:
    """The streaming Ray Data execution over the attempt's pending units, and in an incremental run the carry's
    beside it (pipeline/carry.py) -> (the shards they wrote, the watch of its nodes); (0, None) if none is pending."""
    if not a.work:
        return 0, None
    read = read_args(plan, a)
    if plan.base is None:
        return follow([recommend(read_pending(plan, a, read), plan, a)], a.left, plan.cfg.runs, lease)
    indexes = start_indexes(plan.base, plan.cfg.incremental.base_shards_per_task, a.work, a.total, read)
    decode = recommend(read_pending(plan, a, {**read, "lookup": Lookup(indexes.fate)}), plan, a)
    return follow([decode, carried_shards(plan, a, plan.base, indexes)], a.left, plan.cfg.runs, lease)


def read_args(plan: Plan, a: Attempt) -> dict:
    """What a read task needs (`units.read_retrying`): the input's columns the nightly reads, the duplicates, how
    to hash each row's inputs, the code it must run."""
    cfg, renderer = plan.cfg, plan.inputs.renderer
    columns = input_columns(cfg, plan.data.schema, renderer.template)
    column = cfg.decoding.exclude_column if cfg.decoding.exclude_column in columns else None
    windows = tuple((c, w) for c, w in renderer.windows.items() if c != "history")
    texts = tuple(c for c in renderer.user_columns if c not in renderer.windows)
    hashing = units.Hashing(renderer.max_items, column, cfg.decoding.exclude == "history", windows, texts)
    return {
        "fs": plan.fs,
        "columns": columns,
        "schema": plan.data.schema,
        "names": plan.names,
        "duplicates": a.duplicates,
        "hashing": hashing,
        "storage": cfg.storage,
        "uri": cfg.input,
        "code": plan.identity["code"]["sha256"],
    }


def read_pending(plan: Plan, a: Attempt, read: dict):
    """The pending units -> their rows (user_id, history and the exclusion column if present; pos; duplicates
    flagged; input_hash; in an incremental run those not carried, with `in_base`), one read task per unit."""
    import ray

    ds = ray.data.from_items(a.work)
    # Store errors: a call that still fails after storage.retry_s raises StoreUnavailable, itself (not wrapped). A read
    # task's ends the job (exit 4); a shard's is an application error Ray retries on the same actor (retry_exceptions),
    # BATCH_RETRIES times (ShardRecommender counts them). System failures (a lost node, a killed worker) are Ray
    # Data's own retries, unbounded: a restarted actor reruns its unfinished batches, a lost read task runs again.
    ds.context.raise_original_map_exception = True
    ds.context.actor_task_retry_on_errors = [S.StoreUnavailable]
    cluster.share(ds.context)
    # Ray Data fuses these read tasks with `recommend`'s repartition (same resources: 1 CPU each, cluster.READ_CPUS),
    # so every unit is read and cut into blocks by one task; the actor pool leaves that CPU free (cluster.fits)
    return ds.map_batches(
        units.read_retrying,  # a read task's process imports pipeline.units: pyarrow and storage, never torch
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={**read, "order": plan.cfg.compute.order_by_length},
    )


def recommend(ds, plan: Plan, a: Attempt):
    """Rows -> the ShardRecommender actor pool (each batch a shard it decodes, writes and commits) -> one summary row
    per shard."""
    cfg = plan.cfg
    c = cfg.compute
    # blocks of batches_per_task batches: every actor of the pool gets work, each task decodes (and commits) them
    # one batch at a time
    ds = ds.repartition(target_num_rows_per_block=c.batch_size * c.batches_per_task)
    return ds.map_batches(
        shards.ShardRecommender,
        batch_size=c.batch_size,
        batch_format="pyarrow",
        fn_constructor_kwargs={  # small, inline: the items are read by each actor (items.ItemsRef)
            "spec": replace(
                plan.spec,
                run_id=a.run_id,
                catalog=None,
                recommendable=None,
                users_per_actor=-(-a.left // a.pool.initial),
                target_sha256=plan.identity["models"]["target"],
                draft_sha256=plan.identity["models"].get("draft") or "",
                target_files=plan.identity["model_files"]["target"],
                draft_files=plan.identity["model_files"].get("draft") or "",
                **engine_auto_inputs(plan, a),
            ),
            "items": ItemsRef(
                Sources.of(cfg, plan.spec.template.item_columns), plan.identity["catalog"], plan.items.identity
            ),
            "run": a.run,
            "storage": cfg.storage,
            "attempt": a.id,
            "code": plan.identity["code"]["sha256"],
        },
        compute=a.pool.strategy(),
        **actor_resources(c),
    )


def engine_auto_inputs(plan: Plan, a: Attempt) -> dict:
    """compute.engine auto: where the run's one decision is recorded (runs.EngineRecord) and the trial users, the
    input's first engine_trial_max decode batches (the same for every actor, restart and resume) with the input's
    exclusion column if it has one (the run then decodes eager); {} otherwise."""
    c = plan.cfg.compute
    if c.engine != "auto":
        return {}
    n = c.engine_trial_max * plan.spec.warm_users
    columns = input_columns(plan.cfg, plan.data.schema, plan.spec.template)
    trial = S.retrying(
        lambda: units.head(plan.units, plan.fs, columns, n, plan.data.schema, plan.names),
        plan.cfg.storage,
        f"read {plan.cfg.input}",
    )
    return {"engine_record": runs.EngineRecord(a.run, plan.cfg.storage), "trial_users": trial}


def actor_resources(c: Compute) -> dict:
    """What each recommender actor reserves: its CPUs and, for GPU actors, its share of a GPU (fractional: several
    actors of a small model share one GPU)."""
    return {"num_cpus": c.cpus_per_actor, "num_gpus": c.gpus_per_actor or None}
