"""The nightly job: check everything on the driver (before Ray does any work), take the date's lease, then one
streaming Ray Data execution, then the manifest, _SUCCESS and publication (runs.py has the layout, shards.py the units
of work, lease.py the lease).

units (input row groups) -> read (rows not yet committed; duplicate user ids flagged) -> batches -> ShardRecommender
(actor pool, GPUs per actor from the config; each batch is a shard it writes: recommendations, rejects, then metrics,
the commit) -> one summary row per shard to the driver (progress) -> manifest -> _SUCCESS -> publish.

Nothing proportional to the number of users stays on the driver or in the object store: blocks stream through and
are written as they finish. A killed run is resumed with `resume=RUN_ID` (or "latest"): only the positions no
committed shard covers are decoded again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import hashlib
import json
import logging
import os
import queue
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs

from decoding.stats import timed
from decoding.templates import TEMPLATE_FILE, PromptTemplate, get_template, read_template
from operators.recommender import Inputs, prepare, table_schema
from operators.spec import ActorSpec
from pipeline import cluster, runs, shards, units
from pipeline import storage as S
from pipeline.config import Compute, Config, Runs
from pipeline.items import Items, ItemsRef, Sources, read_items
from pipeline.lease import Lease, LeaseLost
from pipeline.models import compile_store

log = logging.getLogger("genrec.nightly")
RESUME_FREE_COMPUTE = ("num_actors", "cpus_per_actor", "threads_per_actor", "batches_per_task", "order_by_length")
# ^ not in the rows: how the users are cut into shards and slices, never what a user gets
NODE_POLL_S = 2.0  # how often the driver compares the alive nodes with the last look


def open_input(cfg: Config) -> tuple[pads.Dataset, object, str]:
    """The histories as a pyarrow dataset; every file's footer is read here, so a corrupt file fails fast, named."""
    fs, path = S.filesystem(cfg.input, cfg.storage)
    try:
        info = S.retrying(lambda: fs.get_file_info(path), cfg.storage, f"HEAD {cfg.input}")
    except OSError as e:
        if "ACCESS_DENIED" in str(e) or "AccessDenied" in str(e):
            raise PermissionError(
                f"input {cfg.input}: the object store refused access; check the credentials in "
                "the environment and storage.endpoint"
            ) from None
        raise
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"input {cfg.input} not found")
    try:
        data = S.retrying(lambda: pads.dataset(path, filesystem=fs, format="parquet"), cfg.storage, f"LIST {cfg.input}")
    except (OSError, pa.ArrowInvalid) as e:
        raise ValueError(f"input {cfg.input}: not readable as parquet ({e})") from None
    kinds = {}  # each file's user_id type
    for fragment in data.get_fragments():
        try:
            S.retrying(fragment.ensure_complete_metadata, cfg.storage, f"read the footer of {fragment.path}")
        except (OSError, pa.ArrowInvalid) as e:
            raise ValueError(f"input file {fragment.path}: corrupt or not parquet ({e})") from None
        names = fragment.physical_schema.names
        missing = {"user_id", "history"} - set(names)
        if missing:
            raise ValueError(f"input file {fragment.path}: missing column(s) {sorted(missing)} (has {names})")
        kinds[fragment.path] = id_kind(fragment.physical_schema.field("user_id").type, fragment.path)
    if len(set(kinds.values())) > 1:
        shown = "; ".join(f"{kind} in {path}" for path, kind in sorted(kinds.items(), key=lambda x: x[1])[:4])
        raise ValueError(f"input {cfg.input}: user_id is {shown}: one kind of id in every file (an id is one user)")
    return data, fs, path


def id_kind(kind: pa.DataType, uri: str) -> str:
    """A file's user_id type -> its kind of id: integer, string or binary, what every mode keys a user by (its list,
    its duplicates, and in the sampling modes its draws: decoding/draws.py). Anything else (a float id from pandas'
    NaN, a decimal, a date, dictionary-encoded strings) is refused here, naming the type and the cast to make."""
    t = pa.types
    if t.is_integer(kind):
        return "integer"
    if t.is_string(kind) or t.is_large_string(kind):
        return "string"
    if t.is_binary(kind) or t.is_large_binary(kind) or t.is_fixed_size_binary(kind):
        return "binary"
    raise ValueError(
        f"input {uri}: column user_id is {kind}; user ids must be integers, strings or binary. Cast it where the "
        "input is written: integral floats to int64 (pandas: df.user_id.astype('int64'), after dropping the rows "
        "with no id), a decimal or date to string (df.user_id.astype(str))"
    )


def code_version() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        from importlib.metadata import version

        return f"genrec-batch {version('genrec-batch')}"


def resolve_models(cfg: Config) -> dict:
    """The models as the driver checks them, before any work -> {role: {"uri", "sha256", "dir"}} for the target, and
    the draft in the atspeed modes. A local folder is hashed; an s3:// model is checked without its weights
    (`S.model_head`: its sha256sums.json, its small files downloaded into a temporary folder, "dir", and its
    weights' sizes against their headers): the driver's node needs no room for them, and the sha256 is the same
    either way (`S.weights_fingerprint`). The actors download and verify the weights on their own nodes."""
    models = {}
    for role in ("target", "draft"):
        uri = getattr(cfg.models, role)
        if uri and (role == "target" or cfg.decoding.uses_draft):
            try:
                models[role] = model_of(uri, cfg.storage)
            except (FileNotFoundError, ValueError) as e:
                raise FileNotFoundError(f"models.{role}: {e}") from None
    return models


