"""Incremental nights under faults, on a real local Ray with local files: a night killed part-way and resumed publishes
every user once, as a full night lists them; a base deleted while a night reads it stops the night, which publishes
nothing; a pinned base outlives --gc until its pin expires."""

import json
import time
from pathlib import Path

import pytest

from pipeline import runs
from tests.test_incremental import (
    BASE_DATE,
    NIGHT,
    assert_same_lists,
    based,
    build_world,
    night_config,
    published,
    run_base,
)
from tests.test_nightly import config, killed_run


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("incremental-faults"))


@pytest.fixture(scope="module")
def base_night(world, ray_session_plain, tmp_path_factory):
    out = tmp_path_factory.mktemp("base") / "out"
    return out, run_base(world[0], out)


def test_an_incremental_night_killed_and_resumed_publishes_every_user_once(world, base_night, tmp_path):
    """An incremental night (a carry task per base shard: many carried shards) killed after two shards:
    --resume latest carries and decodes the rest, and every user is published once, as a full night lists them."""
    from pipeline.nightly import run_nightly

    root, _ = world
    based(base_night, tmp_path)
    cfg = night_config(root, tmp_path / "out", "incremental.enabled=true", "incremental.base_shards_per_task=1")
    run_nightly(cfg)
    old = killed_run(cfg, keep=2)
    manifest = run_nightly(cfg, resume="latest")
    assert manifest["run_id"] == old and manifest["resume"]["resumed"]
    run_nightly(night_config(root, tmp_path / "full"))
    a, users, _ = published(cfg)
    b, _, _ = published(night_config(root, tmp_path / "full"))
    assert_same_lists(a, b)
    assert users["user_id"].to_pylist() and len(set(users["user_id"].to_pylist())) == users.num_rows


def test_a_base_deleted_mid_run_stops_the_night_and_publishes_nothing(world, base_night, tmp_path):
    """The base's files deleted after the plan found it: the run stops with BaseGone (exit 2) naming it; nothing is
    published for the night. While a run holds its pin, --gc leaves a superseded base alone."""
    from pipeline.carry import BaseGone
    from pipeline.nightly import run_nightly
    from pipeline.plan import plan_run

    root, _ = world
    base = config(root, based(base_night, tmp_path), f"input={root / 'base.parquet'}", f"run_date={BASE_DATE}")
    cfg = night_config(root, tmp_path / "out", "incremental.enabled=true")
    plan = plan_run(cfg)
    for f in (Path(plan.base.uri) / "users").glob("*.parquet"):
        f.unlink()
    with pytest.raises(BaseGone, match=f"incremental base {plan.base.uri}"):
        run_nightly(cfg, plan=plan)
    assert runs.latest_run(cfg.output, NIGHT, cfg.storage) is None

    old = plan.base.uri
    runs.pin(old, "a-reader", time.time() + 600, cfg.storage)
    again = run_nightly(base)  # the base's date rerun: the old base is superseded
    assert again["run_id"] not in old
    assert runs.collect(base.output, base.storage, grace_s=0) == [] and Path(old).is_dir()
    for pin in (Path(old) / "_PINS").iterdir():
        pin.write_text(json.dumps({"by": "a-reader", "until": time.time() - 1}))
    assert runs.collect(base.output, base.storage, grace_s=0) == [Path(old).name.removeprefix("run_id=")]
