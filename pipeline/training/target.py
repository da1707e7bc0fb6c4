"""Target training (`train_target`): the next item's L code tokens from the last `history_len` items.

Every prefix of every training history is a sample; the loss is on the item tokens only. Either a Llama from
scratch (layers / hidden / heads / kv_heads) or a local HF causal LM whose vocabulary gets the code tokens added
(`base_model`, the LC-Rec recipe). Each epoch: Recall/NDCG@{5,10,20} on the validation split with `beam_search`;
the best checkpoint is kept (safetensors + config + tokenizer + training.json) and scored on the test split.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from decoding.alignment import recommendation_loss
from decoding.codes import semantic_id_matrix
from decoding.models import add_code_tokens, build_model, load_model, load_tokenizer, pick_device
from decoding.templates import PromptTemplate, get_template
from decoding.tree import chain_forward
from pipeline.training.common import (
    TrainConfig,
    evaluate_recommendations,
    fit,
    load_data,
    load_eval_users,
    parameters,
    report_head,
    sample_batch,
    seed_everything,
    subset_of,
    write_final_report,
)

PRESETS = {  # small: CPU demo within minutes; gpu-*: real runs on an accelerator
    "demo": dict(layers=2, hidden=128, heads=4, kv_heads=2, epochs=3, batch_size=128, lr=3e-3, eval_users=1000),
    "gpu-small": dict(layers=8, hidden=512, heads=8, kv_heads=4, epochs=30, batch_size=256, lr=1e-3, eval_users=5000),
    "gpu-base": dict(layers=12, hidden=768, heads=12, kv_heads=4, epochs=30, batch_size=256, lr=5e-4, eval_users=20000),
}


@dataclass(kw_only=True)
class TargetConfig(TrainConfig):
    data: str
    out: str
    base_model: str | None = None  # template default: `codes` from scratch, `lcrec` on a base model


def train_target(cfg: TargetConfig) -> dict:
    """Trains the target into cfg.out; returns the training report (also written as training.json).
    Bad data (missing files, a catalog/tokenizer mismatch, no samples) raises ValueError before any training."""
    device = pick_device(cfg.device)
    rng = seed_everything(cfg.seed)
    data_dir, out = Path(cfg.data), Path(cfg.out)
    template = get_template(cfg.template or ("lcrec" if cfg.base_model else "codes")).with_max_items(cfg.history_len)
    model, tokenizer = target_model(cfg, template)
    data = load_data(data_dir, tokenizer, template, cfg.eval_users, device)
    model.to(device)
    subset = subset_of(len(data.sample_end), cfg.max_samples, rng)

    def step_loss(m, idx):
        ids, mask, labels = sample_batch(data, idx, device)
        logits = chain_forward(m, ids, mask, labels[:, None])[:, 0]  # [B, L, V]
        return recommendation_loss(logits, labels)

    def validate(m):
        metrics = evaluate_recommendations(m, data, data.eval_histories, data.eval_targets, cfg.eval_batch, device)
        return metrics, metrics.get("ndcg@10", 0.0)

    report = {
        "kind": "target",
        **report_head(cfg, template, data, subset),
        "eval_users": len(data.eval_histories),
        "device": str(device),
        "parameters": parameters(model),
        "epochs": [],
    }
    best_model = fit(model, tokenizer, step_loss, validate, data, subset, cfg, rng, device, out, report, "target")
    # the kept checkpoint on the test split (the paper's protocol: users without targets are skipped)
    histories, targets = load_eval_users(data_dir, "test", cfg.test_users)
    report["test"] = evaluate_recommendations(best_model, data, histories, targets, cfg.eval_batch, device)
    write_final_report(out, report, data_dir)
    print(f"target test (best epoch {report['best_epoch']}): {report['test']}", file=sys.stderr)
    return report


def target_model(cfg: TargetConfig, template: PromptTemplate):
    """-> (model, tokenizer): a Llama from scratch on the prepared folder's tokenizer, or (`base_model`, LC-Rec) a
    pretrained causal LM with the catalog's code tokens added to its vocabulary; on the CPU."""
    data_dir = Path(cfg.data)
    if not cfg.base_model:
        tokenizer = load_tokenizer(data_dir / "tokenizer")
        return build_model(len(tokenizer), cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, seed=cfg.seed), tokenizer
    model = load_model(cfg.base_model, device="cpu", dtype="float32")
    tokenizer = load_tokenizer(cfg.base_model)
    codes = semantic_id_matrix(pq.read_table(data_dir / "items.parquet"), str(data_dir / "items.parquet"))
    add_code_tokens(model, tokenizer, codes.shape[1], int(codes.max()) + 1, template)
    return model, tokenizer
