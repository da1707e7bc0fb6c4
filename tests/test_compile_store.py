"""The compiled engine in the nightly: its cache in object storage (pipeline/models.CompileStore,
compute.compile_store), a compiled night publishing the eager night's lists, and the record of compute.engine auto,
on SeaweedFS and a local Ray. Not numerics-sensitive: what is compared here is files, counts, records and the
actor's plumbing (a compiled night's lists against an eager night's, users clear of a near-tie); the engines' parity
under every kernel family is tests/test_compiled.py's, so `make test-kernels` does not repeat this."""

import hashlib
import io
import json
import logging
import mmap
import pickle
import tarfile
from pathlib import Path

import pytest
import torch

from decoding.compiled import GRAPHS_PER_BUCKET
from pipeline.models import KEY_ENV, KEY_FILE_ENV
from tests.servers import seaweedfs

SECRET = "a-test-signing-key-of-the-store"


def test_a_store_warm_starts_the_next_nightly_actor_and_auto_records_its_choice(tmp_path_factory):
    """compute.engine=compiled with the compile store on SeaweedFS: the first run's actor (an empty node cache) finds
    at its key an archive planted by a store writer without the signing key (code that runs when inductor loads it),
    never unpacks it (the code never runs), compiles its bucket cold at start and uploads the cache, signed; the
    second run's actor (a new process, another empty node cache) fetches it, verifies it and starts warm: 0 graphs
    compiled from scratch, the same recommendations. The cold run publishes the eager run's lists
    (`assert_publishes_what_eager_does`). Then compute.engine auto: the run's one decision, its trials and parity in
    the manifest and the report."""
    import pyarrow.parquet as pq
    import ray

    from pipeline.nightly import run_nightly
    from pipeline.report import report_run
    from tests.test_nightly import config, make_world, read_run

    root = tmp_path_factory.mktemp("compile-store")
    world = make_world(root, n_users=40)  # shards of 16, 16 and 8 users
    marker = root / "planted-code-ran"
    with seaweedfs(root / "s3") as s3, pytest.MonkeyPatch.context() as env:
        for name, value in s3.env().items():  # the actors' credentials (the raylet passes its environment on)
            env.setenv(name, value)
        env.setenv(KEY_ENV, SECRET)  # the actors' signing key
        store = [f"compute.compile_store={s3.uri('compile-cache')}", f"storage.endpoint={s3.endpoint}"]
        # whoever can write to the store, without the key, plants code at the key the cold run's actor will fetch
        planted = plant(world, config(world, world / "cold", "compute.engine=compiled", *store), marker, b"not-the-key")
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            runs = {}
            for run in ("cold", "warm"):  # each actor with a node cache of its own, empty
                cache = f"compute.compile_cache={root / ('node-cache-' + run)}"
                runs[run] = run_nightly(config(world, world / run, "compute.engine=compiled", cache, *store))
            runs["eager"] = run_nightly(config(world, world / "eager"))  # a local target: no store
            auto_cfg = config(  # on the warm run's node cache: its trials compile nothing from scratch
                world,
                world / "auto",
                "compute.engine=auto",
                f"compute.compile_cache={root / 'node-cache-warm'}",
                "compute.engine_short_run_s=0",
                "compute.engine_trials=1",
            )
            auto = run_nightly(auto_cfg)
        finally:
            ray.shutdown()
    out = {run: read_run(config(world, world / run))[1] for run in ("cold", "warm", "eager")}
    assert_publishes_what_eager_does(world, out, runs)
    cache = [json.loads(out[run]["metrics"].to_pandas().compile_cache.dropna().iloc[0]) for run in ("cold", "warm")]
    assert cache[0]["key"] == planted and cache[0]["fetched"]["found"] and not cache[0]["fetched"]["used"]
    assert "is not signed with this store's key" in cache[0]["fetched"]["note"] and not marker.exists()
    assert cache[0]["uploaded"]["uploaded"]  # compiled cold, and replaced the planted cache with a signed one
    assert cache[0]["graphs_cold"] == GRAPHS_PER_BUCKET and runs["cold"]["engine"]["graphs_cold"] == GRAPHS_PER_BUCKET
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
    decision = auto["engine"]["decision"]  # the run's one decision (_ENGINE.json), taken on the input's first users
    assert decision["choice"] == state["engine"]["choice"] and decision["decided_by"] == actor
    assert state["engine"]["trial_batches"] >= 1 and decision["parity"][0]["users"] >= 16
    _, page = report_run(str(world / "auto"), auto_cfg.storage)
    assert f"engine **{state['engine']['choice']}** on cpu" in (Path(page) / "report.md").read_text()