def model_of(uri: str, storage) -> dict:
    """One model as the driver checks it: {"uri", "sha256", "dir"} (an s3:// model's small files in a temporary
    folder, removed when the process ends; "head": that folder)."""
    if not S.is_s3(uri):
        local = S.local_model_dir(uri, "", storage)
        return {"uri": uri, "sha256": S.fingerprint(local), "dir": str(local)}
    head = tempfile.TemporaryDirectory(prefix="genrec-model-head-")
    sums = S.model_head(uri, storage, Path(head.name))
    return {"uri": uri, "sha256": S.weights_fingerprint(sums), "dir": head.name, "head": head}


def resolve_template(cfg: Config, models: dict) -> PromptTemplate:
    """The prompt template: models.template (a preset or a JSON file) or the target directory's; a draft that carries
    a template must carry the same one (it reads the target's prompts)."""
    try:
        template = get_template(cfg.models.template) if cfg.models.template else read_template(models["target"]["dir"])
    except ValueError as e:
        raise ValueError(f"models.template: {e}" if cfg.models.template else f"models.target: {e}") from None
    draft = models.get("draft", {}).get("dir")
    if draft and (Path(draft) / TEMPLATE_FILE).is_file() and read_template(draft) != template:
        raise ValueError(
            f"models.draft {cfg.models.draft}: its {TEMPLATE_FILE} differs from the target's prompt "
            "template; a draft must read the prompts its target reads"
        )
    return template


def fetch_model(uri: str, cache_dir: str, storage) -> str:
    """A model URI -> a local directory on this node (s3:// copied once per node, verified)."""
    return str(S.local_model_dir(uri, cache_dir, storage))


def actor_spec(cfg: Config, run_id: str, items: Items, template: PromptTemplate) -> ActorSpec:
    """What every actor gets: the model URIs and how to fetch them on its node, the items read once (the index and
    which of its items a list may hold), the prompt template, the decoding settings."""
    m = cfg.models
    return ActorSpec(
        run_id=run_id,
        target=m.target,
        catalog=items.table,
        catalog_name=cfg.catalog,
        recommendable=items.served,
        decoding=cfg.decoding,
        template=template,
        on_duplicate=cfg.duplicate_items,
        draft=m.draft if cfg.decoding.uses_draft else None,
        fetch=functools.partial(fetch_model, cache_dir=m.cache_dir, storage=cfg.storage),
        gpu=cfg.compute.gpus_per_actor > 0,
        dtype=cfg.compute.dtype,
        audit_users=cfg.compute.batch_size if cfg.compute.audit_users is None else cfg.compute.audit_users,
        decode_batch=cfg.compute.decode_batch,
        order_by_length=cfg.compute.order_by_length,
        threads=cfg.compute.threads_per_actor,
        engine=cfg.compute.engine,
        engine_trials=cfg.compute.engine_trials,
        engine_short_run_s=cfg.compute.engine_short_run_s,
        engine_trial_max=cfg.compute.engine_trial_max,
        engine_clear_users=cfg.compute.engine_clear_users,
        compile_cache=cfg.compute.compile_cache,
        compile_store=compile_store(cfg),
        warm_users=cfg.compute.decode_batch or cfg.compute.batch_size,
    )


def direct_spec(cfg: Config) -> ActorSpec:
    """The spec of the config's actor for a recommender built in this process (the benchmarks' direct calls)."""
    items = read_items(Sources.of(cfg), cfg.storage, record=False)
    return actor_spec(cfg, "direct", items, resolve_template(cfg, resolve_models(cfg)))


class Clock:
    """The driver's phase timings of one run, for the manifest's `timings` (`decoding.stats.timed`, as `Meter.phase`
    times a decoder's phases): `with clock.phase("attempt"):` adds the block's seconds to `seconds["attempt_s"]`.
    `started` is the wall clock when it was made (the shards' commit times are measured from it)."""

    def __init__(self):
        self.started = time.time()
        self.seconds: dict[str, float] = {}

    def phase(self, name: str):
        return timed(self.seconds, f"{name}_s")


@dataclass
class Plan:
    """A run checked on the driver, before Ray starts any work."""

    cfg: Config
    data: pads.Dataset
    fs: object  # the input's filesystem
    units: list[units.Unit]
    items: Items  # the item index, the recommendable set and the block list
    models: dict
    spec: ActorSpec  # run_id set when the run starts
    inputs: Inputs
    identity: dict  # what the decoded rows depend on, by content (`content_identity`)
    identity_s: float  # what computing it took

    @property
    def fingerprint(self) -> str:
        """What a resume must find unchanged: the config (but `runs`), the input's row groups and the content of the
        input files, the catalog, the recommendable set, the block list and the models."""
        return hashlib.sha256(json.dumps([self.config, self.identity], default=str).encode()).hexdigest()

    @property
    def config(self) -> dict:
        """The config a resume must find unchanged, as _RUN.json records it (`resume_config`)."""
        return resume_config(self.cfg.to_dict())

    def changes(self, state: dict) -> list[str]:
        """What differs between a run's recorded start (_RUN.json) and this plan, named; [] when it can resume."""
        if state.get("fingerprint") == self.fingerprint:
            return []
        old, new = state.get("identity") or {}, self.identity
        out = [
            f"input file {f}"
            for f in sorted(set(old.get("input", {})) | set(new["input"]))
            if old.get("input", {}).get(f) != new["input"].get(f)
        ]
        out += ["the input's row groups"] * (old.get("row_groups") != new["row_groups"])
        out += [f"the catalog {self.cfg.catalog}"] * (old.get("catalog") != new["catalog"])
        sources = Sources.of(self.cfg)
        out += [
            f"the {what} items ({sources.named(what)})"
            for what in ("recommendable", "blocked")
            if "items" in old and old["items"].get(what) != new["items"][what]  # a run of an older version: below
        ]
        out += [  # a model's sha256 compares only within one way of computing it (`MODEL_SHA256`)
            f"models.{r} {getattr(self.cfg.models, r)}"
            for r in sorted(set(old.get("models", {})) | set(new["models"]))
            if old.get("model_sha256") == MODEL_SHA256 and old.get("models", {}).get(r) != new["models"].get(r)
        ]
        was = {**DEFAULTS, **resume_config(state.get("config") or {})}  # a field it predates: as if at its default
        keys = sorted(k for k in set(was) | set(self.config) if was.get(k) != self.config.get(k))
        out += [f"the config ({', '.join(keys)})"] * bool(keys)
        return out or ["its recorded fingerprint (started by another version of genrec-batch)"]


