"""The nightly on a real multi-node Ray cluster, nodes lost and joined from outside: a head with 0 CPUs and worker
nodes of 2 CPUs, each its own `ray start` on loopback (own ports, temp dir and HOME, so its own model cache), token
authentication on; input, catalog and model on SeaweedFS; `python -m jobs.nightly` as its own process.

- A worker node SIGKILLed mid-run (raylet, agents and workers at once): Ray restarts its actors on the other node and
  runs their unfinished batches again; the job publishes by itself, every user once, and logs the loss and recovery.
- A killed run resumed on a cluster that has shrunk: an actor that can never be placed makes it exit 5 saying what
  it waits for; resumed with what fits, it publishes.
- A node that joins mid-run gets an actor of an autoscaling pool (`compute.num_actors=auto`).
The timings are printed (`pytest -s`)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from pipeline import runs
from pipeline import storage as S
from pipeline.storage import Storage
from tests.servers import ray_head, ray_worker, seaweedfs
from tests.test_nightly import make_world
from tests.test_store_faults import Driver, committed, published_once, wait_committed

USERS, K, BATCH = 400, 5, 8  # as test_store_faults (its helpers check every user once): 50 shards
DATE = "2026-11-21"
# the GCS declares a silent node dead after 5 missed checks 2 s apart (Ray's defaults: 3 s apart, each with a 10 s
# timeout), so the lost node costs the suite less waiting; the path is the same
HEALTH_CHECK = {
    "RAY_health_check_period_ms": "2000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SeaweedFS holding input, catalog and the target model, and a Ray head with no CPUs (workers join per test)."""
    root = tmp_path_factory.mktemp("cluster")
    world = make_world(root / "world", n_users=USERS)
    saved = dict(os.environ)
    try:
        with seaweedfs(root / "s3") as s3, ray_head(root / "ray", num_cpus=0, env={**s3.env(), **HEALTH_CHECK}) as head:
            os.environ.update({**s3.env(), **head.env()})  # the workers' environment; this process reads the outputs
            client = s3.client()
            for name in ("test.parquet", "items.parquet"):
                client.upload_file(str(world / "data" / name), s3.bucket, f"data/{name}")
            S.upload_model_dir(str(world / "target"), s3.uri("models", "target"), Storage(endpoint=s3.endpoint))
            yield world, s3, head, root
    finally:
        os.environ.clear()
        os.environ.update(saved)


def settings(world, s3, out: str, *extra) -> list[str]:
    return [
        f"input={s3.uri('data', 'test.parquet')}",
        f"catalog={s3.uri('data', 'items.parquet')}",
        f"output={s3.uri(out)}",
        f"storage.endpoint={s3.endpoint}",
        f"models.target={s3.uri('models', 'target')}",
        f"models.cache_dir={world / 'driver-cache'}",  # the driver's; each worker's is under its own HOME
        f"decoding.k={K}",
        f"compute.batch_size={BATCH}",
        "compute.batches_per_task=1",
        "compute.threads_per_actor=1",
        f"run_date={DATE}",
        "runs.progress_s=5",
        "runs.lease_s=10",
        *extra,
    ]