def assert_publishes_what_eager_does(world: Path, out: dict, runs: dict) -> None:
    """The cold compiled run (its actor compiled its bucket at start) against the eager run: the same users and
    ranks, and the same lists for every user clear of a near-tie within the two runs' largest score difference
    (at least 90% of them); compile seconds and graphs in the metrics and the manifest, none for eager."""
    import pyarrow.parquet as pq

    from tests.test_nightly import direct_beam_search

    recs = {e: out[e]["recommendations"].to_pandas().sort_values(["user_id", "rank"]) for e in ("eager", "cold")}
    assert recs["eager"][["user_id", "rank"]].values.tolist() == recs["cold"][["user_id", "rank"]].values.tolist()
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    ref, _ = direct_beam_search(world, users.history.tolist())
    gap = dict(zip(users.user_id, ref.stats["tie_gap"].tolist()))
    diff = float((recs["eager"].score.values - recs["cold"].score.values).__abs__().max())
    same = {u: g.item_id.tolist() for u, g in recs["eager"].groupby("user_id")}
    clear = [u for u in same if gap[u] > 2 * diff]
    assert len(clear) >= 0.9 * len(same), f"{len(same) - len(clear)} users within {2 * diff:.2g} of a near-tie"
    got = {u: g.item_id.tolist() for u, g in recs["cold"].groupby("user_id")}
    assert all(got[u] == same[u] for u in clear)
    metrics = out["cold"]["metrics"].to_pandas()
    assert (metrics.engine == "compiled").all() and sorted(metrics.users_in) == [8, 16, 16]
    assert metrics.graphs_compiled.sum() == GRAPHS_PER_BUCKET  # the warm-up's: every shard snapped to its bucket
    manifest, eager = runs["cold"], runs["eager"]
    ((actor, seconds),) = manifest["timings"]["compile_s"].items()
    assert seconds > 0 and manifest["engine"]["name"] == "compiled"
    assert manifest["engine"]["graphs_compiled"] == GRAPHS_PER_BUCKET
    assert eager["timings"]["compile_s"] is None and eager["engine"]["graphs_compiled"] == 0
    assert eager["engine"]["compile_store"] is None  # a local target: no store unless one is named


