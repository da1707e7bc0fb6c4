"""Incremental nights on a real local Ray with local files: a night that carries unchanged users publishes what a full
night publishes (float32: the same lists, scores within float32's reordering bound), decodes only new and changed users,
runs full naming the part of its fingerprint that changed, resumes after a kill, and stops on a base that vanished."""

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from pipeline import runs
from pipeline.lineage import input_hashes
from tests.helpers import float32_atol
from tests.test_nightly import config, killed_run, make_world

BASE_DATE, NIGHT = "2026-11-21", "2026-11-22"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("incremental"))


def build_world(root: Path) -> tuple[Path, dict]:
    """Tiny models, a base night's input (histories, exclusion lists) and tonight's -> (root, who tonight decodes)."""
    root = make_world(root, n_users=120)
    rng = np.random.default_rng(3)
    t = pq.read_table(root / "data" / "test.parquet").select(["user_id", "history"])
    items = pq.read_table(root / "data" / "items.parquet").column("item_id").to_numpy()
    exclude = [rng.choice(items, 3).tolist() if u % 3 == 0 else None for u in range(t.num_rows)]
    t = t.append_column("exclude_items", pa.array(exclude, pa.list_(pa.int64())))
    pq.write_table(t, root / "base.parquet", row_group_size=50)
    night, expected = tonight(t, items, rng)
    pq.write_table(night, root / "night.parquet", row_group_size=40)
    return root, expected


@pytest.fixture(scope="module")
def base_night(world, ray_session_plain, tmp_path_factory):
    """The base night published once -> its output root and manifest."""
    out = tmp_path_factory.mktemp("base") / "out"
    return out, run_base(world[0], out)


def run_base(root: Path, out: Path) -> dict:
    """The base night (the default settings: beam, float32) under `out` -> its manifest."""
    from pipeline.nightly import run_nightly

    return run_nightly(config(root, out, f"input={root / 'base.parquet'}", f"run_date={BASE_DATE}"))


def based(base_night, tmp_path: Path) -> Path:
    """A copy of the base night's output root, for one test to write tonight's nights into."""
    out = tmp_path / "out"
    shutil.copytree(base_night[0], out)
    return out


def tonight(t: pa.Table, items: np.ndarray, rng) -> tuple[pa.Table, dict]:
    """The base night's users changed as a day changes them -> tonight's input and which users must be decoded: 10
    with a new last item (the window moves), 8 with a new exclusion list, 6 with an older item prepended (outside the
    8-item window: carried), 5 removed, 7 new users, and one user's row twice (the repeat rejected)."""
    rows = t.to_pylist()
    long = [i for i, r in enumerate(rows) if len(r["history"]) >= 8]
    picks = rng.permutation(long)
    window, outside = picks[:10], picks[10:16]
    exclusion = rng.permutation([i for i in range(len(rows)) if i not in set(picks[:16])])[:8]
    removed = set(rng.permutation([i for i in range(len(rows)) if i not in set(picks[:16]) | set(exclusion)])[:5])
    for i in window:
        rows[i]["history"] = rows[i]["history"][1:] + [int(rng.choice(items))]
    for i in outside:
        rows[i]["history"] = [int(rng.choice(items))] + rows[i]["history"]
    for i in exclusion:
        rows[i]["exclude_items"] = [int(x) for x in rng.choice(items, 2)]
    changed = {rows[i]["user_id"] for i in [*window, *exclusion]}
    new = [{"user_id": 10_000 + j, "history": rng.choice(items, 5).tolist(), "exclude_items": None} for j in range(7)]
    kept = [r for i, r in enumerate(rows) if i not in removed]
    repeat = dict(kept[3])
    out = pa.Table.from_pylist(kept[:20] + new[:3] + kept[20:] + [repeat] + new[3:], schema=t.schema)
    carried = {r["user_id"] for r in kept} - changed
    return out, {"changed": changed, "new": {r["user_id"] for r in new}, "carried": carried, "removed": len(removed)}


def night_config(root: Path, out: Path, *extra):
    return config(root, out, f"input={root / 'night.parquet'}", f"run_date={NIGHT}", *extra)


