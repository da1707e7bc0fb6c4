"""Tiny end-to-end training on generated data: target and draft losses fall, the saved directories reload
through decoding/models.py, beam_search runs on them; bad input fails before any training starts, and the
command-line entry points turn that into exit code 2."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.models import build_model, load_model, load_tokenizer
from pipeline.prepare import build_tokenizer, write_synthetic
from pipeline.training.draft import DraftConfig, train_draft
from pipeline.training.target import TargetConfig, train_target

ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = dict(
    layers=1,
    hidden=32,
    heads=2,
    kv_heads=1,
    epochs=3,
    batch_size=32,
    lr=0.01,
    warmup=5,
    eval_users=40,
    test_users=40,
    device="cpu",
    patience=5,
)
TINY_DRAFT = dict(
    layers=1,
    hidden=16,
    heads=2,
    kv_heads=1,
    epochs=2,
    batch_size=32,
    lr=0.01,
    warmup=5,
    eval_users=30,
    test_users=30,
    max_samples=600,
    k=4,
    draft_beams=8,
    device="cpu",
    patience=5,
)


def run_job(*argv) -> subprocess.CompletedProcess:
    """`python -m jobs.NAME ...` from the repository root, on this checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth")
    write_synthetic(out, n_users=250, n_items=120, levels=3, codes=6, seed=0, history_len=8)
    return out


@pytest.fixture(scope="module")
def target(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("target")
    train_target(TargetConfig(data=str(data), out=str(out), history_len=8, **TINY_TARGET))
    return out


def report(path):
    return json.loads((path / "training.json").read_text())


def assert_runs_beam_search(model_dir, data):
    model = load_model(model_dir, device="cpu", dtype="float32")
    tok = load_tokenizer(model_dir)
    cat = Catalog.from_parquet(data / "items.parquet", tok)
    ids = torch.tensor([[tok.bos_token_id] + cat.tokens[3].tolist() + cat.tokens[9].tolist()])
    rec = beam_search(model, ids, torch.ones_like(ids), cat, 5)
    assert (rec.item_ids >= 0).all() and torch.isfinite(rec.scores).all()


def test_target_trains_reloads_and_decodes(target, data):
    r = report(target)
    losses = [e["train_loss"] for e in r["epochs"]]
    assert losses[-1] < losses[0]
    assert r["samples"] > 500 and r["data_fingerprint"] and r["best_epoch"] >= 1
    assert set(r["test"]) >= {"recall@10", "ndcg@10", "users"} and r["test"]["users"] == 40
    # the report states how the test users' histories were built (write_synthetic's splits, from prepare.json)
    from pipeline.prepare import SYNTHETIC_SPLITS

    assert r["protocol"]["test"] == {
        "split": "test",
        "convention": SYNTHETIC_SPLITS["test"],
        "source": str(data / "prepare.json"),
    }
    assert r["config"]["hidden"] == 32 and list(target.glob("*.safetensors"))
    assert_runs_beam_search(target, data)


@pytest.mark.parametrize("objective", ["sft", "wordkd", "seqkd", "tvdkd", "atspeed-s", "atspeed-r"])
def test_draft_objectives_train_reload_and_decode(objective, target, data, tmp_path):
    out = tmp_path / objective
    train_draft(
        DraftConfig(data=str(data), target=str(target), out=str(out), objective=objective, history_len=8, **TINY_DRAFT)
    )
    r = report(out)
    losses = [e["train_loss"] for e in r["epochs"]]
    assert losses[-1] < losses[0], losses
    assert len(r["test_coverage"]) == 3 and all(0 <= c <= 1 for c in r["test_coverage"])
    assert r["protocol"]["test"]["source"] == str(data / "prepare.json")
    assert load_tokenizer(out).get_vocab() == load_tokenizer(target).get_vocab()  # the draft shares the tokenizer
    assert_runs_beam_search(out, data)
    if objective != "sft":
        assert len(list((target / "teacher").glob("teacher-*.safetensors"))) == 1  # one cache, reused


def test_lcrec_base_model_gets_the_code_tokens(data, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    raw = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    base_tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    base = tmp_path / "base"
    build_model(len(words), 1, 32, 2, 1).save_pretrained(base)
    base_tok.save_pretrained(base)
    out = tmp_path / "lcrec"
    train_target(
        TargetConfig(data=str(data), out=str(out), base_model=str(base), history_len=8, **{**TINY_TARGET, "epochs": 1})
    )
    tok = load_tokenizer(out)
    assert {"<a_0>", "<c_5>", "<bos>", "<pad>", "hello"} <= set(tok.get_vocab())
    assert load_model(out).config.vocab_size == len(tok) == 4 + 2 + 3 * 6
    assert_runs_beam_search(out, data)


def test_catalog_tokenizer_mismatch_fails_before_training(data, tmp_path):
    bad = tmp_path / "data"
    shutil.copytree(data, bad)
    shutil.rmtree(bad / "tokenizer")
    build_tokenizer(3, 4).save_pretrained(bad / "tokenizer")  # the catalog uses codes up to 5
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="catalog and tokenizer do not match"):
        train_target(TargetConfig(data=str(bad), out=str(out), **TINY_TARGET))
    assert not out.exists()
    # the entry point turns the ValueError into exit code 2 and `error: ...`
    run = run_job("jobs.train_target", "--data", str(bad), "--out", str(out), "--epochs", "1", "--device", "cpu")
    assert run.returncode == 2, run.stderr
    assert "error: catalog and tokenizer do not match" in run.stderr and not out.exists()


def test_empty_training_set_fails_before_training(data, tmp_path):
    bad = tmp_path / "data"
    shutil.copytree(data, bad)
    one_item = pa.table({"user_id": pa.array([1, 2], pa.int64()), "history": pa.array([[1], []], pa.list_(pa.int64()))})
    pq.write_table(one_item, bad / "train.parquet")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="empty training set"):
        train_target(TargetConfig(data=str(bad), out=str(out), **TINY_TARGET))
    assert not out.exists()