def resume_config(config: dict) -> dict:
    """The part of a config (`Config.to_dict()`) that the decoded rows depend on: all but how the job runs (`runs`,
    `storage.retry_s`: a run that gave up on the store resumes with a larger budget; the pool's size and CPUs,
    RESUME_FREE_COMPUTE: a run that stalled resumes on the cluster it has)."""
    out = {k: v for k, v in config.items() if k != "runs"}
    if isinstance(out.get("storage"), dict):
        out["storage"] = {k: v for k, v in out["storage"].items() if k != "retry_s"}
    if isinstance(out.get("compute"), dict):
        out["compute"] = {k: v for k, v in out["compute"].items() if k not in RESUME_FREE_COMPUTE}
    return json.loads(json.dumps(out, default=str))


DEFAULTS = resume_config(Config().to_dict())  # top-level fields a run's recorded config may predate
MODEL_SHA256 = "weights-sha256-v2"  # how a model's sha256 is computed (S.weights_fingerprint): runs recorded otherwise
# are another version's, whose models are not compared


def content_identity(cfg: Config, data: pads.Dataset, fs, plan_units: list, models: dict, items: Items) -> dict:
    """Each input file's content identity (S3: ETag and size; locally the sha256 of its bytes), the input's row groups,
    the catalog's identity, the recommendable set's and the block list's (sha256 of their ids) and every model's
    sha256."""
    cat_fs, cat_path = S.filesystem(cfg.catalog, cfg.storage)
    rows = [(u.path, u.row_group, u.rows) for u in plan_units]
    return {
        "input": {f: S.content_id(f, fs, cfg.storage) for f in sorted(data.files)},
        "row_groups": hashlib.sha256(json.dumps(rows).encode()).hexdigest(),
        "catalog": S.content_id(cat_path, cat_fs, cfg.storage),
        "items": items.identity,
        "models": {role: m["sha256"] for role, m in models.items()},
        "model_sha256": MODEL_SHA256,
    }


def plan_run(cfg: Config) -> Plan:
    """Every check that needs no Ray: credentials, input, the items (catalog, recommendable set, block list), models,
    template, the actor's own checks, the output store's conditional writes (`S.check_conditional_writes`). A missing
    input, catalog, item set or model raises FileNotFoundError naming it ("... not found")."""
    for uri in (cfg.output, cfg.input, cfg.catalog, cfg.recommendable, cfg.blocked):
        if uri:
            S.check_access(uri, cfg.storage)
    data, fs, _ = open_input(cfg)
    items = read_items(Sources.of(cfg), cfg.storage)
    log_items(items.info)
    models = resolve_models(cfg)
    spec = actor_spec(cfg, "", items, resolve_template(cfg, models))
    heads = {m["uri"]: m["dir"] for m in models.values()}  # the driver's copies: no weights
    inputs = prepare(replace(spec, fetch=heads.__getitem__))  # what an actor would refuse fails here, before any work
    plan_units, clock = units.plan_units(data), Clock()
    with clock.phase("input_identity"):
        identity = content_identity(cfg, data, fs, plan_units, models, items)
    S.check_conditional_writes(cfg.output, cfg.storage)  # what the lease and _LATEST rest on, before the lease
    return Plan(cfg, data, fs, plan_units, items, models, spec, inputs, identity, clock.seconds["input_identity_s"])


def log_items(info: dict) -> None:
    """One line on what the lists are drawn from; a warning for ids of the recommendable set or the block list that
    the item index lacks (counted in the manifest, not fatal)."""
    log.info(
        "items: %d in the index %s; %d recommendable, %d blocked, %d not recommendable",
        info["items"],
        info["uri"],
        info["recommendable"],
        info["blocked"],
        info["not_recommendable"],
    )
    for name in ("recommendable_set", "block_list"):
        part = info[name]
        if part["unknown_ids"]:
            log.warning(
                "%s %s: %d ids the item index lacks (no semantic ID: never recommended); counted in the manifest",
                name.replace("_", " "),
                part["source"],
                part["unknown_ids"],
            )


