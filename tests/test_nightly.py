"""The nightly graph on a real local Ray with local files: exactly-once outputs equal to beam_search, bad rows in
rejects, fail-fast on bad files and models, atomic reruns, and an actor killed mid-run."""

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.models import build_model, load_model, load_tokenizer
from decoding.stats import BASE_KEYS
from decoding.templates import PRESETS, write_template
from operators.outputs import table_schema
from operators.prompts import Renderer, catalog_probes
from pipeline import runs
from pipeline import storage as S
from pipeline.config import load_config
from pipeline.prepare import write_synthetic
from pipeline.storage import Storage
from tests.helpers import float32_atol


def make_world(root, n_users=100):
    """Synthetic histories and catalog (3 levels x 6 codes) and two tiny random models with the data's tokenizer."""
    write_synthetic(root / "data", n_users=n_users, n_items=150, levels=3, codes=6, seed=1, history_len=8)
    for name, seed in (("target", 0), ("draft", 1)):
        build_model(4 + 3 * 6, 1, 32, 2, 1, seed=seed).save_pretrained(root / name)
        for f in (root / "data" / "tokenizer").iterdir():
            shutil.copy(f, root / name / f.name)
        write_template(root / name, PRESETS["codes"].with_max_items(8))
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("nightly"))


@pytest.fixture(scope="module")
def ray_session(world):
    import ray

    marker = world / "actor-crashed"  # the first actor exits once, after 2 batches; Ray restarts it
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"GENREC_TEST_FAIL_AFTER": f"2:{marker}"}})
    yield marker
    ray.shutdown()


def config(world, out, *extra):
    return load_config(
        None,
        [
            f"input={world / 'data' / 'test.parquet'}",
            f"catalog={world / 'data' / 'items.parquet'}",
            f"output={out}",
            f"models.target={world / 'target'}",
            f"models.draft={world / 'draft'}",
            "decoding.k=5",
            "compute.batch_size=16",
            "run_date=2026-11-21",
            f"models.cache_dir={world / 'cache'}",
            *extra,
        ],
    )


def read_run(cfg):
    run = runs.latest_run(cfg.output, cfg.run_date, cfg.storage)
    assert run is not None
    tables = {name: pq.read_table(f"{run}/{name}") for name in ("recommendations", "rejects", "metrics")}
    return run, tables


def assert_metrics_contract(metrics: pa.Table, mode: str) -> None:
    """Every mode's metric rows carry the decoders' base keys, measured: a batch that decoded users ran the target
    (forwards, tokens, a timed prefill), and only the speculative modes ran a draft."""
    m = metrics.to_pandas()
    assert set(BASE_KEYS) | {"other_s", "wall_s"} <= set(m.columns) and set(m["mode"]) == {mode}
    busy = m[m.users_ok > 0]
    assert len(busy) and (busy.target_forwards > 0).all() and (busy.target_tokens > 0).all()
    assert (busy.prefill_s > 0).all() and (busy.decode_s > 0).all() and (busy.kv_tokens > 0).all()
    assert (busy.target_tokens >= busy.prompt_tokens).all()
    speculative = mode.startswith("atspeed")
    assert ((busy.draft_forwards > 0) == speculative).all() and ((busy.verify_s > 0) == speculative).all()
    phases = busy.prefill_s + busy.draft_s + busy.verify_s + busy.decode_s + busy.other_s
    assert ((phases - busy.wall_s).abs() < 1e-6 + 1e-3 * busy.wall_s).all()


def direct_beam_search(world, histories, k=5):
    tok = load_tokenizer(world / "target")
    items = pq.read_table(world / "data" / "items.parquet")
    cat = Catalog.from_table(items, tok, on_duplicate="first")
    p = Renderer.compile(PRESETS["codes"].with_max_items(8), tok, catalog_probes(cat.item_tokens)).render(
        histories, cat.item_tokens
    )
    return beam_search(load_model(world / "target"), p.input_ids, p.attention_mask, cat, k), p