def test_a_corrupted_partial_or_foreign_compile_cache_is_ignored_with_a_warning(tmp_path, caplog):
    """CompileStore on SeaweedFS: a cache published for a key is fetched whole (its files unpacked as uploaded); an
    archive whose bytes changed, an archive that is missing (a partial upload), a cache.json written for another key
    or torch version, and a cache.json that is not one are each ignored with a warning that says why, nothing
    unpacked: the actor compiles cold, never fails."""
    from pipeline import storage as S
    from pipeline.models import CompileStore, compile_target, seal
    from pipeline.storage import Storage

    made = tmp_path / "made"
    (made / "fxgraph" / "ab").mkdir(parents=True)
    (made / "fxgraph" / "ab" / "entry").write_bytes(b"compiled graph")
    (made / "locks").mkdir()
    (made / "locks" / "x.lock").write_bytes(b"")
    key = "torch-x/cpu-avx2/model-0123-float32/b16-p24-x0-k5-l3"
    with seaweedfs(tmp_path / "s3") as s3, pytest.MonkeyPatch.context() as env:
        for name, value in s3.env().items():
            env.setenv(name, value)
        env.setenv(KEY_ENV, SECRET)
        store = CompileStore(s3.uri("cc"), Storage(endpoint=s3.endpoint))
        where = S.join(store.root, key, compile_target("cpu")["tag"])
        assert store.fetch(key, str(tmp_path / "none"))["note"] == "no cache for this key"
        assert not store.publish(key, str(made))["uploaded"]  # only a folder compiled or verified here
        seal(made, key, SECRET.encode(), compile_target("cpu")["tag"])  # what the actor does after its own compile
        assert store.publish(key, str(made))["uploaded"]
        got = store.fetch(key, str(tmp_path / "fetched"))
        assert got["used"] and (tmp_path / "fetched" / "fxgraph" / "ab" / "entry").read_bytes() == b"compiled graph"
        assert not (tmp_path / "fetched" / "locks").exists()  # lock files stay on their node
        meta = json.loads(S.read_bytes(S.join(where, "cache.json"), store.storage))
        archive = S.join(where, meta["archive"])
        good = S.read_bytes(archive, store.storage)
        cases = {
            "does not match its checksum": lambda: S.write_bytes(archive, good[:-7] + b"garbage", store.storage),
            "is missing (a partial upload)": lambda: s3.client().delete_object(
                Bucket=s3.bucket, Key=archive.split(f"{s3.bucket}/", 1)[1]
            ),
            "a foreign cache": lambda: S.write_bytes(
                S.join(where, "cache.json"), json.dumps({**meta, "key": "other"}).encode(), store.storage
            ),
            "is not a cache description": lambda: S.write_bytes(
                S.join(where, "cache.json"), b'{"x": 1}', store.storage
            ),
        }
        for i, (why, damage) in enumerate(cases.items()):
            S.write_bytes(archive, good, store.storage)
            S.write_bytes(S.join(where, "cache.json"), json.dumps(meta).encode(), store.storage)
            damage()
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="genrec.nightly"):
                got = store.fetch(key, str(tmp_path / f"case{i}"))
            assert got["found"] and not got["used"] and why in got["note"], got
            assert not (tmp_path / f"case{i}").exists()
            assert any("compile cache" in r.message and "ignored" in r.message for r in caplog.records)


# ---------------------------------------------------------------- a store that runs no one else's code

ENTRY = "fxgraph/pl/fplanted/entry"  # where inductor's FX-graph cache keeps a graph it unpickles on load
WRAPPER = "pl/cplanted.py"  # a wrapper module inductor imports on load


class Plant:
    """Unpickled, it runs code: it writes its marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def planted_archive(marker) -> bytes:
    """An inductor cache archive whose loading runs code: a pickled FX-graph entry and a wrapper module, each writing
    `marker` when unpickled or imported."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in ((ENTRY, pickle.dumps(Plant(marker))), (WRAPPER, Plant(marker).__reduce__()[1][0].encode())):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def write_archive(
    store, key: str, data: bytes, secret: bytes | None, signed_key: str | None = None, size: int | None = None
) -> None:
    """Writes `data` and its cache.json at `key` as a store writer would: signed with `secret` (None: unsigned) for
    `signed_key` (default `key`; another: a valid archive replayed under this key), its size given as `size`."""
    from pipeline import storage as S
    from pipeline.models import compile_target, signature

    target = compile_target("cpu")
    sha = hashlib.sha256(data).hexdigest()
    meta = {"archive": f"cache-{sha[:32]}.tar.gz", "sha256": sha, "bytes": size or len(data)}
    meta["torch"] = torch.__version__
    meta.update(key=signed_key or key, target=target)
    if secret is not None:
        meta["signature"] = signature(secret, meta)
    meta["key"] = key
    where = S.join(store.root, key, target["tag"])
    S.write_bytes(S.join(where, meta["archive"]), data, store.storage)
    S.write_bytes(S.join(where, "cache.json"), json.dumps(meta).encode(), store.storage)


