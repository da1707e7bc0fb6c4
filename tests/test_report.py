"""Reports and offline evaluation of real nightly runs (local Ray): the numbers equal the shard metrics aggregated
here independently, the plots are valid PNGs, a comparison of a run with itself (and of strict speculative with
beam search) shows identical outputs, the evaluation equals a hand-computed example, and Chromium renders the page."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pipeline.evaluate import evaluate
from pipeline.report import FIGURES as REPORT_FIGURES
from pipeline.report import build_blocks, figures_for, report_run, screenshot_report, summarize, to_markdown
from pipeline.runs import load_run
from pipeline.storage import Storage
from tests.helpers import float32_atol
from tests.test_nightly import config, make_world

LOCAL = Storage()
ROOT = Path(__file__).resolve().parents[1]

PRICE = 3.0
FIGURES = ("throughput", "time_split", "accepted_steps", "kv_memory", "cost")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One beam and one atspeed-strict run of the same 100 users, two actors each."""
    import ray

    from pipeline.nightly import run_nightly

    root = tmp_path_factory.mktemp("report")
    world = make_world(root)
    ray.init(num_cpus=4, include_dashboard=False)  # two 1-CPU actors plus the read and write tasks
    try:
        out = {
            mode: run_nightly(config(world, root / mode, f"decoding.mode={mode}", "compute.num_actors=2"))
            for mode in ("beam", "atspeed-strict")
        }
    finally:
        ray.shutdown()
    return {mode: str(root / mode / f"run_date={m['run_date']}" / f"run_id={m['run_id']}") for mode, m in out.items()}


def num(x, digits=3):  # the report's documented format: thousands separators, fixed decimals
    return f"{x:,}" if isinstance(x, int) else f"{x:,.{digits}f}"


def independent_summary(run: str) -> dict:
    m = pd.read_parquet(f"{run}/metrics")
    manifest = json.loads(open(f"{run}/manifest.json").read())
    users = int(m.users_ok.sum())
    wall = manifest["timings"]["decode_s"]
    hist = np.zeros(8, np.int64)
    for h in m.accepted_hist.dropna():
        hist[: len(h)] += np.asarray(h)
    actors = m.actor.nunique()  # the actors that decoded (an autoscaling pool's size varies; a restart is another)
    return {
        "users": users,
        "users_per_s": users / wall,
        "busy_users_per_s": users / m.wall_s.sum(),
        "prefill": m.prefill_s.sum(),
        "verify": m.verify_s.sum(),
        "target_forwards": int(m.target_forwards.sum()),
        "kv": m.kv_tokens.sum() / users,
        "kv_beam": m.kv_tokens_beam_batch.sum() / users,
        "positions": m.prompt_positions.sum() / users,
        "padding": m.prompt_padding.sum() / m.prompt_positions.sum(),
        "kv_padding": m.kv_padding_tokens.sum() / users,
        "cost": PRICE * actors * wall / 3600 / users * 1e6,
        "busy_cost": PRICE * m.wall_s.sum() / 3600 / users * 1e6,
        "accepted": (hist * np.arange(8)).sum() / hist.sum() if hist.sum() else None,
        "rounds": int(hist.sum()),
    }


def assert_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)  # decodes the whole file
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100 and pixels.std() > 0.01  # not a blank image
    return pixels