def test_nightly_outputs_equal_beam_search_exactly_once(world, ray_session, tmp_path):
    from pipeline.nightly import run_nightly

    cfg = config(world, tmp_path / "out", "compute.num_actors=auto")
    manifest = run_nightly(cfg)
    assert ray_session.exists()  # an actor was killed mid-run and the run still completed
    pool = {"min": 1, "max": None, "initial": 1}  # auto: 2 CPUs less the read side's one, and more where nodes join
    assert manifest["actors"] == {"count": 1, "pool": pool, "num_cpus": 1.0, "num_gpus": None}
    assert manifest["cluster"] == {"nodes_lost": [], "nodes_joined": [], "tasks_retried": 0}
    run, t = read_run(cfg)
    assert S.read_bytes(f"{run}/_SUCCESS", cfg.storage) is not None and manifest["status"] == "succeeded"
    recs = t["recommendations"].to_pandas().sort_values(["user_id", "rank"])
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    assert set(recs.user_id) == set(users.user_id)  # every valid user ...
    assert (recs.groupby("user_id").size() == 5).all()  # ... exactly once, with k ranked items
    assert (recs.groupby("user_id")["rank"].apply(list) == [[1, 2, 3, 4, 5]] * len(users)).all()
    assert np.isin(recs.item_id, pq.read_table(world / "data" / "items.parquet").column("item_id").to_numpy()).all()
    ref, _ = direct_beam_search(world, users.history.tolist())
    want = dict(zip(users.user_id, ref.item_ids.tolist()))
    assert all(want[u] == g.item_id.tolist() for u, g in recs.groupby("user_id"))
    assert_metrics_contract(t["metrics"], "beam")
    metrics = t["metrics"].to_pandas()
    assert metrics.users_ok.sum() == len(users) and metrics.users_in.sum() == len(users)
    assert manifest["counts"]["recommendations"] == len(recs) and manifest["models"]["target"]["sha256"]
    # a task decodes compute.batches_per_task (4) batches, each its own shard: one metric row per batch of <= 16
    assert (metrics.users_in <= 16).all() and metrics.shard.is_unique and len(metrics) >= len(users) / 16
    assert manifest["counts"]["batches"] == len(metrics)
    # on a CPU each shard is decoded at once (compute.decode_batch unset): users per decode = the shard's users
    assert (metrics.decode_batch == metrics.users_ok).all()
    assert manifest["counts"]["decode_batch"] == {"min": metrics.decode_batch.min(), "max": metrics.decode_batch.max()}
    t = manifest["timings"]
    assert 0 < t["duplicates_s"] < t["first_shard_s"] <= t["decode_s"] <= t["total_s"]
    assert 0 < t["actor_ready_s"] < t["first_shard_s"]  # an actor ready, then its first shard committed
    assert manifest["duplicates"] == {"users": 0, "checked_on": "driver"}
    assert (metrics.dtype == "float32").all() and metrics.audit_users.isna().all()  # float32: exact, no audit
    assert manifest["precision_audit"] == {
        "dtype": "float32",
        "users": 0,
        "note": "float32 is exact (top-K identical to transformers); nothing to audit",
    }


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["beam", "atspeed-strict"])
def test_an_actor_decodes_a_shard_in_slices_that_fit(world, mode, monkeypatch):
    """A shard decoded in slices (compute.decode_batch pinned to 3, then an out-of-memory above 2 users: the slice
    halved, retried, and kept for later shards) returns what one decode of the whole shard returns, and the metrics
    say how many users each decode held."""
    from operators.recommender import Recommender
    from pipeline.plan import plan_run

    users = pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"]).slice(0, 11)
    cfg = config(world, world / "unused", f"decoding.mode={mode}")
    spec = plan_run(cfg).spec
    whole = Recommender(spec)(users).to_pandas()
    sliced = Recommender(replace(spec, decode_batch=3))
    got = sliced(users).to_pandas()
    recs = lambda t: t[t.kind == "rec"][["user_id", "rank", "item_id", "score"]].reset_index(drop=True)  # noqa: E731
    atol = float32_atol(torch.tensor(recs(whole).score.to_numpy()))  # other batch shapes: other summation orders
    pd.testing.assert_frame_equal(recs(got), recs(whole), check_exact=False, atol=atol, rtol=0)
    metric = lambda t: json.loads(t[t.kind == "metric"].metrics.iloc[0])  # noqa: E731
    assert metric(got)["decode_batch"] == 3 and metric(whole)["decode_batch"] == 11
    tree = lambda m: m["target_tokens"] - m["prompt_positions"]  # noqa: E731
    assert tree(metric(got)) == tree(metric(whole))  # the same tree tokens, summed over slices
    assert metric(got)["prompt_positions"] <= metric(whole)["prompt_positions"]  # slices of like lengths pad less

    decode = sliced.decode

    def at_most_two(mode, target, draft, ids, mask, users, exclude=None):  # what a GPU with room for two users does
        if ids.shape[0] > 2:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated): {ids.shape[0]} users")
        return decode(mode, target, draft, ids, mask, users, exclude)

    monkeypatch.setattr(sliced, "decode", at_most_two)
    got = sliced(users).to_pandas()
    pd.testing.assert_frame_equal(recs(got), recs(whole), check_exact=False, atol=atol, rtol=0)
    assert metric(got)["decode_batch"] == 1 and sliced.batcher.oom_batch == 1  # 3 -> 1: halved below the limit
    assert metric(sliced(users).to_pandas())["decode_batch"] == 1  # later shards start from the smaller batch


@pytest.mark.parametrize("mode", ["beam", "disc"])
def test_a_half_precision_actor_audits_its_first_users_in_float32(world, mode):
    """In bfloat16 the actor re-decodes its first compute.audit_users users in float32 (across batches: 11 of the
    first, 9 of the second, none after) and records how its lists compare: the counts equal those of a float32
    actor's own lists for beam search; a sampling mode compares draws made with the same seed. Wall time and
    users/s leave the audit out; it is reported as audit_s."""
    from operators.recommender import Recommender
    from pipeline.plan import plan_run

    users = pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"])
    batches = [users.slice(0, 11), users.slice(11, 11), users.slice(22, 11)]
    spec = plan_run(
        config(world, world / "unused", f"decoding.mode={mode}", "compute.dtype=bfloat16", "compute.audit_users=20")
    ).spec
    assert spec.audit_users == 20
    half, exact = Recommender(spec), Recommender(replace(spec, dtype="float32"))
    metric = lambda t: json.loads(t.filter(pc.equal(t["kind"], "metric"))["metrics"][0].as_py())  # noqa: E731
    recs = lambda t: t.filter(pc.equal(t["kind"], "rec")).to_pandas()  # noqa: E731
    seen = []
    for batch, audited in zip(batches, (11, 9, None)):
        got, ref = half(batch), exact(batch)
        m, m32 = metric(got), metric(ref)
        assert m["dtype"] == "bfloat16" and m32["dtype"] == "float32" and "audit_users" not in m32
        assert m.get("audit_users") == audited
        if audited is None:
            assert not half.audit.float32  # the float32 copies were freed once the audit was done
            continue
        assert 0 < m["audit_s"] and m["wall_s"] > 0 and m["audit_max_abs_score_diff"] >= 0
        assert 0 <= m["audit_identical_lists"] <= audited and 0 < m["audit_topk_overlap_sum"] <= audited
        if mode == "beam":  # the audit's float32 lists are the float32 actor's
            a, b = recs(got), recs(ref)
            first = batch["user_id"].to_pylist()[:audited]
            same = [a[a.user_id == u].item_id.tolist() == b[b.user_id == u].item_id.tolist() for u in first]
            assert m["audit_identical_lists"] == sum(same)
            seen.append(sum(same) < audited)
    if mode == "beam":
        assert any(seen)  # random weights in bfloat16: some lists differ, and the audit says so


