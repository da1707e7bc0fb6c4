"""The benchmarks run end to end on real Beauty prompts (`python -m jobs.bench` in a subprocess): decode agreement
with transformers, DISC timing, and `bench all` (every section, one report, every timed repeat recorded); the exact
catalog scorer and the distances behind the DISC bias section. The timing harness itself: test_bench_harness.py."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoding.disc import constrained_sample
from decoding.metrics import distances, draw_stats
from decoding.models import build_model, tiny_model
from decoding.reference import catalog_logprob, sequence_logprob
from pipeline.prepare import BEAUTY_SOURCE
from tests.helpers import EPS32, WIDTH, float32_atol, left_padded_prompts, random_catalog

EPS64 = torch.finfo(torch.float64).eps

ROOT = Path(__file__).resolve().parents[1]
BEAUTY = BEAUTY_SOURCE


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Amazon Beauty prepared once for the module."""
    out = tmp_path_factory.mktemp("beauty")
    subprocess.run(
        [sys.executable, "-m", "jobs.prepare_data", "--source", str(BEAUTY), "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return out


def tiny_beauty_model(path: Path, data: Path, hidden: int, seed: int) -> Path:
    """A random 1-layer Llama over the Beauty vocabulary, saved with the prepared tokenizer."""
    build_model(1028, 1, hidden, 2, 1, seed=seed).save_pretrained(path)
    for f in (data / "tokenizer").iterdir():
        shutil.copy(f, path / f.name)
    return path


TINY = dict(layers=1, hidden=32, heads=2)  # a random Llama of 1 layer x 32, 2 heads


def bench(*argv, **flags):
    """`python -m jobs.bench ARGV --FLAG VALUE ...` in a subprocess: each keyword a flag (underscores as dashes), a
    list giving it several values, every value written with str()."""
    for flag, value in flags.items():
        argv += ("--" + flag.replace("_", "-"), *map(str, value if isinstance(value, list) else [value]))
    return subprocess.run([sys.executable, "-m", "jobs.bench", *argv], cwd=ROOT, capture_output=True, text=True)


def refused(capsys, *argv) -> tuple[int, str]:
    """`python -m jobs.bench ARGV` in this process, for what it refuses before any work (argparse's errors, missing
    data, models or device) -> (its exit code, its stderr)."""
    from jobs import bench as job

    try:
        code = job.main(list(argv))
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err


def bench_gpu_smoke(data: Path, out: Path, **flags):
    """`bench gpu --device cpu --smoke` over the prepared data on the TINY random Llama -> OUT."""
    return bench("gpu", "--smoke", device="cpu", data=data, out=out, **TINY, **flags)


def test_bench_decode_small(data, tmp_path):
    out = tmp_path / "out"
    run = bench("decode", data=data, users=6, batch=3, k=5, index_items=3000, repeats=2, device="cpu", out=out, **TINY)
    assert run.returncode == 0, run.stderr
    result = json.loads((out / "decode.json").read_text())
    decode = result["decode"]
    assert decode["agreement"] == {
        "users": 6,
        "same_items_same_order": 1.0,
        "same_item_set": 1.0,
        "max_abs_score_diff": decode["agreement"]["max_abs_score_diff"],
    }
    assert decode["agreement"]["max_abs_score_diff"] < 1e-4
    assert (
        decode["methods"]["beam_search"]["kv_tokens_per_user"] < decode["methods"]["transformers"]["kv_tokens_per_user"]
    )
    assert [r["items"] for r in result["index"]] == [12023, 3000]
    # every repeat's seconds, interleaved with the order alternating, the median within the range
    assert decode["order"] == ["transformers", "beam_search", "beam_search", "transformers"]
    for row in decode["methods"].values():
        t = row["timing"]
        assert len(t["seconds"]) == 2 and t["min_s"] <= t["median_s"] <= t["max_s"]
        assert row["users_per_s"]["min"] <= row["users_per_s"]["median"] <= row["users_per_s"]["max"]
    assert set(decode["speedup"]) == {"median", "low", "high", "within_noise", "per_repeat"}
    assert decode["speedup"]["low"] <= decode["speedup"]["median"] <= decode["speedup"]["high"]
    for index in result["index"]:
        assert all(len(t["seconds"]) == 2 for t in index["timings"].values())
        assert set(index["timings"]) == {"allowed_next", "verify", "cpu_trie"}
    md = (out / "decode.md").read_text()
    assert "speed-up" in md and "median (min-max) of 2 interleaved repeats" in md
    assert "decode: transformers vs beam_search" in run.stderr  # the progress bar


def test_bench_bad_arguments(tmp_path, capsys):
    """Bad flags exit 2 with argparse's message; missing data or models exit 2 with how to make them, before any
    output is written (the command's main, in this process: `python -m jobs.bench` is main's exit code)."""
    code, err = refused(capsys, "decode", "--k", "0")
    assert code == 2 and "expected an integer >= 1, got 0" in err
    code, err = refused(capsys, "decode", "--repeats", "0")
    assert code == 2 and "expected an integer >= 1, got 0" in err
    oom = ("--simulate-oom", "generate")
    code, err = refused(capsys, "gpu", "--device", "cpu", "--smoke", *oom, "--out", str(tmp_path))
    assert code == 2 and "invalid choice: 'generate'" in err
    code, err = refused(capsys, "decode", "--data", "/nonexistent", "--out", str(tmp_path))
    assert code == 2 and "/nonexistent/items.parquet not found" in err
    code, err = refused(capsys, "all", "--target", str(tmp_path / "missing"), "--out", str(tmp_path))
    assert code == 2
    assert re.search(r"no target model at .*missing: train the demo models with `make models`", err)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text("{}")
    code, err = refused(capsys, "all", "--target", str(tmp_path / "target"), "--drafts", "--out", str(tmp_path))
    assert code == 2 and re.search(r"no draft models .*`make models`.*--drafts", err)
    assert not (tmp_path / "all.json").exists() and not (tmp_path / "decode.json").exists()
    run = bench("decode", "--k", "0")  # the command itself: the same exit code and message
    assert run.returncode == 2 and "expected an integer >= 1, got 0" in run.stderr


def test_bench_disc_small(data, tmp_path):
    out, model = tmp_path / "out", tiny_beauty_model(tmp_path / "model", data, 32, 0)
    run = bench(
        "disc", data=data, model=model, users=4, batch=2, k=3, max_rounds=2, top_m=20, repeats=2, device="cpu", out=out
    )
    assert run.returncode == 0, run.stderr
    disc = json.loads((out / "disc.json").read_text())["disc"]
    methods = disc["methods"]
    assert set(methods) == {
        "beam_search",
        "constrained_sample",
        "disc rounds=1 exact",
        "disc rounds=2 exact",
        "disc rounds=1 PPV top-20",
        "disc rounds=2 PPV top-20",
    }
    assert methods["constrained_sample"]["acceptance_rate"] == 1.0
    assert all(0 <= m["invalid_mass"] <= 1 for n, m in methods.items() if n != "beam_search")
    assert all(len(m["timing"]["seconds"]) == 2 for m in methods.values())
    assert len(disc["order"]) == 2 * 6 and disc["order"][:6] != disc["order"][6:]  # rotated every repeat
    assert "vs_beam_search" not in methods["beam_search"]
    assert all(len(m["vs_beam_search"]["per_repeat"]) == 2 for n, m in methods.items() if n != "beam_search")


def test_bench_exclude_small(data, tmp_path):
    out, model = tmp_path / "out", tiny_beauty_model(tmp_path / "model", data, 32, 0)
    run = bench(
        "exclude", data=data, model=model, users=5, batch=2, k=4, counts=[3, 60], repeats=2, device="cpu", out=out
    )
    assert run.returncode == 0, run.stderr
    ex = json.loads((out / "exclude.json").read_text())["exclude"]
    methods = ex["methods"]
    assert list(methods) == ["none", "exclude 3", "exclude 60"] and len(ex["order"]) == 3 * 2
    assert all(m["excluded_returned"] == 0 and m["full_lists"] == 1.0 for n, m in methods.items() if n != "none")
    assert methods["exclude 60"]["bound"] is None and len(methods["exclude 3"]["cost"]["per_repeat"]) == 2
    work = ex["own_work"]["parts"]
    assert set(work) == {"3", "60"} and all(0 < w["of_decode_median"] < 1 for w in work.values())
    assert "| 60 |" in (out / "exclude.md").read_text()


def test_bench_padding_small(data, tmp_path):
    """bench padding on 24 Beauty users in batches of 6, prompts stretched to 60 tokens: both orders decode the same
    lists; ordered by length, fewer prompt positions and KV tokens of padding, the same tree tokens per user; the
    recorded padding share is the one of its prompt positions. The GPU page's cell runs at smoke sizes on a CPU."""
    from pipeline.bench.padding import gpu_cell

    out = tmp_path / "out"
    run = bench(
        "padding", data=data, users=24, batch=6, k=4, prompt_tokens=60, repeats=2, device="cpu", out=out, **TINY
    )
    assert run.returncode == 0, run.stderr
    r = json.loads((out / "padding.json").read_text())["padding"]
    a, b = r["methods"]["input order"], r["methods"]["ordered"]
    assert r["identical_lists"] == 24 and r["prompt_tokens_max"] == 60 and len(r["order"]) == 2 * 2
    assert (
        b["prompt_positions_per_user"] < a["prompt_positions_per_user"]
        and b["kv_padding_per_user"] < a["kv_padding_per_user"]
    )
    tree = lambda m: m["target_tokens_per_user"] - m["prompt_positions_per_user"]  # noqa: E731
    assert tree(a) == pytest.approx(tree(b)) and 0 <= b["prompt_padding_fraction"] < a["prompt_padding_fraction"] < 1
    assert "| ordered |" in (out / "padding.md").read_text()
    result, md = gpu_cell(str(data), 1, 32, 2, "float32", 1, smoke=True)
    assert result["padding"]["users"] == 64 and "| input order |" in md


def test_bench_all_small(data, tmp_path):
    """Every section in one run at tiny sizes: one JSON and one Markdown report with hardware, versions, seeds,
    the command, and a verdict per claim."""
    out = tmp_path / "out"
    target = tiny_beauty_model(tmp_path / "target", data, 32, 0)
    drafts = [tiny_beauty_model(tmp_path / f"draft-{i}", data, 16, i + 1) for i in range(2)]
    run = bench(
        "all",
        data=data,
        target=target,
        drafts=drafts,
        users=4,
        batch=2,
        k=3,
        index_items=2000,
        repeats=2,
        ks=[1, 3],
        batch1_users=2,
        disc_k=2,
        rounds=[1, 2],
        bias_users=2,
        draws=64,
        device="cpu",
        seed=7,
        out=out,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads((out / "all.json").read_text())
    sections = result["sections"]
    assert list(sections) == ["decode", "speculative", "disc", "disc-bias"]
    assert result["command"].startswith("python -m jobs.bench all --data") and result["seeds"]["seed"] == 7
    assert {"python", "torch", "transformers", "ray", "pyarrow", "numpy", "git_commit"} <= set(result["versions"])
    assert result["hardware"]["cpu_cores"] >= 1 and result["hardware"]["ram_gib"] > 0
    assert all(s["args"]["seed"] == 7 and s["args"]["device"] == "cpu" for s in sections.values())

    decode = sections["decode"]["decode"]
    assert decode["agreement"]["users"] == 4 and decode["agreement"]["same_items_same_order"] == 1.0
    assert [r["items"] for r in sections["decode"]["index"]] == [12023, 2000]

    spec = sections["speculative"]["speculative"]
    assert [(t["batch"], t["users"], list(t["k"])) for t in spec["batches"]] == [(1, 2, ["1", "3"]), (2, 4, ["1", "3"])]
    strict = [c for t in spec["batches"] for row in t["k"].values() for n, c in row["drafts"].items() if "strict" in n]
    assert len(strict) == 2 * 2 * 2 and all(c["same_as_beam_search"] == 1.0 for c in strict)
    for t in spec["batches"]:  # every repeat of beam_search and of every draft x mode (x transformers at batch 1)
        for row in t["k"].values():
            assert len(row["beam_search"]["seconds"]) == 2 and len(row["order"]) == 2 * (1 + 2 * 2 + (t["batch"] == 1))
            assert all(
                len(c["timing"]["seconds"]) == 2 and c["ws_range"][0] <= c["ws"] <= c["ws_range"][1]
                for c in row["drafts"].values()
            )
    assert result["repeats"] == 2
    assert all(len(r["timing"]["seconds"]) == 2 for r in decode["methods"].values())

    disc = sections["disc"]["disc"]
    assert disc["k"] == 2 and disc["users"] == 4 and "disc rounds=2 exact" in disc["methods"]
    assert all(len(m["timing"]["seconds"]) == 2 for m in disc["methods"].values())

    bias = sections["disc-bias"]["disc_bias"]
    assert bias["users"] == 2 and bias["draws"] == 64 and len(bias["p_b"]) == 2
    assert list(bias["methods"]) == ["exact sampler", "constrained_sample", "disc rounds=1", "disc rounds=2"]
    cells = [*bias["methods"].values(), bias["exact"]["constrained decoding Q"]]
    assert all(0 <= c[key] <= 1 for c in cells for key in ("tv_items", "tv_level_a"))
    assert all(0 < c["mean_x"] <= 1 for c in cells) and all(0 < p <= 1 for p in bias["p_b"])

    md = (out / "all.md").read_text()
    for text in (
        "# genrec-batch",
        "| hardware |",
        "| versions |",
        "| seeds | 7",
        result["versions"]["git_commit"],
        "## decode",
        "## catalog index",
        "## speculative beam search",
        "## DISC vs constrained",
        "## DISC bias",
        "| exact sampler (draws from P_S) |",
        "strict speculative identical to beam_search on 100% of users",
        "beam_search = transformers on 100% of users",
        "best WS@K over beam_search by median",
        "2 interleaved repeats per method",
        "median (min-max)",
    ):
        assert text in md, text
    assert md.count("**verdict**") == 4
    assert "bench all: sections" in run.stderr  # the progress bar


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_catalog_logprob_scores_every_item_exactly(temperature):
    """The whole-catalog scorer (prompt cache shared by chunks) = a full forward per item; Q = p / x is constrained
    decoding's distribution: it sums to 1 and x is the importance weight constrained_sample reports.

    Bounds: the logits are float32 (the rest is float64), so log p by two batch shapes differs within
    float32_atol (tests/helpers.py: each logit sums WIDTH products). Each item's Q is computed from its own row's
    logits, so siblings in other rows see their shared prefix's logits rounded apart: sum Q moves from 1 by at most
    max |error of log Q| <= 2 float32_atol (log p and log x each). That guards against x that is not the mass of
    the valid continuations (a wrong mask, a level left out, the temperature applied to one side only), which moves
    sum Q by the mass misassigned. log x <= 0 up to the float64 rounding of L normalisers over V tokens."""
    cat = random_catalog(30, 3, 5, seed=1)
    model = tiny_model("llama", cat.vocab_size, seed=2)
    ids, mask = left_padded_prompts(2, [6, 3], cat.vocab_size, seed=3)
    ids, mask = ids[1:], mask[1:]  # the left-padded prompt
    log_p, log_x = catalog_logprob(model, ids, mask, cat, temperature=temperature, chunk=7, valid_mass=True)
    n = len(cat)
    full = sequence_logprob(
        model, torch.cat([ids.repeat(n, 1), cat.tokens], 1), mask.repeat(n, 1), cat.code_len, temperature=temperature
    ).double()
    atol = float32_atol(full)
    torch.testing.assert_close(log_p, full, atol=atol, rtol=0)
    whole = catalog_logprob(model, ids, mask, cat, temperature=temperature, chunk=n)
    torch.testing.assert_close(whole, log_p, atol=atol, rtol=0)
    assert (log_x <= cat.code_len * cat.vocab_size * EPS64).all() and (log_x > log_p).all()
    assert (log_p - log_x).exp().sum().item() == pytest.approx(1.0, abs=2 * atol)
    rec = constrained_sample(
        model,
        ids.repeat(20, 1),
        mask.repeat(20, 1),
        cat,
        1,
        temperature=temperature,
        generator=torch.Generator().manual_seed(0),
    )
    row = cat.node_of(rec.token_ids[:, 0]) - cat.level_start[cat.code_len]
    rtol = cat.code_len * (WIDTH + cat.vocab_size) * EPS32  # x in float32: L masses, each a sum over V
    torch.testing.assert_close(rec.stats["importance_weight"][:, 0].double(), log_x[row].exp(), atol=0, rtol=rtol)


@pytest.mark.numerics
def test_disc_bias_distances():
    """TV over the items and over the level-a marginal, KL, and the mean valid mass of the draws, by hand."""
    cat = random_catalog(4, 2, 3, seed=0)  # 4 items over 2 levels x 3 codes
    p_s = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    d = distances(p_s, q, cat)
    assert d["tv_items"] == pytest.approx(0.4) and d["kl"] == pytest.approx(float((p_s * (p_s / q).log()).sum()))
    first = cat.tokens[:, 0]
    marg = lambda p: torch.stack([p[first == t].sum() for t in first.unique()])  # noqa: E731
    assert d["tv_level_a"] == pytest.approx(0.5 * float((marg(p_s) - marg(q)).abs().sum()))
    assert distances(p_s, p_s, cat) == pytest.approx({"tv_items": 0.0, "tv_level_a": 0.0, "kl": 0.0})
    x = torch.tensor([1.0, 0.5, 0.25, 0.125], dtype=torch.float64)
    s = draw_stats(p_s, x, torch.tensor([0, 0, 0, 1]), cat)  # empirical (0.75, 0.25, 0, 0)
    assert s["tv_items"] == pytest.approx(0.5 * (0.35 + 0.05 + 0.2 + 0.1))
    assert s["mean_x"] == pytest.approx(0.875) and s["mean_x_se"] == pytest.approx(0.25 / 4**0.5)
    smoothed = torch.tensor([3.5, 1.5, 0.5, 0.5], dtype=torch.float64) / 6
    assert s["kl"] == pytest.approx(float((p_s * (p_s / smoothed).log()).sum()))
    with pytest.raises(RuntimeError, match="not catalog items"):
        draw_stats(p_s, x, torch.tensor([0, -1]), cat)


def test_bench_templates_small(data, tmp_path):
    """Rendering cost of every template (renderer vs tokenizer) and one nightly job per template, at tiny sizes."""
    out = tmp_path / "out"
    run = bench("templates", data=data, users=40, shape_users=8, render_users=500, repeats=1, batch=20, out=out, **TINY)
    assert run.returncode == 0, run.stderr[-3000:]
    t = json.loads((out / "templates.json").read_text())["templates"]
    assert set(t["shapes"]["shapes"]) == {"300", "openonerec", "titles"}, t["shapes"]
    render = t["render"]["templates"]
    assert set(render) == {"codes", "lcrec"} and render["codes"]["max_prompt_tokens"] == 81
    assert render["lcrec"]["max_prompt_tokens"] > render["codes"]["max_prompt_tokens"]
    assert all(x["renderer_ms_per_1000"]["median"] > 0 for x in render.values())
    jobs = t["nightly"]["templates"]
    assert all(x["users"] == 40 for x in jobs.values()) and t["render"]["users"] == 500
    assert jobs["lcrec"]["prompt_tokens_per_user"] > jobs["codes"]["prompt_tokens_per_user"]
    assert "| lcrec |" in (out / "templates.md").read_text()


def test_bench_gpu_refuses_without_cuda(tmp_path):
    """`bench gpu` without a CUDA device (or on the CPU without --smoke) exits 2 with how to run it, before any
    model is built or any output written."""
    out = tmp_path / "out"
    # the default device (cuda if available, else cpu) and --device cuda on a machine without CUDA; --device cpu
    # (without --smoke) wherever CUDA is
    argvs = [["--device", "cpu"]] if torch.cuda.is_available() else [[], ["--device", "cuda"]]
    for argv in argvs:
        run = bench("gpu", *argv, "--out", str(out))
        assert run.returncode == 2, (argv, run.stderr[-2000:])
        assert "needs a CUDA device" in run.stderr or "sees no CUDA device" in run.stderr, run.stderr[-2000:]
        assert "--device cpu --smoke" in run.stderr and "Traceback" not in run.stderr
    assert not out.exists()


def cells_of(result: dict, kind: str) -> list[dict]:
    """A gpu report's rows of one kind of cell."""
    return [r for r in result["cells"] if r["kind"] == kind]


def test_bench_gpu_smoke_on_cpu(data, tmp_path):
    """`bench gpu --device cpu --smoke` runs every cell at smoke sizes in one process and writes one report: the
    matmul rate, the SID-GR anchor at batch 8, 1 and the largest that fits, parity (float32 identical to transformers
    for every user, left-padded ones included; bfloat16 / float16 against transformers and strict speculative), the
    shapes grid, each cell's useful-FLOP fraction of the measured rate, then DISC and speculative."""
    out = tmp_path / "out"
    target = tiny_beauty_model(tmp_path / "target", data, 32, 0)
    draft = tiny_beauty_model(tmp_path / "draft", data, 16, 1)
    sections = ["parity", "shapes", "anchor", "disc", "speculative"]
    run = bench_gpu_smoke(data, out, target=target, drafts=[draft], sections=sections, page=tmp_path / "pages")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "gpu.json").read_text())
    [page] = (tmp_path / "pages").glob("gpu-*.md")  # the report kept as a dated page, its provenance on top
    text, ver = page.read_text(), result["versions"]
    assert re.fullmatch(r"gpu-[a-z0-9-]+-\d{4}-\d{2}-\d{2}\.md", page.name) and text.startswith("# GPU benchmark: ")
    assert ver["git_commit"] in text and ver["torch"] in text and "--page" in text
    assert text.endswith((out / "gpu.md").read_text())
    assert {r["status"] for r in result["cells"]} == {"ok"}, [r.get("error") for r in result["cells"]]
    kinds = ["matmul", "anchor", "anchor", "parity", "parity", "parity", "shapes", "anchor", "disc", "speculative"]
    assert [r["kind"] for r in result["cells"]] == kinds  # in order of value
    [matmul] = cells_of(result, "matmul")
    rate = matmul["flops_per_s"]
    assert rate > 0
    parity = cells_of(result, "parity")
    assert [r["dtype"] for r in parity] == ["float32", "bfloat16", "float16"]
    ties = {"transformers": (1e-4, 0.2, 0.04), "speculative": (1e-4, 4e-2, 8e-3)}  # tests/test_engine.py's bounds
    for i, r in enumerate(parity):
        for against in ("transformers", "speculative"):
            x = r[against]
            assert x["tie"] == ties[against][i]
            assert 0 <= x["clear_users_identical"] <= x["clear_users"] <= r["users"]
            assert x["max_abs_score_diff"] >= 0
            if r["dtype"] == "float32":  # exact: every user, the left-padded ones included
                assert x["identical"] == r["users"] and x["max_abs_score_diff"] < 1e-4, (against, x)
    [cell] = cells_of(result, "shapes")
    assert (cell["vocab"], cell["prompt"], cell["k"]) == (2048, 40, 5)
    assert cell["same_items_same_order"] == 1.0  # float32 at smoke sizes: the same lists as transformers
    for method in ("beam_search", "transformers"):
        x = cell["methods"][method]
        assert x["status"] == "ok" and x["batch"] == 2
        flops = cell["useful_flops_per_user"]
        assert x["flop_fraction"] == pytest.approx(flops * x["users_per_s"]["median"] / rate)
    anchor = cells_of(result, "anchor")
    assert [a["methods"]["beam_search"]["batch"] for a in anchor] == [8, 1, 4]  # 4: smoke's most
    assert {(a["arch"], a["code_len"], a["k"]) for a in anchor} == {("qwen3", 3, 8)}
    assert "disc rounds=4 exact" in cells_of(result, "disc")[0]["disc"]["methods"]
    assert cells_of(result, "speculative")[0]["speculative"]["batches"]
    md = (out / "gpu.md").read_text()
    for section in (
        "| SID-GR batch 8, eager | ok |",
        "TFLOP/s**",
        "## parity",
        "| float32 | beam_search vs transformers float32",
        "| float16 | beam_search vs speculative",
        "## shapes: beam_search vs transformers",
        "## anchor: NVIDIA SID-GR's shape",
        "| eager | 8 | ",
        "93.2 ms",
        "17.6 ms",
        "## DISC vs constrained sampling",
        "## speculative beam search vs beam_search",
    ):
        assert section in md, section


def test_bench_gpu_records_out_of_memory(data, tmp_path):
    """A method that runs out of memory at every batch (simulated: the CPU has no allocator limit to hit) is halved
    down to batch 1, then recorded as "out of memory" in the table; the report is still written, the other method
    timed."""
    out = tmp_path / "out"
    run = bench_gpu_smoke(data, out, sections="shapes", simulate_oom="transformers")
    assert run.returncode == 0, run.stderr[-3000:]
    [cell] = cells_of(json.loads((out / "gpu.json").read_text()), "shapes")
    assert cell["methods"]["transformers"] == {"status": "out of memory"}
    assert cell["methods"]["beam_search"]["status"] == "ok" and "speedup" not in cell
    assert "| out of memory |" in (out / "gpu.md").read_text()


def test_bench_precision_small(data, tmp_path):
    """`bench precision` on a tiny model: float32 identical to transformers in float32 for every user; each half
    dtype twice (the float32 head, and logits rounded to the model's dtype), its counts consistent, the table."""
    model = tiny_beauty_model(tmp_path / "model", data, 32, seed=0)
    out = tmp_path / "out"
    run = bench(
        "precision",
        data=data,
        target=model,
        users=8,
        batch=4,
        ks=5,
        dtypes=["float32", "bfloat16"],
        device="cpu",
        out=out,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads((out / "precision.json").read_text())["rows"]
    assert [(r["dtype"], r["head"]) for r in rows] == [
        ("float32", "float32"),
        ("bfloat16", "float32"),
        ("bfloat16", "bfloat16"),
    ]
    assert rows[0]["identical"] == 8 and rows[0]["max_abs_score_diff"] < 1e-4 and rows[0]["topk_overlap"] == 1.0
    for r in rows:
        assert 0 <= r["clear_identical"] <= r["clear_users"] <= r["users"] == 8 and 0 < r["topk_overlap"] <= 1
    assert "| bfloat16 | float32 | 5 |" in (out / "precision.md").read_text()
