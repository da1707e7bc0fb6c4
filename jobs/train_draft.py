"""Train a draft model aligned with a target: `python -m jobs.train_draft --data DIR --target DIR --out DIR
--objective {sft,wordkd,seqkd,tvdkd,atspeed-s,atspeed-r} [--preset demo]`.

The draft shares the target's tokenizer. Objectives (formulas in `decoding/alignment.py`):
  sft        recommendation loss on the ground-truth item only
  wordkd     + token-level KL(target || draft) along the ground-truth item           (mixed by alpha)
  tvdkd      + token-level TVD along the ground-truth item                             (mixed by alpha)
  seqkd      + recommendation loss on the target's top-K sequences                     (mixed by alpha)
  atspeed-s  + reverse KL over the constrained top-K tokens + density regularisation,
               along the target's top-K sequences                                      (mixed by alpha)
  atspeed-r  + TVD over the constrained top-K tokens, along the target's top-K sequences (mixed by alpha)
Teacher data (the target's top-K sequences and its logits along them) is cached next to the target.
Each epoch the draft is scored by what strict verification needs: the fraction of validation users whose target
top-K beams at step t are all among the draft's top-N beams (t = 1..L); the best checkpoint is kept.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from decoding import alignment as A
from decoding.beam import beam_search
from decoding.metrics import topk_coverage
from decoding.models import build_model, load_model, load_tokenizer, pick_device
from decoding.tree import chain_forward
from jobs import training as T
from jobs.teacher import span_logits, span_valid, teacher_data

PRESETS = {
    "demo": dict(layers=1, hidden=64, heads=2, kv_heads=1, epochs=3, batch_size=64, lr=3e-3, warmup=100,
                 max_samples=20000, eval_users=500, test_users=1000),
    "gpu-small": dict(layers=2, hidden=256, heads=4, kv_heads=2, epochs=20, batch_size=128, lr=1e-3,
                      max_samples=None, eval_users=2000),
    "gpu-base": dict(layers=2, hidden=512, heads=8, kv_heads=4, epochs=20, batch_size=128, lr=5e-4,
                     max_samples=None, eval_users=5000),
}


@dataclass(kw_only=True)
class DraftConfig(T.TrainConfig):
    data: str
    target: str
    out: str
    objective: str = "atspeed-s"
    init: str | None = None
    teacher_cache: str | None = None
    alpha: float = 0.5
    beta: float = 1.0  # weight of AtSpeed-S's density regularisation
    k: int = 10  # the target's top-K: teacher beams, and the top-K of the alignment objectives
    draft_beams: int = 40  # N: draft beams when scoring coverage
    teacher_batch: int = 64
    layers: int = 1  # a draft is much smaller than its target
    hidden: int = 64
    heads: int = 2
    kv_heads: int = 1
    max_samples: int | None = 20000


def check_config(cfg: DraftConfig, target, tokenizer, draft) -> None:
    """Everything that would make training meaningless fails here, before any training starts."""
    if cfg.objective not in A.OBJECTIVES:
        raise ValueError(f"unknown objective {cfg.objective!r}; choose from {', '.join(A.OBJECTIVES)}")
    if not 0 <= cfg.alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {cfg.alpha}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocabulary ({draft.config.vocab_size} tokens, {cfg.init}) differs from the "
                         f"target's ({target.config.vocab_size} tokens, {cfg.target}): they must share a tokenizer")
    if cfg.init and (Path(cfg.init) / "tokenizer.json").is_file():
        if load_tokenizer(cfg.init).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"draft tokenizer ({cfg.init}) differs from the target's ({cfg.target})")


@torch.no_grad()
def beams_per_step(model, data: T.Data, histories, width: int, history_len: int, batch_size: int, device):
    """Top-`width` beams after each step t = 1..L -> list over t of [U, width, t]."""
    model.eval()
    out = [[] for _ in range(data.catalog.code_len)]
    for a in range(0, len(histories), batch_size):
        ids, mask = T.prompts(data, histories[a:a + batch_size], history_len, device)
        for t in range(1, data.catalog.code_len + 1):
            out[t - 1].append(beam_search(model, ids, mask, data.catalog, width, steps=t).token_ids.cpu())
    return [torch.cat(x) for x in out]


def coverage(target_beams, draft_beams) -> list[float]:
    """Per step t: fraction of users whose target top-K beams are all among the draft's top-N."""
    return [float(topk_coverage(t, d).float().mean()) for t, d in zip(target_beams, draft_beams)]