def plant(world, cfg, marker, secret: bytes | None) -> str:
    """Plants `planted_archive(marker)` at the key the compiled actor of `cfg` fetches -> the key."""
    from dataclasses import replace

    from decoding.compiled import compile_key
    from operators.recommender import Recommender
    from pipeline.models import compile_store
    from pipeline.plan import plan_run

    plan = plan_run(cfg)
    spec = replace(plan.spec, engine="eager", target_sha256=plan.identity["models"]["target"])
    r = Recommender(spec)
    users, prompt = r.warm_shape()
    key = compile_key(r.target, spec.target_sha256, users, prompt, cfg.decoding.k, r.catalog.code_len, r.prefix_len)
    write_archive(compile_store(cfg), key, planted_archive(marker), secret)
    return key


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with seaweedfs(tmp_path_factory.mktemp("s3")) as server, pytest.MonkeyPatch.context() as env:
        for name, value in server.env().items():
            env.setenv(name, value)
        yield server


KEY = "torch-x/cpu-avx2/model-0123-float32/b16-p24-x0-k5-l3"


def TAG() -> str:  # noqa: N802 -- a constant of this machine, computed on first use
    from pipeline.models import compile_target

    return compile_target("cpu")["tag"]


def test_a_planted_archive_never_runs_its_code(s3, tmp_path, caplog, monkeypatch):
    """An archive whose loading runs code (checked first: unpickling its graph entry writes the marker) is never
    unpacked unless signed with the actor's key for this very key, torch and target: unsigned, signed with another
    key, a valid archive of another key replayed under this one, or any archive where the actor holds no key, each
    is refused with a warning, its folder never created, the marker never written. Signed with the key (from the
    variable or from the file it names) it is unpacked whole."""
    from pipeline.models import CompileStore
    from pipeline.storage import Storage

    control = tmp_path / "control"
    with tarfile.open(fileobj=io.BytesIO(planted_archive(control)), mode="r:gz") as tar:
        pickle.loads(tar.extractfile(ENTRY).read())  # what inductor's cache does with a graph entry
    assert control.read_text() == "ran"  # the plant is live
    marker = tmp_path / "ran"
    data = planted_archive(marker)
    store = CompileStore(s3.uri("planted"), Storage(endpoint=s3.endpoint))
    monkeypatch.setenv(KEY_ENV, SECRET)
    cases = {
        "unsigned": (None, None, "is not signed with this store's key"),
        "signed with another key": (b"another-key", None, "is not signed with this store's key"),
        "replayed from another key": (SECRET.encode(), "torch-x/cpu-avx2/other", "is not signed with this store's key"),
        "no key in the actor": (SECRET.encode(), None, "no signing key"),
    }
    for i, (case, (secret, signed_key, why)) in enumerate(cases.items()):
        write_archive(store, KEY, data, secret, signed_key)
        if case == "no key in the actor":
            monkeypatch.delenv(KEY_ENV)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="genrec.nightly"):
            got = store.fetch(KEY, str(tmp_path / f"node{i}"))
        assert not got["used"] and why in got["note"], (case, got)
        assert not (tmp_path / f"node{i}").exists() and not marker.exists(), case
        if case != "no key in the actor":  # without a key the store is not even read (the driver warned)
            assert got["found"], case
            assert any("compile cache" in r.message and "ignored" in r.message for r in caplog.records), case
    (tmp_path / "key").write_text(SECRET + "\n")
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "key"))
    got = store.fetch(KEY, str(tmp_path / "signed"))
    assert got["used"] and (tmp_path / "signed" / ENTRY).is_file() and not marker.exists()