def test_draft_with_another_vocabulary_fails_before_training(target, data, tmp_path):
    other = tmp_path / "other"
    build_model(load_model(target).config.vocab_size + 7, 1, 16, 2, 1).save_pretrained(other)
    out = tmp_path / "out"
    cfg = DraftConfig(data=str(data), target=str(target), out=str(out), objective="sft", init=str(other), **TINY_DRAFT)
    with pytest.raises(ValueError, match="draft vocabulary"):
        train_draft(cfg)
    assert not out.exists()


def test_unknown_objective(target, data, tmp_path):
    run = run_job(
        "jobs.train_draft",
        "--data",
        str(data),
        "--target",
        str(target),
        "--out",
        str(tmp_path / "x"),
        "--objective",
        "kd9",
    )
    assert run.returncode == 2 and "invalid choice: 'kd9'" in run.stderr
    assert not (tmp_path / "x").exists()
    cfg = DraftConfig(data=str(data), target=str(target), out=str(tmp_path / "o"), objective="kd9")
    with pytest.raises(ValueError, match="unknown objective 'kd9'"):
        train_draft(cfg)
    assert not (tmp_path / "o").exists()


def test_bench_speculative_on_trained_models(target, data, tmp_path):
    """python -m jobs.bench speculative runs on a trained target and draft; strict results equal beam_search."""
    draft = tmp_path / "draft"
    train_draft(
        DraftConfig(data=str(data), target=str(target), out=str(draft), objective="seqkd", history_len=8, **TINY_DRAFT)
    )
    out = tmp_path / "bench"
    run = run_job(
        "jobs.bench",
        "speculative",
        "--data",
        str(data),
        "--target",
        str(target),
        "--drafts",
        str(draft),
        "--ks",
        "1",
        "3",
        "--users",
        "3",
        "--batch",
        "4",
        "--throughput-users",
        "8",
        "--draft-beams",
        "6",
        "--history-len",
        "8",
        "--device",
        "cpu",
        "--out",
        str(out),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((out / "speculative.json").read_text())["speculative"]
    assert [t["batch"] for t in result["batches"]] == [1, 4]
    cells = [c for t in result["batches"] for row in t["k"].values() for c in row["drafts"].values()]
    assert len(cells) == 2 * 2 * 2  # batch sizes x K x verification modes
    assert all(c["same_as_beam_search"] == 1.0 for c in cells if "same_as_beam_search" in c)
    assert all(c["ws"] > 0 and c["as"] >= 0 for c in cells)
    assert "WS@3" in (out / "speculative.md").read_text()