@pytest.mark.parametrize("mode", ["beam", "atspeed-strict"])
def test_report_numbers_equal_the_metrics(runs, mode):
    run = runs[mode]
    _, out = report_run(run, LOCAL, gpu_hour_price=PRICE)
    assert out == f"{run}/report"
    out = Path(out)
    figures = [f for f in FIGURES if f != "accepted_steps" or mode != "beam"]  # beam search verifies no drafts
    for name in figures:
        assert_png(out / "figures" / f"{name}.png")
    assert (out / "figures" / "accepted_steps.png").is_file() == (mode != "beam")
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    want = independent_summary(run)
    assert want["users"] == 100
    for line in (
        f"| users ok | {num(want['users'])} |",
        f"| users/s (decode wall time) | {num(want['users_per_s'])} |",
        f"| users/s per busy actor-second | {num(want['busy_users_per_s'])} |",
        f"| prefill (s, summed over batches) | {num(want['prefill'])} |",
        f"| target forwards | {num(want['target_forwards'])} |",
        f"| KV tokens held per user | {num(want['kv'], 1)} |",
        f"| KV tokens per user, batch beam search | {num(want['kv_beam'], 1)} |",
        f"| prompt positions per user (prefill) / of them left padding | {num(want['positions'], 1)} / "
        f"{want['padding']:.1%} |",
        f"| of them for left padding | {num(want['kv_padding'], 1)} |",
        f"| cost per million users, allocated (USD) | {num(want['cost'], 2)} |",
        f"| cost per million users, busy (USD) | {num(want['busy_cost'], 2)} |",
    ):
        assert line in md, line
    per_actor = (
        pd.read_parquet(f"{run}/metrics").groupby("actor").agg(users=("users_ok", "sum"), busy=("wall_s", "sum"))
    )
    wall = json.loads(open(f"{run}/manifest.json").read())["timings"]["decode_s"]
    for actor, r in per_actor.iterrows():  # one table row per actor (how many actors got batches is Ray's choice)
        assert (
            f"| {actor} | " in md and f"| {num(int(r.users))} | {num(r.users / r.busy)} | {r.busy / wall:.0%} |" in md
        )
    m = pd.read_parquet(f"{run}/metrics")
    [accelerator] = set(m.accelerator)  # both CPU actors on this machine's CPUs
    assert accelerator.endswith("/cpu")
    grid = np.linspace((m.committed_at - m.wall_s).min(), m.committed_at.max(), 200_001)  # when any shard decoded
    covered = np.zeros(len(grid), bool)
    for a, b in zip(m.committed_at - m.wall_s, m.committed_at):
        covered |= (grid >= a) & (grid <= b)
    busy = covered.mean() * (grid[-1] - grid[0]) / wall
    row = re.search(rf"\| {re.escape(accelerator)} \| ([0-9,]+) \| (\d+)% \|", md)
    assert row and int(row[1]) == m.actor.nunique() and abs(int(row[2]) - 100 * busy) <= 1, (row, busy)
    if mode == "beam":  # no speculation: neither its rows nor its section
        assert "mean accepted steps" not in md and "## Accepted steps" not in md and want["rounds"] == 0
        assert "| verify (s" not in md and "| draft (s" not in md and want["verify"] == 0
    else:  # every user-round of speculation is in the histogram
        assert f"| mean accepted steps per verification | {num(want['accepted'])} |" in md and want["rounds"] >= 100
        assert f"| verify (s, summed over batches) | {num(want['verify'])} |" in md
    assert md.count("![") == len(figures) and html.count('src="data:image/png;base64,') == len(figures)
    assert "| metric | " + mode in md and "\n|---|---:|\n" in md  # names left, values right (pipeline/markdown.py)
    assert "<table>" in html and "figures/" not in html  # self-contained: nothing to fetch