def published(cfg) -> tuple[pa.Table, pa.Table, dict]:
    """A date's published run: its recommendations sorted by user and rank, its users table, its manifest."""
    from pipeline.output import open_run

    run = open_run(runs.date_dir(cfg.output, cfg.run_date), cfg.storage)
    recs = run.table("recommendations").sort_by([("user_id", "ascending"), ("rank", "ascending")])
    return recs, run.table("users"), run.manifest


def assert_same_lists(a: pa.Table, b: pa.Table) -> None:
    """Two nights' recommendations: the same users, ranks and items; scores within what float32 sums of another batch
    shape may differ by (`float32_atol`: the batch a user is decoded in changes the kernels' accumulation order)."""
    for column in ("user_id", "rank", "item_id", "mode"):
        assert a[column].equals(b[column]), column
    sa, sb = (torch.tensor(t["score"].to_numpy()) for t in (a, b))
    assert (sa - sb).abs().max() <= float32_atol(sa, sb)


@pytest.mark.parametrize("mode", ["beam", "disc"])  # strict speculation lists what beam search does (test_speculative)
def test_an_incremental_night_equals_a_full_night(world, ray_session_plain, tmp_path, mode):
    """Base night, then tonight incremental and full: the same lists for every user; only the new and changed users
    decoded, users outside the window and unchanged users carried, removed users dropped, the repeat rejected."""
    from pipeline.nightly import run_nightly

    root, expected = world
    extra = [f"decoding.mode={mode}", "decoding.seed=7", "decoding.exclude=none"]
    base = config(root, tmp_path / "out", f"input={root / 'base.parquet'}", f"run_date={BASE_DATE}", *extra)
    run_nightly(base)
    incremental = run_nightly(night_config(root, tmp_path / "out", "incremental.enabled=true", *extra))
    run_nightly(night_config(root, tmp_path / "full", *extra))
    a, users, manifest = published(night_config(root, tmp_path / "out", *extra))
    b, full_users, full = published(night_config(root, tmp_path / "full", *extra))
    assert_same_lists(a, b)
    assert manifest["incremental"]["mode"] == "carry" and manifest["incremental"]["base_run_id"]
    assert manifest["lineage"]["sha256"] == full["lineage"]["sha256"]
    source = dict(zip(users["user_id"].to_pylist(), users["source"].to_pylist()))
    assert {u for u, s in source.items() if s == "decoded"} == expected["changed"] | expected["new"]
    assert {u for u, s in source.items() if s == "carried"} == expected["carried"]
    hashes = dict(zip(full_users["user_id"].to_pylist(), full_users["input_hash"].to_pylist()))
    assert dict(zip(users["user_id"].to_pylist(), users["input_hash"].to_pylist())) == hashes
    counts = incremental["counts"]
    assert counts["users_carried"] == len(expected["carried"]) and counts["users_dropped"] == expected["removed"]
    assert counts["users_decoded"] == len(expected["changed"] | expected["new"])
    assert full["counts"]["users_carried"] == 0 and full["incremental"] == {"enabled": False, "mode": "full"} | {
        k: full["incremental"][k] for k in ("decode_s", "full_decode_s_estimate")
    }
    reasons = runs.read_table(runs.latest_run(base.output, NIGHT, base.storage), "rejects", base.storage)
    assert reasons["reason"].to_pylist() == ["duplicate_user"]


def test_a_changed_part_makes_a_full_night_that_names_it(world, base_night, tmp_path):
    """After a base night: a changed catalog, model, template or setting plans a full night naming the part."""
    from pipeline.plan import plan_run

    root, _ = world
    based(base_night, tmp_path)
    tonight_cfg = night_config(root, tmp_path / "out", "incremental.enabled=true")
    assert plan_run(tonight_cfg).incremental["mode"] == "carry"
    catalog = pq.read_table(root / "data" / "items.parquet")
    codes = catalog["semantic_id"].to_pylist()
    codes[0], codes[1] = codes[1], codes[0]
    pq.write_table(catalog.set_column(1, "semantic_id", pa.array(codes)), tmp_path / "items.parquet")
    template = tmp_path / "template.json"
    template.write_text(json.dumps({"name": "codes", "max_items": 8, "bos": False}))
    cases = {
        "catalog": [f"catalog={tmp_path / 'items.parquet'}"],
        "target": [f"models.target={root / 'draft'}"],
        "template": [f"models.template={template}"],
        "decoding.k": ["decoding.k=4"],
        "decoding.history_len": ["decoding.history_len=6"],
        "blocked": ["blocked_items=[3]"],
        "dtype": ["compute.dtype=bfloat16"],
    }
    for part, extra in cases.items():
        record = plan_run(night_config(root, tmp_path / "out", "incremental.enabled=true", *extra)).incremental
        assert record["mode"] == "full" and part in record["parts_differ"], (part, record)
    same = plan_run(night_config(root, tmp_path / "out", "incremental.enabled=true", "compute.batch_size=7"))
    assert same.incremental["mode"] == "carry"  # how users are cut into shards is not a part