@pytest.mark.parametrize("budget", ["device", "cpu", "neither"])
def test_the_audit_goes_where_its_float32_copies_fit(world, monkeypatch, budget):
    """A simulated budget (the device's free bytes, the host's available bytes): with room on the device the float32
    copies go there; with a device too small for them beside the run's decode batch they go to the CPU and audit
    the same users with the same lists as on the device; with the host too small as well the audit is skipped, its
    reason (both budgets, in GiB) in the metric row, and no float32 copy is ever loaded."""
    from operators.audit import PrecisionAudit
    from operators.recommender import Recommender
    from pipeline.plan import plan_run

    users = pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"])
    spec = plan_run(config(world, world / "unused", "compute.dtype=bfloat16", "compute.audit_users=20")).spec
    gib = 1 << 30
    budgets = {"device": (64 * gib, 64 * gib), "cpu": (0, 64 * gib), "neither": (0, 0)}
    monkeypatch.setattr(PrecisionAudit, "budget", lambda self: budgets[budget])
    loads = []
    real_load = PrecisionAudit.models

    def counted(self, *args):
        out = real_load(self, *args)
        loads.append(dict(self.float32))
        return out

    monkeypatch.setattr(PrecisionAudit, "models", counted)
    half = Recommender(spec)
    metric = lambda t: json.loads(t.filter(pc.equal(t["kind"], "metric"))["metrics"][0].as_py())  # noqa: E731
    m = metric(half(users.slice(0, 11)))
    if budget == "neither":
        assert "audit_users" not in m and half.audit.left == 0 and not loads[0] and not half.audit.float32
        assert m["audit_skipped"].startswith("the float32 copies need ")
        assert m["audit_skipped"].endswith(": the device has 0.0 GiB free, the host 0.0 GiB available")
        assert "audit_users" not in metric(half(users.slice(11, 11)))  # skipped for the rest of the run
        return
    assert m["audit_users"] == 11 and m["audit_device"] == {"device": "gpu", "cpu": "cpu"}[budget]
    assert "audit_skipped" not in m and set(loads[0]) == {"target"}
    reference = Recommender(spec)  # room on the device: the lists the CPU placement must reproduce
    monkeypatch.setattr(PrecisionAudit, "budget", lambda self: budgets["device"])
    r = metric(reference(users.slice(0, 11)))
    for key in ("audit_users", "audit_identical_lists", "audit_topk_overlap_sum", "audit_max_abs_score_diff"):
        assert m[key] == r[key]


def test_audit_placement_and_its_manifest_entry():
    """audit_placement's boundaries, exact: the device when weights + one float32 user + the run's decode batch fit
    80% of the device's free bytes less the head's buffers; else the CPU when weights + one user fit 80% of the host;
    else skipped, with the reason. The manifest lists where the audits ran and why any was skipped; the report says
    so."""
    from decoding.memory import audit_placement, usable_bytes
    from pipeline.report import audit_text
    from pipeline.shards import precision_audit

    weights, per_user, beside, host = 10 << 30, 1 << 20, 2 << 30, 32 << 30
    device = int((weights + per_user + beside + (8 << 26)) / 0.8) + 1  # just enough on the device
    assert usable_bytes(device) >= weights + per_user + beside > usable_bytes(device - 2)
    assert audit_placement(weights, per_user, beside, device, host) == ("device", "")
    assert audit_placement(weights, per_user, beside, device - 2, host) == ("cpu", "")
    assert audit_placement(weights, per_user, beside, None, host) == ("cpu", "")  # no GPU: the host
    small = int((weights + per_user) / 0.8) - 2  # the host just too small
    where, why = audit_placement(weights, per_user, beside, device - 2, small)
    assert where is None and "need 10.0 GiB (+ 2.0 GiB" in why and "the host 12.5 GiB available" in why
    audit = {"audit_users": 0, "audit_identical_lists": 0, "audit_topk_overlap_sum": 0.0, "audit_s": 0.0}
    a = precision_audit(["bfloat16"], audit, [], {"audit_device": set(), "audit_skipped": {why}})
    assert a == {"dtype": "bfloat16", "users": 0, "identical_lists": 0, "topk_overlap": None,
                 "max_abs_score_diff": None, "seconds": 0.0, "skipped": [why]}  # fmt: skip
    assert audit_text(a) == f"bfloat16: no audit; skipped: {why}"
    ran = {**audit, "audit_users": 4, "audit_identical_lists": 3, "audit_topk_overlap_sum": 3.5, "audit_s": 2.0}
    a = precision_audit(["bfloat16"], ran, [0.01], {"audit_device": {"cpu", "gpu"}, "audit_skipped": set()})
    assert a["device"] == ["cpu", "gpu"] and "skipped" not in a and "note" not in a
    assert audit_text(a).endswith("audit 2.000 s on cpu, gpu")


def test_a_bfloat16_run_publishes_its_precision_audit(world, ray_session, tmp_path):
    """`--set compute.dtype=bfloat16` on a CPU: the manifest's precision_audit sums the actors' audits (one batch's
    worth per actor by default), and the report shows it beside the dtype."""
    from pipeline.nightly import run_nightly
    from pipeline.report import report_run

    cfg = config(world, tmp_path / "out", "compute.dtype=bfloat16")
    manifest = run_nightly(cfg)
    m = read_run(cfg)[1]["metrics"].to_pandas()
    a = manifest["precision_audit"]
    assert a["dtype"] == "bfloat16" and (m.dtype == "bfloat16").all()
    assert a["users"] == m.audit_users.sum() and a["users"] % 16 == 0 and a["users"] >= 16  # batch_size 16 per actor
    assert a["identical_lists"] == m.audit_identical_lists.sum() <= a["users"]
    assert a["topk_overlap"] == pytest.approx(m.audit_topk_overlap_sum.sum() / a["users"]) and a["topk_overlap"] > 0
    assert a["max_abs_score_diff"] == m.audit_max_abs_score_diff.max() and a["seconds"] > 0
    _, out = report_run(runs.latest_run(cfg.output, cfg.run_date, cfg.storage), cfg.storage)
    text = (Path(out) / "report.md").read_text()
    assert f"bfloat16: {a['identical_lists']} of {a['users']} users' top-K identical to float32" in text


@pytest.mark.parametrize("id_type", [pa.int64(), pa.string()])
def test_duplicate_ids_found_on_the_driver_and_by_ray_alike(ray_session, tmp_path, id_type):
    """The duplicated user ids of an input of several files and row groups, with each one's first position: the
    driver's pyarrow grouping (within its memory budget, estimated from the footers) and the Ray aggregation (the
    fallback beyond it) find the same ones, which a hand count confirms."""
    import pyarrow.fs as pafs

    from pipeline.units import find_duplicates, id_bytes, plan_units

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 700, 2000)  # about 2000 - 700 (1 - e^-2.9) repeats, across files and row groups
    for f in range(3):
        part = pa.table({"user_id": pa.array(ids[f * 700 : (f + 1) * 700]).cast(id_type)})
        pq.write_table(part, tmp_path / f"part-{f}.parquet", row_group_size=256)
    data = pads.dataset(str(tmp_path), format="parquet")
    units = plan_units(data)
    fs = pafs.LocalFileSystem()
    assert len(units) > 3 and sum(u.rows for u in units) == len(ids)
    first = {}
    for pos, u in enumerate(ids):
        first.setdefault(u, pos)
    want = {(str(u) if id_type == pa.string() else int(u), first[u]) for u in set(ids) if (ids == u).sum() > 1}
    budget = id_bytes(units, fs) / 2**20
    for mb, where in ((budget, "driver"), (budget * 0.99, "ray")):
        found, how = find_duplicates(units, fs, mb)
        assert how == where
        assert set(zip(found["user_id"].to_pylist(), found["first"].to_pylist())) == want
    unique = tmp_path / "unique"
    unique.mkdir()
    pq.write_table(
        pa.table({"user_id": pa.array(np.arange(600)).cast(id_type)}), unique / "u.parquet", row_group_size=256
    )
    assert find_duplicates(plan_units(pads.dataset(str(unique), format="parquet")), fs) == (None, "driver")


