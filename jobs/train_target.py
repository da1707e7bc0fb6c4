"""Train the target generative recommender: `python -m jobs.train_target --data DIR --out DIR [--preset demo]`.

Input = the last `history_len` items of a history as semantic-ID tokens, output = the next item's L code tokens;
the loss is on the item tokens only; every prefix of every training history is a sample. Either a Llama from
scratch (--layers/--hidden/--heads/--kv-heads) or a local HF causal LM whose vocabulary gets the code tokens
added (--base-model DIR, the LC-Rec recipe). Each epoch: Recall/NDCG@{5,10,20} on the validation split with
`beam_search`; the best checkpoint is kept (safetensors + config + tokenizer + training.json); early stopping.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from decoding.codes import semantic_id_matrix
from decoding.alignment import recommendation_loss
from decoding.models import add_code_tokens, build_model, load_model, load_tokenizer, pick_device
from decoding.tree import chain_forward
from jobs import training as T

PRESETS = {  # small: CPU demo within minutes; gpu-*: real runs on an accelerator
    "demo": dict(layers=2, hidden=128, heads=4, kv_heads=2, epochs=3, batch_size=128, lr=3e-3, eval_users=1000),
    "gpu-small": dict(layers=8, hidden=512, heads=8, kv_heads=4, epochs=30, batch_size=256, lr=1e-3, eval_users=5000),
    "gpu-base": dict(layers=12, hidden=768, heads=12, kv_heads=4, epochs=30, batch_size=256, lr=5e-4,
                     eval_users=20000),
}


@dataclass(kw_only=True)
class TargetConfig(T.TrainConfig):
    data: str
    out: str
    base_model: str | None = None


def train_target(cfg: TargetConfig) -> dict:
    device = pick_device(cfg.device)
    rng = T.seed_everything(cfg.seed)
    data_dir, out = Path(cfg.data), Path(cfg.out)
    if cfg.base_model:  # LC-Rec: a pretrained causal LM gets the code tokens
        model = load_model(cfg.base_model, device="cpu", dtype="float32")
        tokenizer = load_tokenizer(cfg.base_model)
        codes = semantic_id_matrix(pq.read_table(data_dir / "items.parquet"), str(data_dir / "items.parquet"))
        add_code_tokens(model, tokenizer, levels=codes.shape[1], codes=int(codes.max()) + 1)
    else:
        tokenizer = load_tokenizer(data_dir / "tokenizer")
        model = build_model(len(tokenizer), cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, seed=cfg.seed)
    data = T.load_data(data_dir, tokenizer, cfg.history_len, cfg.eval_users, device)
    model.to(device)
    subset = T.subset_of(len(data.sample_end), cfg.max_samples, rng)
    def step_loss(m, idx):
        ids, mask, labels = T.sample_batch(data, idx, cfg.history_len, device)
        logits = chain_forward(m, ids, mask, labels[:, None])[:, 0]  # [B, L, V]
        return recommendation_loss(logits, labels)

    report = {"kind": "target", "config": T.config_dict(cfg), "data_fingerprint": data.fingerprint,
              "samples": int(len(subset)), "eval_users": len(data.eval_histories), "device": str(device),
              "parameters": sum(p.numel() for p in model.parameters()), "epochs": []}
    def validate(m):
        metrics = T.evaluate_recommendations(m, data, data.eval_histories, data.eval_targets, cfg.history_len,
                                             cfg.eval_batch, device)
        return metrics, metrics.get("ndcg@10", 0.0)

    best_model = T.fit(model, tokenizer, step_loss, validate, data, subset, cfg, rng, device, out, report, "target")
    # the kept checkpoint on the test split (the paper's protocol: users without targets are skipped)
    histories, targets = T.load_eval_users(data_dir, "test", cfg.test_users)
    report["test"] = T.evaluate_recommendations(best_model, data, histories, targets, cfg.history_len,
                                                cfg.eval_batch, device)
    T.write_report(out, report)
    print(f"target test (best epoch {report['best_epoch']}): {report['test']}", file=sys.stderr)
    return report


def parse_args(argv=None) -> TargetConfig:
    p = argparse.ArgumentParser(prog="python -m jobs.train_target", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a prepare_data folder (items, train, valid, tokenizer/)")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--preset", choices=sorted(PRESETS), help="size and schedule defaults; flags override")
    p.add_argument("--base-model", help="local HF causal LM to extend with the code tokens (LC-Rec recipe)")
    T.add_common_args(p, TargetConfig)
    args = p.parse_args(argv)
    return T.config_from_args(args, TargetConfig, PRESETS)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        report = train_target(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    best = next((e for e in report["epochs"] if e["epoch"] == report.get("best_epoch")), None)
    print(f"best epoch {report.get('best_epoch')}: {best['valid'] if best else {}} -> {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
