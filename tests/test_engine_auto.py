"""compute.engine auto (operators/recommender.py AutoEngine): one decision per run, taken with power.

The nightly's actor (the Recommender, called in-process) over a world of 96 users in shards of 16, its trial users
the world's (as the nightly gives every actor the input's first users), its decision recorded in a run folder
(pipeline.runs.EngineRecord; on SeaweedFS where actors race). The compiled graphs go to the suite's COMPILE_CACHE.

Power. The bound on the two engines' score difference is twice what the run's dtype costs the eager engine against
the next wider dtype on the same trial users (measured in the run: float32 against float64, half precision against
float32), and a user counts only when its eager tie gap exceeds twice that bound. The test hook (SKEW_ENV) rolls every
compiled list by one place, so every clear user whose list is not one near-tie block exposes it. The trials draw
groups until compute.engine_clear_users (16 here) users are clear, so a kept compiled engine has agreed with eager on
at least 16 users clear of a near-tie: an engine wrong for a share f of users passes unseen with probability at most
(1 - f)^16 (f = 0.25: 1%). On this world about a quarter of the users are clear in bfloat16, most in float16 and
float32 (measured on all 96 of its users as trial users, CPU: 24, 80 and 96 of 96). The trial users are the input's
first users in file order, so "wrong for a share f" means a share of those users: the statement carries over to the
whole input only where the first users are like the rest (here the world's users are generated alike, in no order).
"""

import json
from dataclasses import replace

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from tests.helpers import COMPILE_CACHE

CLEAR = 16  # compute.engine_clear_users in these tests


pytestmark = pytest.mark.usefixtures("compile_cache")  # tests/conftest.py: the suite's inductor cache


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from tests.test_nightly import make_world

    return make_world(tmp_path_factory.mktemp("engine-auto"), n_users=96)


@pytest.fixture(scope="module")
def users(world):
    return pq.read_table(world / "data" / "test.parquet", columns=["user_id", "history"])


def actor(world, users, run, *extra, record=None):
    """A nightly actor of compute.engine auto whose trial users are the world's and whose decision goes to `run`."""
    from operators.recommender import Recommender
    from pipeline.plan import plan_run
    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage
    from tests.test_nightly import config

    settings = [
        "compute.engine=auto",
        f"compute.compile_cache={COMPILE_CACHE}",
        "compute.engine_short_run_s=0",
        f"compute.engine_clear_users={CLEAR}",
        "compute.audit_users=0",
        *extra,
    ]
    spec = plan_run(config(world, world / "unused", *settings)).spec
    record = record or EngineRecord(str(run), Storage())
    return Recommender(replace(spec, trial_users=users, engine_record=record))


def shards(actor, users, batch: int = 16, n: int = 2):
    """The actor's output on its first n shards of `batch` users -> [(recommendations frame, metric row)]."""
    out = []
    for a in range(0, n * batch, batch):
        t = actor(users.slice(a, batch)).to_pandas()
        metric = json.loads(t[t.kind == "metric"].metrics.iloc[0])
        out.append((t[t.kind == "rec"][["user_id", "rank", "item_id"]], metric))
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_wrong_compiled_engine_is_rejected_in_every_dtype(world, users, tmp_path, dtype, monkeypatch):
    """With the compiled engine made wrong (the hook), the trials find clear users whose lists differ, in half
    precision as in float32 (the bound from the dtype's measured cost leaves users clear: the old bound, hidden x eps
    x |score|, left none in bfloat16); the run's decision is eager, recorded, and every shard publishes eager's
    lists."""
    from operators.engines import SKEW_ENV
    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage

    monkeypatch.setenv(SKEW_ENV, "1")
    a = actor(world, users, tmp_path / "run", f"compute.dtype={dtype}")
    out = shards(a, users)
    state = out[0][1]["auto"]["engine"]
    (p,) = state["parity"]
    assert state["choice"] == "eager" and state["reason"].startswith("no parity on the trial users"), state
    assert p["clear"] >= 1 and p["identical_clear"] < p["clear"] and not p["holds"]
    assert p["bound"] >= 2 * p["noise"] > 0
    if dtype == "bfloat16":  # what the issue found: the old bound was above every tie gap
        hidden, eps = a.target.config.hidden_size, torch.finfo(torch.bfloat16).eps
        assert p["bound"] < hidden * eps * 1.0  # |score| >= 1 here: far below the old bound
    assert {m["engine"] for _, m in out} == {"eager"} and state["checked"]
    assert EngineRecord(str(tmp_path / "run"), Storage()).read()["choice"] == "eager"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_right_compiled_engine_keeps_parity_on_enough_clear_users(world, users, tmp_path, dtype):
    """Without the hook the pooled evidence holds on at least CLEAR clear users (more trial groups drawn where one
    is not enough), the choice is the faster engine, and every shard after it publishes that engine's lists."""
    a = actor(world, users, tmp_path / "run", f"compute.dtype={dtype}")
    out = shards(a, users)
    state = out[-1][1]["auto"]["engine"]
    (p,) = state["parity"]
    assert p["holds"] and p["clear"] >= CLEAR and p["identical_clear"] == p["clear"], state
    assert state["trial_batches"] >= 2 and p["users"] == 16 * state["trial_batches"]
    fast = max(state["trial_users_per_s"], key=state["trial_users_per_s"].get)
    assert state["choice"] == fast and {m["engine"] for _, m in out} == {fast}