def check_run(cfg: Config, resume: str | None = None) -> dict:
    """`--check`: every check the driver makes before the date's lease (`plan_run`: credentials, input files and
    schema, the items, the models and their checksums, the template against the catalog, an actor's own checks, the
    output store's conditional writes) and, with `resume`, which run would be resumed -> a summary. No lease, no Ray,
    nothing decoded or written (the store check's scratch objects are deleted); a failure raises as the run would."""
    plan = plan_run(cfg)
    run = None
    if resume:
        finished = finished_unpublished(plan) if resume == "latest" else None
        run = {"publishes": finished} if finished else {"resumes": resume_id(plan, resume)}
    info = plan.items.info
    return {
        "check": "passed",
        "run_date": cfg.run_date,
        "input": {"uri": cfg.input, "files": len(plan.data.files), "rows": sum(u.rows for u in plan.units)},
        "items": {k: info[k] for k in ("items", "recommendable", "blocked", "not_recommendable")},
        "models": {role: {"uri": m["uri"], "sha256": m["sha256"]} for role, m in plan.models.items()},
        "template": plan.inputs.renderer.template.name,
        "max_prompt_tokens": plan.inputs.renderer.max_len,
        "output": {"uri": cfg.output, "conditional_writes": "honoured"},
        **({"resume": run} if resume else {}),
    }


def run_nightly(cfg: Config, resume: str | None = None, plan: Plan | None = None) -> dict:
    """Runs (or, with resume = a run id or "latest", continues) the nightly job of cfg.run_date on the current Ray
    cluster (ray.init() done) -> the manifest. Raises LeaseHeld if another run holds the date, LeaseLost if this run
    lost it (or another run published the date) before publishing."""
    STOP.reset()
    plan = plan or plan_run(cfg)
    finished = finished_unpublished(plan) if resume == "latest" else None
    if finished:
        return publish_finished(plan, finished)
    run_id = resume_id(plan, resume) if resume else None
    resumed = run_id is not None
    run_id = run_id or dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    lease = Lease(runs.date_dir(cfg.output, cfg.run_date), run_id, cfg.storage, cfg.runs.lease_s, STOP.ending)
    with leased(lease, run_id):  # acquired inside: a signal that lands just after the lease was taken still releases it
        lease.acquire(resumed)
        return execute(plan, run_id, resumed, lease, runs.latest_version(cfg.output, cfg.run_date, cfg.storage))


@contextlib.contextmanager
def leased(lease: Lease, run_id: str):
    """The block holds the date's lease (it acquires it) and releases it on every way out. An error on its way out
    is the job's end: a signal then is recorded, never raised (the error keeps its exit code), and the error carries
    what became of the lease (`lease_state`, for the `stopped:` line). A store that gave out (on the driver, or in a
    task Ray retried) is its own error, unwrapped, logged before the release is tried."""
    try:
        yield lease
    except BaseException as e:
        STOP.end("releasing the run date's lease after the error above")
        down = S.unavailable(e) if isinstance(e, Exception) else None
        down = down if down is not e else None
        if down is not None:
            log.error("run %s stops: %s", run_id, down)
        (down or e).lease_state = lease.release()
        if down is not None:
            raise down from None
        raise
    finally:
        lease.release()  # a run that ended well: the same, once


def resume_id(plan: Plan, resume: str) -> str | None:
    """--resume RUN_ID: that run, which must be unfinished and started on this same config, input, catalog and models
    (else ValueError naming what changed); --resume latest: the date's newest unfinished run if it can resume, else
    None: a new run (which supersedes it when it publishes), so that a retried job always publishes the date."""
    cfg = plan.cfg
    unfinished = runs.unfinished(cfg.output, cfg.run_date, cfg.storage)
    if resume == "latest":
        if not unfinished:
            log.info("--resume latest: no unfinished run of %s; starting a new run", cfg.run_date)
            return None
        changed = plan.changes(runs.state_of(runs.run_dir(cfg.output, cfg.run_date, unfinished[0]), cfg.storage))
        if changed:
            log.warning(
                "--resume latest: run %s cannot be resumed: %s changed since it started; starting a new run "
                "(it supersedes that one when it publishes)",
                unfinished[0],
                "; ".join(changed),
            )
            return None
        return unfinished[0]
    if resume not in unfinished:
        run = runs.run_dir(cfg.output, cfg.run_date, resume)
        why = (
            "it has _SUCCESS (already complete)"
            if runs.complete(run, cfg.storage)
            else "it was superseded by a later run"
            if S.read_bytes(S.join(run, "_SUPERSEDED"), cfg.storage)
            else "not found"
        )
        raise FileNotFoundError(
            f"--resume {resume}: run {run} cannot be resumed: {why}"
            if why != "not found"
            else f"--resume {resume}: run {run} not found"
        )
    check_resumable(plan, resume, runs.state_of(runs.run_dir(cfg.output, cfg.run_date, resume), cfg.storage))
    return resume


def check_resumable(plan: Plan, run_id: str, state: dict) -> None:
    changed = plan.changes(state)
    if changed:
        run = runs.run_dir(plan.cfg.output, plan.cfg.run_date, run_id)
        raise ValueError(
            f"--resume {run_id}: {'; '.join(changed)} changed since the run started (compare "
            f"{S.join(run, '_RUN.json')}); its committed shards would mix two inputs or models. Start a "
            "new run instead (--resume latest does)"
        )


def finished_unpublished(plan: Plan) -> str | None:
    """The date's newest complete run that was never published (its driver stopped between _SUCCESS and _LATEST) and
    was started on this same config, input, catalog and models, or None."""
    cfg = plan.cfg
    for run_id in runs.complete_unpublished(cfg.output, cfg.run_date, cfg.storage):
        if not plan.changes(runs.state_of(runs.run_dir(cfg.output, cfg.run_date, run_id), cfg.storage) or {}):
            return run_id
    return None


