"""The driver's SIGTERM / SIGINT: one handler for the process (STOP), the blocks a signal waits for (publication, the
lease's release as the job ends), and the job's last line: `stopped:`, or the `error:` of the error behind Ray's
wrappers (`ray_cause`)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("genrec.nightly")


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
    Interrupted here, as a signal anywhere else is. The driver's stderr keeps to its own lines (`plain_ray_logs`)."""
    import ray

    plain_ray_logs()
    try:
        ray.init(ignore_reinit_error=True, log_to_driver=True)
        STOP.install()
    except SystemExit as e:
        if e.code not in (signal.SIGTERM, signal.SIGINT):
            raise
        STOP.received = signal.Signals(e.code).name
        raise Interrupted(e.code) from None


class NoTraceback(logging.Filter):
    """A console handler's records without their tracebacks, the message kept; none of the records Ray Data logs
    as an error leaves its API (`ray.data.exceptions`: the job's `error:` line says it, and they call any error
    that is not a UDF's own class Ray's "internal"). The record is the one every handler of its logger gets, one after
    another: this handler's filter runs after the handlers listed before it (Ray Data's log file) wrote it whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info, record.exc_text = None, None
        return record.name != "ray.data.exceptions"


def plain_ray_logs() -> None:
    """What Ray prints on the driver's stderr, beside the job's own lines: the workers' lines without colour codes
    when stderr is no terminal (RAY_COLOR_PREFIX=0, unless set), and Ray Data's console records without tracebacks:
    it logs a task's error with its remote traceback before the driver gets the error, whose one `error:` line says
    it (`ray_cause`); its log file in the Ray session's folder (logs/ray-data) keeps them."""
    import os
    import sys

    import ray.data  # noqa: F401 -- configures Ray Data's loggers, whose console handler is filtered here

    if not sys.stderr.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    for handler in logging.getLogger("ray.data").handlers:
        if type(handler).__name__ == "PlainRayHandler" and not any(isinstance(f, NoTraceback) for f in handler.filters):
            handler.addFilter(NoTraceback())


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
    if isinstance(e, Interrupted) and getattr(e, "after_publish", None):
        return f"stopped: {e}; {e.after_publish}"
    if isinstance(e, Interrupted):
        more = "" if resume else " (it decodes only what is not committed)"
        return f"stopped: {e}; {held} and the decode shut down: `--resume latest` continues the run{more}"
    if STOP.received:
        return f"stopped: {STOP.received} received while {STOP.during or 'ending'}; {held}"
    return None


def exit_stopped(e: BaseException, resume: bool, code: int) -> None:
    """The end of a run a signal stopped (its decode is shut down, its lease released): one `stopped:` line, Ray
    disconnected, then exit `code` at once. os._exit, not a return: Ray's own threads (its core worker's, Ray
    Data's) outlive a stopped execution, and one that calls into Ray while the interpreter exits aborts the process
    (SIGABRT)."""
    import sys

    import ray

    from pipeline import cluster

    print(stop_note(e, resume), file=sys.stderr)
    if ray.is_initialized():
        try:
            cluster.stop_executions(e)  # any execution a signal met outside the decode's own shutdown
            ray.shutdown()
        except Exception as err:  # exiting anyway: the cluster ends a gone driver's job itself
            print(f"ray.shutdown: {err}", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ray_cause(e: BaseException) -> BaseException:
    """The error behind Ray's wrappers, what a command's `error:` line prints and its exit code is chosen by: a task's
    RayTaskError (the class Ray raises it as, a subclass of its cause's, too), whose text is Ray's coloured task
    header and the remote traceback, -> its cause; Ray Data's UserCodeException -> the error it wraps. Anything else
    as it is."""
    import sys

    ray = sys.modules.get("ray")  # no Ray imported: no Ray error
    if ray is None:
        return e
    from ray.exceptions import RayTaskError, UserCodeException

    seen = set()
    while id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RayTaskError) and isinstance(e.cause, BaseException):
            e = e.cause
        elif isinstance(e, UserCodeException) and e.__cause__ is not None:
            e = e.__cause__
    return without_retry_context(e)


RETRY_CONTEXT = re.compile(r"\nFailed to .+ after \d+/\d+ attempts \(total backoff [\d.]+s\)\.(\n.*)?\Z", re.S)


def without_retry_context(e: BaseException) -> BaseException:
    """An error a Ray Data task raised, without what Ray Data appended to its text (its args) when its retries ran
    out: "Failed to apply UDF transform after 1/1 attempts ..." and how to configure them."""
    args = e.args
    if args and isinstance(args[0], str) and (found := RETRY_CONTEXT.search(args[0])):
        e.args = (args[0][: found.start()], *args[1:])
    elif len(args) > 1 and isinstance(args[-1], str) and RETRY_CONTEXT.fullmatch("\n" + args[-1]):
        e.args = args[:-1]
    return e


HOLD_ENV = "GENREC_TEST_HOLD_"  # tests only: GENREC_TEST_HOLD_<POINT> names a folder (`hold_for_test`)


def hold_for_test(point: str) -> None:
    """Tests only: a process that reaches `point` (BEFORE_PUBLISH: a driver about to publish; BEFORE_COMMIT and
    AFTER_COMMIT: an Iceberg commit's data files written, its snapshot committed) while GENREC_TEST_HOLD_<POINT>
    names a folder writes `held` there (its pid) and waits for `go`, so that a test can pause or kill it from
    outside at that very point."""
    folder = os.environ.get(HOLD_ENV + point)
    if folder:
        Path(folder, "held").write_text(str(os.getpid()))
        while not Path(folder, "go").exists():
            time.sleep(0.05)