def test_too_few_clear_users_stay_eager_and_say_why(world, users, tmp_path):
    """Trials that cannot tell the engines apart (more clear users needed than the trial users hold) stay eager."""
    a = actor(world, users, tmp_path / "run", "compute.engine_clear_users=500", "compute.engine_trial_max=3")
    (_, metric), *_ = shards(a, users, n=1)
    state = metric["auto"]["engine"]
    assert state["choice"] == "eager" and state["trial_batches"] == 3
    assert state["reason"].startswith("inconclusive: ") and "compute.engine_clear_users 500 needed" in state["reason"]


def test_two_actors_racing_publish_one_engines_lists(world, users, tmp_path_factory, monkeypatch):
    """Two actors of one run on SeaweedFS: A decides and records first; B (slower: it read the record before A wrote
    it) runs its own trials with the compiled engine made wrong, so its own decision is eager, but its conditional
    create loses and it adopts A's. Both publish the engine A chose; a restarted actor C runs no trial at all."""
    from operators.engines import SKEW_ENV
    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage
    from tests.servers import seaweedfs

    root = tmp_path_factory.mktemp("race")
    with seaweedfs(root / "s3") as s3, pytest.MonkeyPatch.context() as env:
        for name, value in s3.env().items():
            env.setenv(name, value)
        record = EngineRecord(s3.uri("out/run_date=2026-11-21/run_id=r1"), Storage(endpoint=s3.endpoint))

        class ReadTooEarly:  # B's first read happened before A's claim
            def __init__(self):
                self.reads = 0

            def read(self):
                self.reads += 1
                return None if self.reads == 1 else record.read()

            def claim(self, decision):
                return record.claim(decision)

        a = actor(world, users, root / "unused", record=record)
        a.actor = "actor-A"
        out_a = shards(a, users)
        monkeypatch.setenv(SKEW_ENV, "1")
        b = actor(world, users, root / "unused", record=ReadTooEarly())
        b.actor = "actor-B"
        out_b = shards(b, users)
        monkeypatch.delenv(SKEW_ENV)
        c = actor(world, users, root / "unused", record=record)
        out_c = shards(c, users, n=1)
        recorded = record.read()
    choice = recorded["choice"]
    assert recorded["decided_by"] == "actor-A" and b.engine_auto.decided_by == "actor-A"
    assert len(b.engine_auto.groups) >= 1 and len(c.engine_auto.groups) == 0  # B ran trials; C adopted without
    for out in (out_a, out_b, out_c):
        assert {m["engine"] for _, m in out} == {choice}
        assert {m["auto"]["engine"]["reason"] for _, m in out} == {recorded["reason"]}
    for (ra, _), (rb, _) in zip(out_a, out_b):  # the same shards: one engine's lists
        pd.testing.assert_frame_equal(ra.reset_index(drop=True), rb.reset_index(drop=True))


def test_a_bucket_the_trials_did_not_check_decodes_eager(world, users, tmp_path):
    """A run decided compiled, its trials having checked another bucket than the actor's (as after a slice halved
    by an out-of-memory): the actor decodes eager there, saying why; in the checked bucket it decodes compiled."""
    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage

    record = EngineRecord(str(tmp_path / "unchecked"), Storage())
    a = actor(world, users, tmp_path, record=record)
    setting = a.engine_auto.setting
    decision = {"choice": "compiled", "reason": "by hand", "decided_by": "test", "parity": [], "setting": setting}
    record.claim({**decision, "checked": [{"users": 4, "prompt": 64, "setting": setting}]})
    ((_, metric),) = shards(a, users, n=1)
    assert metric["engine"] == "eager" and "did not check bucket" in metric["engine_note"]
    u, p = a.compiled.bucket(a.target, torch.zeros(16, a.renderer.max_len - a.prefix_len, dtype=torch.int64))
    record = EngineRecord(str(tmp_path / "checked"), Storage())
    record.claim({**decision, "checked": [{"users": u, "prompt": p, "setting": setting}]})
    a = actor(world, users, tmp_path, record=record)
    ((_, metric),) = shards(a, users, n=1)
    assert metric["engine"] == "compiled" and metric["engine_note"] is None


