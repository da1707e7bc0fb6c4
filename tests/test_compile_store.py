"""The compiled engine's cache in object storage (pipeline/models.CompileStore, compute.compile_store) and the nightly's
record of compute.engine auto, on SeaweedFS and a local Ray. Not numerics-sensitive (what is compared here is files,
counts and records; the engines' parity is tests/test_compiled.py's), so `make test-kernels` does not repeat it."""

import json
import logging
from pathlib import Path

import pytest

from tests.servers import seaweedfs
from tests.test_compiled import COMPILE_CACHE


def test_a_store_warm_starts_the_next_nightly_actor_and_auto_records_its_choice(tmp_path_factory):
    """compute.engine=compiled with the compile store on SeaweedFS: the first run's actor (an empty node cache)
    compiles its bucket cold at start and uploads the cache; the second run's actor (a new process, another empty
    node cache) fetches it, verifies it and starts warm: 0 graphs compiled from scratch, the same recommendations.
    Then compute.engine auto: the actor's choice, trials and parity in the manifest and the report."""
    import pyarrow.parquet as pq
    import ray

    from pipeline.nightly import run_nightly
    from pipeline.report import report_run
    from tests.test_nightly import config, make_world, read_run

    root = tmp_path_factory.mktemp("compile-store")
    world = make_world(root, n_users=40)  # shards of 16, 16 and 8 users
    with seaweedfs(root / "s3") as s3, pytest.MonkeyPatch.context() as env:
        for name, value in s3.env().items():  # the actors' credentials (the raylet passes its environment on)
            env.setenv(name, value)
        store = [f"compute.compile_store={s3.uri('compile-cache')}", f"storage.endpoint={s3.endpoint}"]
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            runs = {}
            for run in ("cold", "warm"):  # each actor with a node cache of its own, empty
                cache = f"compute.compile_cache={root / ('node-cache-' + run)}"
                runs[run] = run_nightly(config(world, world / run, "compute.engine=compiled", cache, *store))
            auto_cfg = config(
                world,
                world / "auto",
                "compute.engine=auto",
                f"compute.compile_cache={COMPILE_CACHE}",
                "compute.engine_short_run_s=0",
                "compute.engine_trials=1",
            )
            auto = run_nightly(auto_cfg)
        finally:
            ray.shutdown()
    out = {run: read_run(config(world, world / run))[1] for run in ("cold", "warm")}
    cache = [json.loads(out[run]["metrics"].to_pandas().compile_cache.dropna().iloc[0]) for run in ("cold", "warm")]
    assert cache[0]["fetched"]["note"] == "no cache for this key" and cache[0]["uploaded"]["uploaded"]
    assert cache[0]["graphs_cold"] == 2 and runs["cold"]["engine"]["graphs_cold"] == 2
    assert cache[1]["fetched"]["used"] and cache[1]["key"] == cache[0]["key"] and cache[1]["uploaded"] is None
    assert cache[1]["graphs_cold"] == 0 and runs["warm"]["engine"]["graphs_cold"] == 0  # started warm
    assert runs["warm"]["engine"]["compile_store"] == s3.uri("compile-cache")
    recs = [out[run]["recommendations"].to_pandas().sort_values(["user_id", "rank"]) for run in ("cold", "warm")]
    assert (
        recs[0][["user_id", "rank", "item_id"]].values.tolist()
        == recs[1][["user_id", "rank", "item_id"]].values.tolist()
    )
    assert len(recs[0]) == 5 * pq.read_metadata(world / "data" / "test.parquet").num_rows
    print(
        f"\ncompile store: cold start compiled {runs['cold']['timings']['compile_s']} s, warm start "
        f"{runs['warm']['timings']['compile_s']} s (fetched {cache[1]['fetched']['bytes']} bytes)"
    )
    ((actor, state),) = auto["auto"].items()
    assert state["engine"]["choice"] in ("eager", "compiled") and state["engine"]["parity"][0]["holds"]
    assert auto["engine"]["name"] == "auto"
    _, page = report_run(str(world / "auto"), auto_cfg.storage)
    assert f"engine **{state['engine']['choice']}** on cpu" in (Path(page) / "report.md").read_text()


def test_a_corrupted_partial_or_foreign_compile_cache_is_ignored_with_a_warning(tmp_path, caplog):
    """CompileStore on SeaweedFS: a cache published for a key is fetched whole (its files unpacked as uploaded); an
    archive whose bytes changed, an archive that is missing (a partial upload), a cache.json written for another key
    or torch version, and a cache.json that is not one are each ignored with a warning that says why, nothing
    unpacked: the actor compiles cold, never fails."""
    from pipeline import storage as S
    from pipeline.config import Storage
    from pipeline.models import CompileStore

    made = tmp_path / "made"
    (made / "fxgraph" / "ab").mkdir(parents=True)
    (made / "fxgraph" / "ab" / "entry").write_bytes(b"compiled graph")
    (made / "locks").mkdir()
    (made / "locks" / "x.lock").write_bytes(b"")
    key = "torch-x/cpu-avx2/model-0123-float32/b16-p24-x0-k5-l3"
    with seaweedfs(tmp_path / "s3") as s3, pytest.MonkeyPatch.context() as env:
        for name, value in s3.env().items():
            env.setenv(name, value)
        store = CompileStore(s3.uri("cc"), Storage(endpoint=s3.endpoint))
        assert store.fetch(key, str(tmp_path / "none"))["note"] == "no cache for this key"
        assert store.publish(key, str(made))["uploaded"]
        got = store.fetch(key, str(tmp_path / "fetched"))
        assert got["used"] and (tmp_path / "fetched" / "fxgraph" / "ab" / "entry").read_bytes() == b"compiled graph"
        assert not (tmp_path / "fetched" / "locks").exists()  # lock files stay on their node
        meta = json.loads(S.read_bytes(S.join(store.root, key, "cache.json"), store.storage))
        archive = S.join(store.root, key, meta["archive"])
        good = S.read_bytes(archive, store.storage)
        cases = {
            "does not match its checksum": lambda: S.write_bytes(archive, good[:-7] + b"garbage", store.storage),
            "is missing (a partial upload)": lambda: s3.client().delete_object(
                Bucket=s3.bucket, Key=archive.split(f"{s3.bucket}/", 1)[1]
            ),
            "a foreign cache": lambda: S.write_bytes(
                S.join(store.root, key, "cache.json"), json.dumps({**meta, "key": "other"}).encode(), store.storage
            ),
            "is not a cache description": lambda: S.write_bytes(
                S.join(store.root, key, "cache.json"), b'{"x": 1}', store.storage
            ),
        }
        for i, (why, damage) in enumerate(cases.items()):
            S.write_bytes(archive, good, store.storage)
            S.write_bytes(S.join(store.root, key, "cache.json"), json.dumps(meta).encode(), store.storage)
            damage()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="genrec.nightly"):
                got = store.fetch(key, str(tmp_path / f"case{i}"))
            assert got["found"] and not got["used"] and why in got["note"], got
            assert not (tmp_path / f"case{i}").exists()
            assert any("compile cache" in r.message and "ignored" in r.message for r in caplog.records)