def test_user_ids_of_every_integer_type_key_the_join():
    """uint64 ids past 2^63 and int32 ids key the join as int64, strings as one string type, whatever each night's
    files hold."""
    from pipeline.carry import key_of

    assert key_of(pa.array([2**63 + 5, 3], pa.uint64())).to_pylist() == [-(2**63) + 5, 3]
    assert key_of(pa.array([7], pa.int32())).type == pa.int64()
    assert key_of(pa.array(["a"], pa.string())).equals(key_of(pa.array(["a"], pa.large_string())))


def test_the_input_hash_reads_the_window_and_the_exclusions():
    """A change inside the prompt's window or the exclusion list changes a user's hash; one outside the window does not,
    unless the whole history is excluded; rows that are not lists of ids have none."""
    h = pa.array([[1, 2, 3, 4], [9, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4], None, [1, None]])
    e = pa.array([[7], [7], [7], [8], [7], None])
    window = input_hashes(h, e, 3, whole_history=False).to_pylist()
    assert window[0] == window[1] and window[0] != window[2] and window[0] != window[3]
    assert window[4] is None and window[5] is None
    whole = input_hashes(h, e, 3, whole_history=True).to_pylist()
    assert whole[0] != whole[1]
    assert input_hashes(h.slice(1, 2), e.slice(1, 2), 3, False).to_pylist() == window[1:3]  # slices: the same
    assert input_hashes(h, None, 3, False)[0] != window[0]


def test_the_input_hash_reads_the_text_a_prompt_writes():
    """A user field hashes as the prompt writes it: an integer column's 3 writes "3", the float column pandas makes of
    it on a night with a null writes "3.0", another prompt, another hash (so is the catalog's text); a string "3"
    and an integer 3 write the same text; a null stays apart from an empty text."""
    from pipeline.lineage import catalog_texts_sha256

    h = pa.array([[1]] * 3)
    of = lambda column: input_hashes(h, None, 3, False, texts=[column]).to_pylist()  # noqa: E731
    ints, floats, strings = of(pa.array([3, None, 0])), of(pa.array([3.0, None, 0.0])), of(pa.array(["3", None, ""]))
    assert ints[0] != floats[0] and ints[0] == strings[0] and ints[1] == floats[1] == strings[1] != strings[2]
    table = lambda values: pa.table({"item_id": [2, 1], "title": values})  # noqa: E731
    assert catalog_texts_sha256(table([3, 4]), ["title"]) != catalog_texts_sha256(table([3.0, 4.0]), ["title"])


def test_a_first_night_or_an_older_base_runs_full(world, tmp_path):
    """No published run to carry from: a full night that says why."""
    from pipeline.plan import plan_run

    root, _ = world
    record = plan_run(night_config(root, tmp_path / "empty", "incremental.enabled=true")).incremental
    assert record["mode"] == "full" and record["full_because"] == ["no published run to carry from"]