def test_compare_a_run_with_itself_and_with_strict_speculation(runs):
    report_run(runs["beam"], LOCAL, compare=runs["beam"])
    out = next(Path(runs["beam"]).glob("report-vs-*"))
    doc = json.loads((out / "report.json").read_text())
    assert doc["speedup"] == {"users_per_s": 1.0, "users_per_busy_s": 1.0}
    assert doc["outputs"]["identical"] and doc["outputs"]["users"] == 100 and doc["outputs"]["max_abs_score_diff"] == 0
    assert (
        "**1.00x** users/s" in (out / "report.md").read_text()
        and "Outputs: **identical**" in (out / "report.md").read_text()
    )
    # strict speculative decoding is lossless: the same items as beam search, user by user, rank by rank
    report_run(runs["atspeed-strict"], LOCAL, compare=runs["beam"])
    doc = json.loads(next(Path(runs["atspeed-strict"]).glob("report-vs-*/report.json")).read_text())
    scores = torch.tensor(pd.read_parquet(f"{runs['beam']}/recommendations").score.to_numpy())
    assert doc["outputs"]["identical"] and doc["outputs"]["max_abs_score_diff"] <= float32_atol(scores)
    want = independent_summary(runs["atspeed-strict"])["users_per_s"] / independent_summary(runs["beam"])["users_per_s"]
    assert doc["speedup"]["users_per_s"] == pytest.approx(want, rel=1e-12)
    for name in FIGURES:  # side by side: both runs in every figure
        assert_png(next(Path(runs["atspeed-strict"]).glob(f"report-vs-*/figures/{name}.png")))


