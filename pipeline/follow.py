"""The driver following a decode: the executions' summary rows streamed on threads of their own, progress and ETA,
what a stalled run waits for, the nodes lost and joined, the lease; a stop shuts the execution down first."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from pipeline import cluster
from pipeline.config import Runs
from pipeline.lease import Lease, LeaseLost

log = logging.getLogger("genrec.nightly")


NODE_POLL_S = 2.0  # how often the driver compares the alive nodes with the last look


class Stalled(Exception):
    """No shard committed for runs.stall_exit_s: the job stops (exit 5) and releases the lease; a resume, perhaps with
    another compute.num_actors, decodes the rest."""


def stream(executions: list, stopped: threading.Event) -> queue.Queue:
    """The executions' summary rows (each a Ray Data dataset, or a function of `stopped` that returns one once its
    inputs are ready, None if stopped first), each execution consumed by a thread of its own -> a queue of tables,
    then None (every execution ended) or the first exception that ended one: the driver keeps watching while nothing
    commits.
    Once `stopped` is set, a thread leaves its execution at its next row (one that started late is shut down so)."""
    rows: queue.Queue = queue.Queue()
    left = [len(executions)]
    lock = threading.Lock()

    def pump(ds) -> None:
        try:
            ds = ds(stopped) if callable(ds) else ds  # an execution that waits for its inputs first (None: stopped)
            if ds is None or stopped.is_set():
                return
            for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                if stopped.is_set():
                    return
                rows.put(batch)
        except BaseException as e:  # handed to the driver's thread, which raises it
            rows.put(e)
            return
        with lock:
            left[0] -= 1
            if not left[0]:
                rows.put(None)

    for i, ds in enumerate(executions):
        threading.Thread(target=pump, args=(ds,), name=f"genrec-shards-{i}", daemon=True).start()
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


def follow(executions: list, total: int, r: Runs, lease: Lease) -> tuple[int, cluster.Watch]:
    """Streams the executions (Ray Data datasets): one summary row per written shard, logged as `Progress`; every
    node lost or joined and each loss's recovery (`cluster.Watch`). Raises Stalled (`Progress`), LeaseLost if the
    lease is lost, Interrupted on a signal, having shut the executions down first (no task is submitted after) ->
    (shards written, the watch)."""
    p, stopped = Progress(total, r), threading.Event()
    last_poll = p.t0
    try:
        # inside: a signal while they start shuts the executions down too
        rows, watch = stream(executions, stopped), cluster.Watch()
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
        stopped.set()
        cluster.stop_executions(e)
        raise
    log.info("decoded %d users in %d shards, %.1f s", p.users, p.shards, time.perf_counter() - p.t0)
    return p.shards, watch