def publish_finished(plan: Plan, run_id: str) -> dict:
    """--resume latest on a complete, unpublished run: publishes it (holding the date's lease) without decoding."""
    cfg = plan.cfg
    lease = Lease(runs.date_dir(cfg.output, cfg.run_date), run_id, cfg.storage, cfg.runs.lease_s, STOP.ending)
    with leased(lease, run_id):
        lease.acquire(True)
        latest = runs.latest_version(cfg.output, cfg.run_date, cfg.storage)
        run = runs.run_dir(cfg.output, cfg.run_date, run_id)
        manifest = json.loads(S.read_bytes(S.join(run, "manifest.json"), cfg.storage))
        log.info("--resume latest: run %s is complete but was not published; publishing it without decoding", run_id)
        lease.check()
        with STOP.deferred("publishing"):
            runs.publish(cfg.output, cfg.run_date, run_id, cfg.storage, cfg.runs.grace_s, latest)
        return manifest


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


def execute(plan: Plan, run_id: str, resumed: bool, lease: Lease, latest: str | None) -> dict:
    """Decodes what the run has not committed, writes the manifest and _SUCCESS, and publishes the run with a
    compare-and-swap of _LATEST against `latest` (its version when this run took the date's lease)."""
    clock, attempt = Clock(), None
    try:
        with clock.phase("total"), clock.phase("decode"):  # from the start, as the shards' commit times are
            attempt = start_attempt(plan, run_id, resumed, clock)
        with clock.phase("total"):
            with clock.phase("decode"):
                attempt.shards_decoded, attempt.watch = decode_pending(plan, attempt, lease)
            files, sums = tally_shards(plan, attempt, clock.started)
        manifest = manifest_of(plan, attempt, files, sums, timings(plan, clock, sums))
        publish_run(plan, attempt, manifest, lease, latest)
        return manifest
    except Interrupted as e:
        if not lease.lost:  # a fenced-out driver leaves the run's state to the driver that holds the date
            record_interruption(plan, run_id, attempt.id if attempt else None, e)
        raise


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
        lambda: units.find_duplicates(plan.units, plan.fs, cfg.runs.duplicates_driver_mb),
        cfg.storage,
        f"read the user ids of {cfg.input}",
    )


def decode_pending(plan: Plan, a: Attempt, lease: Lease) -> tuple[int, cluster.Watch | None]:
    """One streaming Ray Data execution over the attempt's pending units -> (the shards it wrote, the watch of its
    nodes); (0, None) if none is pending."""
    if not a.work:
        return 0, None
    return follow(recommend(read_pending(plan, a), plan, a), a.left, plan.cfg.runs, lease)


def read_pending(plan: Plan, a: Attempt):
    """The pending units -> their rows (user_id, history and the exclusion column if present; duplicates flagged),
    one read task per unit."""
    import ray

    cfg = plan.cfg
    ds = ray.data.from_items(a.work)
    # Store errors: a call that still fails after storage.retry_s raises StoreUnavailable, itself (not wrapped). A read
    # task's ends the job (exit 4); a shard's is an application error Ray retries on the same actor (retry_exceptions),
    # BATCH_RETRIES times (ShardRecommender counts them). System failures (a lost node, a killed worker) are Ray
    # Data's own retries, unbounded: a restarted actor reruns its unfinished batches, a lost read task runs again.
    ds.context.raise_original_map_exception = True
    ds.context.actor_task_retry_on_errors = [S.StoreUnavailable]
    cluster.share(ds.context)
    columns = input_columns(cfg, plan.data.schema)
    # Ray Data fuses these read tasks with `recommend`'s repartition (same resources: 1 CPU each, cluster.READ_CPUS),
    # so every unit is read and cut into blocks by one task; the actor pool leaves that CPU free (cluster.fits)
    return ds.map_batches(
        read_units,
        batch_size=1,
        batch_format="pyarrow",
        fn_kwargs={
            "fs": plan.fs,
            "columns": columns,
            "duplicates": a.duplicates,
            "order": cfg.compute.order_by_length,
            "storage": cfg.storage,
            "uri": cfg.input,
        },
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
                **engine_auto_inputs(plan, a),
            ),
            "items": ItemsRef(Sources.of(cfg), plan.identity["catalog"], plan.items.identity),
            "run": a.run,
            "storage": cfg.storage,
            "attempt": a.id,
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
    column = plan.cfg.decoding.exclude_column
    columns = ["user_id", "history"] + ([column] if column and column in plan.data.schema.names else [])
    trial = S.retrying(lambda: plan.data.head(n, columns=columns), plan.cfg.storage, f"read {plan.cfg.input}")
    return {"engine_record": runs.EngineRecord(a.run, plan.cfg.storage), "trial_users": trial}


def tally_shards(plan: Plan, a: Attempt, since: float) -> tuple[dict, dict]:
    """The shards this run publishes (those its attempt trusted and those it committed, nothing else) -> (every
    table's files, `shards.tally` of them); with no shard at all, empty typed recommendations and rejects tables.
    The shards must cover every input user."""
    cfg = plan.cfg
    stems = shards.attempt_shards(a.run, cfg.storage, a.trusted, a.id)
    files = {name: [f"{stem}.parquet" for stem in stems] for name in runs.TABLES}
    if not stems:
        files |= write_empty_tables(plan, a.run)
    sums = shards.tally(a.run, cfg.storage, stems, since=since)
    if sums["users_in"] != a.total:
        raise RuntimeError(
            f"run {a.run_id}: the committed shards cover {sums['users_in']} users, the input has {a.total}"
        )
    return files, sums