def test_a_compile_error_falls_back_to_eager(world, users, tmp_path):
    """No C++ compiler (inductor's cpp.cxx names a missing one; an empty compile cache, so it must compile): under
    auto the trials record the error and the run stays eager; under compute.engine compiled the actor starts, records
    the error for its bucket and decodes it eager, never failing the run."""
    import torch._inductor.config as inductor

    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage

    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        # an empty cache and graphs no other test compiles (K 4): inductor's in-process caches hold none of them
        cache, k = f"compute.compile_cache={tmp_path / 'empty-cache'}", "decoding.k=4"
        a = actor(world, users, tmp_path / "run", cache, k)
        ((recs, metric),) = shards(a, users, n=1)
        state = metric["auto"]["engine"]
        assert state["choice"] == "eager" and state["reason"].startswith("compile failed: "), state
        assert "/nonexistent/c++" in state["reason"], state["reason"]
        assert metric["compile_errors"] and metric["engine"] == "eager" and len(recs) == 16 * 4
        assert EngineRecord(str(tmp_path / "run"), Storage()).read() is None  # one node's error is not the run's
        assert "the run's decision is not recorded by it" in metric["engine_note"]
        b = actor(world, users, tmp_path / "run2", "compute.engine=compiled", cache, k)
        ((recs, metric),) = shards(b, users, n=1)
        assert metric["engine"] == "eager" and metric["engine_note"].startswith("compile failed: ")
        assert json.loads(metric["compile_errors"]) and len(recs) == 16 * 4


def test_a_decision_holds_only_in_the_setting_it_was_made_in(world, users, tmp_path):
    """A run decided compiled by float32 trials (its buckets checked in float32): a bfloat16 actor of the run (or one
    on another device, torch or k) decodes eager, saying why, without trials; neither a record without a setting
    (older) nor bare (users, prompt) buckets count as checked anywhere."""
    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage

    f32 = actor(world, users, tmp_path / "probe").engine_auto.setting
    assert f32["dtype"] == "float32" and f32["torch"] == torch.__version__ and f32["device"].startswith("cpu-")
    for i, (setting, checked) in enumerate(((f32, None), (None, "bare"))):
        record = EngineRecord(str(tmp_path / f"run{i}"), Storage())
        a = actor(world, users, tmp_path, "compute.dtype=bfloat16", record=record)
        u, p = a.compiled.bucket(a.target, torch.zeros(16, a.renderer.max_len - a.prefix_len, dtype=torch.int64))
        buckets = [[u, p]] if checked == "bare" else [{"users": u, "prompt": p, "setting": f32}]
        record.claim(
            {"choice": "compiled", "reason": "float32 trials", "decided_by": "f32", "parity": [], "checked": buckets}
            | ({"setting": setting} if setting else {})
        )
        ((_, metric),) = shards(a, users, n=1)
        assert metric["dtype"] == "bfloat16" and metric["engine"] == "eager", metric
        assert "this actor runs" in metric["engine_note"] and "bfloat16" in metric["engine_note"]
        assert len(a.engine_auto.groups) == 0 and a.engine_auto.checked == set()


def test_per_user_exclusions_decide_eager_before_any_trial(world, users, tmp_path):
    """decoding.exclude history (the compiled engine decodes excluding users eager): the run records eager with that
    reason, and no trial decodes or compiles anything."""
    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage

    a = actor(world, users, tmp_path / "run", "decoding.exclude=history")
    ((_, metric),) = shards(a, users, n=1)
    state = metric["auto"]["engine"]
    assert state["choice"] == "eager" and state["reason"].startswith("per-user exclusions (decoding.exclude history)")
    assert (
        state["trial_batches"] == 0 and state["compile_s"] == 0 and not a.compiled.warm and metric["engine"] == "eager"
    )
    assert EngineRecord(str(tmp_path / "run"), Storage()).read()["reason"] == state["reason"]


def test_an_actors_own_failure_is_never_the_runs_decision(world, users, tmp_path, monkeypatch):
    """Trials that run out of memory, and trials whose reference-dtype copy would not fit (the memory check, before
    anything is loaded or compiled), leave this actor eager with the reason noted and record nothing: the run's
    decision is left to an actor that can run the trials."""
    from operators import engines
    from pipeline.runs import EngineRecord
    from pipeline.storage import Storage

    def oom(self, r, engine, ids, mask):
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    cases = {
        "out of memory": (engines.AutoEngine, "trial_decode", oom),
        "no room": (engines, "host_free_memory", lambda: 1 << 20),
    }
    for i, (case, (owner, name, patch)) in enumerate(cases.items()):
        with monkeypatch.context() as m:
            m.setattr(owner, name, patch)
            a = actor(world, users, tmp_path / f"run{i}")
            ((recs, metric),) = shards(a, users, n=1)
        state = metric["auto"]["engine"]
        assert state["choice"] == "eager" and state["local"] and metric["engine"] == "eager", (case, state)
        assert "the run's decision is not recorded by it" in metric["engine_note"], case
        assert EngineRecord(str(tmp_path / f"run{i}"), Storage()).read() is None, case
        assert len(recs) == 16 * 5
    assert (
        "reference copy and its decode need" in state["reason"] and state["trial_batches"] == 0 and not a.compiled.warm
    )
