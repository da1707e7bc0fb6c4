"""Faults from outside, on a real Ray head (token auth) with real driver processes: the driver SIGKILLed mid-run
and then resumed (every user exactly once, only the uncommitted shards decoded again), and two runs of one date
overlapping (exactly one publishes; a reader that resolved the previous run keeps reading it)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from jobs.nightly import STOPPED
from pipeline import runs
from pipeline import storage as S
from pipeline.config import load_config
from pipeline.lease import LeaseLost
from pipeline.signals import Interrupted, Stop
from pipeline.storage import Storage
from tests.servers import ray_head
from tests.test_nightly import direct_beam_search, make_world
from tests.test_store_faults import (
    Driver,
    cluster,  # noqa: F401 (the fixture: SeaweedFS and a Ray head)
    committed,
    published_once,
    wait_committed,
)
from tests.test_store_faults import items as store_items

ROOT = Path(__file__).resolve().parents[1]
USERS, K = 1200, 5
DATE = "2026-11-21"


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    world = make_world(root / "world", n_users=USERS)
    with ray_head(root / "ray") as head:
        yield world, head


def args(world, out, *extra):
    return [
        f"input={world / 'data' / 'test.parquet'}",
        f"catalog={world / 'data' / 'items.parquet'}",
        f"output={out}",
        f"models.target={world / 'target'}",
        f"decoding.k={K}",
        "compute.batch_size=8",
        f"run_date={DATE}",
        f"models.cache_dir={world / 'cache'}",
        "runs.progress_s=1",
        *extra,
    ]


def driver(head, items, *flags) -> subprocess.Popen:
    """`python -m jobs.nightly` as its own process (and session), connected to the head."""
    cmd = [sys.executable, "-m", "jobs.nightly", *(x for item in items for x in ("--set", item)), *flags]
    env = {**os.environ, **head.env(), "RAY_ADDRESS": head.address}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout=600) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def committed_shards(out: Path) -> int:
    return len(list(out.glob(f"run_date={DATE}/run_id=*/metrics/s*.parquet")))


def assert_every_user_once(world, run: str):
    recs = pq.read_table(f"{run}/recommendations").to_pandas()
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    assert len(recs) == USERS * K and set(recs.user_id) == set(users.user_id)
    assert (recs.groupby("user_id")["rank"].apply(sorted) == [list(range(1, K + 1))] * USERS).all()
    return recs, users


def test_driver_killed_mid_run_then_resumed(head, tmp_path):
    world, head = head
    out = tmp_path / "out"
    items = args(world, out)
    proc = driver(head, items)
    deadline = time.time() + 300
    while committed_shards(out) < 6 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed: " + proc.communicate()[1][-2000:]
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and everything it started in its session
    proc.wait()
    killed = committed_shards(out)
    assert runs.latest_run(str(out), DATE, load_config(None, items).storage) is None  # nothing published
    rc, stdout, err = finish(driver(head, items, "--resume", "latest"))
    assert rc == 0, err[-3000:]
    manifest = json.loads(stdout[stdout.index("{") :])
    resume = manifest["resume"]
    assert resume["resumed"] and resume["shards_committed_before"] >= killed >= 6
    total = manifest["counts"]["batches"]  # shards of the published run
    assert 0 < resume["shards_decoded"] < total and resume["users_decoded"] < USERS
    print(
        f"resume: {resume['shards_committed_before']} shards committed before the kill, "
        f"{resume['shards_decoded']} of {total} decoded again ({resume['users_decoded']} of {USERS} users)"
    )
    assert "progress:" in err  # the driver logs users done / total, users/s and an ETA
    run = runs.latest_run(str(out), DATE, load_config(None, items).storage)
    recs, users = assert_every_user_once(world, run)
    ref, _ = direct_beam_search(world, users.history.tolist(), k=K)
    want = dict(zip(users.user_id, ref.item_ids.tolist()))
    assert all(want[u] == g.sort_values("rank").item_id.tolist() for u, g in recs.groupby("user_id"))
    metrics = pq.read_table(f"{run}/metrics").to_pandas()
    assert metrics.shard.is_unique and metrics.users_in.sum() == USERS  # shard ids unique across the two drivers


def test_overlapping_runs_publish_once_and_readers_keep_their_run(head, tmp_path):
    world, head = head
    out = tmp_path / "out"
    items = args(world, out)
    storage = load_config(None, items).storage
    rc, _, err = finish(driver(head, items))
    assert rc == 0, err[-3000:]
    old = runs.resolve(str(out / f"run_date={DATE}"), storage)  # a reader resolves _LATEST ...
    first, second = driver(head, items), driver(head, items)  # ... then two reruns of the date start together
    results = [finish(first), finish(second)]
    codes = sorted(rc for rc, _, _ in results)
    assert codes == [0, 3], [err[-2000:] for _, _, err in results]
    refused = next(err for rc, _, err in results if rc == 3)
    assert "refused" in refused and "is being written by run" in refused
    stdout = next(o for rc, o, _ in results if rc == 0)
    winner = json.loads(stdout[stdout.index("{") :])
    assert pq.read_table(f"{old}/recommendations").num_rows == USERS * K  # the old run is still whole
    assert (Path(old) / "_SUPERSEDED").is_file()
    run = runs.resolve(str(out / f"run_date={DATE}"), storage)
    assert run.endswith(winner["run_id"])
    assert_every_user_once(world, run)
    assert S.list_children(str(out / f"run_date={DATE}"), storage) == sorted(
        [Path(old).name, f"run_id={winner['run_id']}"]
    )  # the refused run wrote nothing


def test_sigterm_mid_run_releases_the_date_and_a_resume_publishes(cluster):  # noqa: F811
    """`ray job stop` or a pod eviction: SIGTERM to the driver's process group once 6 shards are committed. The driver
    stops submitting work, releases the date's lease (on S3: expires 0), records the interruption in the run's state
    and exits STOPPED, never an abort; `--resume latest` takes the lease at once, decodes only the rest and publishes
    every user once."""
    world, s3, _, head = cluster
    out = "sigterm"
    settings = store_items(world, s3, s3.endpoint, out, "models.draft=null")  # beam search: no draft
    started = time.monotonic()
    driver = Driver(head, s3, settings)
    fresh = wait_committed(s3, out, 1, driver) - started  # a fresh driver's start, to compare the resume's with
    wait_committed(s3, out, 6, driver)
    os.killpg(driver.proc.pid, signal.SIGTERM)
    stopped = time.monotonic()
    rc, _, log = driver.finish(timeout=120)
    assert rc == STOPPED, log[-3000:]
    exited_s = time.monotonic() - stopped
    assert [line for line in log.splitlines() if line.startswith("stopped:")], log[-3000:]
    storage = load_config(None, settings).storage
    lease = json.loads(S.read_bytes(S.join(runs.date_dir(s3.uri(out), DATE), "_LEASE"), storage))
    assert lease["expires"] == 0  # released
    run = runs.run_dir(s3.uri(out), DATE, lease["run_id"])
    (stop,) = runs.state_of(run, storage)["interruptions"]
    assert stop["signal"] == "SIGTERM" and stop["attempt"]
    assert runs.latest_run(s3.uri(out), DATE, storage) is None  # nothing published
    before = committed(s3, out)
    resumed = time.monotonic()
    resume = Driver(head, s3, settings, "--resume", "latest")
    first = wait_committed(s3, out, before + 1, resume) - resumed
    rc, stdout, log = resume.finish()
    assert rc == 0, log[-3000:]
    assert "watching it" not in log  # the released lease is taken at once
    summary = json.loads(stdout[stdout.index("{") :])
    assert summary["run_id"] == lease["run_id"] and summary["resume"]["shards_committed_before"] >= 6
    _, manifest = published_once(world, s3, out)
    assert manifest["resume"]["interruptions"] == [stop]
    t = manifest["timings"]
    print(
        f"\nSIGTERM: the driver exited {STOPPED} {exited_s:.1f} s after the signal; the resume committed its first "
        f"shard {first:.1f} s after its process started (a fresh driver's: {fresh:.1f} s; {t['first_shard_s']:.1f} s "
        f"after it took the lease, its first actor ready at {t['actor_ready_s']:.1f} s) and published "
        f"{manifest['counts']['users_ok']} users"
    )


def test_a_signal_raises_once_at_once_and_waits_for_publication():
    """The driver's handler: the first SIGTERM / SIGINT raises Interrupted where the driver is; later ones are
    ignored, so that the clean-up they would interrupt finishes; inside publication the signal waits and the job
    ends as published."""
    stop = Stop()
    with pytest.raises(Interrupted, match="SIGTERM received") as e:
        stop.handle(signal.SIGTERM, None)
    assert e.value.signal == "SIGTERM"
    stop.handle(signal.SIGINT, None)  # while stopping: ignored, no second Interrupted
    publishing = Stop()
    with publishing.deferred("publishing"):
        publishing.handle(signal.SIGINT, None)  # waits for the block
        assert publishing.pending == signal.SIGINT
    publishing.handle(signal.SIGTERM, None)  # published: ignored too
    assert publishing.received == "SIGINT"
    after = Stop()
    with after.deferred("publishing"):
        pass
    after.handle(signal.SIGTERM, None)  # the first signal after publication: the published run ends as it would have
    assert after.received == "SIGTERM" and after.pending == signal.SIGTERM
    failed = Stop()
    with pytest.raises(OSError), failed.deferred("publishing"):
        raise OSError("the store refused the publication")
    with pytest.raises(Interrupted):  # not published: a signal stops the driver
        failed.handle(signal.SIGTERM, None)


# ---------------------------------------------------------------- signals at the lease's edges, a fenced manifest


@pytest.fixture
def handler(monkeypatch):
    """The driver's handler (a fresh Stop as pipeline.signals.STOP) installed for SIGTERM / SIGINT, restored after."""
    from pipeline import signals

    stop = Stop()
    monkeypatch.setattr(signals, "STOP", stop)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop.install()
    yield stop
    for s, h in saved.items():
        signal.signal(s, h)