def train_draft(cfg: DraftConfig) -> dict:
    device = pick_device(cfg.device)
    rng = T.seed_everything(cfg.seed)
    if cfg.objective not in A.OBJECTIVES:  # also checked by argparse; callers of this function get it too
        raise ValueError(f"unknown objective {cfg.objective!r}; choose from {', '.join(A.OBJECTIVES)}")
    target = load_model(cfg.target, device=str(device), dtype="float32")
    tokenizer = load_tokenizer(cfg.target)
    draft = load_model(cfg.init, device=str(device), dtype="float32") if cfg.init else build_model(
        target.config.vocab_size, cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, seed=cfg.seed).to(device)
    check_config(cfg, target, tokenizer, draft)
    data = T.load_data(cfg.data, tokenizer, cfg.history_len, cfg.eval_users, device)
    subset = T.subset_of(len(data.sample_end), cfg.max_samples, rng)
    teacher = None if cfg.objective == "sft" else teacher_data(
        cfg.target, target, data, subset, cfg.k, cfg.history_len, cfg.teacher_batch, device, cfg.teacher_cache)
    span_lo = teacher.span_lo if teacher is not None else None
    width = teacher.top_logits.shape[-1] if teacher is not None else None

    def step_loss(m, idx):
        ids, mask, labels = T.sample_batch(data, idx, cfg.history_len, device)  # labels [B, L]
        if cfg.objective in ("sft", "wordkd", "tvdkd"):
            logits = chain_forward(m, ids, mask, labels[:, None])  # [B, 1, L, V]
            rec = A.recommendation_loss(logits[:, 0], labels)
            if cfg.objective == "sft":
                return rec
            gt = teacher.gt_logits[teacher.rows(idx)].to(device).float()  # [B, L, V]
            kd = A.word_kd if cfg.objective == "wordkd" else A.tvd_kd
            return A.mix(rec, kd(logits[:, 0], gt), cfg.alpha)
        rows = teacher.rows(idx)
        top = teacher.tokens[rows].to(device)  # [B, K, L], -1 rows: fewer than K items
        weight = (top >= 0).all(-1, keepdim=True).expand_as(top).float()  # [B, K, L]
        logits = chain_forward(m, ids, mask, torch.cat([labels[:, None], top.clamp(min=0)], 1))  # [B, 1+K, L, V]
        rec = A.recommendation_loss(logits[:, 0], labels)
        if cfg.objective == "seqkd":
            return A.mix(rec, A.recommendation_loss(logits[:, 1:], top.clamp(min=0), weight), cfg.alpha)
        draft_span = span_logits(logits[:, 1:], span_lo, width)  # [B, K, L, W]
        target_span = teacher.top_logits[rows].to(device).float()
        valid = span_valid(data.catalog, top, span_lo.to(device), width)
        if cfg.objective == "atspeed-s":
            align = A.atspeed_s(draft_span, target_span, valid, cfg.k, weight, cfg.beta)
        else:
            align = A.atspeed_r(draft_span, target_span, valid, cfg.k, weight)
        return A.mix(rec, align, cfg.alpha)

    target_valid = beams_per_step(target, data, data.eval_histories, cfg.k, cfg.history_len, cfg.eval_batch, device)
    report = {"kind": "draft", "objective": cfg.objective, "config": T.config_dict(cfg),
              "data_fingerprint": data.fingerprint, "samples": int(len(subset)), "device": str(device),
              "parameters": sum(p.numel() for p in draft.parameters()),
              "target_parameters": sum(p.numel() for p in target.parameters()), "epochs": []}
    def validate(m):  # what strict verification needs, at every step
        cov = coverage(target_valid, beams_per_step(m, data, data.eval_histories, cfg.draft_beams, cfg.history_len,
                                                    cfg.eval_batch, device))
        return {"coverage": cov}, float(np.mean(cov))

    best_draft = T.fit(draft, tokenizer, step_loss, validate, data, subset, cfg, rng, device, Path(cfg.out), report,
                       f"draft {cfg.objective}")
    histories, _ = T.load_eval_users(cfg.data, "test", cfg.test_users)
    report["test_coverage"] = coverage(
        beams_per_step(target, data, histories, cfg.k, cfg.history_len, cfg.eval_batch, device),
        beams_per_step(best_draft, data, histories, cfg.draft_beams, cfg.history_len, cfg.eval_batch, device))
    report["test_users"] = len(histories)
    T.write_report(Path(cfg.out), report)
    print(f"draft {cfg.objective} test coverage (users {len(histories)}): {report['test_coverage']}", file=sys.stderr)
    return report


def parse_args(argv=None) -> DraftConfig:
    p = argparse.ArgumentParser(prog="python -m jobs.train_draft", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a prepare_data folder")
    p.add_argument("--target", required=True, help="the trained target model directory")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--objective", required=True, choices=A.OBJECTIVES)
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--init", help="start from this local draft model instead of a fresh one")
    p.add_argument("--teacher-cache", help="teacher data folder (default: <target>/teacher)")
    T.add_common_args(p, DraftConfig)
    return T.config_from_args(p.parse_args(argv), DraftConfig, PRESETS)


def main(argv=None) -> int:
    cfg = parse_args(argv)
    try:
        report = train_draft(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"draft {cfg.objective}: best epoch {report.get('best_epoch')}, test coverage {report['test_coverage']}"
          f" -> {cfg.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
