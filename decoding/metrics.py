"""Offline recommendation metrics and draft/target alignment measures (pure tensors / numpy)."""
from __future__ import annotations

import numpy as np
import torch


def recall_ndcg(recommended: np.ndarray, targets, ks=(5, 10, 20)) -> dict:
    """recommended [U, K] item ids (-1 = none, best first); targets: U lists of relevant item ids.
    Recall@k = |top-k ∩ targets| / |targets|, NDCG@k with binary relevance; users without targets are skipped
    (the paper's convention). Returns {"recall@k": ..., "ndcg@k": ..., "users": n}."""
    recommended = np.asarray(recommended)
    keep = [i for i, t in enumerate(targets) if t is not None and len(t)]
    out = {"users": len(keep)}
    if not keep:
        return {**out, **{f"{m}@{k}": 0.0 for k in ks for m in ("recall", "ndcg")}}
    rec = recommended[keep]  # [U', K]
    width = max(len(targets[i]) for i in keep)
    tgt = np.full((len(keep), width), -2, dtype=np.int64)  # -2 never matches a recommendation
    for row, i in enumerate(keep):
        tgt[row, : len(targets[i])] = np.unique(np.asarray(targets[i], dtype=np.int64))[: width]
    n_tgt = (tgt != -2).sum(1)  # [U']
    hit = (rec[:, :, None] == tgt[:, None, :]).any(2) & (rec >= 0)  # [U', K]
    discount = 1.0 / np.log2(np.arange(2, rec.shape[1] + 2))  # [K]
    for k in ks:
        out[f"recall@{k}"] = float((hit[:, :k].sum(1) / n_tgt).mean())
        ideal = np.array([discount[: min(n, k)].sum() for n in n_tgt])
        out[f"ndcg@{k}"] = float(((hit[:, :k] * discount[:k]).sum(1) / ideal).mean())
    return out


def topk_coverage(target_prefixes: torch.Tensor, draft_prefixes: torch.Tensor) -> torch.Tensor:
    """target [B, K, t], draft [B, N, t] beams (rows of -1 are padding) -> bool [B]: every target beam is among
    the draft's beams, the condition under which strict verification accepts the step."""
    same = (target_prefixes[:, :, None, :] == draft_prefixes[:, None, :, :]).all(-1)  # [B, K, N]
    found = same.any(-1) | (target_prefixes < 0).any(-1)  # padding target beams need no match
    return found.all(-1)
