"""The nightly graph on a real Ray head node (token auth) against a real S3 server (SeaweedFS): inputs, models
and outputs all on s3://; wrong credentials fail clearly and leak no secret; `ray job submit` end to end."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch

from decoding.templates import TEMPLATE_FILE, PromptTemplate, write_template
from jobs import nightly, show, upload_model
from pipeline import runs
from pipeline import storage as S
from pipeline.config import load_config
from pipeline.output import open_run
from pipeline.storage import Storage
from tests.servers import check_then_put, ignoring_conditions, ray_head, seaweedfs, store_proxy
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


def test_a_deployment_from_an_uploaded_model_and_an_s3_config_equals_beam_search(cluster, tmp_path, capsys):
    """The path of a new deployment: the model uploaded with the command, the config read from s3://, the driver in
    its own process (as on a cluster), connected to the token-authenticated head. Its node cannot hold the models
    (models.cache_dir under a HOME that is a file: no folder can be made there): it checks them on the store without
    their weights, and the actors, whose HOME is the head's, download them; the manifest's sha256 is the local
    folder's. Every user's list is beam search's; evaluation and report read the run from the bucket; `show`, the
    reader API and the example read the manifest's files, never a stale shard."""
    import uuid

    world, s3, head, root = cluster
    storage = Storage(s3.endpoint)
    local, uri, output = tmp_path / "model", s3.uri("models", "uploaded"), s3.uri("deployed")
    shutil.copytree(world / "target", local)
    assert upload(world, s3, local, uri) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["files"] == {p.name: S.sha256_file(p) for p in local.iterdir()} and summary["template"] == "codes"
    assert json.loads(S.read_bytes(S.join(uri, "sha256sums.json"), storage)) == summary["files"]
    assert sorted(keys(s3, "models/uploaded")) == sorted(
        f"models/uploaded/{n}" for n in [*summary["files"], "sha256sums.json"]
    )

    cache = Path.home() / ".cache" / f"genrec-test-models-{uuid.uuid4().hex[:8]}"
    items = (f"models.cache_dir=~/.cache/{cache.name}", f"models.target={uri}", f"output={output}")
    config = write_config(tmp_path / "nightly.yaml", s3_config(s3, root, *items))
    S.write_bytes(s3.uri("configs", "nightly.yaml"), config.read_bytes(), storage)
    with pytest.raises(ValueError, match="not found"):
        load_config(s3.uri("configs", "missing.yaml"), [f"storage.endpoint={s3.endpoint}"])
    (tmp_path / "no-home").write_text("")  # the driver's HOME: a file
    env = {**os.environ, **head.env(), "RAY_ADDRESS": head.address, "HOME": str(tmp_path / "no-home")}
    env["AWS_ENDPOINT_URL"] = s3.endpoint  # where the driver reads its s3:// config
    run = subprocess.run(
        [sys.executable, "-m", "jobs.nightly", "--config", s3.uri("configs", "nightly.yaml")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    assert (tmp_path / "no-home").is_file() and cache.is_dir()  # the actors' copies, none on the driver's side
    shutil.rmtree(cache)
    done = json.loads(run.stdout[run.stdout.index("{") :])
    cfg = load_config(str(config))
    published = runs.latest_run(cfg.output, cfg.run_date, cfg.storage)
    assert published and published.startswith("s3://") and done["run_id"] in published
    manifest = json.loads(S.read_bytes(S.join(published, "manifest.json"), cfg.storage))
    assert manifest["status"] == "succeeded" and manifest["models"]["target"] == {
        "uri": uri,
        "sha256": S.fingerprint(world / "target"),  # the same either way: the local folder's
    }
    assert S.fingerprint(local) == S.fingerprint(world / "target")
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
    reads_back(world, s3, tmp_path, capsys, output, users.user_id.tolist(), env)
    assert upload(world, s3, local, uri) == 0  # the same model again: uploaded again, verified
    assert upload(world, s3, world / "draft", uri) == 2  # another model under the URI nodes cached this one by
    assert "already holds another model" in capsys.readouterr().err
    assert json.loads(S.read_bytes(S.join(uri, "sha256sums.json"), storage)) == summary["files"]


def reads_back(world, s3, tmp_path, capsys, output: str, users: list, env: dict) -> None:
    """`show`, the reader API and the example read a published run's manifest files, never a stale shard placed in
    its folder (a fenced driver's, for users the input does not have), which a listing reads."""
    storage = Storage(s3.endpoint)
    published = open_run(output, storage)
    shards = [S.read_parquet(f, storage) for f in published.files("recommendations")]
    stale = shards[0].set_column(0, "user_id", pc.add(shards[0]["user_id"], 10**6))
    S.write_parquet(stale, S.join(runs.table_dir(published.uri, "recommendations"), "0-stale.parquet"), storage)
    fs, path = S.filesystem(published.uri, storage)
    assert pq.read_table(f"{path}/recommendations", filesystem=fs).num_rows == 5 * len(users) + stale.num_rows

    assert len(shards) == -(-len(users) // 32)  # shards of compute.batch_size users
    recs = open_run(output, storage).table("recommendations")
    manifest_users = pa.concat_tables(shards)["user_id"].to_pylist()
    assert sorted(recs["user_id"].to_pylist()) == sorted(manifest_users) and sorted(set(manifest_users)) == sorted(
        users
    )
    assert recs.num_rows == 5 * len(users) and open_run(output, storage).table("metrics")["users_ok"].to_pylist()

    assert show.main([output, "--endpoint", s3.endpoint]) == 0
    shown = capsys.readouterr().out
    assert published.run_id in shown and "0-stale" not in shown
    assert all(f in shown for name in runs.TABLES for f in published.files(name))
    example = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "examples" / "read_output.py"), output],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert example.returncode == 0, example.stderr[-3000:]
    assert f"users {len(users)}, recommendations {5 * len(users)}" in example.stdout


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


@pytest.mark.faults
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
from pipeline.storage import Storage
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


@pytest.mark.faults
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


@pytest.mark.faults
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


@pytest.mark.faults
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


@pytest.mark.faults
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


# ------------------------------------------------------------------ from a laptop to a cluster: upload, check, read


def keys(s3, prefix: str) -> list[str]:
    """The bucket's keys under a prefix."""
    got = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=prefix.rstrip("/") + "/")
    return [o["Key"] for o in got.get("Contents", [])]