@pytest.mark.parametrize("check", ["driver", "ray"])
def test_bad_rows_land_in_rejects(world, ray_session, tmp_path, check):
    from pipeline.nightly import run_nightly

    good = pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"]).slice(0, 20)
    hist = [[str(i) for i in h] for h in good.column("history").to_pylist()]
    bad = {
        "user_id": [9001, 9002, 9003, 9004, good["user_id"][0].as_py(), good["user_id"][1].as_py()],
        "history": [None, [], ["12", "abc"], [str(10**12)], hist[0], hist[1]],
    }
    table = pa.table(
        {
            "user_id": good["user_id"].to_pylist() + bad["user_id"],
            "history": pa.array(hist + bad["history"], pa.list_(pa.string())),
        }
    )  # wrong column type
    pq.write_table(table, tmp_path / "in.parquet")
    budget = "1024" if check == "driver" else "0"  # 0: the Ray aggregation
    cfg = config(world, tmp_path / "out", f"input={tmp_path / 'in.parquet'}", f"runs.duplicates_driver_mb={budget}")
    manifest = run_nightly(cfg)
    assert manifest["duplicates"] == {"users": 2, "checked_on": check}
    _, t = read_run(cfg)
    reasons = dict(zip(t["rejects"]["user_id"].to_pylist(), t["rejects"]["reason"].to_pylist()))
    assert reasons[9001] == reasons[9002] == "empty_history"
    assert reasons[9003] == "bad_type" and reasons[9004] == "unknown_item"
    dup = t["rejects"].filter(pa.compute.equal(t["rejects"]["reason"], "duplicate_user"))
    assert sorted(dup["user_id"].to_pylist()) == sorted(bad["user_id"][4:])  # first kept, the rest rejected
    recs = t["recommendations"].to_pandas()
    assert sorted(set(recs.user_id)) == sorted(good["user_id"].to_pylist())  # numeric strings were fine
    assert (recs.groupby("user_id").size() == 5).all()


def test_corrupt_file_and_missing_model_fail_without_success(world, ray_session, tmp_path):
    from pipeline.nightly import run_nightly

    folder = tmp_path / "in"
    folder.mkdir()
    shutil.copy(world / "data" / "test.parquet", folder / "part-0.parquet")
    (folder / "part-1.parquet").write_bytes(b"PAR1 this is not parquet")
    cfg = config(world, tmp_path / "out", f"input={folder}")
    with pytest.raises(ValueError, match="part-1.parquet"):
        run_nightly(cfg)
    assert runs.latest_run(cfg.output, cfg.run_date, cfg.storage) is None
    cfg = config(world, tmp_path / "out2", f"models.target={tmp_path / 'no-such-model'}")
    with pytest.raises(FileNotFoundError, match="models.target: .*no-such-model"):
        run_nightly(cfg)
    assert runs.latest_run(cfg.output, cfg.run_date, cfg.storage) is None and not (tmp_path / "out2").exists()