def test_compare_detects_a_changed_recommendation(runs, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(runs["beam"], copy)
    recs = pq.read_table(copy / "recommendations").to_pandas()
    shutil.rmtree(copy / "recommendations")
    (copy / "recommendations").mkdir()
    recs.loc[(recs.user_id == recs.user_id.iloc[0]) & (recs["rank"] == 3), "item_id"] = -7
    pq.write_table(pa.Table.from_pandas(recs, preserve_index=False), copy / "recommendations" / "part.parquet")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["recommendations"] = ["part.parquet"]  # readers read the files the manifest lists
    (copy / "manifest.json").write_text(json.dumps(manifest))
    report_run(str(copy), LOCAL, runs["beam"], str(tmp_path / "rep"))
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert not doc["outputs"]["identical"] and doc["outputs"]["users_differ"] == 1
    assert "NOT identical: 1 of 100 users differ" in (tmp_path / "rep" / "report.md").read_text()


def test_evaluation_of_a_real_run_lands_in_the_report(runs, tmp_path):
    from decoding.metrics import recall_ndcg

    run = runs["beam"]
    evaluate(run, LOCAL)
    ev = json.loads((Path(run) / "report" / "evaluation.json").read_text())
    recs = pd.read_parquet(f"{run}/recommendations").sort_values(["user_id", "rank"])
    users = pd.read_parquet(json.loads((Path(run) / "manifest.json").read_text())["config"]["input"])
    lists = recs.groupby("user_id").item_id.apply(list)
    want = recall_ndcg(np.array([lists[u] for u in users.user_id]), users.target_items.tolist(), (1, 5, 10, 20))
    assert ev["users"] == 100 and all(ev[key] == pytest.approx(value) for key, value in want.items())
    report_run(run, LOCAL)
    md = (Path(run) / "report" / "report.md").read_text()
    assert "## Quality (offline evaluation)" in md
    assert ev["protocol"]["source"] and f"Split `test`: {ev['protocol']['convention']}." in md
    assert ev["k"] == 5
    for k in (1, 5):
        assert f"| Recall@{k} | {ev[f'recall@{k}']:.4f} |" in md and f"| NDCG@{k} | {ev[f'ndcg@{k}']:.4f} |" in md
    for k in (10, 20):  # the run returned 5 items per user: nothing was measured at 10 or 20
        assert f"| Recall@{k} | n/a (k = 5) |" in md and f"| NDCG@{k} | n/a (k = 5) |" in md
    # side by side, each run with its own evaluation (strict speculation: the same items, the same quality)
    evaluate(runs["atspeed-strict"], LOCAL)
    report_run(runs["atspeed-strict"], LOCAL, run, str(tmp_path / "both"))
    md = (tmp_path / "both" / "report.md").read_text()
    assert f"| Recall@5 | {ev['recall@5']:.4f} | {ev['recall@5']:.4f} |" in md


def test_a_report_shows_only_what_applies_to_its_runs(runs):
    """A beam-search run's report has no accepted-steps section or figure, no draft or speculation rows, and none
    for exclusions, the auto decoder choice or accelerator memory (a CPU run without them); beside a speculative run,
    what applies to that run comes back, with '-' or 0 for the beam run."""
    beam, strict = (summarize(load_run(runs[m], LOCAL), PRICE) for m in ("beam", "atspeed-strict"))
    alone = to_markdown(build_blocks([beam], None, [None]))
    assert list(figures_for([beam])) == ["throughput", "time_split", "kv_memory", "cost"]
    for absent in (
        "## Accepted steps",
        "accepted_steps.png",
        "| draft forwards |",
        "| draft tokens per user",
        "| mean accepted steps",
        "| draft (s",
        "| verify (s",
        "| exclusions",
        "| decoder (batches)",
        "| peak accelerator memory",
        "## Comparison",
        "## Quality",
        "Auto mode",
    ):
        assert absent not in alone, absent
    assert "| target forwards |" in alone and "## Time split" in alone and "## KV memory" in alone
    both = to_markdown(build_blocks([strict, beam], None, [None, None]))
    assert list(figures_for([strict, beam])) == list(REPORT_FIGURES) == list(FIGURES) and "## Accepted steps" in both
    assert f"| mean accepted steps per verification | {num(strict['mean_accepted_steps'])} | - |" in both
    assert f"| draft forwards | {num(strict['draft_forwards'])} | 0 |" in both and strict["draft_forwards"] > 0
    assert f"| verify (s, summed over batches) | {num(strict['phase_s']['verify_s'])} | 0.000 |" in both


def test_cut_offs_above_the_runs_k_are_not_applicable(runs):
    """The quality table writes `n/a (k = 10)` for a cut-off above the evaluated run's k (its lists are k long, so
    @20 would repeat @10), and the value where the cut-off is within k, run by run."""
    s = summarize(load_run(runs["beam"], LOCAL), PRICE)
    ev = {"ks": [1, 5, 10, 20], "users": 7, "users_without_recommendations": 0}
    ten = {**ev, "k": 10, **{f"{m}@{k}": k / 100 + (m == "ndcg") / 1000 for m in ("recall", "ndcg") for k in ev["ks"]}}
    twenty = {**ten, "k": 20}
    md = to_markdown(build_blocks([s, s], None, [ten, twenty]))
    assert "| Recall@10 | 0.1000 | 0.1000 |" in md and "| NDCG@10 | 0.1010 | 0.1010 |" in md
    assert "| Recall@20 | n/a (k = 10) | 0.2000 |" in md and "| NDCG@20 | n/a (k = 10) | 0.2010 |" in md
    assert "k = 10" in md.split("## Quality")[1].split("|")[0]  # the paragraph states each run's k too


def hand_run(root, recs: dict[int, list[int]], k: int):
    """A minimal published run folder: manifest, _SUCCESS, one metrics row, recommendations."""
    root.mkdir(parents=True)
    rows = [(u, r + 1, item) for u, items in recs.items() for r, item in enumerate(items)]
    (root / "recommendations").mkdir()
    pq.write_table(
        pa.table(
            {
                "user_id": [r[0] for r in rows],
                "rank": pa.array([r[1] for r in rows], pa.int32()),
                "item_id": [r[2] for r in rows],
                "score": pa.array([0.0] * len(rows), pa.float32()),
            }
        ),
        root / "recommendations" / "part.parquet",
    )
    (root / "metrics").mkdir()
    pq.write_table(pa.table({"users_ok": [len(recs)]}), root / "metrics" / "metrics.parquet")
    (root / "manifest.json").write_text(json.dumps({"run_id": "hand", "config": {"decoding": {"k": k}}}))
    (root / "_SUCCESS").write_text("")
    return root


def test_evaluation_equals_a_hand_computed_example(tmp_path):
    run = hand_run(
        tmp_path / "run", {1: [10, 11, 12, 13], 2: [20, 21, 22, 23], 3: [30, 31, 32, 33], 4: [40, 41, 42, 43]}, k=4
    )
    pq.write_table(
        pa.table(
            {
                "user_id": [1, 2, 3, 4, 5, 1, 6],
                "history": [[1]] * 7,
                "target_items": [[11], [99], [], [40, 42, 42], [50], [10], None],
            }
        ),
        tmp_path / "in.parquet",
    )
    evaluate(str(run), LOCAL, str(tmp_path / "in.parquet"))
    ev = json.loads((run / "report" / "evaluation.json").read_text())
    # users 1 (hit at rank 2), 2 (miss), 4 (two targets, hits at ranks 1 and 3), 5 (no recommendations: a miss);
    # user 3 (no targets) and 6 (null) skipped; user 1's second row ignored (the first row is kept)
    assert ev["users"] == 4 and ev["users_without_recommendations"] == 1
    assert ev["recall@1"] == pytest.approx((0 + 0 + 1 / 2 + 0) / 4)
    assert ev["ndcg@1"] == pytest.approx((0 + 0 + 1 / 1 + 0) / 4)
    ndcg_4 = (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    for k in (5, 10, 20):  # the run returned 4 items: every target within them is found by @5
        assert ev[f"recall@{k}"] == pytest.approx((1 + 0 + 1 + 0) / 4)
        assert ev[f"ndcg@{k}"] == pytest.approx((1 / math.log2(3) + 0 + ndcg_4 + 0) / 4)
    # the Markdown does not print a cut-off above the run's k as if it had been measured (the JSON keeps the values)
    assert (
        "| Recall | 0.1250 | n/a (k = 4) | n/a (k = 4) | n/a (k = 4) |"
        in (run / "report" / "evaluation.md").read_text()
    )
    assert ev["protocol"]["source"] is None and "as given" in (run / "report" / "evaluation.md").read_text()
    # a data folder written by jobs.prepare_data states how its split was built: quoted by the evaluation
    from pipeline.prepare import SPLIT_CONVENTION

    (tmp_path / "data").mkdir()
    (tmp_path / "in.parquet").rename(tmp_path / "data" / "test.parquet")
    (tmp_path / "data" / "prepare.json").write_text(json.dumps({"splits": SPLIT_CONVENTION}))
    ev = evaluate(str(run), LOCAL, str(tmp_path / "data" / "test.parquet"))
    assert ev["protocol"] == {
        "split": "test",
        "convention": SPLIT_CONVENTION["test"],
        "source": str(tmp_path / "data" / "prepare.json"),
    }
    assert "train + valid items" in SPLIT_CONVENTION["test"]
    assert f"Split `test`: {SPLIT_CONVENTION['test']}." in (run / "report" / "evaluation.md").read_text()


def test_bad_runs_and_inputs_fail_clearly(runs, tmp_path):
    with pytest.raises(FileNotFoundError, match="no published run"):
        report_run(str(tmp_path / "nothing-here"), LOCAL)
    broken = tmp_path / "broken"
    shutil.copytree(runs["beam"], broken)
    (broken / "_SUCCESS").unlink()
    with pytest.raises(ValueError, match="no _SUCCESS marker"):
        report_run(str(broken), LOCAL)
    with pytest.raises(ValueError, match="price must be >= 0"):
        report_run(runs["beam"], LOCAL, gpu_hour_price=-1)
    pq.write_table(pa.table({"user_id": [1], "history": [[1]]}), tmp_path / "no-targets.parquet")
    with pytest.raises(ValueError, match="no target_items column"):
        evaluate(runs["beam"], LOCAL, str(tmp_path / "no-targets.parquet"))
    pq.write_table(pa.table({"user_id": [1], "history": [[1]], "target_items": [["a"]]}), tmp_path / "str.parquet")
    with pytest.raises(ValueError, match="target_items must be a list of integer item ids"):
        evaluate(runs["beam"], LOCAL, str(tmp_path / "str.parquet"))


def job(name: str, *argv, path: str | None = None):
    """`python -m jobs.NAME ...` in a subprocess, as an operator runs it; `path` replaces PATH (and hides $CHROMIUM)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **({"PATH": path} if path is not None else {})}
    if path is not None:
        env.pop("CHROMIUM", None)
    return subprocess.run(
        [sys.executable, "-m", f"jobs.{name}", *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_the_command_lines(runs, tmp_path):
    """The entry points: the report on stdout and its path on stderr; a bad run or input is exit 2 with the message;
    a failed --screenshot (no chromium on PATH) is exit 2 after the report is written."""
    ok = job("report", "--run", runs["beam"], "--out", str(tmp_path / "r"))
    assert ok.returncode == 0 and "| users ok | 100 |" in ok.stdout and "report.html" in ok.stderr
    bad = job("report", "--run", str(tmp_path / "nothing-here"))
    assert bad.returncode == 2 and "error:" in bad.stderr and "no published run" in bad.stderr
    no_targets = tmp_path / "no-targets.parquet"
    pq.write_table(pa.table({"user_id": [1], "history": [[1]]}), no_targets)
    bad = job("evaluate", "--run", runs["beam"], "--input", str(no_targets))
    assert bad.returncode == 2 and "no target_items column" in bad.stderr
    shot = job(
        "report",
        "--run",
        runs["beam"],
        "--out",
        str(tmp_path / "s"),
        "--screenshot",
        str(tmp_path / "shot.png"),
        path=str(tmp_path),
    )
    assert shot.returncode == 2 and "--screenshot failed: no chromium on PATH" in shot.stderr
    assert (tmp_path / "s" / "report.html").is_file()  # the report itself is written


def test_chromium_renders_the_report_with_its_plots(runs, tmp_path):
    """Looked at as a person would: the page in headless Chromium shows the summary table and the plots. Skipped
    where no Chromium is found, except where GENREC_REQUIRE_BROWSER is set (CI installs one and sets it)."""
    from PIL import Image

    from pipeline.report import chromium

    try:
        chromium()
    except FileNotFoundError as e:
        if os.environ.get("GENREC_REQUIRE_BROWSER"):
            raise
        pytest.skip(str(e))

    _, out = report_run(runs["atspeed-strict"], LOCAL, runs["beam"], str(tmp_path / "r"))
    screenshot_report(out, tmp_path / "shot.png", LOCAL)
    shot = np.asarray(Image.open(tmp_path / "shot.png").convert("RGB")).astype(int)
    assert shot.shape[0] > 1500  # the page is long: table, five figures
    colour = lambda rgb: (np.abs(shot - np.array(rgb)).sum(-1) < 30).sum()  # noqa: E731
    assert colour((31, 119, 180)) > 5000 and colour((255, 127, 14)) > 5000  # matplotlib's first two series colours
    assert (shot.sum(-1) < 150).sum() > 5000  # dark text: the tables and headings rendered
    assert Path(tmp_path / "r" / "report.html").is_file()


def test_evaluation_reads_the_targets_of_every_file_of_a_folder(tmp_path):
    """An input folder whose first file has no target_items: the second file's targets are read (the files' schemas
    unified), and the first file's users have none."""
    from pipeline.evaluate import read_targets

    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"user_id": [1, 2], "history": [[1], [2]]}), tmp_path / "in" / "part-0.parquet")
    second = pa.table({"user_id": [3], "history": [[3]], "target_items": pa.array([[30, 31]], pa.list_(pa.int32()))})
    pq.write_table(second, tmp_path / "in" / "part-1.parquet")
    assert read_targets(str(tmp_path / "in"), LOCAL).to_pylist() == [{"user_id": 3, "target_items": [30, 31]}]
