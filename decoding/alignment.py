"""Draft-model training objectives: recommendation loss, KD baselines, and the AtSpeed alignment losses.

Pure tensors in, scalar out. `draft` are the draft model's logits, `target` the target model's logits at the
same positions ([..., V], any leading shape); the target side never receives gradients. `valid` [..., V] marks
the tokens that continue a catalog item (constrained alignment: the other tokens are excluded before
normalising, the paper's ablation shows this matters). Positions whose `weight` is 0 (padding) do not count.

With p = target, q = draft, p_c / q_c their softmax over the valid tokens only:
- word KD         KL(p || q) over the full vocabulary, per token;
- TVD KD          1/2 sum_v |p_v - q_v| over the full vocabulary, per token;
- seq KD          the recommendation loss on the target's top-K sequences (call `recommendation_loss`);
- AtSpeed-S       S = the K valid tokens with the highest q_c (draft order, y_K its K-th), q_S / p_S = q_c / p_c
                  renormalised over S, per position
                    sum_{y in S} q_S(y) (log q_S(y) - log p_S(y))        reverse KL over the constrained top-K
                  + beta * p_S(y_K) * (- sum_{y in S} q_S(y) log q_S(y)) density regularisation (beta = 1)
                  (Eq. 3-5, as in the authors' released implementation; without the renormalisation the partial
                  sum is minimised at q = p / e on S and drives the draft's mass off its top-K);
- AtSpeed-R       T = the K valid tokens with the highest p_c, per position 1/2 sum_{y in T} |q_c(y) - p_c(y)|
                  (TVD over the constrained top-K, Eq. 7-9), on the target's top-K sequences.
The AtSpeed and KD objectives are mixed with the recommendation loss as (1 - alpha) * L_rec + alpha * L_align.

Level spans: every token that can appear at level t of a semantic ID lies in one span [lo_t, lo_t + W) of the
vocabulary, so the constrained objectives can be computed on logits cut to the spans ([..., L, W] instead of
[..., L, V]; `span_logits`, `span_valid`), which is how the teacher's logits are stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decoding.catalog import Catalog

OBJECTIVES = ("sft", "wordkd", "seqkd", "tvdkd", "atspeed-s", "atspeed-r")


def recommendation_loss(logits: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of labels [...] under logits [..., V] (full vocabulary), mean over weighted positions."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    return _mean(ce, weight, labels.shape)


def word_kd(draft: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Token-level forward KL(p || q) over the full vocabulary."""
    log_p = target.detach().float().log_softmax(-1)
    log_q = draft.float().log_softmax(-1)
    return _mean((log_p.exp() * (log_p - log_q)).sum(-1), weight, draft.shape[:-1])


def tvd_kd(draft: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Token-level total variation distance over the full vocabulary."""
    p = target.detach().float().softmax(-1)
    q = draft.float().softmax(-1)
    return _mean(0.5 * (p - q).abs().sum(-1), weight, draft.shape[:-1])


def constrained_log_softmax(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log_softmax over the valid tokens only; -inf elsewhere. [..., V] (a row without valid tokens: unconstrained)"""
    valid = valid | ~valid.any(-1, keepdim=True)
    return logits.float().masked_fill(~valid, float("-inf")).log_softmax(-1)


def atspeed_s(
    draft: torch.Tensor,
    target: torch.Tensor,
    valid: torch.Tensor,
    k: int,
    weight: torch.Tensor | None = None,
    beta: float = 1.0,
) -> torch.Tensor:
    """Reverse KL over the draft's constrained top-k tokens plus beta times the density regularisation term."""
    log_q = constrained_log_softmax(draft, valid)  # [..., V]
    log_p = constrained_log_softmax(target.detach(), valid)
    log_q_s, top, in_s = _top_valid(log_q, k)  # [..., k]; in_s False where fewer than k tokens are valid
    off = torch.where(in_s, 0.0, float("-inf"))
    log_q_s = torch.where(in_s, (log_q_s + off).log_softmax(-1), 0.0)  # renormalised over S
    log_p_s = torch.where(in_s, (log_p.gather(-1, top) + off).log_softmax(-1), 0.0)
    q_s = torch.where(in_s, log_q_s.exp(), 0.0)
    rkl = (q_s * (log_q_s - log_p_s)).sum(-1)
    entropy_s = -(q_s * log_q_s).sum(-1)
    last = in_s.sum(-1, keepdim=True) - 1  # position of y_K, the last token of S
    p_k = log_p_s.gather(-1, last).squeeze(-1).exp()
    return _mean(rkl + beta * p_k * entropy_s, weight, draft.shape[:-1])


def atspeed_r(
    draft: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, k: int, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Total variation distance over the target's constrained top-k tokens."""
    log_q = constrained_log_softmax(draft, valid)
    log_p = constrained_log_softmax(target.detach(), valid)
    log_p_t, top, in_t = _top_valid(log_p, k)
    q_t = torch.where(in_t, log_q.gather(-1, top), float("-inf")).exp()
    p_t = torch.where(in_t, log_p_t.exp(), 0.0)
    return _mean(0.5 * (q_t - p_t).abs().sum(-1), weight, draft.shape[:-1])


def mix(rec: torch.Tensor, align: torch.Tensor, alpha: float) -> torch.Tensor:
    return (1 - alpha) * rec + alpha * align


def level_spans(catalog: Catalog) -> tuple[torch.Tensor, int]:
    """Per level t, the span [lo_t, lo_t + W) holding every token that can appear at that level."""
    lo = catalog.tokens.min(0).values  # [L]
    width = int((catalog.tokens.max(0).values - lo).max()) + 1
    return lo.clamp(max=catalog.vocab_size - width).cpu(), width


def span_logits(logits: torch.Tensor, span_lo: torch.Tensor, width: int) -> torch.Tensor:
    """[..., L, V] -> [..., L, W]: level t keeps columns span_lo[t] : span_lo[t] + W."""
    return torch.stack([logits[..., t, int(lo) : int(lo) + width] for t, lo in enumerate(span_lo)], -2)


def span_valid(catalog: Catalog, tokens: torch.Tensor, span_lo: torch.Tensor, width: int) -> torch.Tensor:
    """Sequences [..., L] -> bool [..., L, W]: at each level, the tokens that continue a catalog item after the
    sequence's prefix (the constrained objectives' support)."""
    lead, code_len = tokens.shape[:-1], tokens.shape[-1]
    flat = tokens.reshape(-1, code_len).clamp(min=0)
    masks = [catalog.allowed_next(flat[:, :t])[:, int(span_lo[t]) : int(span_lo[t]) + width] for t in range(code_len)]
    return torch.stack(masks, 1).view(*lead, code_len, width)


def _top_valid(log_probs: torch.Tensor, k: int):
    """Top-k of constrained log_probs [..., V] -> (values with 0 off the valid set, indices, in-set mask) [..., k]."""
    values, top = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    in_set = torch.isfinite(values)
    return torch.where(in_set, values, 0.0), top, in_set


def _mean(values: torch.Tensor, weight: torch.Tensor | None, shape) -> torch.Tensor:
    values = values.reshape(shape)
    if weight is None:
        return values.mean()
    weight = weight.to(values.dtype).reshape(shape)
    return (values * weight).sum() / weight.sum().clamp(min=1e-12)
