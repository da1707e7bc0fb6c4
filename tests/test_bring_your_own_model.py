"""Bring your own LLM recommender, end to end: LC-Rec-format data -> `prepare_data --format lcrec` -> a base causal LM
with a real BPE tokenizer -> `train_target --base-model --template lcrec` (the LC-Rec recipe) -> the nightly job ->
`jobs.evaluate`. The published recommendations equal `transformers` constrained beam search run on the rendered
prompt text through the tokenizer, the way a user of the model calls it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from decoding.catalog import Catalog
from decoding.models import build_model, load_model, load_tokenizer
from decoding.reference import generate_beam_search
from decoding.templates import read_template
from pipeline.config import load_config
from pipeline.evaluate import evaluate
from pipeline.prepare import write_synthetic
from pipeline.storage import Storage
from tests.helpers import assert_same_ranking, bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]
LEVELS, CODES, K = 3, 6, 5


def job(name: str, *argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", f"jobs.{name}", *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def lcrec_source(root: Path) -> Path:
    """Synthetic users and items written in LC-Rec's layout: an index JSON and sequential_{train,valid,test}.txt."""
    synth = root / "synth"
    write_synthetic(synth, n_users=150, n_items=90, levels=LEVELS, codes=CODES, seed=3, history_len=20)
    items = pq.read_table(synth / "items.parquet").to_pylist()
    src = root / "lcrec"
    src.mkdir()
    (src / "Toy.index.json").write_text(json.dumps({str(r["item_id"]): r["code_tokens"] for r in items}))
    train = pq.read_table(synth / "train.parquet").to_pylist()
    valid = pq.read_table(synth / "valid.parquet").to_pylist()
    test = pq.read_table(synth / "test.parquet").to_pylist()
    lines = lambda rows, key: "".join(f"{r['user_id']} {' '.join(map(str, r[key]))}\n" for r in rows)  # noqa: E731
    (src / "sequential_train.txt").write_text(lines(train, "history"))
    (src / "sequential_valid.txt").write_text(lines(valid, "target_items"))
    (src / "sequential_test.txt").write_text(lines(test, "target_items"))
    return src


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    import ray

    from pipeline.nightly import run_nightly

    root = tmp_path_factory.mktemp("byom")
    job("prepare_data", "--format", "lcrec", "--source", str(lcrec_source(root)), "--out", str(root / "data"))
    base = root / "base"  # a "pretrained" causal LM with its own text tokenizer, no code tokens yet
    tok = bpe_tokenizer(LEVELS, CODES, code_tokens=False)
    build_model(len(tok), 1, 32, 2, 1, seed=0).save_pretrained(base)
    tok.save_pretrained(base)
    job(
        "train_target",
        "--data",
        str(root / "data"),
        "--out",
        str(root / "target"),
        "--base-model",
        str(base),
        "--template",
        "lcrec",
        "--epochs",
        "1",
        "--batch-size",
        "32",
        "--lr",
        "0.01",
        "--warmup",
        "2",
        "--eval-users",
        "20",
        "--test-users",
        "20",
        "--device",
        "cpu",
    )
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        cfg = load_config(
            None,
            [
                f"input={root / 'data' / 'test.parquet'}",
                f"catalog={root / 'data' / 'items.parquet'}",
                f"output={root / 'out'}",
                f"models.target={root / 'target'}",
                f"decoding.k={K}",
                "compute.batch_size=64",
                "run_date=2026-11-22",
            ],
        )
        manifest = run_nightly(cfg)
    finally:
        ray.shutdown()
    return root, cfg, manifest


def test_the_trained_model_carries_its_template_and_code_tokens(published):
    root, _, manifest = published
    template = read_template(root / "target")
    assert template.name == "lcrec" and template.bos  # the BPE tokenizer adds <s> itself, like Llama's
    tok = load_tokenizer(root / "target")
    assert {"<a_0>", f"<c_{CODES - 1}>"} <= set(tok.get_vocab()) and "<pad>" in tok.get_vocab()
    assert manifest["template"]["name"] == "lcrec" and manifest["max_prompt_tokens"] > 60


def test_published_recommendations_equal_transformers_on_the_rendered_text(published):
    root, cfg, manifest = published
    run = Path(manifest["outputs"]["recommendations"]).parent
    recs = pq.read_table(run / "recommendations").to_pandas().sort_values(["user_id", "rank"])
    users = pq.read_table(root / "data" / "test.parquet").to_pandas()
    users = users[users.history.map(len) > 0]
    assert set(recs.user_id) == set(users.user_id) and manifest["counts"]["users_ok"] == len(users)

    template = read_template(root / "target")
    tok = load_tokenizer(root / "target")
    model = load_model(root / "target", device="cpu", dtype="float32")
    items = pq.read_table(root / "data" / "items.parquet")
    codes_of = dict(zip(items["item_id"].to_pylist(), items["semantic_id"].to_pylist()))
    cat = Catalog.from_table(items, tok, on_duplicate="first", code_token=template.code)
    texts = [template.text([codes_of[i] for i in h]) for h in users.history]
    enc = tok(texts, padding=True, return_tensors="pt")  # what a user of the model does: text -> tokenizer
    assert (enc.input_ids[:, 0][enc.attention_mask[:, 0].bool()] == tok.bos_token_id).all()
    got = {u: g for u, g in recs.groupby("user_id")}
    for a in range(0, len(texts), 32):
        want_items, _, want_scores = generate_beam_search(
            model, enc.input_ids[a : a + 32], enc.attention_mask[a : a + 32], cat, K
        )[:3]
        ours = [got[u] for u in users.user_id.iloc[a : a + 32]]
        assert_same_ranking(
            torch.tensor(np.stack([g.item_id.to_numpy() for g in ours])),
            torch.tensor(np.stack([g.score.to_numpy() for g in ours])),
            want_items,
            want_scores,
        )


def test_evaluation_of_the_run(published):
    root, cfg, manifest = published
    result = evaluate(str(root / "out"), Storage())
    assert result["users"] > 100 and 0 <= result["recall@5"] <= 1  # users with test targets
    assert (Path(manifest["outputs"]["recommendations"]).parent / "report" / "evaluation.json").is_file()