def test_models_and_catalogs_an_actor_would_refuse_fail_on_the_driver(world, tmp_path):
    """Refused before Ray does any work (no ray session here: nothing reaches Ray), each naming the cause: a model
    without a prompt template, a draft reading other prompts, code tokens missing from the tokenizer, a column that
    duplicate_items orders by missing or without an order."""
    from pipeline.nightly import run_nightly

    bare = tmp_path / "bare"
    shutil.copytree(world / "target", bare)
    (bare / "genrec_template.json").unlink()
    with pytest.raises(ValueError, match=r"models.target: .*no genrec_template.json.*python -m jobs.template"):
        run_nightly(config(world, tmp_path / "o1", f"models.target={bare}"))
    run_nightly_with = lambda *extra: run_nightly(config(world, tmp_path / "o2", *extra))  # noqa: E731
    other = tmp_path / "draft"
    shutil.copytree(world / "draft", other)
    write_template(other, PRESETS["lcrec"])
    with pytest.raises(ValueError, match="models.draft .*differs from the target's prompt template"):
        run_nightly_with("decoding.mode=atspeed-strict", f"models.draft={other}")
    items = pq.read_table(world / "data" / "items.parquet").to_pylist()
    items[5]["semantic_id"] = [0, 1, 17]  # the tokenizer has codes 0..5 per level
    pq.write_table(pa.Table.from_pylist(items), tmp_path / "items.parquet")
    with pytest.raises(ValueError, match=r"1 code tokens the catalog needs are missing from the tokenizer: <c_17>"):
        run_nightly_with(f"catalog={tmp_path / 'items.parquet'}")
    with pytest.raises(ValueError, match=r"catalog .*items.parquet: missing column\(s\) \['popularity'\]"):
        run_nightly_with("duplicate_items=by:popularity")
    with pytest.raises(ValueError, match="column 'code_tokens' \\(duplicate_items\\) must hold numbers"):
        run_nightly_with("duplicate_items=expand:code_tokens")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_check_runs_the_drivers_checks_takes_no_lease_and_writes_nothing(world, tmp_path, capsys):
    """`--check`: exit 0 and a summary, no Ray, no lease (it passes while another driver holds the date's lease), no
    file under the output; each failure class it claims ends as the run would (exit 2, its `error:` line naming
    it): a bad config field, a missing input, an input without `history`, a user_id of another type, a missing model,
    a template a model lacks, code tokens the tokenizer lacks, a missing recommendable set; a resume it would
    refuse."""
    import fcntl

    from jobs import nightly

    base = [
        f"input={world / 'data' / 'test.parquet'}",
        f"catalog={world / 'data' / 'items.parquet'}",
        f"output={tmp_path / 'out'}",
        f"models.target={world / 'target'}",
        "decoding.k=5",
        "run_date=2026-11-21",
    ]

    def check(*extra) -> tuple[int, str, str]:
        code = nightly.main([x for item in (*base, *extra) for x in ("--set", item)] + ["--check"])
        out, err = capsys.readouterr()
        return code, out, err

    lease = tmp_path / "out" / "run_date=2026-11-21" / "_LEASE"  # another driver's lease on the date
    lease.parent.mkdir(parents=True)
    held = os.open(lease, os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        code, out, _ = check()
    finally:
        os.close(held)
    summary = json.loads(out)
    assert code == 0 and summary["check"] == "passed" and summary["input"]["rows"] == 100
    assert summary["models"]["target"]["sha256"] and summary["output"]["conditional_writes"] == "honoured"
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["_LEASE", "run_date=2026-11-21"]
    assert check(f"output={tmp_path / 'new' / 'out'}")[0] == 0 and not (tmp_path / "new").exists()  # nothing made
    bare = tmp_path / "bare"
    shutil.copytree(world / "target", bare)
    (bare / "genrec_template.json").unlink()
    histories = pq.read_table(world / "data" / "test.parquet")
    pq.write_table(histories.drop_columns(["history"]), tmp_path / "no-history.parquet")
    pq.write_table(histories.set_column(0, "user_id", pc.cast(histories["user_id"], pa.float64())), tmp_path / "f.pq")
    items = pq.read_table(world / "data" / "items.parquet").to_pylist()
    items[5]["semantic_id"] = [0, 1, 17]
    pq.write_table(pa.Table.from_pylist(items), tmp_path / "items.parquet")
    cases = {
        "decoding.k=0": "config: decoding.k must be an integer >= 1",
        f"input={tmp_path / 'none.parquet'}": "none.parquet not found",
        f"input={tmp_path / 'no-history.parquet'}": "missing column(s) ['history']",
        f"input={tmp_path / 'f.pq'}": "column user_id is double",
        f"models.target={tmp_path / 'nowhere'}": "models.target: model directory",
        f"models.target={bare}": "no genrec_template.json",
        f"catalog={tmp_path / 'items.parquet'}": "code tokens the catalog needs are missing from the tokenizer",
        f"recommendable={tmp_path / 'gone.parquet'}": "recommendable",
    }
    for extra, why in cases.items():
        code, out, err = check(extra)
        assert code == 2 and out == "" and why in err and err.startswith("error: "), (extra, err)
    code, _, err = (
        nightly.main(
            [x for item in base for x in ("--set", item)] + ["--check", "--resume", "20260101T000000Z-abcdef"]
        ),
        *capsys.readouterr(),
    )
    assert code == 2 and "run_id=20260101T000000Z-abcdef not found" in err, err
    assert sorted(p.name for p in (tmp_path / "out").rglob("*")) == ["_LEASE", "run_date=2026-11-21"]


def test_rerun_leaves_exactly_one_complete_output(world, ray_session, tmp_path):
    from pipeline.nightly import collect_garbage, run_nightly

    cfg = config(world, tmp_path / "out", "decoding.mode=atspeed-strict")
    first = run_nightly(cfg)["run_id"]
    second = run_nightly(cfg)["run_id"]
    assert first != second
    date_dir = tmp_path / "out" / "run_date=2026-11-21"
    assert S.list_children(str(date_dir), cfg.storage) == sorted([f"run_id={first}", f"run_id={second}"])
    assert (date_dir / f"run_id={first}" / "_SUPERSEDED").is_file()  # kept for readers mid-read, for the grace
    assert collect_garbage(cfg) == []  # within runs.grace_s
    cfg.runs.grace_s = 0.0
    assert collect_garbage(cfg) == [first]
    assert S.list_children(str(date_dir), cfg.storage) == [f"run_id={second}"]
    run, t = read_run(cfg)
    assert run.endswith(second) and t["recommendations"].num_rows == 100 * 5
    assert set(t["recommendations"]["mode"].to_pylist()) == {"atspeed-strict"}
    assert_metrics_contract(t["metrics"], "atspeed-strict")


def test_sampling_modes_return_distinct_catalog_items(world, ray_session, tmp_path):
    from pipeline.nightly import run_nightly

    for mode in ("disc", "atspeed-relaxed"):
        cfg = config(world, tmp_path / mode, f"decoding.mode={mode}")
        run_nightly(cfg)
        t = read_run(cfg)[1]
        recs = t["recommendations"].to_pandas()
        assert (recs.groupby("user_id").item_id.nunique() == 5).all()
        assert_metrics_contract(t["metrics"], mode)  # DISC: its real forwards, tokens and phases


def test_non_finite_users_are_rejected_and_duplicates_reported(world, ray_session, tmp_path):
    """A target that overflows to NaN on one last-level code token (in prompts only: generated last-level tokens are
    never fed back): exactly the users whose prompts hold it are rejected with
    non_finite_logits (and counted), the others are decoded; catalog items that share a semantic ID are dropped by the
    `first` policy and listed in the manifest and the report."""
    from pipeline.nightly import run_nightly
    from pipeline.report import report_run

    items = pq.read_table(world / "data" / "items.parquet")
    shared = pa.table(
        {
            "item_id": [9001, 9002],
            "semantic_id": items["semantic_id"].to_pylist()[:2],
            "code_tokens": items["code_tokens"].to_pylist()[:2],
        }
    ).cast(items.schema)
    pq.write_table(pa.concat_tables([items, shared]), tmp_path / "items.parquet")
    target = tmp_path / "target"
    shutil.copytree(world / "target", target)
    model = load_model(target)
    tok = load_tokenizer(target)
    bad_token = tok.convert_tokens_to_ids("<c_2>")
    with torch.no_grad():
        model.get_input_embeddings().weight[bad_token] = float("inf")
    model.save_pretrained(target)
    cfg = config(world, tmp_path / "out", f"models.target={target}", f"catalog={tmp_path / 'items.parquet'}")
    manifest = run_nightly(cfg)
    _, t = read_run(cfg)
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    last_code = dict(zip(items["item_id"].to_pylist(), (s[-1] for s in items["semantic_id"].to_pylist())))
    poisoned = {u for u, h in zip(users.user_id, users.history) if 2 in {last_code[i] for i in h[-8:]}}
    assert 0 < len(poisoned) < len(users)
    rejects = t["rejects"].to_pandas()
    assert set(rejects[rejects.reason == "non_finite_logits"].user_id) == poisoned
    assert set(t["recommendations"]["user_id"].to_pylist()) == set(users.user_id) - poisoned
    assert t["metrics"].to_pandas().users_non_finite.sum() == len(poisoned) == manifest["counts"]["users_non_finite"]
    dup = manifest["catalog"]["duplicates"]
    assert dup["policy"] == "first" and dup["dropped"] == 2
    assert dup["items"] == [
        {"item_id": 9001, "kept": items["item_id"][0].as_py()},
        {"item_id": 9002, "kept": items["item_id"][1].as_py()},
    ]
    _, out = report_run(str(tmp_path / "out"), cfg.storage)
    md = (Path(out) / "report.md").read_text()
    assert "**2 items dropped** for sharing a semantic ID with a kept item: 9001" in md
    assert f"| of them: non-finite log-probs | {len(poisoned)} |" in md


def test_auto_mode_times_both_decoders_then_keeps_the_faster(world, ray_session, tmp_path):
    """decoding.mode = auto: each actor decodes its first batches with beam and atspeed-strict in turn (A B B A),
    then keeps the faster; the outputs are beam search's exactly, and the decision and its timings are recorded in the
    metrics and the manifest."""
    from pipeline.nightly import run_nightly

    ray_session.touch()  # no injected actor crash here: a restarted actor would start its trials again
    cfg = config(world, tmp_path / "out", "decoding.mode=auto", "decoding.auto_trials=2")
    manifest = run_nightly(cfg)
    _, t = read_run(cfg)
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    recs = t["recommendations"].to_pandas()
    ref, _ = direct_beam_search(world, users.history.tolist())
    want = dict(zip(users.user_id, ref.item_ids.tolist()))
    assert all(want[u] == g.sort_values("rank").item_id.tolist() for u, g in recs.groupby("user_id"))
    m = t["metrics"].to_pandas().sort_values(["actor", "batch"])
    for actor, rows in m.groupby("actor"):
        decoders = rows.decoder.tolist()
        trials = ["beam", "atspeed-strict", "atspeed-strict", "beam"][: len(decoders)]
        assert decoders[:4] == trials  # the trials, in A B B A order
        state = manifest["auto"][actor]
        if len(decoders) > 4:  # decided: every later batch uses the choice
            assert state["choice"] in ("beam", "atspeed-strict") and set(decoders[4:]) == {state["choice"]}
            # the rule the actor implements, from the same timings: each decoder's best (fastest) trial batch in
            # users per decoder-second, the faster decoder kept
            best = {
                d: max(
                    r.users_ok / (r.prefill_s + r.draft_s + r.verify_s + r.decode_s)
                    for r in rows.head(4).itertuples()
                    if r.decoder == d
                )
                for d in ("beam", "atspeed-strict")
            }
            assert state["trial_users_per_s"] == pytest.approx(best, rel=1e-9)
            assert state["choice"] == max(best, key=best.get) and state["trial_batches"] == {
                "beam": 2,
                "atspeed-strict": 2,
            }
    assert set(recs["mode"]) == {"auto"} and (m.draft_forwards[m.decoder == "beam"] == 0).all()
    from pipeline.report import report_run

    _, out = report_run(str(tmp_path / "out"), cfg.storage)
    assert "Auto choices of auto" in (Path(out) / "report.md").read_text()


# ---------------------------------------------------------------- fenced runs


def killed_run(cfg, keep: int) -> str:
    """A complete local run turned into what a driver killed mid-run leaves: its first `keep` shards committed (the
    others' metrics never written), no manifest, no _SUCCESS, nothing published -> its run id."""
    run = runs.latest_run(cfg.output, cfg.run_date, cfg.storage)
    metrics = sorted((Path(run) / "metrics").glob("s*.parquet"))
    assert len(metrics) > keep
    for f in [
        *metrics[keep:],
        Path(run) / "manifest.json",
        Path(run) / "_SUCCESS",
        Path(runs.date_dir(cfg.output, cfg.run_date)) / "_LATEST",
    ]:
        f.unlink()
    return Path(run).name.removeprefix("run_id=")


def copy_inputs(world, tmp_path) -> tuple[Path, Path]:
    (tmp_path / "in").mkdir()
    for name in ("test.parquet", "items.parquet"):
        shutil.copy(world / "data" / name, tmp_path / "in" / name)
    return tmp_path / "in" / "test.parquet", tmp_path / "in" / "items.parquet"


def assert_published_once(cfg, users: pd.DataFrame) -> tuple[str, pd.DataFrame]:
    """The date's published run holds every user exactly once (read as readers do: the manifest's files)."""
    run = runs.latest_run(cfg.output, cfg.run_date, cfg.storage)
    recs = runs.read_table(run, "recommendations", cfg.storage).to_pandas()
    assert set(recs.user_id) == set(users.user_id) and (recs.groupby("user_id").size() == 5).all()
    assert (recs.groupby("user_id")["rank"].apply(sorted) == [[1, 2, 3, 4, 5]] * len(users)).all()
    return run, recs


def test_a_resume_trusts_only_an_unchanged_input(world, ray_session, tmp_path, caplog):
    """A run killed after 4 shards; its input rewritten in place with the same row groups, rows reordered (what an
    upstream job overwriting histories/latest/ does): --resume RUN_ID refuses, naming the file; --resume latest starts
    a new run and publishes every user exactly once. A changed catalog or model is named the same way."""
    from pipeline.nightly import run_nightly
    from pipeline.plan import plan_run

    histories, items = copy_inputs(world, tmp_path)
    cfg = config(world, tmp_path / "out", f"input={histories}", f"catalog={items}")
    run_nightly(cfg)
    old = killed_run(cfg, keep=4)
    table = pq.read_table(histories)
    pq.write_table(
        table.take(pa.array(np.arange(table.num_rows)[::-1])),
        histories,
        row_group_size=pq.ParquetFile(histories).metadata.row_group(0).num_rows,
    )
    assert [rg["num_rows"] for rg in pq.ParquetFile(histories).metadata.to_dict()["row_groups"]] == [table.num_rows]
    with pytest.raises(ValueError, match=f"input file {histories} changed since the run started"):
        run_nightly(cfg, resume=old)
    with caplog.at_level("WARNING", logger="genrec.nightly"):
        manifest = run_nightly(cfg, resume="latest")
    assert manifest["run_id"] != old and not manifest["resume"]["resumed"]
    assert f"run {old} cannot be resumed: input file {histories}" in caplog.text
    assert_published_once(cfg, table.to_pandas())
    assert (Path(runs.run_dir(cfg.output, cfg.run_date, old)) / "_SUPERSEDED").is_file()

    state = json.loads((Path(runs.run_dir(cfg.output, cfg.run_date, manifest["run_id"])) / "_RUN.json").read_text())
    catalog = pq.read_table(items)
    pq.write_table(catalog.take(pa.array(np.arange(catalog.num_rows)[::-1])), items)
    assert plan_run(cfg).changes(state) == [f"the catalog {items}"]
    assert plan_run(replace(cfg, models=replace(cfg.models, target=str(world / "draft")))).changes(state) == [
        f"the catalog {items}",
        f"models.target {world / 'draft'}",
        "the config (models)",
    ]


def test_a_resume_refuses_a_model_whose_config_changed_and_other_software(world, tmp_path, monkeypatch):
    """What a run started under, as _RUN.json records it: another transformers (the fingerprint's software) is named;
    so is the same weights with another config.json (rope_theta: other lists), the model's files."""
    from pipeline import lineage
    from pipeline.plan import plan_run

    model = shutil.copytree(world / "target", tmp_path / "target")
    cfg = config(world, tmp_path / "out", f"models.target={model}")
    plan = plan_run(cfg)
    state = {"fingerprint": plan.fingerprint, "identity": plan.identity, "config": cfg.to_dict()}
    state = json.loads(json.dumps(state, default=str))  # as _RUN.json holds it
    real = lineage._version
    monkeypatch.setattr(lineage, "_version", lambda name: "9.9" if name == "transformers" else real(name))
    assert plan_run(cfg).changes(state) == [f"the software (transformers {real('transformers')} then, 9.9 now)"]
    monkeypatch.undo()
    settings = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**settings, "rope_parameters": {"rope_theta": 10.0}}))
    assert plan_run(cfg).changes(state) == [
        f"models.target {model} (its files but the weights: config, tokenizer, ...)"
    ]