def test_a_bfloat16_incremental_night_agrees_with_a_full_one_within_near_ties(world, ray_session_plain, tmp_path):
    """In bfloat16 a list can depend on the batch it was decoded in: the incremental night (carried users keep the
    base's lists) and the full night agree user by user up to swaps of items whose scores are within twice the
    dtype's noise measured here (the largest score difference of an item both nights list for a user), and the share
    of users with identical lists is reported."""
    from decoding.metrics import same_within_ties
    from pipeline.nightly import run_nightly

    root, _ = world
    extra = ["compute.dtype=bfloat16", "compute.audit_users=0"]
    run_nightly(config(root, tmp_path / "out", f"input={root / 'base.parquet'}", f"run_date={BASE_DATE}", *extra))
    run_nightly(night_config(root, tmp_path / "out", "incremental.enabled=true", *extra))
    run_nightly(night_config(root, tmp_path / "full", *extra))
    lists = []
    for out in ("out", "full"):
        recs = published(night_config(root, tmp_path / out))[0].to_pandas()
        lists.append(recs.groupby("user_id").agg(items=("item_id", list), scores=("score", list)))
    a, b = lists
    assert list(a.index) == list(b.index) and (a["items"].map(len) == b["items"].map(len)).all()
    items_a, items_b = (torch.tensor(x["items"].tolist()) for x in (a, b))
    scores_a, scores_b = (torch.tensor(x["scores"].tolist()) for x in (a, b))
    both = items_a[:, :, None] == items_b[:, None, :]  # [U, K, K]
    noise = float(torch.where(both, (scores_a[:, :, None] - scores_b[:, None, :]).abs(), 0.0).max())
    identical = (items_a == items_b).all(1)
    print(f"bfloat16: {int(identical.sum())} of {len(identical)} users identical, noise {noise:.3g}")
    assert same_within_ties(items_a, scores_a, items_b, 2 * noise).all()


def test_a_night_without_changes_carries_everyone_and_reports_it(world, base_night, tmp_path):
    """Tonight's input is the base's: every user carried, nothing decoded; the lists decoded in and on what the base's
    were (inherited), and the report says so."""
    from pipeline.nightly import run_nightly
    from pipeline.report import summarize

    root, _ = world
    based(base_night, tmp_path)
    base = base_night[1]
    cfg = config(root, tmp_path / "out", f"input={root / 'base.parquet'}", f"run_date={NIGHT}")
    manifest = run_nightly(replace(cfg, incremental=replace(cfg.incremental, enabled=True)))
    counts = manifest["counts"]
    assert counts["users_decoded"] == 0 and counts["users_carried"] == base["counts"]["users_ok"] == counts["users_ok"]
    assert (
        manifest["lineage"]["decoded_on"]
        == base["lineage"]["decoded_on"]
        == {"dtypes": ["float32"], "devices": ["cpu"]}
    )
    s = summarize(runs.load_run(runs.date_dir(cfg.output, NIGHT), cfg.storage), 2.5)
    assert s["incremental"]["users_carried"] == counts["users_carried"] and s["users_ok"] == 0


def test_tonights_decoded_users_must_match_the_bases_dtype_and_device():
    """compute.dtype auto and the GPU model show only in the actors: a night whose decoded users ran in another dtype
    or on another device than its base's is refused before it publishes, naming both."""
    from pipeline.carry import Base, check_decoded_on

    base = Base("b", "r", [], 1, {"dtypes": ["float32"], "devices": ["NVIDIA A10G"]})
    check_decoded_on(base, {"dtypes": ["float32"], "devices": ["NVIDIA A10G"]})
    check_decoded_on(base, {"dtypes": [], "devices": []})  # nothing decoded tonight: every list is the base's
    with pytest.raises(ValueError, match=r"decoded as \['bfloat16'\] on \['NVIDIA H100'\] by \['compiled'\]"):
        check_decoded_on(base, {"dtypes": ["bfloat16"], "devices": ["NVIDIA H100"], "engines": ["compiled"]})


def test_a_night_decoded_on_some_of_its_bases_gpu_models_publishes():
    """A base decoded on a cluster of two GPU models: tonight's few users decoded on one of them mix nothing the base
    did not (published); a GPU model, dtype or engine the base never used is refused."""
    from pipeline.carry import Base, check_decoded_on

    both = {"dtypes": ["float32"], "devices": ["NVIDIA A10G", "NVIDIA H100"]}
    base = Base("b", "r", [], 1, both)
    for tonight in ({"dtypes": ["float32"], "devices": ["NVIDIA H100"]}, both):
        check_decoded_on(base, tonight)
    with pytest.raises(ValueError, match=r"decoded as \['float32'\] on \['NVIDIA L4'\]"):
        check_decoded_on(base, {"dtypes": ["float32"], "devices": ["NVIDIA L4"]})
    half = Base("b", "r", [], 1, {"dtypes": ["bfloat16"], "devices": ["NVIDIA H100"], "engines": ["compiled"]})
    check_decoded_on(half, {"dtypes": ["bfloat16"], "devices": ["NVIDIA H100"], "engines": ["compiled"]})
    with pytest.raises(ValueError, match=r"by \['compiled', 'eager'\]"):
        check_decoded_on(half, {"dtypes": ["bfloat16"], "devices": ["NVIDIA H100"], "engines": ["compiled", "eager"]})
    from types import SimpleNamespace

    from pipeline.publish import lineage_info

    h100 = {"dtypes": ["float32"], "devices": ["NVIDIA H100"]}  # the manifest: the carried lists' models too
    assert (
        lineage_info(SimpleNamespace(base=base, lineage={}), {"decoded_on": h100, "users_carried": 3})["decoded_on"]
        == both
    )
    assert (
        lineage_info(SimpleNamespace(base=base, lineage={}), {"decoded_on": h100, "users_carried": 0})["decoded_on"]
        == h100
    )


