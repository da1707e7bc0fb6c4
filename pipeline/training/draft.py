"""Draft training (`train_draft`): a small model aligned with a trained target for speculative beam search.

The draft shares the target's tokenizer. Objectives (`decoding/alignment.py`): sft, wordkd, tvdkd (along the
ground-truth item), seqkd, atspeed-s, atspeed-r (along the target's top-K sequences, from the cached teacher
data in `teacher.py`). Each epoch the draft is scored by what strict verification needs: per step t = 1..L, the
fraction of validation users whose target top-K beams are all among the draft's top-N beams (`coverage`); the
best checkpoint is kept and scored on the test split.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from decoding import alignment as A
from decoding.beam import beam_search
from decoding.metrics import topk_coverage
from decoding.models import build_model, load_model, load_tokenizer, pick_device
from decoding.templates import TEMPLATE_FILE, PromptTemplate, get_template, read_template
from decoding.tree import chain_forward
from pipeline.training.common import (
    Data,
    TrainConfig,
    fit,
    load_data,
    load_eval_users,
    parameters,
    prompts,
    report_head,
    sample_batch,
    seed_everything,
    subset_of,
    write_final_report,
)
from pipeline.training.teacher import Teacher, teacher_data

PRESETS = {
    "demo": dict(
        layers=1,
        hidden=64,
        heads=2,
        kv_heads=1,
        epochs=3,
        batch_size=64,
        lr=3e-3,
        warmup=100,
        max_samples=20000,
        eval_users=500,
        test_users=1000,
    ),
    "gpu-small": dict(
        layers=2, hidden=256, heads=4, kv_heads=2, epochs=20, batch_size=128, lr=1e-3, max_samples=None, eval_users=2000
    ),
    "gpu-base": dict(
        layers=2, hidden=512, heads=8, kv_heads=4, epochs=20, batch_size=128, lr=5e-4, max_samples=None, eval_users=5000
    ),
}


@dataclass(kw_only=True)
class DraftConfig(TrainConfig):
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
        raise ValueError(
            f"draft vocabulary ({draft.config.vocab_size} tokens, {cfg.init}) differs from the "
            f"target's ({target.config.vocab_size} tokens, {cfg.target}): they must share a tokenizer"
        )
    if cfg.init and (Path(cfg.init) / "tokenizer.json").is_file():
        if load_tokenizer(cfg.init).get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"draft tokenizer ({cfg.init}) differs from the target's ({cfg.target})")


@torch.no_grad()
def beams_per_step(model, data: Data, histories, width: int, batch_size: int, device):
    """Top-`width` beams after each step t = 1..L -> list over t of [U, width, t]."""
    model.eval()
    out = [[] for _ in range(data.catalog.code_len)]
    for a in range(0, len(histories), batch_size):
        ids, mask = prompts(data, histories[a : a + batch_size], device)
        for t in range(1, data.catalog.code_len + 1):
            out[t - 1].append(beam_search(model, ids, mask, data.catalog, width, steps=t).token_ids.cpu())
    return [torch.cat(x) for x in out]


def coverage(target_beams, draft_beams) -> list[float]:
    """Per step t: fraction of users whose target top-K beams are all among the draft's top-N."""
    return [float(topk_coverage(t, d).float().mean()) for t, d in zip(target_beams, draft_beams)]


def draft_template(cfg: DraftConfig) -> PromptTemplate:
    """The target's prompt template: a draft reads the prompts its target reads."""
    template = read_template(cfg.target)
    if cfg.template is not None and get_template(cfg.template) != template:
        raise ValueError(
            f"template {cfg.template!r} differs from the target's ({cfg.target}/{TEMPLATE_FILE}): a "
            "draft is trained on its target's prompts"
        )
    if cfg.history_len is not None and cfg.history_len != template.max_items:
        raise ValueError(
            f"history_len {cfg.history_len} differs from the target's template ({template.max_items} "
            "items): a draft is trained on its target's prompts"
        )
    return template