def pool_nodes(head, states=("ALIVE",)) -> list[str]:
    """The node of each of the pool's actors in one of `states` (the state API keeps dead ones), from the head's state
    API over HTTP with this head's token (the state SDK would send the token this process cached for an earlier local
    Ray)."""
    request = urllib.request.Request(
        f"{head.dashboard_url}/api/v0/actors?limit=10000&detail=1", headers={"Authorization": f"Bearer {head.token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as r:
        actors = json.loads(r.read())["data"]["result"]["result"]
    return [a["node_id"] for a in actors if a["state"] in states and "MapWorker" in a["class_name"]]


def on(worker, nodes: list[str]) -> int:
    """How many of the pool's actors are on the worker node."""
    return nodes.count(worker.node_id)


def wait_until(check, driver: Driver, what: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert driver.proc.poll() is None, f"the run ended before {what}:\n{driver.tail()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s:\n{driver.tail()}"
        time.sleep(0.5)
    return found


def test_a_lost_node_costs_a_retry_not_the_run(cluster):
    """Two worker nodes, two actors; once 6 shards are committed the node with the most actors is SIGKILLed. The job
    publishes by itself (exit 0), every user once; the driver logged the loss (which node, its actors) and the
    recovery (a restarted actor committing a shard), the manifest counts the tasks Ray ran again."""
    world, s3, head, root = cluster
    out = "lost"
    with ray_worker(head, root / "w1") as w1, ray_worker(head, root / "w2") as w2:
        start = time.monotonic()
        driver = Driver(head, s3, settings(world, s3, out, "compute.num_actors=2"))
        wait_committed(s3, out, 6, driver)
        nodes = wait_until(lambda: pool_nodes(head), driver, "alive actor")
        victim = max((w1, w2), key=lambda w: on(w, nodes))
        before = committed(s3, out)
        victim.kill()
        killed = time.monotonic()
        driver.wait_for("recovered from the loss of node")
        recovered = time.monotonic()
        rc, stdout, log = driver.finish()
        total = time.monotonic() - start
    assert rc == 0, log[-4000:]
    _, manifest = published_once(world, s3, out)
    faults = manifest["cluster"]
    assert len(faults["nodes_lost"]) == 1 and faults["nodes_lost"][0]["actors"] >= 1, faults
    assert faults["nodes_lost"][0]["recovered_s"] is not None
    assert faults["tasks_retried"] is None or faults["tasks_retried"] >= 1, faults
    assert re.search(r"node \w+ \([\d.]+\) lost \d+ s into the decode, with \d+ pool actors", log), log[-3000:]
    print(
        f"\nnode loss: killed after {before} of {USERS // BATCH} shards; the driver saw it "
        f"{faults['nodes_lost'][0]['seen_at_s']:.0f} s into the decode; a restarted actor committed "
        f"{recovered - killed:.1f} s after the kill; {faults['tasks_retried']} actor tasks retried; "
        f"decode {manifest['timings']['decode_s']:.1f} s, total {total:.1f} s"
    )


def test_a_resume_on_a_shrunken_cluster_says_what_it_waits_for_then_publishes(cluster):
    """A run on two nodes is killed (its driver SIGKILLed) once 4 shards are committed and one node is gone. Resumed
    with actors of 4 CPUs, which no 2-CPU node can place, it exits 5 after runs.stall_exit_s, having said what it waits
    for, and releases the lease; resumed with the defaults, it starts with what fits (1 actor) and publishes."""
    world, s3, head, root = cluster
    out = "shrunk"
    with ray_worker(head, root / "s1"):
        with ray_worker(head, root / "s2"):
            driver = Driver(head, s3, settings(world, s3, out, "compute.num_actors=3"))
            wait_committed(s3, out, 4, driver)
            os.killpg(driver.proc.pid, signal.SIGKILL)
            driver.proc.wait()
        stalled = Driver(
            head,
            s3,
            settings(world, s3, out, "compute.cpus_per_actor=4", "runs.stall_s=5", "runs.stall_exit_s=12"),
            "--resume",
            "latest",
        )
        rc, _, log = stalled.finish()
        assert rc == 5, log[-4000:]
        waited = [line for line in log.splitlines() if "waiting for:" in line]
        assert waited and "needs CPU 4" in waited[0], log[-4000:]
        error = [line for line in log.splitlines() if line.startswith("error:")]
        assert len(error) == 1 and "no shard committed for" in error[0] and "needs CPU 4" in error[0], log[-3000:]
        start = time.monotonic()
        rc, stdout, log = Driver(
            head, s3, settings(world, s3, out, "compute.num_actors=3"), "--resume", "latest"
        ).finish()
        assert rc == 0, log[-4000:]
        assert "to decode by 1..3 actors, 1 at start" in log, log[-3000:]  # 2 CPUs: one actor, one for the reads
        summary = json.loads(stdout[stdout.index("{") :])
        assert summary["resume"]["resumed"] and summary["resume"]["shards_committed_before"] >= 4
    _, manifest = published_once(world, s3, out)
    assert manifest["actors"]["pool"] == {"min": 1, "max": 3, "initial": 1}
    print(
        f"\nshrunken cluster: the stalled resume said {waited[0].split('waiting for: ')[1]!r} and exited 5; the resume "
        f"on one node published in {time.monotonic() - start:.1f} s (decode {manifest['timings']['decode_s']:.1f} s)"
    )


def test_a_node_that_joins_mid_run_gets_an_actor(cluster):
    """compute.num_actors=auto with 2-CPU actors on one 3-CPU node: one actor (the third CPU is the reads'). A 2-CPU
    node joins as the run starts: the driver logs it, the manifest lists it, Ray Data's autoscaler grows the pool onto
    it (Ray's state API places one of the run's actors there), and the job
    publishes every user once. With Ray Data's default reservation (half the cluster split over the operators) the
    pool's share of the new node fell short of an actor until the reads were done: it grew in half of the runs."""
    world, s3, head, root = cluster
    # 8 x 400 users (400 shards of 8): the decode must outlast the join, Ray Data's autoscaler noticing the free CPUs
    # and the new actor's start (its process, imports and model); 400 users can be done before the pool grows
    out, copies = "joined", 8
    users = pq.read_table(world / "data" / "test.parquet")
    big = pa.concat_tables([users.set_column(0, "user_id", pc.add(users["user_id"], i * 10**6)) for i in range(copies)])
    pq.write_table(big, root / "big.parquet", row_group_size=USERS)
    s3.client().upload_file(str(root / "big.parquet"), s3.bucket, "data/big.parquet")
    big_input = f"input={s3.uri('data', 'big.parquet')}"
    with ray_worker(head, root / "j1", num_cpus=3):
        start = time.monotonic()
        driver = Driver(
            head, s3, settings(world, s3, out, "compute.num_actors=auto", "compute.cpus_per_actor=2", big_input)
        )
        driver.wait_for("to decode by 1..the cluster actors")
        with ray_worker(head, root / "j2") as j2:
            rc, _, log = driver.finish()
            on_joined = on(j2, pool_nodes(head, states=("ALIVE", "DEAD")))  # this run's: the node is new
    assert rc == 0, log[-4000:]
    storage = Storage(endpoint=s3.endpoint)
    run = runs.latest_run(s3.uri(out), DATE, storage)
    recs = runs.read_table(run, "recommendations", storage).to_pandas()
    assert len(recs) == copies * USERS * K and recs.user_id.nunique() == copies * USERS  # every user once
    manifest = json.loads(S.read_bytes(S.join(run, "manifest.json"), storage))
    assert len(manifest["cluster"]["nodes_joined"]) == 1, manifest["cluster"]
    assert re.search(r"node \w+ \([\d.]+\) joined \d+ s into the decode, with CPU 2", log), log[-3000:]
    assert manifest["actors"]["pool"]["max"] is None  # auto: no upper bound
    # the pool grew onto the new node: an actor of this run was placed there, and committed shards (the count: actors
    # that committed; more than two when the autoscaler let an idle actor go and started another later)
    assert on_joined >= 1 and manifest["actors"]["count"] >= 2, (on_joined, manifest["actors"])
    print(
        f"\nnode join: 2 actors decoded {copies * USERS} users, one on the node that joined; "
        f"decode {manifest['timings']['decode_s']:.1f} s, total {time.monotonic() - start:.1f} s"
    )


def test_control_plane_errors_in_the_watch_are_logged_once_and_asked_again(monkeypatch, caplog):
    """Ray's control plane failing (the GCS restarting, a timeout) while the run decodes: the watch logs it once,
    asks again at every poll and, once it answers, reports the node lost and the node joined meanwhile; what a
    stalled run waits for says the resources are unknown instead of failing the run."""
    from pipeline import cluster as C

    node = {"ip": "10.0.0.1", "resources": {"CPU": 2.0}}
    answers = [RuntimeError("GCS unavailable"), {"a": node}, RuntimeError("GCS unavailable")]
    answers += [RuntimeError("deadline exceeded"), {"b": node}]

    def alive_nodes():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(C, "alive_nodes", alive_nodes)
    monkeypatch.setattr(C, "pool_actors", lambda **filters: [])
    caplog.set_level("INFO", logger="genrec.nightly")
    watch = C.Watch()  # the first look fails: no nodes known yet
    t0 = time.perf_counter()
    for _ in range(4):
        watch.poll(t0)
    assert not answers and watch.nodes == {"b": node}
    assert [x["node"] for x in watch.lost] == ["a"] and [x["node"] for x in watch.joined] == ["b"]
    said = [r.getMessage() for r in caplog.records]
    assert sum("control plane did not answer" in m for m in said) == 2  # once per outage, not once per poll
    assert sum("answers again" in m for m in said) == 2
    monkeypatch.setattr(C, "alive_nodes", lambda: (_ for _ in ()).throw(RuntimeError("GCS unavailable")))
    assert "the cluster's resources unknown (Ray's control plane did not answer" in C.waiting_for()
