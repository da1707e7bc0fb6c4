"""What the driver sees of the Ray cluster while a run decodes: the recommender pool that fits it, the nodes that leave
and join it, what a run waits for when no shard commits, and the actor tasks Ray retried.

Node loss is Ray's to recover (Ray Data's actor pools restart a lost actor on another node, `max_restarts=-1`, and
retry its in-flight tasks there, `max_task_retries=-1`); the driver only watches and says what happened.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field

from pipeline.config import Compute, actor_range

log = logging.getLogger("genrec.nightly")

READ_CPUS = 1.0  # what the read side needs: one read task (Ray's default 1 CPU), never taken by the actor pool
RESERVATION_RATIO = 0.0  # Ray Data's op_resource_reservation_ratio: only each operator's minimum is reserved
REQUEST_EXPIRE_S = 60  # a dead driver's share of the cluster lapses after this (Ray Data's default: 180 s)
POOL_CLASS = "MapWorker"  # Ray Data's actor-pool workers: _MapWorker, the class every pool actor runs


@dataclass(frozen=True)
class Pool:
    """The recommender actor pool: Ray Data's ActorPoolStrategy(min_size, max_size, initial_size)."""

    min: int
    max: int | None  # None: as many as the cluster holds (auto)
    initial: int

    def strategy(self):
        import ray

        return ray.data.ActorPoolStrategy(min_size=self.min, max_size=self.max, initial_size=self.initial)

    def describe(self) -> str:
        return f"{self.min}..{self.max or 'the cluster'} actors, {self.initial} at start"


def share(ctx) -> None:
    """How the run shares the cluster (Ray Data's DataContext `ctx`, before the execution starts):
    - between its operators, each is reserved only its minimum (one read task; the pool's `min` actors) and the rest
      is shared: with Ray's default (half the cluster split evenly over the operators) the pool's share of a node that
      joins mid-run falls short of one actor while the reads still run, and it grows only once they are done;
    - between executions, Ray Data's AutoscalingCoordinator splits the cluster among the drivers whose resource
      requests are live; a driver renews its request every 10 s, and the request of one that died (SIGKILL, a lost
      head pod) holds its share until it expires: REQUEST_EXPIRE_S, not 180 s, so a `--resume latest` right after a
      crash can grow its pool within about a minute (the setting is read when Ray Data starts an execution; an
      operator's own RAY_DATA_AUTOSCALING_REQUEST_EXPIRE_TIME_S wins)."""
    ctx.op_resource_reservation_ratio = RESERVATION_RATIO
    os.environ.setdefault("RAY_DATA_AUTOSCALING_REQUEST_EXPIRE_TIME_S", str(REQUEST_EXPIRE_S))


def fits(c: Compute, resources: dict) -> int:
    """Actors the cluster (`resources`: ray.cluster_resources()) holds beside one read task (READ_CPUS): GPU actors by
    its GPUs (0.25 a GPU: four per GPU), every actor by its CPUs; at least one."""
    n = int((resources.get("CPU", 0) - READ_CPUS) / c.cpus_per_actor + 1e-9)
    if c.gpus_per_actor > 0:
        n = min(n, int(resources.get("GPU", 0) / c.gpus_per_actor + 1e-9))
    return max(1, n)


def actor_pool(c: Compute, resources: dict) -> Pool:
    """compute.num_actors -> the pool; N and auto can shrink to a single actor where they must: when actors that
    Ray restarted after a node loss take the CPUs the read side needs, the idle ones are released and the reads run.
    N: up to N, starting with what fits now (a resume on a smaller cluster runs on what it has); `min..max` or
    (min, max): starting with what fits now, at least min where the cluster holds it beside the reads; auto: what fits
    now, then more wherever a node joins."""
    now = fits(c, resources)
    if c.num_actors == "auto":
        return Pool(1, None, now)
    if span := actor_range(c.num_actors):
        lo, hi = span
        return Pool(min(lo, now), hi, min(now, hi))
    return Pool(1, c.num_actors, min(now, c.num_actors))


def alive_nodes() -> dict[str, dict]:
    """node id -> {"ip", "resources"} of the cluster's alive nodes."""
    import ray

    return {
        n["NodeID"]: {"ip": n["NodeManagerAddress"], "resources": n["Resources"]} for n in ray.nodes() if n["Alive"]
    }


def pool_actors(**filters) -> list:
    """The pool's actors in Ray's state API (filters: column=value); [] if the state API cannot answer."""
    from ray.util.state import list_actors

    try:
        found = list_actors(
            filters=[(k, "=", v) for k, v in filters.items()], detail=True, raise_on_missing_output=False
        )
    except Exception as e:  # the dashboard is optional: the run goes on without these details
        log.debug("Ray's state API did not answer: %s", e)
        return []
    return [a for a in found if POOL_CLASS in a.class_name]


def waiting_for() -> str:
    """What a run that commits nothing waits for: the pool's actors not alive (state and resource demands) and the
    cluster's free and total resources."""
    import ray

    waiting = [a for a in pool_actors() if a.state in ("PENDING_CREATION", "RESTARTING", "DEPENDENCIES_UNREADY")]
    actors = "; ".join(f"{a.actor_id[:8]} {a.state} needs {short(a.required_resources or {})}" for a in waiting)
    try:
        resources = (
            f"free {short(ray.available_resources())} of {short(ray.cluster_resources())}; "
            f"{len(alive_nodes())} nodes alive"
        )
    except Exception as e:  # the control plane did not answer: say so, never fail the run over it
        resources = f"the cluster's resources unknown (Ray's control plane did not answer: {e})"
    return f"{len(waiting)} pool actors not alive{': ' + actors if actors else ''}; {resources}"