def write_empty_tables(plan: Plan, run: str) -> dict:
    """Empty, typed recommendations and rejects tables (a run without a shard) -> their files."""
    user_type = plan.data.schema.field("user_id").type
    for name, kind in (("recommendations", "rec"), ("rejects", "reject")):
        runs.write_table(run, name, table_schema(kind, user_type).empty_table(), plan.cfg.storage)
    return {name: [f"{name}.parquet"] for name in ("recommendations", "rejects")}


def manifest_of(plan: Plan, a: Attempt, files: dict, sums: dict, timings: dict) -> dict:
    """The run's manifest: what it read and how (config, code, models, template, catalog), what it wrote (counts,
    every table's files: readers read these, never a listing) and how it went (resume, duplicates, precision audit,
    engine, exclusions, timings)."""
    cfg, renderer = plan.cfg, plan.inputs.renderer
    return {
        "run_id": a.run_id,
        "run_date": cfg.run_date,
        "status": "succeeded",
        "config": cfg.to_dict(),
        "actors": {
            "count": len(sums["compute_actors"]) or a.pool.initial,
            "pool": asdict(a.pool),
            **actor_resources(cfg.compute),
        },
        "cluster": a.watch.faults() if a.watch else {"nodes_lost": [], "nodes_joined": [], "tasks_retried": 0},
        "code_version": code_version(),
        "models": {role: {"uri": m["uri"], "sha256": m["sha256"]} for role, m in plan.models.items()},
        "template": renderer.template.to_dict(),
        "max_prompt_tokens": renderer.max_len,
        "prefix_tokens": len(renderer.prefix_ids),
        "auto": sums["auto"],
        "catalog": catalog_info(plan),
        "counts": {"input_rows": a.total, **{key: sums[key] for key in COUNTS}},
        "resume": resume_info(a),
        "duplicates": {"users": 0 if a.duplicates is None else a.duplicates.num_rows, "checked_on": a.checked_on},
        "precision_audit": sums["precision_audit"],
        "engine": {
            "name": cfg.compute.engine,
            "graphs_compiled": sums["graphs_compiled"],
            "graphs_cold": sums["graphs_cold"],
            "compile_store": plan.spec.compile_store.root if plan.spec.compile_store else None,
            "decision": runs.EngineRecord(a.run, cfg.storage).read() if cfg.compute.engine == "auto" else None,
        },
        "exclusions": exclusions_summary(cfg, plan.data.schema, sums["exclusions"]),
        "timings": timings,
        "outputs": {name: runs.table_dir(a.run, name) for name in runs.TABLES},
        "files": files,
    }


COUNTS = ("users_ok", "users_short", "users_rejected", "users_non_finite", "recommendations", "batches", "decode_batch")


def catalog_info(plan: Plan) -> dict:
    """The manifest's `catalog`: the item index, the recommendable set and the block list (`items.describe`: sources,
    sizes, content hashes, the index's partition into recommendable, blocked and not recommendable items), the items
    the constraint index holds, and the duplicate-semantic-ID policy with the items it dropped."""
    catalog = plan.inputs.catalog
    return {
        **{key: value for key, value in plan.items.info.items() if key != "sets"},
        "indexed": len(catalog),
        "duplicates": {
            "policy": plan.cfg.duplicate_items,
            "dropped": len(catalog.duplicates),
            "items": [{"item_id": d, "kept": k} for d, k in catalog.duplicates],
        },
    }


def resume_info(a: Attempt) -> dict:
    """The manifest's `resume`: whether the run was resumed, the shards committed before this attempt and after."""
    return {
        "resumed": a.resumed,
        "shards_committed_before": len(a.trusted),
        "shards_decoded": a.shards_decoded,
        "users_decoded": a.left,
        "interruptions": a.interruptions,  # earlier attempts stopped by SIGTERM / SIGINT
    }


def timings(plan: Plan, clock: Clock, sums: dict) -> dict:
    """The manifest's `timings` in seconds: the driver's phases (`clock`, `plan_run`'s) and the actors' (from the
    shards' metrics, since `clock.started`)."""
    return {
        "input_identity_s": plan.identity_s,  # the input files' content identities (plan_run)
        "attempt_s": clock.seconds["attempt_s"],  # this attempt recorded, the trusted shards' ranges read
        "duplicates_s": clock.seconds["duplicates_s"],  # the duplicate user ids found
        "actor_ready_s": sums["actor_ready_s"],  # models loaded
        "first_shard_s": sums["first_commit_s"],
        "compile_s": sums["compile_s"],  # per actor: the compiled engine's warm-up and compiles
        "decode_s": clock.seconds["decode_s"],  # from the start until the last shard committed
        "total_s": clock.seconds["total_s"],  # until the manifest
    }


HOLD_ENV = (
    "GENREC_TEST_HOLD_BEFORE_PUBLISH"  # tests only: a folder; the driver writes `held` there, then waits for `go`
)


def hold_for_test() -> None:
    """Tests only (HOLD_ENV): a driver that reached publication signals it and waits, so that a test can pause it
    from outside (SIGSTOP) at that very point."""
    folder = os.environ.get(HOLD_ENV)
    if folder:
        Path(folder, "held").write_text(str(os.getpid()))
        while not Path(folder, "go").exists():
            time.sleep(0.05)


