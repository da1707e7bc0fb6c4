"""The nightly job, its stages strung together: the plan (plan.py: every check on the driver, before Ray does any
work), the date's lease (lease.py), one attempt's streaming Ray Data execution (attempt.py, followed by follow.py),
then the manifest, _SUCCESS and publication (publish.py); signals.py stops it cleanly at any point.

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
import json
import logging
import time
import uuid

from pipeline import runs, signals
from pipeline import storage as S
from pipeline.attempt import decode_pending, record_interruption, start_attempt
from pipeline.carry import BaseGone
from pipeline.config import Config
from pipeline.lease import Lease
from pipeline.plan import Clock, Plan, finished_unpublished, plan_run, resume_id
from pipeline.publish import manifest_of, publish_run, tally_shards, timings
from pipeline.signals import Interrupted, ray_cause

log = logging.getLogger("genrec.nightly")


def check_run(cfg: Config, resume: str | None = None) -> dict:
    """`--check`: every check the driver makes before the date's lease (`plan_run`: credentials, input files and
    schema, the items, the models and their checksums, the template against the catalog, an actor's own checks, the
    output store's conditional writes) and, with `resume`, which run would be resumed -> a summary. No lease, no Ray,
    nothing decoded or written (the store check's scratch objects are deleted); a failure raises as the run would."""
    plan = plan_run(cfg, resume)
    run = None
    if resume:
        finished = finished_unpublished(plan) if resume == "latest" else None
        run = {"publishes": finished} if finished else {"resumes": resume_id(plan, resume)}
    info = plan.items.info
    return {
        "check": "passed",
        "run_date": cfg.run_date,
        "input": {
            "uri": cfg.input,
            **({"version": plan.input_version} if plan.input_version is not None else {}),
            "files": len(plan.data.files),
            "rows": sum(u.rows for u in plan.units),
        },
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
    signals.STOP.reset()
    plan = plan or plan_run(cfg, resume)
    finished = finished_unpublished(plan) if resume == "latest" else None
    if finished:
        return publish_finished(plan, finished)
    run_id = resume_id(plan, resume) if resume else None
    resumed = run_id is not None
    run_id = run_id or dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    lease = Lease(runs.date_dir(cfg.output, cfg.run_date), run_id, cfg.storage, cfg.runs.lease_s, signals.STOP.ending)
    with leased(lease, run_id):  # acquired inside: a signal that lands just after the lease was taken still releases it
        lease.acquire(resumed)
        with pinned_base(plan, run_id):
            return execute(plan, run_id, resumed, lease, runs.latest_version(cfg.output, cfg.run_date, cfg.storage))


@contextlib.contextmanager
def pinned_base(plan: Plan, run_id: str):
    """An incremental run's base pinned against deletion (`runs.pin`) while the block runs, then unpinned; a base
    gone since the plan found it raises BaseGone (exit 2)."""
    base, cfg = plan.base, plan.cfg
    if base is None:
        yield
        return
    pin = runs.pin(base.uri, f"{cfg.run_date}_{run_id}", time.time() + cfg.incremental.pin_s, cfg.storage)
    try:
        if not runs.complete(base.uri, cfg.storage):
            raise BaseGone(f"incremental base {base.uri}: deleted since this run planned to carry from it; rerun")
        yield
    finally:
        try:
            S.delete_files(pin.rpartition("/")[0], [pin.rpartition("/")[2]], cfg.storage)
        except Exception as e:  # the pin expires by itself (incremental.pin_s)
            log.warning("run %s: could not unpin its base %s (%s); the pin expires by itself", run_id, base.uri, e)


@contextlib.contextmanager
def leased(lease: Lease, run_id: str):
    """The block holds the date's lease (it acquires it) and releases it on every way out. An error on its way out
    is the job's end: a signal then is recorded, never raised (the error keeps its exit code), and the error carries
    what became of the lease (`lease_state`, for the `stopped:` line). A store that gave out (on the driver, or in a
    task Ray retried) is its own error, unwrapped, logged before the release is tried."""
    try:
        yield lease
    except BaseException as e:
        signals.STOP.end("releasing the run date's lease after the error above")
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


def publish_finished(plan: Plan, run_id: str) -> dict:
    """--resume latest on a complete, unpublished run: publishes it (holding the date's lease) without decoding."""
    cfg = plan.cfg
    lease = Lease(runs.date_dir(cfg.output, cfg.run_date), run_id, cfg.storage, cfg.runs.lease_s, signals.STOP.ending)
    with leased(lease, run_id):
        lease.acquire(True)
        latest = runs.latest_version(cfg.output, cfg.run_date, cfg.storage)
        run = runs.run_dir(cfg.output, cfg.run_date, run_id)
        manifest = json.loads(S.read_bytes(S.join(run, "manifest.json"), cfg.storage))
        log.info("--resume latest: run %s is complete but was not published; publishing it without decoding", run_id)
        lease.check()
        with signals.STOP.deferred("publishing"):
            runs.publish(cfg.output, cfg.run_date, run_id, cfg.storage, cfg.runs.grace_s, latest)
        return manifest


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


class ExportFailed(Exception):
    """The run is published, but its export to the serving store failed (exit 7): `genrec-batch export` retries it;
    readers of the store still see the version before."""


class TableCommitFailed(Exception):
    """The run is published, but its commit to the table failed (exit 8): `genrec-batch export RUN --to URI` retries
    it; the table's readers still see the date's rows before."""


SINK_STEPS = (("table", TableCommitFailed), ("serving", ExportFailed))  # after the publish, in this order: each
# config section naming a sink (pipeline/stores), and what its failure raises (exit 8, exit 7)


def to_sink(cfg: Config, manifest: dict, section: str) -> dict | None:
    """A published run committed to the sink the config's `section` names (`stores.sink`, by its URI) -> what the
    commit did (its record); None when the section names none. A run superseded since it published is not committed
    (the record says `skipped`: its successor commits itself), never an error. Any failure raises the section's
    failure (SINK_STEPS) naming the run, the store, the cause and the command that retries it."""
    from pipeline import stores
    from pipeline.output import open_run

    target, failure = getattr(cfg, section), dict(SINK_STEPS)[section]
    if not target.uri:
        return None
    sink = stores.sink(target.uri)
    run = runs.run_dir(cfg.output, cfg.run_date, manifest["run_id"])
    try:
        return sink.commit_run(open_run(run, cfg.storage, allow_unpublished=True), target).record()
    except Exception as e:
        raise failure(
            f"run {manifest['run_id']} is published, its commit to the {sink.NAME} {sink.shown(target.uri)} failed: "
            f"{ray_cause(e)}. Readers of the {sink.NAME} see {sink.BEFORE}. Retry: {retry_command(cfg, run, section)}"
        ) from e


def retry_command(cfg: Config, run: str, section: str) -> str:
    """The command that commits a published run to the sink of `section` (what the nightly's step does)."""
    from pipeline import stores

    target = getattr(cfg, section)
    sink = stores.sink(target.uri)
    return " ".join(
        x for x in ("genrec-batch export", run, "--to", sink.shown(target.uri), sink.export_flags(target)) if x
    )


def after_publish(cfg: Config, manifest: dict) -> dict:
    """A published run committed to each sink the config names (SINK_STEPS: the table, then the serving store) ->
    {"table": ..., "serving": ...} (the ones configured). All are tried; then the first failure is raised
    (TableCommitFailed, exit 8; ExportFailed, exit 7), the run staying published."""
    done, failed = {}, []
    for section, _ in SINK_STEPS:
        try:
            record = to_sink(cfg, manifest, section)
        except (TableCommitFailed, ExportFailed) as e:
            log.error("%s", e)
            failed.append(e)
            continue
        except Interrupted as e:  # exit 6, its `stopped:` line saying what is left (signals.stop_note)
            e.after_publish = f"run {manifest['run_id']} is published; {undone(cfg, manifest, section)}"
            raise
        if record is not None:
            done[section] = record
    if len(failed) == 2:
        raise TableCommitFailed(f"{failed[0]}; and {failed[1]}") from failed[0]  # exit 8, both causes named
    if failed:
        raise failed[0]
    return done


def undone(cfg: Config, manifest: dict, step: str) -> str:
    """What a signal left undone after the publish, from `step` on, with the commands that do it."""
    run = runs.run_dir(cfg.output, cfg.run_date, manifest["run_id"])
    sections = [section for section, _ in SINK_STEPS]
    left = [retry_command(cfg, run, s) for s in sections[sections.index(step) :] if getattr(cfg, s).uri]
    return "nothing is left to do" if not left else "left to do (not a resume): " + "; ".join(left)


def collect_garbage(cfg: Config) -> list[str]:
    """`--gc`: deletes the runs of every date superseded more than runs.grace_s ago."""
    return runs.collect(cfg.output, cfg.storage, cfg.runs.grace_s)


def exit_code(e: Exception) -> int | None:
    """The documented exit code of an error (docs/nightly.md#exit-codes; one a Ray task raised: its `ray_cause`),
    None for anything else (a traceback, 1)."""
    from pipeline.follow import Stalled
    from pipeline.lease import LeaseHeld, LeaseLost
    from pipeline.storage import NodeDenied, StoreUnavailable

    codes = [
        ((LeaseHeld, LeaseLost), 3),
        ((NodeDenied,), 9),
        ((FileNotFoundError, ValueError, PermissionError), 2),
        ((StoreUnavailable,), 4),
        ((Stalled,), 5),
        ((ExportFailed,), 7),
        ((TableCommitFailed,), 8),
    ]
    return next((code for kinds, code in codes if isinstance(e, kinds)), None)