def upload(world, s3, local, uri) -> int:
    """`genrec-batch upload-model LOCAL URI --catalog items.parquet`, in this process."""
    return upload_model.main(
        [str(local), uri, "--catalog", str(world / "data" / "items.parquet"), "--endpoint", s3.endpoint]
    )


def without(name):
    return lambda local: (local / name).unlink()


def tokenizer_removed(local):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (local / name).unlink(missing_ok=True)


def norm_resized(local):
    """model.safetensors with model.norm.weight one longer than config.json's hidden size."""
    from safetensors.torch import load_file, save_file

    weights = load_file(local / "model.safetensors")
    weights["model.norm.weight"] = torch.ones(weights["model.norm.weight"].shape[0] + 1)
    save_file(weights, local / "model.safetensors", metadata={"format": "pt"})


def norm_dropped(local):
    from safetensors.torch import load_file, save_file

    weights = load_file(local / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, local / "model.safetensors", metadata={"format": "pt"})


def linked_outside(local):
    """A file of the folder that is a symbolic link to one outside it."""
    secret = local.parent / "secret.txt"
    secret.write_text("not the model's")
    (local / "notes.txt").symlink_to(secret)


REFUSED = {
    "a pickle named model.safetensors": (
        lambda local: torch.save({"w": torch.zeros(1)}, local / "model.safetensors"),
        "model.safetensors: not a valid safetensors file",
    ),
    "a tensor of another shape": (norm_resized, "model.norm.weight [33] (config: [32])"),
    "a missing tensor": (norm_dropped, "missing ['model.norm.weight']"),
    "a symbolic link": (linked_outside, "notes.txt -> "),
    "no template": (without(TEMPLATE_FILE), "genrec-batch template --model"),
    "pickled weights": (
        lambda local: torch.save({"w": torch.zeros(1)}, local / "pytorch_model.bin"),
        "pytorch_model.bin",
    ),
    "no tokenizer": (tokenizer_removed, "a tokenizer"),
    "no safetensors": (without("model.safetensors"), "*.safetensors weights"),
    "a template that does not render": (
        lambda local: write_template(local, PromptTemplate(code_token="<{level}-{code}>")),
        "<a-",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_an_incomplete_model_folder_is_refused_before_any_upload(cluster, tmp_path, capsys, case):
    world, s3, _, _ = cluster
    spoil, named = REFUSED[case]
    local = tmp_path / "model"
    shutil.copytree(world / "target", local)
    spoil(local)
    prefix = f"models/refused-{case.replace(' ', '-')}"
    assert upload(world, s3, local, s3.uri(prefix)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and named in err, err
    assert keys(s3, prefix) == []  # nothing written


def test_a_model_copied_without_its_checksums_names_upload_model(cluster, tmp_path):
    """A folder copied with `aws s3 sync` has no sha256sums.json: the nightly's model loading names the command."""
    world, s3, _, _ = cluster
    fs = s3.filesystem()
    for f in (world / "target").iterdir():
        with fs.open_output_stream(f"{s3.bucket}/models/synced/{f.name}") as out:
            out.write(f.read_bytes())
    with pytest.raises(FileNotFoundError, match=r"no sha256sums\.json.*genrec-batch upload-model"):
        S.local_model_dir(s3.uri("models", "synced"), str(tmp_path / "cache"), Storage(s3.endpoint))


def test_a_store_that_ignores_conditional_writes_is_refused_before_the_lease(cluster, tmp_path, capsys, monkeypatch):
    """Behind a proxy that strips If-None-Match / If-Match (and signs the requests again), SeaweedFS acts as a store
    that ignores conditional writes: the nightly exits 2 naming both capabilities, before its lease; the real store
    passes the same check (and the nightly on it publishes: above), as does a local output, unless its filesystem has
    no hard links or its locks do not exclude; no scratch object stays."""
    world, s3, _, root = cluster
    output = s3.uri("ignoring")
    with store_proxy(s3) as proxy:
        proxy.rewrite = ignoring_conditions(s3)
        extra = (f"output={output}", f"storage.endpoint={proxy.endpoint}")
        config = write_config(tmp_path / "nightly.yaml", s3_config(s3, root, *extra))
        assert nightly.main(["--config", str(config), "--check"]) == 2  # what --check catches, as the run does
        assert "conditional create (If-None-Match: *)" in capsys.readouterr().err
        assert nightly.main(["--config", str(config)]) == 2
        requests = list(proxy.requests)
    err = capsys.readouterr().err
    assert "conditional create (If-None-Match: *): a second create of one key succeeded" in err, err
    assert "conditional replace (If-Match: ETag): a replace of a version already replaced succeeded" in err
    assert any("_STORE_CHECK" in target for _, target in requests)
    assert not any("_LEASE" in target for _, target in requests) and keys(s3, "ignoring") == []
    from tests.servers import free_ports

    (dead,) = free_ports(1)  # a store nobody answers at: --check ends as the run would, exit 4
    down = write_config(tmp_path / "down.yaml", s3_config(s3, root, f"storage.endpoint=http://127.0.0.1:{dead}"))
    assert nightly.main(["--config", str(down), "--set", "storage.retry_s=1", "--check"]) == 4
    assert "unavailable" in capsys.readouterr().err
    S.check_conditional_writes(output, Storage(s3.endpoint))
    S.check_conditional_writes(str(tmp_path / "local" / "run"), Storage())  # the folders it made, removed after
    (tmp_path / "kept").mkdir()
    S.check_conditional_writes(str(tmp_path / "kept"), Storage())  # a folder that was there stays, empty
    assert keys(s3, "ignoring") == [] and not (tmp_path / "local").exists()
    assert list((tmp_path / "kept").iterdir()) == []

    def no_links(src, dst):
        raise PermissionError(1, "Operation not permitted")

    with monkeypatch.context() as m:
        m.setattr(S.os, "link", no_links)
        with pytest.raises(ValueError, match="has no hard links"):  # a filesystem without them (the local create)
            S.check_conditional_writes(str(tmp_path / "nolinks"), Storage())
    monkeypatch.setattr(S.fcntl, "flock", lambda fd, op: None)  # a filesystem whose locks do not exclude
    with pytest.raises(ValueError, match="granted two exclusive locks"):
        S.check_conditional_writes(str(tmp_path / "nolocks"), Storage())


def test_a_store_that_checks_then_writes_is_refused_before_the_lease(cluster, tmp_path, capsys):
    """Behind a proxy that emulates conditional puts with a HEAD, then a PUT (`check_then_put`), SeaweedFS answers
    each put alone as S3 would, but two drivers racing for a lease could both take it: the store check's racing
    creates and replaces find it out, and the nightly exits 2 naming both, before its lease; no scratch object stays.
    It cannot pass by chance: the racers are released together by a barrier and send at once (milliseconds apart),
    and the proxy holds every put that passed its HEAD for 0.2 s before it writes, so every racer's HEAD comes
    before any racer's put lands."""
    world, s3, _, root = cluster
    output = s3.uri("checks-then-puts")
    with store_proxy(s3) as proxy:
        proxy.rewrite, proxy.continue_early = check_then_put(s3, delay_s=0.2), True
        extra = (f"output={output}", f"storage.endpoint={proxy.endpoint}")
        config = write_config(tmp_path / "nightly.yaml", s3_config(s3, root, *extra))
        assert nightly.main(["--config", str(config)]) == 2
        requests = list(proxy.requests)
    error = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))
    assert "conditional create (If-None-Match: *): " in error and "conditional replace (If-Match: ETag): " in error
    assert " concurrent creates of one key succeeded (the store checks, then writes: not atomic)" in error, error
    assert " concurrent replaces of one version succeeded (the store checks, then writes: not atomic)" in error
    assert "a second create" not in error and "already replaced" not in error  # one at a time it behaves
    assert any("_STORE_CHECK" in target for _, target in requests)
    assert not any("_LEASE" in target for _, target in requests) and keys(s3, "checks-then-puts") == []


@pytest.mark.parametrize(
    "name",
    ["../../escaped", "/tmp/absolute", ".complete", "weights.bin", "sub/model.json"],  # guard: never read
)
def test_checksums_naming_anything_but_a_plain_file_are_refused(cluster, tmp_path, name):
    """sha256sums.json names the files a node copies into its cache: a name that leaves the cache folder, a hidden
    one (the cache's own markers) or a pickle is refused before anything is copied."""
    world, s3, _, _ = cluster
    storage, uri = Storage(s3.endpoint), s3.uri("models", "crafted")
    digest = S.sha256_file(world / "target" / "config.json")
    S.write_bytes(S.join(uri, "config.json"), (world / "target" / "config.json").read_bytes(), storage)
    S.write_bytes(S.join(uri, "sha256sums.json"), json.dumps({"config.json": digest, name: digest}).encode(), storage)
    with pytest.raises(ValueError, match=f"model {uri}: sha256sums.json names {name!r}"):
        S.local_model_dir(uri, str(tmp_path / "cache" / "node"), storage)
    assert not list((tmp_path / "cache").rglob("config.json")) and not (tmp_path / "cache" / "escaped").exists()


def test_two_uploads_racing_to_one_prefix_do_not_both_succeed(cluster, tmp_path, monkeypatch):
    """Another model's upload lands between this upload's read of sha256sums.json and its write: the conditional
    write of sha256sums.json fails and the upload is refused, leaving the other's sums in place."""
    world, s3, _, _ = cluster
    storage, uri = Storage(s3.endpoint), s3.uri("models", "raced")
    read, raced = S.read_versioned, []

    def read_then_race(u, st, budget_s=None):
        got = read(u, st, budget_s)
        if u == S.join(uri, "sha256sums.json") and not raced:
            raced.append("under way")  # the racing upload reads it too
            raced[0] = S.upload_model_dir(str(world / "target"), uri, storage)
        return got

    monkeypatch.setattr(S, "read_versioned", read_then_race)
    with pytest.raises(ValueError, match="changed while this model was uploaded"):
        S.upload_model_dir(str(world / "draft"), uri, storage)
    assert json.loads(read(S.join(uri, "sha256sums.json"), storage)[0]) == raced[0]


def test_the_driver_checks_an_s3_model_without_its_weights(cluster, tmp_path):
    """S.model_head: the model's small files downloaded and checked, its weights only HEADed and their headers read
    (a ranged GET); its sha256 is the local folder's. A weight file missing, cut short, or not safetensors at all is
    refused, naming it."""
    world, s3, _, _ = cluster
    storage = Storage(s3.endpoint)
    uri = s3.uri("models", "head-checked")
    S.upload_model_dir(str(world / "target"), uri, storage)
    head = tmp_path / "head"
    head.mkdir()
    sums = S.model_head(uri, storage, head)
    assert S.weights_fingerprint(sums) == S.fingerprint(world / "target")
    assert (head / "config.json").is_file() and not list(head.glob("*.safetensors"))
    (weights,) = [n for n in sums if n.endswith(".safetensors")]
    key = f"models/head-checked/{weights}"
    data = (world / "target" / weights).read_bytes()
    client = s3.client()
    for damage, why in (
        (lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=data[:-100]), "cut short or padded"),
        (lambda: client.put_object(Bucket=s3.bucket, Key=key, Body=b"\x80\x04pickled" * 10), "not a safetensors"),
        (lambda: client.delete_object(Bucket=s3.bucket, Key=key), "missing"),
    ):
        damage()
        with pytest.raises(ValueError, match=f"{weights}: .*{why}"):
            S.model_head(uri, storage, head)