def test_keys_that_share_a_hash_are_told_apart_and_a_user_listed_twice_is_decoded(monkeypatch):
    """The indexes sort string ids by a 64-bit hash; here every id of one length shares one (a collision for each),
    and the base lists "dd" twice: each pending user finds its own base row or none, and only users the base lists
    once with the same input hash are carried."""
    import pyarrow.compute as pc

    from pipeline import carry

    monkeypatch.setattr(
        carry, "key_hash", lambda keys: pc.fill_null(pc.utf8_length(keys), 0).to_numpy().astype(np.int64)
    )
    h = [bytes([i]) * 16 for i in range(8)]
    base = carry.sorted_by_key(
        pa.table(
            {
                "key": pa.array(["a", "bb", "cc", "dd", "dd"], pa.large_string()),
                "base_hash": [h[0], h[1], h[2], h[3], h[3]],
            }
        )
    )
    keys = pa.array(["b", "cc", "zz", "a", None, "dd"], pa.large_string())
    at = carry.find(keys, base)
    assert [base["key"][int(i)].as_py() if i >= 0 else None for i in at] == [None, "cc", None, "a", None, "dd"]
    tonight = carry.sorted_by_key(
        pa.table(
            {
                "key": pa.array(["b", "cc", "zz", "a", "dd"], pa.large_string()),
                "pos": pa.array([0, 1, 2, 3, 4], pa.int64()),
                "input_hash": [h[0], h[2], h[5], h[7], h[3]],
            }
        )
    )
    fate = carry.decide(base, tonight, 5)
    assert fate.tolist() == [0, carry.CARRIED, 0, carry.IN_BASE, carry.IN_BASE]  # "dd": listed twice, decoded


# ---------------------------------------------------------------- other code