def publish_run(plan: Plan, a: Attempt, manifest: dict, lease: Lease, latest: str | None) -> None:
    """Checks the date's lease, writes the manifest and _SUCCESS (each created only if absent: no second writer
    replaces them), checks the lease again and publishes the run, deleting the runs it superseded past their grace.
    A run that lost the date never writes its manifest over another's, nor publishes."""
    cfg = plan.cfg
    hold_for_test()
    lease.check()
    runs.finish(a.run, manifest, cfg.storage, lease.check)
    lease.check()
    with STOP.deferred("publishing"):  # published, then stopped: the run is done, exit 0
        deleted = runs.publish(cfg.output, cfg.run_date, a.run_id, cfg.storage, cfg.runs.grace_s, latest)
    log.info(
        "run %s published: %s; deleted superseded runs %s", a.run_id, json.dumps(manifest["counts"]), deleted or "none"
    )


def read_units(batch: pa.Table, storage, uri: str, **kwargs) -> pa.Table:
    """units.read_units with its reads tried again as a whole while the store fails transiently."""
    return S.retrying(lambda: units.read_units(batch, **kwargs), storage, f"read {uri}")


def input_columns(cfg: Config, schema: pa.Schema) -> list[str]:
    """The input columns the actors read: user_id, history and the exclusion column when the input has it."""
    return ["user_id", "history"] + (
        [cfg.decoding.exclude_column] if cfg.decoding.exclude_column in schema.names else []
    )


def exclusions_summary(cfg: Config, schema: pa.Schema, sums: dict) -> dict:
    """The manifest's `exclusions`: the mode, the exclusion column (None: not in the input), the users they were built
    for, the excluded items per user (distinct items the index holds: mean and max) and the ignored unknown ids."""
    users = sums["exclude_users"]
    return {
        "mode": cfg.decoding.exclude,
        "column": cfg.decoding.exclude_column if cfg.decoding.exclude_column in schema.names else None,
        "users": users,
        "excluded_per_user_mean": sums["excluded_items"] / users if users else 0.0,
        "excluded_per_user_max": sums["excluded_max"],
        "unknown_ids_ignored": sums["exclude_unknown_ids"],
    }


def actor_resources(c: Compute) -> dict:
    """What each recommender actor reserves: its CPUs and, for GPU actors, its share of a GPU (fractional: several
    actors of a small model share one GPU)."""
    return {"num_cpus": c.cpus_per_actor, "num_gpus": c.gpus_per_actor or None}


class Stalled(Exception):
    """No shard committed for runs.stall_exit_s: the job stops (exit 5) and releases the lease; a resume, perhaps with
    another compute.num_actors, decodes the rest."""


class Interrupted(BaseException):
    """SIGTERM (`ray job stop`, a pod's eviction) or SIGINT reached the driver: it stops the decode, records the
    interruption in the run's state and releases the lease on its way out. A BaseException, as KeyboardInterrupt is,
    so that no `except Exception` on the way (a retried store call, the state API's) swallows it."""

    def __init__(self, signum: int):
        self.signal = signal.Signals(signum).name
        super().__init__(f"{self.signal} received")


@dataclass
class Stop:
    """The driver's SIGTERM / SIGINT handler (`install`, in the main thread): the first signal raises Interrupted in
    the main thread, at once, wherever it waits; from `deferred` (publication: _LATEST and the markers) on it never
    does: a published run ends as it would have (its lease released, its summary printed, exit 0). Later signals
    are logged and ignored, so that the clean-up they interrupt finishes."""

    received: str | None = None  # the first signal's name
    deferring: str | None = None  # the block a signal waits for
    pending: int | None = None
    during: str | None = None  # what the first signal met, when a block held it (the job's end reports it)

    def install(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self.handle)

    def handle(self, signum: int, frame) -> None:
        if self.received:
            log.warning("%s received while stopping: ignored", signal.Signals(signum).name)
            return
        if self.deferring:
            log.warning("%s received while %s: stopping once that is done", signal.Signals(signum).name, self.deferring)
            self.pending, self.received, self.during = signum, signal.Signals(signum).name, self.deferring
            return
        self.received = signal.Signals(signum).name
        raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self, what: str):
        self.deferring = what
        try:
            yield
        except BaseException:
            self.deferring = None  # not published: a signal stops the driver again
            raise
        self.deferring = f"ending after {what}"  # published: the rest of the run's end is never interrupted
        if self.pending is not None:
            name = signal.Signals(self.pending).name
            log.warning("%s received while %s, which is done: the job ends as it would have", name, what)

    @contextlib.contextmanager
    def ending(self, what: str):
        """Signals wait while the block runs and never raise (the lease's release as the job ends: the error already
        on its way keeps its exit code); one that came is recorded for the job's end to report (`stop_note`).
        Inside another deferral (publication's, an error's) that one decides."""
        if self.deferring is not None:
            yield
            return
        self.deferring = what
        try:
            yield
        finally:
            self.deferring = None

    def end(self, what: str) -> None:
        """From now on the driver is ending (an error on its way out): a signal is recorded, never raised."""
        self.deferring = self.deferring or what

    def reset(self) -> None:
        """A new run in this process: no deferral left from an earlier one (a signal received stays received)."""
        self.deferring = self.pending = None


STOP = Stop()  # the process's one handler (jobs/nightly.py installs it)


