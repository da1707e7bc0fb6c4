"""Serving published runs from a real Redis (Debian's redis-server, started by the tests on loopback): an export
switches the namespace's pointer only once every user is written, every user reads back its run's list through the
documented protocol (pointer, then key), rollback and removal of old versions, a store that could drop keys refused,
Redis killed mid-export (the previous version stays whole, a rerun resumes and switches), two exports racing (one
wins, the other exits 3), a 3-node Redis Cluster, and the nightly's own export after it publishes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline import runs
from pipeline.config import Serving
from pipeline.output import open_run
from pipeline.stores import redis as serving
from tests.helpers import assert_one_error_line
from tests.redis_server import RedisServer, require_redis, start_cluster
from tests.test_nightly import config, make_world

DAY1, DAY2 = "2026-11-21", "2026-11-22"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, ray_session_plain):
    """Two published nights of one output, their lists different (day 2's histories end in another item) ->
    (world, output root, day 1's run folder, day 2's)."""
    from pipeline.nightly import run_nightly

    require_redis()
    root = make_world(tmp_path_factory.mktemp("serving"), n_users=120)
    t = pq.read_table(root / "data" / "test.parquet")
    h = t["history"].combine_chunks()
    values = h.values.to_numpy().copy()
    values[h.offsets.to_numpy()[1:] - 1] = np.roll(values[h.offsets.to_numpy()[1:] - 1], 1)
    day2 = t.set_column(t.schema.get_field_index("history"), "history", pa.ListArray.from_arrays(h.offsets, values))
    pq.write_table(day2, root / "day2.parquet")
    out = root / "out"
    a = run_nightly(config(root, out, f"run_date={DAY1}"))
    b = run_nightly(config(root, out, f"run_date={DAY2}", f"input={root / 'day2.parquet'}"))
    return root, out, runs.run_dir(str(out), DAY1, a["run_id"]), runs.run_dir(str(out), DAY2, b["run_id"])


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def lists_of(run: str) -> tuple[dict, list]:
    """A published run's lists {user_id: [(rank, item_id, score)]} and its input's user ids."""
    recs = open_run(run).table("recommendations").sort_by([("user_id", "ascending"), ("rank", "ascending")])
    out: dict = {}
    for u, r, i, s in zip(*(recs[c].to_pylist() for c in ("user_id", "rank", "item_id", "score")), strict=True):
        out.setdefault(u, []).append((r, i, float(np.float32(s))))
    users = open_run(run).table("users")["user_id"].to_pylist()
    return out, users


def assert_serves(client, namespace: str, run: str) -> None:
    """Every user of the run reads back, through `serving.Reader`, exactly its list; a user without one gets None."""
    lists, users = lists_of(run)
    reader = serving.Reader(client, namespace)
    assert serving.run_of(reader.version()) == open_run(run).run_id
    assert lists and set(lists) <= set(users)
    for user in users:
        assert reader.get(user) == lists.get(user), user
    assert reader.get(10**12) is None


def target(url: str, **kw) -> Serving:
    return Serving(url, **{"namespace": "recs", **kw})


def test_an_export_switches_and_every_user_reads_back_its_list(two_runs, redis_server):
    _, _, a, b = two_runs
    client = redis_server.client()
    assert serving.Reader(client, "recs").get(1) is None  # no version yet: no list
    first = serving.export(open_run(a), target(redis_server.url))
    assert first.switched and first.previous is None and first.users == open_run(a).manifest["counts"]["users_ok"]
    assert_serves(client, "recs", a)
    second = serving.export(open_run(b), target(redis_server.url))
    assert second.previous == first.version and second.bytes > 0
    assert_serves(client, "recs", b)
    assert serving.versions(client, target(redis_server.url)) == [second.version, first.version]
    again = serving.export(open_run(b), target(redis_server.url))  # the current version again: nothing to do
    assert not again.switched
    with pytest.raises(serving.Refused, match="later than this run's"):  # readers would go back a night
        serving.export(open_run(a), target(redis_server.url))
    older = serving.export(open_run(a), target(redis_server.url, allow_older=True))
    assert older.switched and older.version not in (first.version, second.version)  # a version of its own
    assert_serves(client, "recs", a)


GRACE_S = 1.0  # the tests' serving.grace_s: a removed version's keys expire this long after its removal


def read_by(client, version: str, run: str) -> None:
    """A reader that read the pointer (`version`) before the version was removed reads every user's list of `run`
    in it, within the grace."""
    lists, users = lists_of(run)
    for user in users:
        value = client.get(serving.Keys("recs").user(version, user))
        assert (serving.decode(value) if value is not None else None) == lists.get(user), user


def expire_then_end(client, t: Serving, version: str) -> None:
    """A removed version: each of its keys expires within the grace, none is left once it has passed, and the next
    trim ends its removal."""
    keys = list(client.scan_iter(match=f"recs:{version}:*".encode()))
    assert keys and all(0 < client.pttl(k) <= GRACE_S * 1000 for k in keys)
    wait_for(lambda: not list(client.scan_iter(match=f"recs:{version}:*".encode())), "the keys' expiry", 10)
    assert client.sismember("{recs}:removing", version)
    serving.trim(client, t)
    assert not client.sismember("{recs}:removing", version)


def test_rollback_points_back_and_the_rolled_back_version_stays_readable_for_the_grace(two_runs, redis_server):
    _, _, a, b = two_runs
    t = target(redis_server.url, grace_s=GRACE_S)
    first, _ = (serving.export(open_run(run), t) for run in (a, b))
    client = redis_server.client()
    with pytest.raises(serving.Raced):  # a late switch to day 1's version (a retry, a second export of day 1)
        shards = len(open_run(a).manifest["files"]["recommendations"])
        serving.switch(client, t, open_run(a), first.version, None, shards, first.users)
    assert first.version in serving.versions(client, t)  # a kept version is never removed by a lost switch
    before = serving.Reader(client, "recs").version()  # a reader reads the pointer just before the rollback
    was, now = serving.rollback(t)
    assert (serving.run_of(was), serving.run_of(now)) == (open_run(b).run_id, open_run(a).run_id) and before == was
    read_by(client, before, b)  # ... and then its list: still there
    assert_serves(client, "recs", a)
    expire_then_end(client, t, was)
    with pytest.raises(serving.Refused, match="no previous version"):
        serving.rollback(t)


def test_versions_beyond_keep_are_removed_and_keep_0_leaves_readers_their_list(two_runs, redis_server):
    _, _, a, b = two_runs
    t = target(redis_server.url, keep=0, grace_s=GRACE_S)
    old = serving.export(open_run(a), t).version
    client = redis_server.client()
    before = serving.Reader(client, "recs").version()  # a reader reads the pointer just before the switch
    done = serving.export(open_run(b), t)
    assert done.removed == [old] == [before]
    read_by(client, before, a)  # none kept for rollback, but a reader's list is there for the grace
    assert client.hexists(f"{{recs}}:done:{old}", serving.REMOVED)  # marked: never switched or rolled back to
    assert serving.versions(client, t) == [done.version]
    assert_serves(client, "recs", b)
    expire_then_end(client, t, old)


def test_a_writer_racing_a_removal_leaves_no_key_behind(two_runs, redis_server, monkeypatch):
    """A version is removed (a lost switch: never read) between a writer's check and its SETs: the writer finds the
    mark after its round trip and expires what it wrote (Raced). 50 keys a writer that died between its SETs and
    that check left are deleted by the first trim after the grace."""
    import pyarrow.dataset as pads

    _, _, a, _ = two_runs
    t, run = target(redis_server.url, grace_s=GRACE_S), open_run(a)
    client = redis_server.client()
    version = serving.version_of(client, t, run.run_id)
    file, sets = run.files("recommendations")[0], serving._set_all

    def removed_first(c, values):
        serving.remove_version(client, t, version, unlisted=True)  # the whole removal pass runs before the SETs
        sets(c, values)

    monkeypatch.setattr(serving, "_set_all", removed_first)
    with pytest.raises(serving.Raced, match="was removed while this export wrote it"):
        serving.write_shard(pa.table({"file": [file], "shard": ["s0"]}), t, version, serving.Credentials(), run.storage)
    users = pads.dataset(file).to_table(columns=["user_id"])["user_id"].unique()
    keys = [serving.Keys("recs").user(version, u) for u in users.to_pylist()]
    assert keys and all(0 < client.pttl(k) <= GRACE_S * 1000 for k in keys)
    dead = [serving.Keys("recs").user(version, 10**9 + i) for i in range(50)]  # a writer that died after its SETs
    sets(client, [(k, b"x") for k in dead])
    assert serving.trim(client, t) == [] and client.sismember("{recs}:removing", version)  # within the grace: kept
    wait_for(lambda: not any(client.exists(k) for k in keys), "the writer's keys' expiry", 10)
    serving.trim(client, t)
    assert not list(client.scan_iter(match=f"recs:{version}:*".encode()))
    assert not client.sismember("{recs}:removing", version)


def test_an_export_whose_run_is_superseded_while_it_writes_is_skipped(two_runs, redis_server, monkeypatch):
    """While it writes, a rerun of its date publishes and the rerun's export removes the version it writes (a
    superseded run's, `serving.abandoned`): the export says skipped, never Raced, and its keys expire."""
    _, _, a, _ = two_runs
    t, client, why = target(redis_server.url, grace_s=GRACE_S), redis_server.client(), []
    write = serving.write_version

    def rerun_published(run, t, version, *args):
        out = write(run, t, version, *args)
        why.append("not published: superseded by run R")  # the rerun published, then its export removed this one:
        assert serving.abandoned(client, t, run) == [version]  # (the run superseded, as `runs.unpublished` says)
        return out

    monkeypatch.setattr(serving, "write_version", rerun_published)
    monkeypatch.setattr(serving, "superseded", lambda run: why[-1] if why else None)
    monkeypatch.setattr(runs, "unpublished", lambda run, storage: why[-1] if why else None)
    done = serving.export(open_run(a), t)
    assert not done.switched and done.skipped == why[0] and serving.Reader(client, "recs").version() is None
    keys = list(client.scan_iter(match=f"recs:{done.version}:*".encode()))
    assert keys and all(0 < client.pttl(k) <= GRACE_S * 1000 for k in keys)


def export_cli(run: str, url: str, *extra: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """`genrec-batch export` in its own process, a driver of the tests' Ray cluster."""
    import ray

    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, **(env or {})}
    cmd = [sys.executable, "-m", "jobs.export", run, "--to", url, "--namespace", "recs", *extra]
    return subprocess.Popen(cmd, env=env, text=True, **popen)


def test_a_store_that_could_drop_keys_is_refused(two_runs, redis_server):
    _, _, a, _ = two_runs
    client = redis_server.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    p = export_cli(a, redis_server.url, stderr=subprocess.PIPE)
    assert p.wait(120) == 2 and "maxmemory-policy allkeys-lru" in p.stderr.read()
    assert client.dbsize() == 0
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("appendonly", "no")
    with pytest.raises(serving.Refused, match="appendonly no"):
        serving.export(open_run(a), target(redis_server.url))
    assert client.dbsize() == 0
    serving.export(open_run(a), target(redis_server.url, allow_no_persistence=True))  # the operator opted in
    assert_serves(client, "recs", a)


def wait_for(check, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.faults  # Redis killed (SIGKILL) mid-export: make test-faults
def test_redis_killed_mid_export_keeps_the_previous_version_whole_and_a_rerun_switches(two_runs, redis_server):
    """Day 1 is served; day 2's export (one writer) is paused from outside once its first shard is recorded, then
    Redis is killed (SIGKILL): the export gives up (exit 4), Redis restarts from its append-only file and still
    serves day 1 whole; a rerun writes only the shards not yet recorded, and switches."""
    _, _, a, b = two_runs
    first = serving.export(open_run(a), target(redis_server.url))
    client = redis_server.client()
    p = export_cli(b, redis_server.url, "--writers", "1", "--retry-s", "2", stderr=subprocess.PIPE)

    def started() -> bool:
        version = client.hget("{recs}:pending", open_run(b).run_id)
        return version is not None and client.hlen(f"{{recs}}:done:{version.decode()}") >= 1

    wait_for(started, "the export's first shard")
    client.execute_command("CLIENT", "PAUSE", "60000", "WRITE")
    version = client.hget("{recs}:pending", open_run(b).run_id).decode()
    shards = len(open_run(b).manifest["files"]["recommendations"])
    assert client.hlen(f"{{recs}}:done:{version}") < shards and client.get("{recs}:current").decode() == first.version
    redis_server.kill()
    assert p.wait(120) == 4  # its one `error:` line the cause itself, no Ray task header or remote traceback
    port = redis_server.port
    down = rf"error: Redis redis://127\.0\.0\.1:{port}/0 unavailable: [^\n]+ failed for \d+ s \(\d+ tries; "
    assert_one_error_line(p.stderr.read(), down + r"serving\.retry_s = 2\): [^\n]+")
    redis_server.start()
    client = redis_server.client()
    assert_serves(client, "recs", a)  # the previous version, whole
    again = serving.export(open_run(b), target(redis_server.url))
    assert again.switched and again.resumed_shards >= 1 and again.version == version
    assert again.users == open_run(b).manifest["counts"]["users_ok"]
    assert_serves(client, "recs", b)


def test_two_racing_exports_one_wins_and_the_other_exits_3(two_runs, redis_server, tmp_path):
    """Both exports read the pointer (none) while Redis holds writes (CLIENT PAUSE WRITE, from outside); released,
    both write their versions and try to switch from none: one does, the other exits 3 with its version removed."""
    _, _, a, b = two_runs
    client = redis_server.client()
    client.execute_command("CLIENT", "PAUSE", "120000", "WRITE")
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [
        export_cli(run, redis_server.url, stderr=log.open("w"), stdout=subprocess.DEVNULL)
        for run, log in zip((a, b), logs, strict=True)
    ]
    wait_for(lambda: all("whose version is None" in log.read_text() for log in logs), "both exports to start")
    client.execute_command("CLIENT", "UNPAUSE")
    codes = [p.wait(180) for p in procs]
    assert sorted(codes) == [0, 3], [log.read_text()[-2000:] for log in logs]
    winner, loser = (a, b) if codes[0] == 0 else (b, a)
    assert "another export or a rollback changed" in logs[codes.index(3)].read_text()
    assert_serves(client, "recs", winner)
    lost = list(client.scan_iter(match=f"recs:{open_run(loser).run_id}.*".encode()))
    assert all(0 < client.pttl(k) <= 60_000 for k in lost)  # removed: expiring after serving.grace_s (60 s)


def test_a_redis_cluster_serves_every_user_from_keys_over_every_node(two_runs, tmp_path):
    """A 3-node Redis Cluster on loopback: the users' keys spread over the nodes' slots; the pointer and the list
    read through a cluster client; rollback."""
    from redis.cluster import RedisCluster

    _, _, a, b = two_runs
    servers = start_cluster(tmp_path / "cluster")
    try:
        t = target(servers[0].url)
        for run in (a, b):
            serving.export(open_run(run), t)
        client = RedisCluster.from_url(servers[0].url)
        assert_serves(client, "recs", b)
        assert all(s.client().dbsize() > 0 for s in servers)  # keys on every node
        serving.rollback(t)
        assert_serves(client, "recs", a)
    finally:
        for s in servers:
            s.stop()


def test_the_nightly_exports_after_it_publishes_and_never_records_the_password(two_runs, tmp_path, caplog):
    from pipeline.nightly import run_nightly, to_sink

    root, _, _, _ = two_runs
    server = RedisServer(tmp_path / "redis", password="s3cret-pw").start()
    try:
        url = server.url
        cfg = config(root, tmp_path / "out", f"serving.url={url}", "serving.namespace=nightly")
        manifest = run_nightly(cfg)
        record = to_sink(cfg, manifest, "serving")
        assert record["switched"] and record["run_id"] == manifest["run_id"] and "s3cret" not in record["url"]
        run = runs.run_dir(cfg.output, cfg.run_date, manifest["run_id"])
        assert "s3cret" not in (Path(run) / "manifest.json").read_text() and "s3cret" not in caplog.text
        import redis

        assert_serves(redis.Redis.from_url(url), "nightly", run)
    finally:
        server.stop()
    from pipeline.nightly import ExportFailed, exit_code

    with pytest.raises(ExportFailed, match="is published") as e:  # the store is gone: exit 7, the run stays published
        to_sink(config(root, tmp_path / "out", f"serving.url={url}", "serving.retry_s=0.5"), manifest, "serving")
    assert exit_code(e.value) == 7 and "s3cret" not in str(e.value)


def test_a_list_value_round_trips_and_a_foreign_value_is_refused():
    items, scores = np.array([5, 2**40, -1]), np.array([0.5, -1.25, 3.0], np.float32)
    value = serving.encode(items, scores)
    assert len(value) == 3 + 12 * 3
    assert serving.decode(value) == [(1, 5, 0.5), (2, 2**40, -1.25), (3, -1, 3.0)]
    with pytest.raises(ValueError, match="format"):
        serving.decode(b"\x02" + value[1:])
    assert (
        serving.Keys("ns").user("r1.x", 7) == b"ns:r1.x:7" and serving.Keys("ns").user("r1.x", "a:b") == b"ns:r1.x:a:b"
    )
    assert serving.run_of("20261121T000000Z-abc123.0f1e2d3c") == "20261121T000000Z-abc123"
    assert serving.masked("rediss://u:p@h:1/0") == "rediss://u:***@h:1/0"
    assert serving.masked("redis://h:1/0?password=p&db=0") == "redis://h:1/0?password=***&db=0"
    assert "p" not in repr(serving.Credentials("u", "p")).replace("Credentials", "")


def test_a_run_superseded_after_it_published_is_skipped_by_its_serve_step(two_runs, redis_server, tmp_path):
    """A night publishes; an export of it dies after one shard. A rerun of its date publishes and exports before the
    first night's serve step runs: that step skips the superseded run (as its table commit does), never exit 7, and
    readers keep the rerun's. The dead export's version, which no export can switch to any more, is removed: none of
    its keys outlives the grace."""
    from pipeline.nightly import after_publish, run_nightly

    root, _, _, _ = two_runs
    cfg = config(root, tmp_path / "out", f"serving.url={redis_server.url}", "serving.namespace=recs")
    cfg = replace(cfg, serving=replace(cfg.serving, grace_s=GRACE_S))
    first, client = run_nightly(cfg), redis_server.client()
    run = open_run(runs.run_dir(cfg.output, cfg.run_date, first["run_id"]))
    dead = serving.version_of(client, cfg.serving, run.run_id)
    shard = pa.table({"file": [run.files("recommendations")[0]], "shard": ["s0"]})
    serving.write_shard(shard, cfg.serving, dead, serving.Credentials(), run.storage)
    assert list(client.scan_iter(match=f"recs:{dead}:*".encode()))
    second = run_nightly(cfg)
    assert after_publish(cfg, second)["serving"]["switched"]
    late = after_publish(cfg, first)["serving"]  # raised ExportFailed (exit 7) before
    assert not late["switched"] and late["skipped"].startswith("not published: ") and late["run_id"] == first["run_id"]
    assert_serves(client, "recs", runs.run_dir(cfg.output, cfg.run_date, second["run_id"]))
    assert not client.hexists("{recs}:pending", run.run_id)
    assert all(0 < client.pttl(k) <= GRACE_S * 1000 for k in client.scan_iter(match=f"recs:{dead}:*".encode()))
    wait_for(lambda: not list(client.scan_iter(match=f"recs:{dead}:*".encode())), "the keys' expiry", 10)