def short(resources: dict) -> str:
    """{CPU: 2.0, GPU: 1.0, memory: ..., node:...} -> "CPU 2, GPU 1" (Ray's own bookkeeping resources left out)."""
    keep = {
        k: v for k, v in resources.items() if not re.match(r"(node:|memory|object_store_memory|accelerator_type)", k)
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(keep.items())) or "nothing"


def retried_tasks() -> int | None:
    """Actor tasks of the pool that Ray ran again (attempt > 0: their actor was lost, or a store error), in this job;
    None if the state API cannot answer."""
    import ray
    from ray.util.state import list_tasks

    try:
        tasks = list_tasks(
            filters=[("job_id", "=", ray.get_runtime_context().get_job_id()), ("type", "=", "ACTOR_TASK")],
            limit=10_000,  # the state API's most
            raise_on_missing_output=False,
        )
    except Exception as e:
        log.debug("Ray's state API did not answer: %s", e)
        return None
    return len({t.task_id for t in tasks if t.attempt_number > 0 and POOL_CLASS in t.name})


def stop_executions(why: BaseException) -> None:
    """Shuts down this driver's running Ray Data executions (no task is submitted after; their actor pools are
    killed), as a driver that stops early must: Ray Data has no public handle on a running execution, whose
    scheduling loop is a thread of its own (StreamingExecutor), so those threads are found and shut down."""
    import threading

    from ray.data._internal.execution.streaming_executor import StreamingExecutor

    for thread in threading.enumerate():
        if isinstance(thread, StreamingExecutor):
            try:
                thread.shutdown(force=True, exception=why)
            except Exception as e:  # stopping anyway: Ray's end of the job ends the rest
                log.warning("could not shut Ray Data's execution down: %s", e)


@dataclass
class Watch:
    """The nodes of the cluster while a run decodes: each loss (when it was seen, the pool actors on the node, when a
    restarted actor next committed a shard) and each join, logged as they happen. A control-plane error (the GCS
    restarting, a timeout) is logged once and the next poll asks again: the decode goes on without the watch."""

    nodes: dict | None = None  # node id -> {"ip", "resources"} at the last answer; None: none yet
    lost: list = field(default_factory=list)  # [{"node", "ip", "seen_at", "actors", "recovered_s"}]
    joined: list = field(default_factory=list)  # [{"node", "ip", "seen_at"}]
    unanswered: str | None = None  # the control plane's error while it does not answer

    def __post_init__(self):
        self.nodes = self.nodes if self.nodes is not None else self.look()

    def look(self) -> dict | None:
        """The alive nodes, or None (logged once per outage) when Ray's control plane does not answer."""
        try:
            nodes = alive_nodes()
        except Exception as e:
            if self.unanswered is None:
                log.warning("Ray's control plane did not answer (%s); the watch asks again every poll", e)
            self.unanswered = str(e)
            return None
        if self.unanswered is not None:
            log.info("Ray's control plane answers again")
            self.unanswered = None
        return nodes

    def poll(self, t0: float) -> None:
        """Compares the alive nodes with the last answer; logs every loss and join."""
        now_nodes, now = self.look(), time.perf_counter() - t0
        if now_nodes is None or self.nodes is None:
            self.nodes = now_nodes if now_nodes is not None else self.nodes
            return
        for node in self.nodes.keys() - now_nodes.keys():
            actors = pool_actors(node_id=node)
            self.lost.append(
                {"node": node, "ip": self.nodes[node]["ip"], "seen_at_s": round(now, 1), "actors": len(actors)}
            )
            log.warning(
                "node %s (%s) lost %.0f s into the decode, with %d pool actors: Ray restarts them where the cluster "
                "has room and runs their unfinished batches again",
                node[:12],
                self.nodes[node]["ip"],
                now,
                len(actors),
            )
        for node in now_nodes.keys() - self.nodes.keys():
            self.joined.append({"node": node, "ip": now_nodes[node]["ip"], "seen_at_s": round(now, 1)})
            log.info(
                "node %s (%s) joined %.0f s into the decode, with %s",
                node[:12],
                now_nodes[node]["ip"],
                now,
                short(now_nodes[node]["resources"]),
            )
        self.nodes = now_nodes

    def committed(self, restarted: bool, t0: float) -> None:
        """A shard committed; the first one from a restarted actor after a loss ends that loss's recovery."""
        if not restarted:
            return
        for loss in self.lost:
            if "recovered_s" not in loss:
                loss["recovered_s"] = round(time.perf_counter() - t0 - loss["seen_at_s"], 1)
                log.warning(
                    "recovered from the loss of node %s: a restarted actor committed a shard %.1f s after the loss "
                    "was seen",
                    loss["node"][:12],
                    loss["recovered_s"],
                )

    def faults(self) -> dict:
        """The manifest's `cluster`: nodes lost and joined, and the actor tasks Ray ran again."""
        return {
            "nodes_lost": self.lost,
            "nodes_joined": self.joined,
            "tasks_retried": retried_tasks() if self.lost else 0,
        }