def connect_ray() -> None:
    """ray.init (RAY_ADDRESS / a running cluster, else a local one), then the driver's handler again: ray.init puts
    its own SIGTERM handler in place (sys.exit(signum)), so a SIGTERM while it runs is Ray's SystemExit, made
    Interrupted here, as a signal anywhere else is."""
    import ray

    try:
        ray.init(ignore_reinit_error=True, log_to_driver=True)
        STOP.install()
    except SystemExit as e:
        if e.code not in (signal.SIGTERM, signal.SIGINT):
            raise
        STOP.received = signal.Signals(e.code).name
        raise Interrupted(e.code) from None


def stop_note(e: BaseException, resume: bool) -> str | None:
    """The job's `stopped:` line: for a run a signal stopped (Interrupted), or one whose end a signal met after
    another error (that error keeps its exit code); None when no signal came. It says whether the date's lease was
    released."""
    held = {
        "none": "no lease was taken",
        "released": "the lease is released",
        "held": "the lease could not be released: it stays held until it expires (runs.lease_s), then `--resume "
        "latest` takes it over",
        "unknown": "the lease may be held (a put of it was cut short and the store could not be asked): it expires "
        "after runs.lease_s, then `--resume latest` takes it over",
    }[getattr(e, "lease_state", "none")]
    if isinstance(e, Interrupted):
        more = "" if resume else " (it decodes only what is not committed)"
        return f"stopped: {e}; {held} and the decode shut down: `--resume latest` continues the run{more}"
    if STOP.received:
        return f"stopped: {STOP.received} received while {STOP.during or 'ending'}; {held}"
    return None


def stream(ds) -> queue.Queue:
    """The execution's summary rows, consumed by a thread of their own -> a queue of tables, then None (the end) or
    the exception that ended it: the driver keeps watching while nothing commits."""
    rows: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                rows.put(batch)
            rows.put(None)
        except BaseException as e:  # handed to the driver's thread, which raises it
            rows.put(e)

    threading.Thread(target=pump, name="genrec-shards", daemon=True).start()
    return rows


@dataclass
class Progress:
    """What `follow` has seen of a decode (times: perf_counter): it logs users done / total, users/s and an ETA every
    runs.progress_s; when no shard has committed for runs.stall_s, what the run waits for, again every stall_s; it
    raises Stalled past runs.stall_exit_s."""

    total: int
    r: Runs
    t0: float = field(default_factory=time.perf_counter)
    users: int = 0
    shards: int = 0

    def __post_init__(self):
        self.last_commit = self.last_said = self.last_logged = self.t0

    def committed(self, batch: pa.Table, now: float) -> None:
        self.users += int(pc.sum(batch["users_in"]).as_py() or 0)
        self.shards += batch.num_rows
        self.last_commit = now

    def check(self, now: float) -> None:
        idle, r = now - self.last_commit, self.r
        if idle >= r.stall_exit_s:
            raise Stalled(
                f"no shard committed for {idle:.0f} s (runs.stall_exit_s = {r.stall_exit_s:g}), "
                f"{self.users} of {self.total} users decoded: {cluster.waiting_for()}"
            )
        if idle >= r.stall_s and now - self.last_said >= r.stall_s:
            self.last_said = now
            log.warning("no shard committed for %.0f s; waiting for: %s", idle, cluster.waiting_for())
        if now - self.last_logged >= r.progress_s:
            self.last_logged, rate = now, self.users / (now - self.t0)
            eta = (self.total - self.users) / rate if rate > 0 else float("inf")
            log.info(
                "progress: %d / %d users (%.1f%%), %.1f users/s, ETA %.0f s",
                self.users,
                self.total,
                100 * self.users / max(self.total, 1),
                rate,
                eta,
            )


def next_summary(rows: queue.Queue):
    """The next summary row from `stream` (None: the end), False after a second without one; raises what ended it."""
    try:
        batch = rows.get(timeout=1.0)
    except queue.Empty:
        return False
    if isinstance(batch, BaseException):
        raise batch
    return batch


def follow(ds, total: int, r: Runs, lease: Lease) -> tuple[int, cluster.Watch]:
    """Streams the execution: one summary row per written shard, logged as `Progress`; every node lost or joined and
    each loss's recovery (`cluster.Watch`). Raises Stalled (`Progress`), LeaseLost if the lease is lost, Interrupted
    on a signal, having shut the execution down first (no task is submitted after) -> (shards written, the watch)."""
    p = Progress(total, r)
    last_poll = p.t0
    try:
        rows, watch = stream(ds), cluster.Watch()  # inside: a signal while they start shuts the execution down too
        while (batch := next_summary(rows)) is not None:
            now = time.perf_counter()
            if batch is not False:
                p.committed(batch, now)
                watch.committed(any(batch["restarted"].to_pylist()), p.t0)
            if lease.lost:
                raise LeaseLost(lease.lost)
            if now - last_poll >= NODE_POLL_S:
                last_poll = now
                watch.poll(p.t0)
            p.check(now)
    except BaseException as e:
        cluster.stop_executions(e)
        raise
    log.info("decoded %d users in %d shards, %.1f s", p.users, p.shards, time.perf_counter() - p.t0)
    return p.shards, watch


def collect_garbage(cfg: Config) -> list[str]:
    """`--gc`: deletes the runs of every date superseded more than runs.grace_s ago."""
    return runs.collect(cfg.output, cfg.storage, cfg.runs.grace_s)