def train_draft(cfg: DraftConfig) -> dict:
    """Trains the draft into cfg.out; returns the training report (also written as training.json).
    A bad config or data (unknown objective, another vocabulary, ...) raises ValueError before any training."""
    device = pick_device(cfg.device)
    rng = seed_everything(cfg.seed)
    if cfg.objective not in A.OBJECTIVES:  # before any model is loaded
        raise ValueError(f"unknown objective {cfg.objective!r}; choose from {', '.join(A.OBJECTIVES)}")
    target, tokenizer, draft = load_models(cfg, device)
    check_config(cfg, target, tokenizer, draft)
    template = draft_template(cfg)
    data = load_data(cfg.data, tokenizer, template, cfg.eval_users, device)
    subset = subset_of(len(data.sample_end), cfg.max_samples, rng)
    teacher = (
        None
        if cfg.objective == "sft"
        else teacher_data(cfg.target, target, data, subset, cfg.k, cfg.teacher_batch, device, cfg.teacher_cache)
    )
    target_valid = beams_per_step(target, data, data.eval_histories, cfg.k, cfg.eval_batch, device)

    def validate(m):  # what strict verification needs, at every step
        cov = coverage(
            target_valid, beams_per_step(m, data, data.eval_histories, cfg.draft_beams, cfg.eval_batch, device)
        )
        return {"coverage": cov}, float(np.mean(cov))

    report = draft_report(cfg, template, data, subset, device, draft, target)
    loss, out, name = DraftLoss(cfg, data, teacher, device), Path(cfg.out), f"draft {cfg.objective}"
    best_draft = fit(draft, tokenizer, loss, validate, data, subset, cfg, rng, device, out, report, name)
    histories, _ = load_eval_users(cfg.data, "test", cfg.test_users)
    report["test_coverage"] = coverage(
        beams_per_step(target, data, histories, cfg.k, cfg.eval_batch, device),
        beams_per_step(best_draft, data, histories, cfg.draft_beams, cfg.eval_batch, device),
    )
    report["test_users"] = len(histories)
    write_final_report(out, report, cfg.data)
    print(f"draft {cfg.objective} test coverage (users {len(histories)}): {report['test_coverage']}", file=sys.stderr)
    return report


def load_models(cfg: DraftConfig, device: torch.device):
    """-> (the target, its tokenizer, the draft: `init`'s model or a fresh one of cfg's size) on the device."""
    target = load_model(cfg.target, device=str(device), dtype="float32")
    tokenizer = load_tokenizer(cfg.target)
    if cfg.init:
        return target, tokenizer, load_model(cfg.init, device=str(device), dtype="float32")
    draft = build_model(target.config.vocab_size, cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, seed=cfg.seed)
    return target, tokenizer, draft.to(device)


def draft_report(cfg: DraftConfig, template: PromptTemplate, data: Data, subset, device, draft, target) -> dict:
    """training.json as training starts (`fit` adds the epochs, `train_draft` the test coverage)."""
    return {
        "kind": "draft",
        "objective": cfg.objective,
        **report_head(cfg, template, data, subset),
        "device": str(device),
        "parameters": parameters(draft),
        "target_parameters": parameters(target),
        "epochs": [],
    }


@dataclass
class DraftLoss:
    """`fit`'s step_loss for a draft: the recommendation loss on the ground-truth item, mixed by cfg.alpha with the
    objective's alignment term (`decoding/alignment.py`)."""

    cfg: DraftConfig
    data: Data
    teacher: Teacher | None  # the target's top-K sequences and its logits along them (None: sft)
    device: torch.device

    def __call__(self, m, idx: np.ndarray) -> torch.Tensor:
        ids, mask, labels = sample_batch(self.data, idx, self.device)  # labels [B, L]
        if self.cfg.objective in ("sft", "wordkd", "tvdkd"):
            return self.along_ground_truth(m, idx, ids, mask, labels)
        return self.along_top_k(m, idx, ids, mask, labels)

    def along_ground_truth(self, m, idx, ids, mask, labels) -> torch.Tensor:
        """sft, and wordkd / tvdkd: token-level KL / TVD to the target along the ground-truth item."""
        logits = chain_forward(m, ids, mask, labels[:, None])  # [B, 1, L, V]
        rec = A.recommendation_loss(logits[:, 0], labels)
        if self.cfg.objective == "sft":
            return rec
        gt = self.teacher.gt_logits[self.teacher.rows(idx)].to(self.device).float()  # [B, L, V]
        kd = A.word_kd if self.cfg.objective == "wordkd" else A.tvd_kd
        return A.mix(rec, kd(logits[:, 0], gt), self.cfg.alpha)

    def along_top_k(self, m, idx, ids, mask, labels) -> torch.Tensor:
        """seqkd, atspeed-s, atspeed-r: along the target's top-K sequences."""
        cfg, teacher, device = self.cfg, self.teacher, self.device
        rows = teacher.rows(idx)
        top = teacher.tokens[rows].to(device)  # [B, K, L], -1 rows: fewer than K items
        weight = (top >= 0).all(-1, keepdim=True).expand_as(top).float()  # [B, K, L]
        logits = chain_forward(m, ids, mask, torch.cat([labels[:, None], top.clamp(min=0)], 1))  # [B, 1+K, L, V]
        rec = A.recommendation_loss(logits[:, 0], labels)
        if cfg.objective == "seqkd":
            return A.mix(rec, A.recommendation_loss(logits[:, 1:], top.clamp(min=0), weight), cfg.alpha)
        width = teacher.top_logits.shape[-1]
        draft_span = A.span_logits(logits[:, 1:], teacher.span_lo, width)  # [B, K, L, W]
        target_span = teacher.top_logits[rows].to(device).float()
        valid = A.span_valid(self.data.catalog, top, teacher.span_lo.to(device), width)
        if cfg.objective == "atspeed-s":
            align = A.atspeed_s(draft_span, target_span, valid, cfg.k, weight, cfg.beta)
        else:
            align = A.atspeed_r(draft_span, target_span, valid, cfg.k, weight)
        return A.mix(rec, align, cfg.alpha)