def changed_tree(root: Path) -> Path:
    """A copy of genrec-batch's packages (and pyproject.toml) whose pipeline/items.py does not apply the block list:
    other code, as a fix to any module makes it."""
    from pipeline.lineage import code_packages

    repo = Path(__file__).resolve().parents[1]
    for name in code_packages():
        shutil.copytree(repo / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(repo / "pyproject.toml", root)
    items = root / "pipeline" / "items.py"
    text = items.read_text()
    assert text.count("served = listed & ~blocked") == 1
    items.write_text(text.replace("served = listed & ~blocked", "served = listed"))
    return root


def run_from(tree: Path, cfg) -> subprocess.CompletedProcess:
    """`python -m jobs.nightly` with `cfg` from `tree` (its PYTHONPATH and working directory: Ray puts the driver's
    working directory first on its workers' path), a driver of the module's Ray."""
    import ray

    (tree / "night.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    env = {**os.environ, "PYTHONPATH": str(tree), "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    cmd = [sys.executable, "-m", "jobs.nightly", "--config", str(tree / "night.yaml")]
    return subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=600)


def test_a_night_of_other_code_is_neither_carried_nor_resumed(
    world, base_night, ray_session_plain, tmp_path, capsys, caplog
):
    """The base night's date run by code whose pipeline/items.py does not apply the block list, with the base night's
    most listed item blocked: it lists that item. Tonight, with the same settings and this code, runs full naming
    `code` alone. That run stopped after 3 shards: `--resume RUN_ID` under this code is refused (exit 2) naming the
    code then and now; `--resume latest` would start a new run."""
    from jobs import nightly
    from pipeline.lineage import code_identity
    from pipeline.nightly import check_run
    from pipeline.plan import plan_run

    root, _ = world
    recs = published(config(root, base_night[0], f"run_date={BASE_DATE}"))[0]
    blocked = int(pd.Series(recs["item_id"].to_numpy()).value_counts().index[0])
    cfg = config(root, tmp_path / "out", f"input={root / 'base.parquet'}", f"run_date={BASE_DATE}")
    cfg = replace(cfg, blocked_items=[blocked])
    done = run_from(changed_tree(tmp_path / "changed"), cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    assert blocked in published(cfg)[0]["item_id"].to_pylist()  # the other code ran
    tonight = plan_run(night_config(root, tmp_path / "out", "incremental.enabled=true", f"blocked_items=[{blocked}]"))
    # the code, and what that code computed differently of the run's inputs (here the catalog's listed items)
    assert tonight.incremental["mode"] == "full" and "code" in tonight.incremental["parts_differ"]

    old = killed_run(cfg, keep=3)
    was = json.loads((Path(runs.run_dir(cfg.output, BASE_DATE, old)) / "_RUN.json").read_text())["identity"]["code"]
    now = code_identity()
    assert was["sha256"] != now["sha256"]
    (tmp_path / "night.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    code = nightly.main(["--config", str(tmp_path / "night.yaml"), "--check", "--resume", old])
    err = capsys.readouterr().err  # Ray's workers may forward lines of their own: the job's error is one line
    error = next((line for line in err.splitlines() if line.startswith("error: ")), "")
    assert code == 2 and error.startswith(
        f"error: --resume {old}: the code (genrec-batch {was['version']}, source {was['sha256'][:12]} then, "
        f"{now['version']}, source {now['sha256'][:12]} now) changed since the run started"
    ), err
    assert "Start a new run instead (--resume latest does)" in err
    with caplog.at_level("WARNING", logger="genrec.nightly"):
        assert check_run(cfg, "latest")["resume"] == {"resumes": None}  # a new run
    assert f"run {old} cannot be resumed: the code (genrec-batch" in caplog.text


def test_every_task_refuses_other_code_than_the_drivers(world, ray_session_plain, tmp_path, monkeypatch):
    """A node that runs other code than the driver planned with: its read tasks, carry tasks and recommender actors
    refuse to work, naming the node; an actor's refusal reaches the driver as itself, a ValueError (exit 2), at its
    first batch, before it decodes anything."""
    from pipeline import attempt, carry, units
    from pipeline.lineage import code_identity
    from pipeline.nightly import exit_code, run_nightly
    from pipeline.plan import plan_run
    from pipeline.shards import ShardRecommender

    other = "f" * 64
    with pytest.raises(ValueError, match=f"a read task on node .* runs other genrec-batch code .*\\({other[:12]}\\)"):
        units.read_retrying(pa.table({"path": ["x"]}), None, "in", code=other)
    with pytest.raises(ValueError, match="a carry task on node"):
        carry.carry_part(pa.table({"part": [0]}), carry.Carry(*[None] * 9, code=other))
    actor = ShardRecommender(None, None, "", None, "", code=other)  # nothing loaded
    with pytest.raises(ValueError, match="a recommender actor on node"):
        actor(pa.table({"pos": [0]}))

    root, _ = world
    cfg = config(root, tmp_path / "out", f"input={root / 'base.parquet'}")
    plan = plan_run(cfg)
    plan.identity["code"] = {**plan.identity["code"], "sha256": other}
    real = attempt.read_args
    monkeypatch.setattr(attempt, "read_args", lambda p, a: {**real(p, a), "code": code_identity()["sha256"]})
    with pytest.raises(ValueError, match="a recommender actor on node") as e:
        run_nightly(cfg, plan=plan)
    assert exit_code(e.value) == 2


def test_the_code_is_every_package_of_the_source_tree_or_the_wheel(monkeypatch):
    """The packages whose files make the code identity: in a source tree those its pyproject.toml packages, in a
    wheel install (no pyproject.toml beside them) those the installed distribution lists; the same here."""
    from pipeline import lineage

    tree = lineage.code_packages()
    assert {"decoding", "operators", "pipeline", "jobs"} <= set(tree) and "tests" not in tree
    monkeypatch.setattr(lineage, "_project", lambda: (None, None))
    assert lineage.code_packages() == tree


def test_a_prompt_reads_the_columns_its_template_names_and_nothing_else_carries_past_them(world, tmp_path):
    """A template writing the catalog's titles: the fingerprint holds the titles' content, so a changed title makes a
    full night naming the catalog, and a resume of a run started on the old titles is refused naming it; a column a
    template names that the input or the catalog lacks is refused before any work, named."""
    from pipeline.lineage import differences
    from pipeline.plan import plan_run

    root, _ = world
    catalog = pq.read_table(root / "data" / "items.parquet")
    titles = [f"item {i}" for i in catalog["item_id"].to_pylist()]
    pq.write_table(catalog.append_column("title", pa.array(titles)), tmp_path / "items.parquet")
    template = tmp_path / "template.json"
    # the world's word-level tokenizer holds the code tokens as words: text from data is the template's to trust
    template.write_text(
        json.dumps({"name": "titled", "item": "{codes}{item:title}", "max_items": 8, "trusted": ["title"]})
    )
    cfg = night_config(root, tmp_path / "out", f"catalog={tmp_path / 'items.parquet'}", f"models.template={template}")
    before = plan_run(cfg)
    state = {"fingerprint": before.fingerprint, "identity": before.identity, "config": before.config}
    titles[5] = "another title"
    pq.write_table(catalog.append_column("title", pa.array(titles)), tmp_path / "items.parquet")
    after = plan_run(cfg)
    assert differences(before.lineage, after.lineage) == ["catalog"]
    assert before.lineage["catalog"]["texts"] != after.lineage["catalog"]["texts"]
    assert any("the catalog" in c for c in after.changes(state))
    template.write_text(json.dumps({"name": "branded", "item": "{codes}{item:brand}", "max_items": 8}))
    with pytest.raises(ValueError, match=r"missing column\(s\) \['brand'\]"):
        plan_run(cfg)
    template.write_text(json.dumps({"name": "profiled", "prefix": "{user:profile} ", "max_items": 8}))
    with pytest.raises(ValueError, match=r"writes the input's column\(s\) \['profile'\], which input .* lacks"):
        plan_run(cfg)


def test_a_night_that_changes_only_a_user_text_field_decodes_only_those_users(world, ray_session_plain, tmp_path):
    """A template writing each user's profile, prompts bounded by decoding.max_prompt_tokens: tonight changes 6
    users' profiles and nothing else; the incremental night decodes those 6 and carries every other user. The base
    night counts the prompts it cut to fit in its manifest, and its report shows prompt tokens per user."""
    from pipeline.nightly import run_nightly
    from pipeline.report import summarize

    root, _ = world
    base = pq.read_table(root / "base.parquet")
    profiles = [f"likes {u % 5} things" for u in range(base.num_rows)]
    pq.write_table(base.append_column("profile", pa.array(profiles)), tmp_path / "base.parquet")
    changed = [3, 17, 40, 41, 77, 100]
    for i in changed:
        profiles[i] = "likes <a_1> now" if i % 2 else None
    pq.write_table(base.append_column("profile", pa.array(profiles)), tmp_path / "night.parquet")
    template = tmp_path / "template.json"
    profiled = {"name": "profiled", "prefix": "{user:profile} ", "max_items": 8, "trusted": ["profile"]}  # word-level
    template.write_text(json.dumps(profiled))  # tokenizer: its code tokens are words, the profile trusted
    extra = [f"models.template={template}", "decoding.exclude=none", "decoding.max_prompt_tokens=22"]
    extra += ["compute.batch_size=64"]
    base_cfg = config(root, tmp_path / "out", f"input={tmp_path / 'base.parquet'}", f"run_date={BASE_DATE}", *extra)
    counts = run_nightly(base_cfg)["counts"]
    assert counts["users_truncated"] > 0 and counts["users_too_long"] == 0
    s = summarize(runs.load_run(runs.date_dir(base_cfg.output, BASE_DATE), base_cfg.storage), 2.5)
    assert 10 < s["prompt_tokens_per_user"] <= 22 and s["users_truncated"] == counts["users_truncated"]
    cfg = config(root, tmp_path / "out", f"input={tmp_path / 'night.parquet'}", f"run_date={NIGHT}", *extra)
    manifest = run_nightly(replace(cfg, incremental=replace(cfg.incremental, enabled=True)))
    _, users, _ = published(cfg)
    source = dict(zip(users["user_id"].to_pylist(), users["source"].to_pylist()))
    ids = base["user_id"].to_pylist()
    assert {u for u, s in source.items() if s == "decoded"} == {ids[i] for i in changed}
    assert manifest["counts"]["users_carried"] == base.num_rows - len(changed)
