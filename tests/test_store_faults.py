"""Object-store faults from outside, on the whole job: a real Ray head (token auth), `python -m jobs.nightly` as its
own process, input, catalog and outputs on a real SeaweedFS. The store is paused (SIGSTOP) for 20 s and then killed
and restarted 20 s later, mid-run: the job rides both out and publishes every user once. The store then goes away
(every connection reset, through a proxy) for longer than storage.retry_s: the job exits 4 with one `error:` line
naming the store, the URI and the cause, releases the lease as the store comes back, and a `--resume latest` with a
larger budget takes the lease at once and publishes. The timings and retries are printed (`pytest -s`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import runs
from pipeline import storage as S
from pipeline.config import load_config
from tests.servers import ray_head, seaweedfs, store_proxy
from tests.test_nightly import make_world

ROOT = Path(__file__).resolve().parents[1]
USERS, K, BATCH = 400, 5, 8
DATE = "2026-11-21"
PAUSE_S = 20.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SeaweedFS holding the world's input and catalog, a proxy in front of it, and a Ray head."""
    root = tmp_path_factory.mktemp("storefaults")
    world = make_world(root / "world", n_users=USERS)
    with seaweedfs(root / "s3") as s3, store_proxy(s3) as proxy, ray_head(root / "ray", env=s3.env()) as head:
        client = s3.client()
        for name in ("test.parquet", "items.parquet"):
            client.upload_file(str(world / "data" / name), s3.bucket, f"data/{name}")
        saved = dict(os.environ)
        os.environ.update(s3.env())  # this process reads the outputs too
        try:
            yield world, s3, proxy, head
        finally:
            os.environ.clear()
            os.environ.update(saved)


def items(world, s3, endpoint: str, out: str, *extra) -> list[str]:
    return [
        f"input={s3.uri('data', 'test.parquet')}",
        f"catalog={s3.uri('data', 'items.parquet')}",
        f"output={s3.uri(out)}",
        f"storage.endpoint={endpoint}",
        f"models.target={world / 'target'}",
        f"models.cache_dir={world / 'cache'}",
        f"decoding.k={K}",
        f"compute.batch_size={BATCH}",
        "compute.batches_per_task=1",
        f"run_date={DATE}",
        "runs.progress_s=5",
        *extra,
    ]


class Driver:
    """`python -m jobs.nightly` in its own process and session, its stderr read line by line as it comes."""

    def __init__(self, head, s3, settings: list[str], *flags: str, env: dict | None = None):
        cmd = [sys.executable, "-m", "jobs.nightly", *(x for item in settings for x in ("--set", item)), *flags]
        env = {**os.environ, **s3.env(), **head.env(), "RAY_ADDRESS": head.address, **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None or self.reader.is_alive(), f"ended before {text!r}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout} s:\n{self.tail()}"
            time.sleep(0.05)

    def finish(self, timeout: float = 600) -> tuple[int, str, str]:
        out = self.proc.stdout.read()
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=10)
        return self.proc.returncode, out, "".join(self.lines)

    def tail(self) -> str:
        return "".join(self.lines[-40:])


def committed(s3, out: str) -> int:
    """Shards committed so far (metrics files of the date's runs), listed from the store itself."""
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=f"{out}/run_date={DATE}/")
    return sum(1 for page in pages for o in page.get("Contents", []) if "/metrics/s" in o["Key"])


def wait_committed(s3, out: str, n: int, driver: Driver, timeout: float = 300) -> float:
    """Waits until at least n shards are committed -> when (monotonic)."""
    deadline = time.monotonic() + timeout
    while committed(s3, out) < n:
        assert driver.proc.poll() is None, f"the run ended with {committed(s3, out)} shards:\n{driver.tail()}"
        assert time.monotonic() < deadline, f"fewer than {n} shards after {timeout} s:\n{driver.tail()}"
        time.sleep(0.1)
    return time.monotonic()


def published_once(world, s3, out: str) -> tuple[str, dict]:
    """The published run has every user exactly once, K ranks each -> (run folder, manifest)."""
    storage = load_config(None, items(world, s3, s3.endpoint, out)).storage
    run = runs.latest_run(s3.uri(out), DATE, storage)
    assert run is not None
    recs = runs.read_table(run, "recommendations", storage).to_pandas()
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    assert len(recs) == USERS * K and set(recs.user_id) == set(users.user_id)
    assert (recs.groupby("user_id")["rank"].apply(sorted) == [list(range(1, K + 1))] * USERS).all()
    return run, json.loads(S.read_bytes(S.join(run, "manifest.json"), storage))


def retries(log: str) -> tuple[int, int]:
    """(retries our policy logged, calls that succeeded after retrying) in a run's log."""
    return len(re.findall(r"; retry \d+ in ", log)), len(re.findall(r"succeeded after \d+ retries", log))