def test_a_template_column_of_two_types_in_an_input_folder_is_refused_naming_both_files(world, tmp_path):
    """A column the prompt template writes ({user:segment}) is an integer in one file of the input and a string in
    the other: refused before any work naming both files and types, as the input's own columns are (exit 2)."""
    from pipeline.plan import plan_run

    users, folder = pq.read_table(world / "data" / "test.parquet").select(["user_id", "history"]), tmp_path / "in"
    folder.mkdir()
    parts = [folder / f"part-{i}.parquet" for i in (0, 1)]
    pq.write_table(users.slice(0, 10).append_column("segment", pa.array(range(10), pa.int64())), parts[0])
    rest = users.slice(10)
    pq.write_table(rest.append_column("segment", pa.array(["s"] * rest.num_rows)), parts[1])
    template = tmp_path / "template.json"
    template.write_text(json.dumps({"name": "segmented", "prefix": "{user:segment} ", "max_items": 8}))
    cfg = config(world, tmp_path / "out", f"input={folder}", f"models.template={template}")
    with pytest.raises(ValueError) as e:
        plan_run(cfg)
    assert str(e.value) == (
        f"input {folder}: column 'segment' is int64 in {parts[0]} and string in {parts[1]}; its files must hold one "
        "type (cast it where they are written)"
    )


