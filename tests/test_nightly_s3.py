"""The nightly graph on a real Ray head node (token auth) against a real S3 server (SeaweedFS): inputs, models
and outputs all on s3://; wrong credentials fail clearly and leak no secret; `ray job submit` end to end."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline import runs
from pipeline import storage as S
from pipeline.config import load_config
from tests.servers import ray_head, seaweedfs
from tests.test_nightly import direct_beam_search, make_world

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SeaweedFS + a Ray head whose drivers and workers get the S3 credentials from their environment; the world's
    data and models uploaded to the bucket."""
    root = tmp_path_factory.mktemp("s3world")
    world = make_world(root / "world")
    with seaweedfs(root / "s3") as s3, ray_head(root / "ray", env=s3.env()) as head:
        saved = dict(os.environ)
        os.environ.update({**s3.env(), **head.env()})
        try:
            fs = s3.filesystem()
            for name in ("test.parquet", "items.parquet"):
                fs.create_dir(f"{s3.bucket}/data")
                with open(world / "data" / name, "rb") as src, fs.open_output_stream(f"{s3.bucket}/data/{name}") as dst:
                    dst.write(src.read())
            storage = load_config(
                None, ["input=x", "catalog=x", "output=x", "models.target=x", f"storage.endpoint={s3.endpoint}"]
            ).storage
            for name in ("target", "draft"):
                S.upload_model_dir(str(world / name), s3.uri("models", name), storage)
            yield world, s3, head, root
        finally:
            os.environ.clear()
            os.environ.update(saved)


def s3_config(s3, root, *extra):
    return [
        f"input={s3.uri('data', 'test.parquet')}",
        f"catalog={s3.uri('data', 'items.parquet')}",
        f"output={s3.uri('nightly')}",
        f"models.target={s3.uri('models', 'target')}",
        f"models.draft={s3.uri('models', 'draft')}",
        f"storage.endpoint={s3.endpoint}",
        f"models.cache_dir={root / 'cache'}",
        "decoding.k=5",
        "decoding.history_len=8",
        "compute.batch_size=32",
        "run_date=2026-11-21",
        *extra,
    ]


def write_config(path: Path, items: list[str]) -> Path:
    """`a.b=value` items -> a config file (JSON is YAML)."""
    nested: dict = {}
    for key, value in (item.split("=", 1) for item in items):
        node = nested
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = int(value) if value.isdigit() else value
    path.write_text(json.dumps(nested))
    return path