def test_a_second_actor_never_rewrites_a_folder_the_first_loaded(s3, tmp_path, monkeypatch):
    """Two actors of one node fetch one key: the first unpacks into a fresh folder and renames it into place, the
    second uses that folder as it is (not fetched again); a sibling that lost the race to place it writes nothing
    into it. Every file the first actor loaded keeps its inode, bytes and mtime, and no half-unpacked folder stays."""
    from pipeline.models import CompileStore, seal, unpack_into_place
    from pipeline.storage import Storage

    monkeypatch.setenv(KEY_ENV, SECRET)
    made = tmp_path / "made"
    (made / "ab").mkdir(parents=True)
    (made / "ab" / "graph.so").write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    (made / "ab" / "wrapper.py").write_text("x = 1\n")
    store = CompileStore(s3.uri("siblings"), Storage(endpoint=s3.endpoint))
    seal(made, KEY, SECRET.encode(), TAG())
    assert store.publish(KEY, str(made))["uploaded"]
    node = tmp_path / "node" / "torch-x-avx2"
    assert store.fetch(KEY, str(node))["note"] == "verified and unpacked"

    def seen():
        return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in node.rglob("*") if p.is_file()}

    before = seen()
    with open(node / "ab" / "graph.so", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as loaded:
        second = store.fetch(KEY, str(node))
        assert second["used"] and second["note"] == "the node's verified copy, not fetched again"
        assert second["bytes"] == 0
        archive = tmp_path / "archive.tar.gz"
        archive.write_bytes(pack_of(made))
        assert unpack_into_place(archive, node, KEY, SECRET.encode(), TAG()) == node  # lost the race: theirs
        assert loaded[:4] == b"\x7fELF" and loaded[4:260] == bytes(range(256))
    assert seen() == before and sorted(p.name for p in node.parent.iterdir()) == [node.name]


def pack_of(folder) -> bytes:
    from pipeline.models import pack

    return pack(folder)


@pytest.mark.parametrize("member", ["symlink", "hardlink", "absolute", "parent", "device"])
def test_a_signed_archive_with_links_or_paths_outside_is_not_unpacked(s3, tmp_path, member, monkeypatch):
    """Even signed, an archive member that is a link, a device, an absolute path or climbs out with `..` stops the
    unpacking: nothing is placed and nothing is written outside the folder."""
    from pipeline.models import CompileStore
    from pipeline.storage import Storage

    monkeypatch.setenv(KEY_ENV, SECRET)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo(
            {"absolute": str(tmp_path / "abs"), "parent": "/".join(("..", "escape"))}.get(member, "entry")
        )
        if member in ("symlink", "hardlink"):
            info.type, info.linkname = (tarfile.SYMTYPE if member == "symlink" else tarfile.LNKTYPE), "other"
        elif member == "device":
            info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, 1, 3
        tar.addfile(tarfile.TarInfo("other"), io.BytesIO(b""))
        tar.addfile(info, io.BytesIO(b"") if info.isfile() else None)
    store = CompileStore(s3.uri(f"unsafe-{member}"), Storage(endpoint=s3.endpoint))
    write_archive(store, KEY, buf.getvalue(), SECRET.encode())
    node = tmp_path / "node" / "cache"
    got = store.fetch(KEY, str(node))
    assert got["found"] and not got["used"] and got["note"].startswith("unreadable"), got
    assert not node.exists() and list(node.parent.iterdir()) == []
    assert not (tmp_path / "abs").exists() and not (tmp_path / "node" / "escape").exists()


# ---------------------------------------------------------------- the node's folders, the description, the key


def test_a_node_folder_not_verified_here_is_never_used_or_published(s3, tmp_path, monkeypatch):
    """The node's cache lives under `<compile_cache>/signed-v1/<key>/<target tag>` (apart from folders older code
    unpacked unchecked, and per CPU model and flags: one node's code never runs on another CPU of a shared cache). A
    folder there without a manifest (planted, or left by older code), or whose files changed since it was sealed, is
    moved aside, never used, and `publish` refuses it: nothing planted spreads to the store. A folder sealed here
    (compiled by the actor, or unpacked from a verified archive) is used as it is and published."""
    from pipeline.models import MANIFEST, CompileStore, compile_target, seal
    from pipeline.storage import Storage

    monkeypatch.setenv(KEY_ENV, SECRET)
    store = CompileStore(s3.uri("node-folders"), Storage(endpoint=s3.endpoint))
    folder = Path(store.node_folder(str(tmp_path / "cache"), KEY))
    assert folder == tmp_path / "cache" / "signed-v1" / KEY / compile_target("cpu")["tag"]
    (folder / "pl").mkdir(parents=True)
    (folder / WRAPPER).write_text("planted = True\n")  # a folder nobody sealed
    assert not store.publish(KEY, str(folder))["uploaded"]
    got = store.fetch(KEY, str(folder))
    assert not got["used"] and "did not verify (moved aside" in got["note"] and not folder.exists(), got
    aside = [p for p in folder.parent.iterdir() if ".unverified-" in p.name]
    assert len(aside) == 1 and (aside[0] / WRAPPER).is_file()  # kept (a process may hold it), never loaded
    assert store.fetch(KEY, str(tmp_path / "elsewhere"))["note"] == "no cache for this key"  # nothing was uploaded
    (folder / "ab").mkdir(parents=True)
    (folder / "ab" / "graph.py").write_text("x = 1\n")
    seal(folder, KEY, SECRET.encode(), TAG())  # what the actor does after its own compile
    assert store.fetch(KEY, str(folder))["note"] == "the node's verified copy, not fetched again"
    assert store.publish(KEY, str(folder))["uploaded"]
    (folder / WRAPPER).parent.mkdir()
    (folder / WRAPPER).write_text("planted = True\n")  # a file added after the seal
    assert not store.fetch(KEY, str(folder))["note"].startswith("the node's verified copy")
    fetched = Path(store.node_folder(str(tmp_path / "cache"), KEY))  # refilled from the verified archive
    assert (fetched / "ab" / "graph.py").is_file() and not (fetched / WRAPPER).exists()
    assert (fetched / MANIFEST).is_file()
    monkeypatch.setenv(KEY_ENV, "another-key")  # a manifest sealed with another key does not verify
    assert not store.fetch(KEY, str(fetched))["used"] and not fetched.exists()


def test_a_folder_placed_first_by_someone_else_is_used_only_if_it_verifies(s3, tmp_path, monkeypatch):
    """A verified archive is unpacked into a fresh folder; between the node folder's move aside and the rename,
    something else creates the node folder (a sibling's inductor, a local user): unsealed, it is never loaded, and the
    actor loads its own verified copy; sealed by a sibling (the same archive), the sibling's is loaded."""
    from pipeline import models
    from pipeline.models import CompileStore, seal, sealed
    from pipeline.storage import Storage

    monkeypatch.setenv(KEY_ENV, SECRET)
    store = CompileStore(s3.uri("lost-rename"), Storage(endpoint=s3.endpoint))
    made = tmp_path / "made"
    (made / "ab").mkdir(parents=True)
    (made / "ab" / "graph.py").write_text("x = 1\n")
    seal(made, KEY, SECRET.encode(), TAG())
    assert store.publish(KEY, str(made))["uploaded"]
    real = models.place

    def someone_first(content):
        def place(fresh, folder):
            (folder / "ab").mkdir(parents=True)
            (folder / "ab" / "graph.py").write_text(content)
            if content == "x = 1\n":
                seal(folder, KEY, SECRET.encode(), TAG())  # a sibling that unpacked the same verified archive
            return real(fresh, folder)

        return place

    node = tmp_path / "node" / "cache"
    monkeypatch.setattr(models, "place", someone_first("ATTACKER PICKLE"))
    got = store.fetch(KEY, str(node))
    assert got["used"] and Path(got["folder"]) != node and "does not verify" in got["note"], got
    assert (Path(got["folder"]) / "ab" / "graph.py").read_text() == "x = 1\n"
    assert sealed(Path(got["folder"]), KEY, SECRET.encode(), TAG()) and not sealed(node, KEY, SECRET.encode(), TAG())
    node2 = tmp_path / "node2" / "cache"
    monkeypatch.setattr(models, "place", someone_first("x = 1\n"))
    got = store.fetch(KEY, str(node2))
    assert got["used"] and got["folder"] == str(node2) and list(node2.parent.iterdir()) == [node2], got


def test_a_manifest_sees_links_and_names_its_key_and_target(tmp_path):
    """A sealed folder stops verifying when a symbolic link is added (to a folder: a walk that does not follow it
    would miss its files; to a file), when a file is added, and when the folder is moved under another target or
    key; sealing a folder that holds a link or a special file is refused."""
    import os

    from pipeline.models import seal, sealed

    folder = tmp_path / "sealed"
    (folder / "fxgraph" / "ab").mkdir(parents=True)
    (folder / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    evil = tmp_path / "evil"
    (evil / "zz").mkdir(parents=True)
    (evil / "zz" / "entry").write_bytes(b"planted")
    secret = SECRET.encode()
    seal(folder, KEY, secret, TAG())
    assert sealed(folder, KEY, secret, TAG())
    assert not sealed(folder, KEY, secret, "target-0000000000000000")  # moved between target-* folders
    assert not sealed(folder, KEY + "x", secret, TAG())
    for link in (folder / "ab", folder / "fxgraph" / "zz", folder / "fxgraph" / "ab" / "more"):
        os.symlink(evil / "zz" if link.name != "more" else evil / "zz" / "entry", link)
        assert not sealed(folder, KEY, secret, TAG()), link
        with pytest.raises(ValueError, match="a symbolic link or special file"):
            seal(folder, KEY, secret, TAG())
        link.unlink()
    assert sealed(folder, KEY, secret, TAG())
    os.mkfifo(folder / "fifo")
    assert not sealed(folder, KEY, secret, TAG())


def test_an_oversized_description_is_never_read_whole(s3, tmp_path, monkeypatch):
    """A cache.json larger than MAX_META_BYTES (a store writer without the key can write one) is refused from a
    ranged read of at most that many bytes: never parsed, the actor compiles cold. The same bound holds locally."""
    from pipeline import storage as S
    from pipeline.models import MAX_META_BYTES, CompileStore, compile_target
    from pipeline.storage import Storage

    monkeypatch.setenv(KEY_ENV, SECRET)
    store = CompileStore(s3.uri("huge-meta"), Storage(endpoint=s3.endpoint))
    where = S.join(store.root, KEY, compile_target("cpu")["tag"])
    S.write_bytes(S.join(where, "cache.json"), b"{" + b" " * (8 * MAX_META_BYTES) + b"}", store.storage)
    asked = []
    real = S.s3_client

    def spy(storage):
        client = real(storage)
        get = client.get_object
        client.get_object = lambda **kw: asked.append(kw.get("Range")) or get(**kw)
        return client

    monkeypatch.setattr(S, "s3_client", spy)
    got = store.fetch(KEY, str(tmp_path / "node"))
    assert got["found"] and not got["used"] and f"larger than {MAX_META_BYTES} bytes" in got["note"], got
    assert asked == [f"bytes=0-{MAX_META_BYTES}"] and not (tmp_path / "node").exists()
    (tmp_path / "big").write_bytes(b"x" * (MAX_META_BYTES + 1))
    with pytest.raises(S.TooLarge):
        S.read_bytes(str(tmp_path / "big"), Storage(), limit=MAX_META_BYTES)
    assert S.read_bytes(str(tmp_path / "none"), Storage(), limit=10) is None


def test_the_node_folders_are_private(s3, tmp_path):
    """The signed cache's folders are made with mode 0700; a compile cache folder that group or others may write,
    or that another user owns, is refused naming it (the actor then compiles cold in a private folder)."""
    import os
    import stat

    from pipeline.models import CompileStore
    from pipeline.storage import Storage

    store = CompileStore(s3.uri("private"), Storage(endpoint=s3.endpoint))
    folder = Path(store.node_folder(str(tmp_path / "cache"), KEY))
    for path in [tmp_path / "cache", *folder.parents][: len(folder.relative_to(tmp_path / "cache").parts)]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    (tmp_path / "open-to-all").mkdir(mode=0o777)
    (tmp_path / "open-to-all").chmod(0o777)
    with pytest.raises(ValueError, match=f"compile cache folder {tmp_path / 'open-to-all'} is not private"):
        store.node_folder(str(tmp_path / "open-to-all"), KEY)
    other = tmp_path / "others" / "signed-v1"
    other.mkdir(parents=True, mode=0o700)
    if os.geteuid() == 0:  # as root (CI), a folder given to nobody; an ordinary user cannot give one away
        os.chown(other, 65534, 65534)
        with pytest.raises(ValueError, match=f"compile cache folder {other} is not private \\(owner uid 65534"):
            store.node_folder(str(tmp_path / "others"), KEY)


def test_an_archive_is_downloaded_only_when_its_description_is_signed_and_its_size_sane(s3, tmp_path, monkeypatch):
    """The signature covers cache.json's description (its archive's name, sha256 and size) and is checked before any
    byte of the archive is read; a signed size above MAX_ARCHIVE_BYTES is refused; an object whose stored size is not
    the signed one is refused from its size alone (HEAD), never read."""
    from pipeline import models
    from pipeline.models import MAX_ARCHIVE_BYTES, CompileStore
    from pipeline.storage import Storage

    monkeypatch.setenv(KEY_ENV, SECRET)
    store = CompileStore(s3.uri("descriptions"), Storage(endpoint=s3.endpoint))
    data = pack_of_text(tmp_path, "x = 1\n")
    reads = []
    real = models.download_checked
    monkeypatch.setattr(models, "download_checked", lambda *a: reads.append(a) or real(*a))
    write_archive(store, KEY, data, b"not-the-key")
    got = store.fetch(KEY, str(tmp_path / "unsigned"))
    assert "is not signed with this store's key" in got["note"] and reads == [], got
    write_archive(store, KEY, data, SECRET.encode(), size=MAX_ARCHIVE_BYTES + 1)
    got = store.fetch(KEY, str(tmp_path / "huge"))
    assert f"at most {MAX_ARCHIVE_BYTES} are fetched" in got["note"] and reads == [], got
    write_archive(store, KEY, data, SECRET.encode(), size=len(data) - 1)
    got = store.fetch(KEY, str(tmp_path / "short"))
    assert f"{len(data)} bytes stored, {len(data) - 1} signed" in got["note"] and not got["used"], got
    write_archive(store, KEY, data, SECRET.encode())
    assert store.fetch(KEY, str(tmp_path / "good"))["used"] and len(reads) == 2


def pack_of_text(tmp_path, text: str) -> bytes:
    made = tmp_path / "made-text"
    made.mkdir(exist_ok=True)
    (made / "wrapper.py").write_text(text)
    return pack_of(made)


def test_the_signing_key_is_read_strictly(tmp_path, monkeypatch):
    """The key's variable and file are stripped alike; a key file its group or others may write is refused, naming
    the variable and the mode; a missing one is one line naming the variable (the driver exits 2 on ValueError)."""
    from pipeline.models import signing_key

    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    assert signing_key() is None
    monkeypatch.setenv(KEY_ENV, f"  {SECRET}\n")
    assert signing_key() == SECRET.encode()
    monkeypatch.delenv(KEY_ENV)
    key = tmp_path / "key"
    key.write_text(SECRET + "\n")
    key.chmod(0o600)
    monkeypatch.setenv(KEY_FILE_ENV, str(key))
    assert signing_key() == SECRET.encode()
    for mode in (0o620, 0o602):
        key.chmod(mode)
        with pytest.raises(ValueError, match=f"{KEY_FILE_ENV}=.*group- or world-writable \\(mode {mode:o}\\)"):
            signing_key()
    monkeypatch.setenv(KEY_FILE_ENV, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=f"^{KEY_FILE_ENV}=.*missing: cannot read the compile store's key") as e:
        signing_key()
    assert "\n" not in str(e.value)
    from types import SimpleNamespace

    from pipeline.models import compile_store

    cfg = SimpleNamespace(compute=SimpleNamespace(compile_store=str(tmp_path / "store")), models=None, storage=None)
    with pytest.raises(ValueError, match=f"^{KEY_FILE_ENV}="):  # what the driver's plan meets first: exit 2
        compile_store(cfg)