def test_a_complete_unpublished_run_is_published_without_decoding(world, ray_session, tmp_path):
    """A driver that stopped between _SUCCESS and _LATEST: --resume latest publishes that run as it is."""
    from pipeline.nightly import run_nightly

    cfg = config(world, tmp_path / "out")
    first = run_nightly(cfg)
    (Path(runs.date_dir(cfg.output, cfg.run_date)) / "_LATEST").unlink()
    run = Path(runs.run_dir(cfg.output, cfg.run_date, first["run_id"]))
    written = {f: f.stat().st_mtime_ns for f in run.rglob("*.parquet")}
    manifest = run_nightly(cfg, resume="latest")
    assert manifest["run_id"] == first["run_id"]
    assert runs.latest_run(cfg.output, cfg.run_date, cfg.storage) == str(run)
    assert S.list_children(runs.date_dir(cfg.output, cfg.run_date), cfg.storage) == [run.name]  # no new run
    assert {f: f.stat().st_mtime_ns for f in run.rglob("*.parquet")} == written  # nothing decoded again


@pytest.mark.faults  # a driver paused past its lease: make test-faults
def test_a_fenced_attempts_late_shards_are_never_read(world, ray_session, tmp_path, monkeypatch):
    """A driver paused past its lease while a resume took the run over: its actor commits a shard (for users the
    resume decodes too) after the resume started. The published run lists only the resume's lineage: every user
    once, the late files never read and deleted at publish."""
    from pipeline import shards
    from pipeline.nightly import run_nightly

    cfg = config(world, tmp_path / "out")
    run_nightly(cfg)
    old = killed_run(cfg, keep=3)
    run = runs.run_dir(cfg.output, cfg.run_date, old)
    users = pq.read_table(world / "data" / "test.parquet").to_pandas()
    late = "s000000000080-0ldd71ve"  # positions 80.. of the paused attempt, committed after the resume started
    begin = shards.begin_attempt

    def then_a_late_commit(*args):
        trusted = begin(*args)
        recs = pa.table(
            {
                "user_id": users.user_id[80:90].tolist() * 5,
                "rank": np.repeat(np.arange(1, 6), 10).astype(np.int32),
                "item_id": [1] * 50,
                "score": [0.0] * 50,
                "mode": ["beam"] * 50,
            },
            schema=table_schema("rec", pa.int64()),
        )
        metric = {"run_id": old, "shard": late[:13], "users_in": 10, "users_ok": 10, "ranges": [[80, 90]]}
        listed = shards.users_of(pa.table({"user_id": recs["user_id"].unique()}), "decoded")
        empty = table_schema("reject", pa.int64()).empty_table()
        shards.write_shard(late, recs, empty, metric, run, cfg.storage, listed)
        return trusted

    monkeypatch.setattr(shards, "begin_attempt", then_a_late_commit)
    manifest = run_nightly(cfg, resume="latest")
    assert manifest["run_id"] == old and manifest["resume"]["shards_committed_before"] == 3
    assert all(f"{late}.parquet" not in files for files in manifest["files"].values())
    _, recs = assert_published_once(cfg, users)
    assert len(recs) == 5 * len(users)
    assert not list(Path(run).rglob(f"{late}.parquet"))  # deleted at publish (and by --gc, should one come later)