def test_nightly_on_s3_equals_beam_search(cluster, tmp_path):
    """The driver in its own process (as on a cluster), connected to the token-authenticated head."""
    world, s3, head, root = cluster
    config = write_config(tmp_path / "nightly.yaml", s3_config(s3, root))
    env = {**os.environ, **head.env(), "RAY_ADDRESS": head.address}
    run = subprocess.run(
        [sys.executable, "-m", "jobs.nightly", "--config", str(config)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    summary = json.loads(run.stdout[run.stdout.index("{") :])
    cfg = load_config(str(config))
    published = runs.latest_run(cfg.output, cfg.run_date, cfg.storage)
    assert published and published.startswith("s3://") and summary["run_id"] in published
    manifest = json.loads(S.read_bytes(S.join(published, "manifest.json"), cfg.storage))
    assert manifest["status"] == "succeeded" and manifest["models"]["target"]["uri"] == s3.uri("models", "target")
    assert S.read_bytes(S.join(published, "_SUCCESS"), cfg.storage) is not None
    fs, path = S.filesystem(published, cfg.storage)
    recs = pq.read_table(f"{path}/recommendations", filesystem=fs).to_pandas()
    metrics = pq.read_table(f"{path}/metrics", filesystem=fs).to_pandas()
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    assert sorted(recs.user_id.unique()) == sorted(users.user_id) and (recs.groupby("user_id").size() == 5).all()
    ref, _ = direct_beam_search(world, users.history.tolist())
    want = dict(zip(users.user_id, ref.item_ids.tolist()))
    assert all(want[u] == g.sort_values("rank").item_id.tolist() for u, g in recs.groupby("user_id"))
    assert metrics.users_ok.sum() == len(users)
    # evaluation and report read the run from the bucket (the output root resolves to its newest run) and write there
    for job in ("evaluate", "report"):
        done = subprocess.run(
            [sys.executable, "-m", f"jobs.{job}", "--run", cfg.output, "--endpoint", s3.endpoint],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
    report = S.read_bytes(S.join(published, "report", "report.md"), cfg.storage).decode()
    assert f"| users ok | {len(users):,} |" in report and "## Quality (offline evaluation)" in report
    assert S.read_bytes(S.join(published, "report", "figures", "cost.png"), cfg.storage)[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrong_credentials_fail_clearly_without_leaking(cluster, caplog):
    from pipeline.nightly import run_nightly

    world, s3, head, root = cluster
    cfg = load_config(None, s3_config(s3, root, f"output={s3.uri('nightly-bad')}"))
    wrong = "WrongSecret" + "x" * 20
    os.environ["AWS_SECRET_ACCESS_KEY"] = wrong
    try:
        with pytest.raises(PermissionError) as err:
            run_nightly(cfg)
    finally:
        os.environ["AWS_SECRET_ACCESS_KEY"] = s3.secret_key
    message = str(err.value)
    assert "refused access" in message and s3.uri("nightly-bad") in message
    for secret in (wrong, s3.secret_key):
        assert secret not in message and secret not in caplog.text
    assert runs.latest_run(cfg.output, cfg.run_date, cfg.storage) is None


def test_ray_job_submit_end_to_end(cluster, tmp_path):
    """`ray job submit` of the nightly entry point to a token-authenticated head, config pointed at S3."""
    world, s3, head, root = cluster
    config = write_config(tmp_path / "nightly.yaml", s3_config(s3, root, f"output={s3.uri('e2e')}"))
    env = {**os.environ, **head.env()}
    cmd = [
        str(Path(sys.executable).parent / "ray"),
        "job",
        "submit",
        "--address",
        head.dashboard_url,
        "--working-dir",
        str(ROOT),
        "--runtime-env",
        str(ROOT / "infra" / "runtime_env.yaml"),
        "--",
        "python",
        "-m",
        "jobs.nightly",
        "--config",
        str(config),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    logs = run.stdout + run.stderr
    assert run.returncode == 0 and "succeeded" in logs, logs[-3000:]
    storage = load_config(None, s3_config(s3, root)).storage
    published = runs.latest_run(s3.uri("e2e"), "2026-11-21", storage)
    assert published is not None
    manifest = S.read_bytes(S.join(published, "manifest.json"), storage).decode()
    fs, path = S.filesystem(published, storage)
    assert pq.read_table(f"{path}/recommendations", filesystem=fs).num_rows == 100 * 5
    for secret in (s3.secret_key, head.token):
        assert secret not in logs and secret not in manifest
    # without the token the cluster refuses the job
    bare = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE")}
    refused = subprocess.run(
        cmd[:5] + ["--", "python", "-c", "print(1)"], env=bare, capture_output=True, text=True, timeout=120
    )
    assert refused.returncode != 0


def test_s3_lease_is_exclusive_expires_and_is_lost(cluster):
    """The date's lease on S3 (conditional puts): a second run is refused while the first holds it, gets it once
    released; a lease its holder stopped renewing expires, is taken over, and the old holder may no longer publish.
    The same exclusion locally (flock)."""
    from pipeline.lease import Lease, LeaseHeld, LeaseLost

    world, s3, head, root = cluster
    storage = load_config(None, s3_config(s3, root)).storage
    date = s3.uri("lease", "run_date=2026-11-21")
    a = Lease(date, "A", storage, ttl_s=30).acquire()
    with pytest.raises(LeaseHeld, match="is being written by run A"):
        Lease(date, "B", storage, ttl_s=30).acquire()
    a.check()
    a.release()
    b = Lease(date, "B", storage, ttl_s=1.0).acquire()
    b.stop.set()  # B's driver hangs: no more renewals
    time.sleep(1.5)
    c = Lease(date, "C", storage, ttl_s=2).acquire()  # takes over the expired lease (unchanged for C's 2 s)
    with pytest.raises(LeaseLost, match="run B lost its run_date lease"):
        b.check()
    c.release()
    local = str(root / "local" / "run_date=2026-11-21")
    d = Lease(local, "D", storage, ttl_s=30).acquire()
    with pytest.raises(LeaseHeld, match="is being written by run D"):
        Lease(local, "E", storage, ttl_s=30).acquire()
    d.release()
    Lease(local, "E", storage, ttl_s=30).acquire().release()


SKEWED_TAKER = """
import json, sys, time
real = time.time
time.time = lambda: real() + 2.5  # this machine's wall clock runs 2.5 s ahead
from pipeline import storage as S
from pipeline.config import Storage
from pipeline.lease import Lease, LeaseHeld
uri, endpoint = sys.argv[1], sys.argv[2]
storage = Storage(endpoint=endpoint)
first = S.read_versioned(uri + "/_LEASE", storage)[1]
while S.read_versioned(uri + "/_LEASE", storage)[1] == first:  # just after the holder's renewal: expires = now + 3
    time.sleep(0.01)
time.sleep(0.7)  # expires = now + 2.3, behind this machine's clock
try:
    Lease(uri, "B", storage, ttl_s=3).acquire().release()
except LeaseHeld as e:
    print(e)
    sys.exit(3)
"""


def test_skewed_clocks_never_take_a_live_lease(cluster):
    """A taker on a machine whose wall clock runs ahead of the holder's by 2.5 s of a 3 s lease (more than the two
    thirds that let it take a live lease before) asks just before the holder's next renewal, when the holder's
    `expires` is behind the taker's clock: the lease is live (renewed every second), so it is refused (exit 3), never
    taken over; the holder keeps it."""
    from pipeline.lease import Lease

    world, s3, head, root = cluster
    storage = load_config(None, s3_config(s3, root)).storage
    date = s3.uri("skew", "run_date=2026-11-21")
    a = Lease(date, "A", storage, ttl_s=3).acquire()
    try:
        for _ in range(2):
            taker = subprocess.run(
                [sys.executable, "-c", SKEWED_TAKER, date, s3.endpoint],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            assert taker.returncode == 3, taker.stderr[-2000:]
            assert "is being written by run A" in taker.stdout
        a.check()  # still A's
    finally:
        a.release()
    Lease(date, "B", storage, ttl_s=3).acquire().release()  # released: taken at once


def test_a_holder_that_cannot_renew_counts_itself_lost(cluster, monkeypatch):
    """A partition from the store: every renewal fails. After lease_s without a renewal (its own monotonic clock)
    the holder has lost the date (another run may take it over from then on) and refuses to publish."""
    import botocore.exceptions

    from pipeline import lease as L

    world, s3, head, root = cluster
    storage = load_config(None, s3_config(s3, root)).storage
    a = L.Lease(s3.uri("partition", "run_date=2026-11-21"), "A", storage, ttl_s=1.5).acquire()

    def unreachable(*args, **kwargs):
        raise botocore.exceptions.EndpointConnectionError(endpoint_url=s3.endpoint)

    monkeypatch.setattr(L.S, "put_if", unreachable)
    time.sleep(2.5)  # the renewals at 0.5, 1.0, 1.5, 2.0 s fail; the one after 1.5 s finds it stale
    assert a.lost and "could not renew its run_date lease" in a.lost
    with pytest.raises(L.LeaseLost, match="could not renew"):
        a.check()


def test_a_paused_publisher_publishes_nothing(cluster):
    """A driver that read _LATEST's version when it took the date, then paused past its lease while another run
    took over and published: its publish (compare-and-swap on that version) fails with LeaseLost; the newer run
    stays published and is not marked superseded."""
    from pipeline.lease import LeaseLost

    world, s3, head, root = cluster
    storage = load_config(None, s3_config(s3, root)).storage
    output = s3.uri("paused")
    for run_id in ("A", "B", "C"):
        S.write_bytes(S.join(runs.run_dir(output, "2026-11-21", run_id), "_SUCCESS"), b"", storage)
    seen_by_a = runs.latest_version(output, "2026-11-21", storage)  # None: nothing published yet
    runs.publish(output, "2026-11-21", "B", storage, grace_s=3600.0, latest=seen_by_a)  # B took over, published
    with pytest.raises(LeaseLost, match="another run published the date"):
        runs.publish(output, "2026-11-21", "A", storage, grace_s=0.0, latest=seen_by_a)  # A wakes up
    assert runs.latest_run(output, "2026-11-21", storage).endswith("run_id=B")
    assert S.read_bytes(S.join(runs.run_dir(output, "2026-11-21", "B"), "_SUPERSEDED"), storage) is None
    assert S.read_bytes(S.join(runs.run_dir(output, "2026-11-21", "A"), "_SUPERSEDED"), storage) is not None
    later = runs.latest_version(output, "2026-11-21", storage)  # a rerun that took the lease after B published
    runs.publish(output, "2026-11-21", "C", storage, grace_s=3600.0, latest=later)
    assert runs.latest_run(output, "2026-11-21", storage).endswith("run_id=C")


def test_overlapping_runs_on_s3_publish_once(cluster, tmp_path):
    """Two drivers of one date started together against S3: one publishes a complete run, the other is refused
    (exit 3) and writes nothing."""
    world, s3, head, root = cluster
    items = s3_config(s3, root, f"output={s3.uri('overlap')}", "compute.batch_size=4")
    cmd = [sys.executable, "-m", "jobs.nightly", *(x for item in items for x in ("--set", item))]
    env = {**os.environ, "RAY_ADDRESS": head.address}
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) + (p.returncode,) for p in procs]
    assert sorted(rc for _, _, rc in results) == [0, 3], [err[-2000:] for _, err, _ in results]
    assert "is being written by run" in next(err for _, err, rc in results if rc == 3)
    storage = load_config(None, items).storage
    date = s3.uri("overlap", "run_date=2026-11-21")
    published = runs.resolve(date, storage)
    fs, path = S.filesystem(published, storage)
    assert pq.read_table(f"{path}/recommendations", filesystem=fs).num_rows == 100 * 5
    assert S.list_children(date, storage) == [published.rsplit("/", 1)[1]]  # the refused run wrote nothing