def test_the_job_rides_out_a_paused_and_a_restarted_store(cluster):
    """The store paused (SIGSTOP) for 20 s once 8 shards are committed, then killed once 8 more are and restarted on
    the same port and data 20 s later: exit 0, every user once, both stalls ridden out within storage.retry_s."""
    world, s3, proxy, head = cluster
    out = "ride"
    driver = Driver(head, s3, items(world, s3, s3.endpoint, out, "storage.retry_s=90"))
    wait_committed(s3, out, 8, driver)
    paused = time.monotonic()
    s3.pause()
    time.sleep(PAUSE_S)
    s3.resume()
    before = committed(s3, out)
    back = wait_committed(s3, out, before + 1, driver)
    wait_committed(s3, out, before + 8, driver)
    killed = time.monotonic()
    s3.kill()
    time.sleep(PAUSE_S)
    s3.restart()
    restarted = time.monotonic()
    before = committed(s3, out)
    back_again = wait_committed(s3, out, before + 1, driver)
    rc, stdout, log = driver.finish()
    assert rc == 0, log[-3000:]
    run, manifest = published_once(world, s3, out)
    assert manifest["counts"]["batches"] == -(-USERS // BATCH)
    n_retries, n_recovered = retries(log)
    assert n_recovered >= 1  # the restart's refused connections were retried by our policy and passed
    print(
        f"\npause: {PAUSE_S:.0f} s, next shard committed {back - paused:.1f} s after the pause began; "
        f"kill: restarted after {restarted - killed:.1f} s, next shard {back_again - killed:.1f} s after the kill; "
        f"{n_retries} retries logged, {n_recovered} calls recovered; total {manifest['timings']['total_s']:.1f} s"
    )


def test_an_outage_longer_than_the_budget_exits_4_and_resumes_at_once(cluster):
    """Every connection to the store reset (through the proxy) once 8 shards are committed, until the job gives up:
    its shard write fails for storage.retry_s, Ray runs the batch again BATCH_RETRIES times, then exit 4 with one
    `error:` line naming the store, the URI and the cause. The store is back while the job stops, so the lease is
    released; `--resume latest` (with a larger budget: a resume may change it) takes it at once and publishes. Until
    the outage each committed shard cost the store exactly its four PUTs."""
    world, s3, proxy, head = cluster
    out = "outage"
    proxy.fault, proxy.requests[:] = None, []
    driver = Driver(head, s3, items(world, s3, proxy.endpoint, out, "storage.retry_s=2"))
    wait_committed(s3, out, 8, driver)
    proxy.fault = lambda method, target: "reset"
    down = time.monotonic()
    requests = list(proxy.requests)
    driver.wait_for(" stops: ")  # the driver gives up; the store comes back while it releases the lease
    gave_up = time.monotonic()
    proxy.fault = None
    rc, _, log = driver.finish()
    assert rc == 4, log[-3000:]
    gave_up_on = re.findall(r"giving up: .*?/(s\d{12}-[0-9a-f]{8})\.parquet failed for", log)  # shards, per try
    assert max(gave_up_on.count(shard) for shard in gave_up_on) == S.BATCH_RETRIES + 1  # Ray ran the batch again
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, log[-3000:]
    assert proxy.endpoint in errors[0] and f"s3://{s3.bucket}/{out}/run_date={DATE}/" in errors[0]
    assert "reset" in errors[0].lower() or "closed" in errors[0].lower()
    storage = load_config(None, items(world, s3, s3.endpoint, out)).storage
    lease = json.loads(S.read_bytes(S.join(runs.date_dir(s3.uri(out), DATE), "_LEASE"), storage))
    assert lease["expires"] == 0  # released
    failed_run = lease["run_id"]
    assert runs.latest_run(s3.uri(out), DATE, storage) is None  # nothing published
    # what the shards committed before the outage cost: their four PUTs, nothing else (no directory requests)
    stems = {
        m.group(1) for _, target in requests if (m := re.search(r"/metrics/(s\d{12}-[0-9a-f]{8})\.parquet$", target))
    }
    assert len(stems) >= 8
    for stem in stems:
        assert sorted(method for method, target in requests if stem in target) == ["PUT"] * 4
    assert not [r for r in requests if r[0] == "PUT" and r[1].endswith("/")]  # no directory markers at all
    resumed = time.monotonic()
    rc, stdout, log = Driver(
        head, s3, items(world, s3, proxy.endpoint, out, "storage.retry_s=30"), "--resume", "latest"
    ).finish()
    assert rc == 0, log[-3000:]
    assert "watching it" not in log  # the released lease is taken at once
    summary = json.loads(stdout[stdout.index("{") :])
    assert summary["run_id"] == failed_run and summary["resume"]["resumed"]
    assert summary["resume"]["shards_committed_before"] >= len(stems)
    _, manifest = published_once(world, s3, out)
    n_retries, _ = retries("".join(driver.lines))
    print(
        f"\noutage: the job gave up {gave_up - down:.1f} s after the store went away ({n_retries} retries logged); "
        f"the resume published in {time.monotonic() - resumed:.1f} s (decode {manifest['timings']['decode_s']:.1f} s); "
        f"{len(stems)} shards before the outage, 4 PUTs each and no other request"
    )