def test_a_retried_shard_without_rejects_leaves_no_stale_rejects(tmp_path):
    """A shard's first attempt rejected two users; its retry rejects none: the retry's (empty) rejects file replaces
    the first one, so no user is both recommended and rejected."""
    from pipeline.shards import users_of, write_shard
    from pipeline.storage import Storage

    run, storage = str(tmp_path / "run"), Storage()
    recs = pa.table(
        {
            "user_id": [1, 2],
            "rank": pa.array([1, 1], pa.int32()),
            "item_id": [5, 6],
            "score": pa.array([0.0, 0.0], pa.float32()),
            "mode": ["beam", "beam"],
        },
        schema=table_schema("rec", pa.int64()),
    )
    rejects = pa.table(
        {"user_id": [1, 2], "reason": ["bad", "bad"], "detail": ["x", "x"]}, schema=table_schema("reject", pa.int64())
    )
    metric = {"run_id": "r", "shard": "s000000000000", "users_in": 2, "ranges": [[0, 2]]}
    users = users_of(pa.table({"user_id": [1, 2]}), "decoded")
    write_shard("s000000000000-a", recs.slice(0, 0), rejects, metric, run, storage, users)
    write_shard("s000000000000-a", recs, rejects.slice(0, 0), metric, run, storage, users)  # Ray's retry of the batch
    got = runs.read_table(run, "rejects", storage, files=["s000000000000-a"])
    assert (
        got.num_rows == 0 and runs.read_table(run, "recommendations", storage, files=["s000000000000-a"]).num_rows == 2
    )


DATE, LOCAL = "2026-11-21", Storage()


def fake_run(out: Path, run_id: str) -> str:
    """A complete run folder of DATE (manifest listing one recommendations file, then _SUCCESS), not published."""
    run = runs.run_dir(str(out), DATE, run_id)
    table = pa.table({"user_id": [1], "rank": [1], "item_id": [7], "score": [0.5], "mode": ["beam"]})
    S.write_parquet(table, S.join(runs.table_dir(run, "recommendations"), "0.parquet"), LOCAL)
    manifest = {
        "run_id": run_id,
        "run_date": DATE,
        "status": "ok",
        "config": {"decoding": {"mode": "beam", "k": 1}},
        "files": {"recommendations": ["0.parquet"], "rejects": [], "metrics": []},
    }
    runs.finish(run, manifest, LOCAL)
    return run


def test_a_run_folder_that_latest_does_not_name_is_refused_unless_asked(tmp_path, capsys):
    """The reader and `show` read a run folder only when its date's _LATEST names it: a complete run never
    published, or one superseded by a later publish, is refused (show: exit 2) unless opted in, then labelled."""
    from jobs import show
    from pipeline.output import open_run

    out = tmp_path / "out"
    first = fake_run(out, "a")
    with pytest.raises(ValueError, match="not published.*names no run"):  # complete, yet no _LATEST names it
        open_run(first, LOCAL)
    runs.publish(str(out), DATE, "a", LOCAL, grace_s=3600)
    second = fake_run(out, "b")  # complete after a's publish: a complete, unpublished run
    assert open_run(first, LOCAL).published and open_run(str(out), LOCAL).run_id == "a"
    assert show.main([second]) == 2 and "names run a" in capsys.readouterr().err
    assert show.main([second, "--any"]) == 0 and "UNPUBLISHED" in capsys.readouterr().out
    assert not open_run(second, LOCAL, allow_unpublished=True).published

    runs.publish(str(out), DATE, "b", LOCAL, grace_s=3600)  # a superseded: kept for the grace period, not read
    with pytest.raises(ValueError, match="not published.*names run b"):
        open_run(first, LOCAL)
    assert show.main([second]) == 0 and "UNPUBLISHED" not in capsys.readouterr().out
    (Path(second) / "_SUPERSEDED").write_text(json.dumps({"by": "c", "at": 0}))  # marked, though _LATEST names it
    with pytest.raises(ValueError, match="superseded by run c"):
        open_run(second, LOCAL)


def test_a_run_is_completed_once_whatever_a_fenced_driver_left(tmp_path):
    """runs.finish: a manifest is created once and _SUCCESS only over the writer's own; a fenced driver's manifest
    left without _SUCCESS gives way to the lease holder's; a run another driver completed refuses a second manifest;
    a run with _SUCCESS but no manifest is not complete (resumable, never published as it is), and a resume clears
    what is left of it."""
    from pipeline.lease import LeaseLost

    st = Storage()
    out, date = str(tmp_path / "out"), "2026-11-21"
    run = runs.run_dir(out, date, "R1")
    S.write_bytes(S.join(run, "_RUN.json"), b"{}", st)
    S.create(S.join(run, "manifest.json"), b'{"by": "A"}', st)  # A, fenced after its manifest
    runs.finish(run, {"by": "B"}, st)  # B, the lease's holder
    assert json.loads(S.read_bytes(S.join(run, "manifest.json"), st)) == {"by": "B"} and runs.complete(run, st)
    with pytest.raises(LeaseLost, match="written by another driver of this run"):
        runs.finish(run, {"by": "A"}, st)
    runs.finish(run, {"by": "B"}, st)  # its own again (an answer lost): fine
    S.delete_files(run, ["manifest.json"], st)  # _SUCCESS without its manifest
    assert not runs.complete(run, st) and runs.unfinished(out, date, st) == ["R1"]
    assert runs.complete_unpublished(out, date, st) == []
    runs.clear_unfinished(run, st)
    assert sorted(p.name for p in Path(run).iterdir()) == ["_RUN.json"]
    checks = []

    def lost_meanwhile():
        checks.append(1)
        S.delete_files(run, ["manifest.json"], st)  # a driver that took the run over cleared it

    with pytest.raises(LeaseLost):
        runs.finish(run, {"by": "A"}, st, lost_meanwhile)
    assert checks and not S.exists(S.join(run, "_SUCCESS"), st)