def test_a_model_replaced_at_its_prefix_is_fetched_anew_and_an_actor_refuses_the_old_one(cluster, tmp_path):
    """The node's cache is keyed by content. Three actors of a node fetch M1 at once: one copy, every file checked.
    The prefix is deleted and M2 uploaded there: an actor of a run planned with M1 refuses it, naming the URI and
    both digests, before any weight is read; one of a run planned with M2 gets M2, never the cached M1, which stays
    while an actor uses it and is deleted by the first fetch after that actor is gone."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import replace
    from functools import partial

    from decoding.templates import PRESETS
    from operators.recommender import prepare
    from operators.spec import ActorSpec
    from pipeline.plan import fetch_model
    from tests.node import fetched

    world, s3, _, _ = cluster
    storage, uri, cache = Storage(s3.endpoint), s3.uri("models", "replaced"), str(tmp_path / "cache")
    m1 = S.upload_model_dir(str(world / "target"), uri, storage)
    one = S.weights_fingerprint(m1)
    spawn = multiprocessing.get_context("spawn")
    queue = spawn.Queue()
    holder = spawn.Process(target=fetched, args=(uri, cache, s3.endpoint, one, 300, queue))  # an actor of M1, alive
    holder.start()
    try:
        with ProcessPoolExecutor(2, mp_context=spawn) as pool:
            got = [*pool.map(fetched, [uri] * 2, [cache] * 2, [s3.endpoint] * 2, [one] * 2), queue.get(timeout=60)]
        assert len({path for path, _ in got}) == 1 and all(files == m1 for _, files in got)
        old = Path(got[0][0])

        S.delete_tree(uri, storage)
        m2 = S.upload_model_dir(str(world / "draft"), uri, storage)
        two = S.weights_fingerprint(m2)
        assert one != two
        catalog = pq.read_table(world / "data" / "items.parquet")
        fetch = partial(fetch_model, cache_dir=cache, storage=storage)
        spec = ActorSpec("r", uri, catalog, "items", template=PRESETS["codes"].with_max_items(8), fetch=fetch)
        with pytest.raises(S.ModelChanged, match=rf"model {uri} on node .*: its weights are {two} now, .*{one}"):
            prepare(replace(spec, target_sha256=one))  # an actor of a run planned with M1
        new = Path(prepare(replace(spec, target_sha256=two)).target)  # one of a run planned with M2
        assert new != old and {f.name: S.sha256_file(f) for f in new.iterdir() if f.name[0] != "."} == m2
        assert old.is_dir()  # M1's actor still uses it
    finally:
        holder.terminate()
        holder.join()
    assert Path(fetch(uri, two, "")) == new and not old.exists()  # M1's actor is gone: the next fetch deletes its copy


@pytest.mark.faults
def test_worker_nodes_without_credentials_end_the_run_with_one_line_naming_the_node_and_the_fix(cluster, tmp_path):
    """The driver has the store's credentials, its workers none (the job's runtime env empties AWS_*): the first
    actor cannot read the s3:// model and the run ends before any decoding, exit 9, its whole stderr one `error:`
    line naming the node, the URI and the fix; nothing published."""
    from tests.helpers import assert_one_error_line

    world, s3, head, root = cluster
    out = tmp_path / "out"
    items = s3_config(s3, root, f"input={world / 'data' / 'test.parquet'}", f"output={out}")
    items += [f"catalog={world / 'data' / 'items.parquet'}", "decoding.mode=beam", f"models.cache_dir={tmp_path}"]
    bare = {name: "" for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")}
    workers = {"runtime_env": {"env_vars": {**bare, "AWS_EC2_METADATA_DISABLED": "true"}}}
    env = {**os.environ, "RAY_ADDRESS": head.address, "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(workers)}
    cmd = [sys.executable, "-m", "jobs.nightly", "--config", str(write_config(tmp_path / "c.yaml", items))]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 9, run.stderr[-3000:]
    uri = re.escape(s3.uri("models", "target"))
    assert_one_error_line(run.stderr, rf"error: node \S+ \([\d.]+\) cannot read the model {uri}: Unable to locate "
                          r"credentials\. Every worker node .*IRSA.*runtime_env env_vars.*")  # fmt: skip
    assert runs.latest_run(str(out), "2026-11-21", Storage()) is None
    assert not list(out.rglob("*.parquet"))  # no shard: nothing was decoded


def test_a_model_whose_config_changed_at_its_prefix_with_the_same_weights_is_refused(cluster, tmp_path):
    """The plan fingerprints a model's weights and its other files (config, tokenizer, chat template). M1 is replaced
    by M1', the same weights and a config.json of another rope_theta (other lists): an actor of a run planned with M1
    refuses it, s3:// or local, naming the URI; one planned with M1' gets it."""
    from pipeline.plan import fetch_model, model_of

    world, s3, _, _ = cluster
    storage, uri, cache = Storage(s3.endpoint), s3.uri("models", "reconfigured"), str(tmp_path / "cache")
    local = shutil.copytree(world / "target", tmp_path / "local")

    def put(local: Path) -> dict:  # the model's files at the prefix, then its sums (as upload-model writes them)
        sums = {f.name: S.sha256_file(f) for f in local.iterdir()}
        for name in sums:
            S.write_bytes(S.join(uri, name), (local / name).read_bytes(), storage)
        S.write_bytes(S.join(uri, S.MODEL_SUMS), json.dumps(sums).encode(), storage)
        return sums

    put(local)
    planned = {where: model_of(where, storage) for where in (uri, str(local))}
    assert planned[uri]["files"] == planned[str(local)]["files"]
    config = json.loads((local / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 10.0
    (local / "config.json").write_text(json.dumps(config))
    now = put(local)
    assert S.weights_fingerprint(now) == planned[uri]["sha256"] and S.files_fingerprint(now) != planned[uri]["files"]
    for where, m in planned.items():
        with pytest.raises(S.ModelChanged, match=f"model {re.escape(where)} on node .*: its files but the weights"):
            fetch_model(where, m["sha256"], m["files"], cache, storage)
    got = Path(fetch_model(uri, S.weights_fingerprint(now), S.files_fingerprint(now), cache, storage))
    assert json.loads((got / "config.json").read_text())["rope_parameters"]["rope_theta"] == 10.0