def lease_of(s3, out: str) -> dict:

    return json.loads(S.read_bytes(S.join(runs.date_dir(s3.uri(out), DATE), "_LEASE"), Storage(s3.endpoint)))


def test_a_signal_inside_acquire_or_release_never_strands_the_lease(cluster, handler, monkeypatch):  # noqa: F811
    """SIGTERM the moment the store took the lease's PUT: the lease is read back, found this run's, and released
    (expires 0). A put whose answer is lost (the store took it, the call failed): the same. A signal while another
    run's lease is watched: nothing was taken, and the note says so. SIGTERM while the lease is released after
    another error (Stalled): the release completes, the error stays the error (exit 5), and the note says what the
    signal met."""
    from pipeline.follow import Stalled
    from pipeline.lease import HELD, NONE, RELEASED, Lease
    from pipeline.nightly import leased
    from pipeline.signals import stop_note

    _, s3, _, _ = cluster
    storage = Storage(s3.endpoint)
    real = S.put_if

    def then(action):
        def put_if(*a, **kw):
            got = real(*a, **kw)
            action()
            return got

        return put_if

    def lease(out: str, run_id: str) -> Lease:
        return Lease(runs.date_dir(s3.uri(out), DATE), run_id, storage, 10, handler.ending)

    monkeypatch.setattr(S, "put_if", then(lambda: os.kill(os.getpid(), signal.SIGTERM)))
    first = lease("signal-acquire", "run-a")
    with pytest.raises(Interrupted, match="SIGTERM"):
        first.acquire()
    assert first.state == HELD and lease_of(s3, "signal-acquire")["expires"] > 0
    assert first.release() == RELEASED and lease_of(s3, "signal-acquire")["expires"] == 0

    def lost():
        raise ConnectionResetError("the answer was lost")

    monkeypatch.setattr(S, "put_if", then(lost))
    second = lease("lost-answer", "run-b")
    with pytest.raises(ConnectionResetError):
        second.acquire()
    monkeypatch.setattr(S, "put_if", real)
    assert second.state == HELD and second.release() == RELEASED and lease_of(s3, "lost-answer")["expires"] == 0

    handler.received = None
    other = lease("watched", "run-other")
    other.acquire()
    other.stop.set()  # its renewals stop: it looks dead
    waiting = lease("watched", "run-w")
    waiting.clock = lambda: time.time() + 3600  # its lease's stamp looks past: watched for ttl before a takeover
    sleep = time.sleep
    monkeypatch.setattr(time, "sleep", lambda s: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(Interrupted) as e, leased(waiting, "run-w"):
        waiting.acquire()
    monkeypatch.setattr(time, "sleep", sleep)
    assert e.value.lease_state == NONE and "no lease was taken" in stop_note(e.value, False)
    assert lease_of(s3, "watched")["run_id"] == "run-other"

    handler.reset()
    handler.received = None
    third = lease("signal-release", "run-c")
    monkeypatch.setattr(S, "put_if", then(lambda: os.kill(os.getpid(), signal.SIGTERM)))
    with pytest.raises(Stalled) as e, leased(third, "run-c"):
        monkeypatch.setattr(S, "put_if", real)
        third.acquire()
        monkeypatch.setattr(S, "put_if", then(lambda: os.kill(os.getpid(), signal.SIGTERM)))
        raise Stalled("no shard committed")
    assert e.value.lease_state == RELEASED and lease_of(s3, "signal-release")["expires"] == 0
    assert stop_note(e.value, False) == (
        "stopped: SIGTERM received while releasing the run date's lease after the error above; the lease is released"
    )


def test_a_sigterm_while_ray_starts_is_a_stop(tmp_path):
    """SIGTERM while ray.init runs meets Ray's own handler (sys.exit(signum)): the driver still ends as a stopped run,
    exit STOPPED and its `stopped:` line, never exit 15."""
    world = make_world(tmp_path / "world", n_users=8)
    settings = [x for item in args(world, tmp_path / "out") for x in ("--set", item)]
    code = (
        "import os, signal, sys, time, ray\n"
        "from jobs import nightly\n"
        "real = ray.init\n"
        "def init(*a, **kw):\n"
        "    out = real(*a, **kw)  # Ray's SIGTERM handler is in place now\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    time.sleep(60)\n"
        "    return out\n"
        "ray.init = init\n"
        f"sys.exit(nightly.main({settings!r}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == STOPPED, run.stderr[-3000:]
    (line,) = [x for x in run.stderr.splitlines() if x.startswith("stopped:")]
    assert "SIGTERM received" in line and "no lease was taken" in line, line


def test_a_fenced_driver_never_writes_the_manifest_of_a_run_another_published(cluster):  # noqa: F811
    """Driver A decodes every shard and reaches publication; it is paused there (SIGSTOP) past its lease. Driver B
    resumes the same run id: it takes the date over, finds every shard committed and publishes. A, continued,
    finds its lease lost before writing anything: exit 3. The published manifest is B's, every user read once; and
    a manifest is created once: a second writer with another manifest is refused."""
    world, s3, _, head = cluster
    out = "fenced"
    hold = world / "hold-fenced"
    hold.mkdir()
    users = pq.read_table(world / "data" / "test.parquet").slice(0, 40)
    pq.write_table(users, world / "forty.parquet")
    s3.client().upload_file(str(world / "forty.parquet"), s3.bucket, "data/forty.parquet")
    settings = [
        *store_items(world, s3, s3.endpoint, out, "models.draft=null", "runs.lease_s=10"),
        f"input={s3.uri('data', 'forty.parquet')}",
    ]
    a = Driver(head, s3, settings, env={"GENREC_TEST_HOLD_BEFORE_PUBLISH": str(hold)})
    deadline = time.monotonic() + 300
    while not (hold / "held").exists():
        assert a.proc.poll() is None and time.monotonic() < deadline, a.tail()
        time.sleep(0.1)
    os.killpg(a.proc.pid, signal.SIGSTOP)
    run_id = lease_of(s3, out)["run_id"]
    time.sleep(11)  # past its lease's stamp: B watches it for runs.lease_s more, then takes it over
    b = Driver(head, s3, settings, "--resume", run_id)
    rc, stdout, log = b.finish()
    assert rc == 0, log[-3000:]
    (hold / "go").write_text("")
    os.killpg(a.proc.pid, signal.SIGCONT)
    rc, _, log = a.finish()
    assert rc == 3 and "lost its run_date lease" in log, log[-3000:]
    storage = load_config(None, settings).storage
    run = runs.latest_run(s3.uri(out), DATE, storage)
    manifest = json.loads(S.read_bytes(S.join(run, "manifest.json"), storage))
    recs = runs.read_table(run, "recommendations", storage).to_pandas()
    assert len(recs) == 40 * K and set(recs.user_id) == set(users["user_id"].to_pylist())  # every user once
    summary = json.loads(stdout[stdout.index("{") :])
    assert manifest["run_id"] == summary["run_id"] == run_id and manifest["resume"] == summary["resume"]
    assert manifest["resume"]["resumed"] and manifest["resume"]["shards_decoded"] == 0  # B's: it decoded nothing
    with pytest.raises(LeaseLost, match="written by another driver of this run"):
        runs.finish(run, {**manifest, "status": "forged"}, storage)
    runs.finish(run, manifest, storage)  # the same manifest again: its own, answer lost
    assert json.loads(S.read_bytes(S.join(run, "manifest.json"), storage)) == manifest
