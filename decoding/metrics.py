"""Offline recommendation metrics and draft/target alignment measures (pure tensors / numpy)."""
from __future__ import annotations

import numpy as np
import torch


def recall_ndcg(recommended: np.ndarray, targets, ks=(5, 10, 20), chunk: int = 65536) -> dict:
    """recommended [U, K] item ids (-1 = none, best first); targets: U lists of relevant item ids.
    Recall@k = |top-k ∩ targets| / |targets|, NDCG@k with binary relevance; users without targets are skipped
    (the paper's convention). Returns {"recall@k": ..., "ndcg@k": ..., "users": n}."""
    lengths = np.array([0 if t is None else len(t) for t in targets], dtype=np.int64)  # [U]
    flat = np.concatenate([np.asarray(t, dtype=np.int64) for t in targets if t is not None and len(t)] or
                          [np.zeros(0, np.int64)])
    return recall_ndcg_flat(recommended, flat, lengths, ks, chunk)


def recall_ndcg_flat(recommended: np.ndarray, flat: np.ndarray, lengths: np.ndarray, ks=(5, 10, 20),
                     chunk: int = 65536) -> dict:
    """`recall_ndcg` with the targets as one flat array [T] and each user's count [U] (an Arrow list column's
    values and lengths: no Python object per user)."""
    recommended = np.asarray(recommended, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = np.nonzero(lengths)[0]
    out = {"users": len(keep)}
    if not len(keep):
        return {**out, **{f"{m}@{k}": 0.0 for k in ks for m in ("recall", "ndcg")}}
    rec, n = recommended[keep], lengths[keep]  # [U', K], [U']
    flat = np.asarray(flat, dtype=np.int64)
    tgt = np.full((len(keep), int(n.max())), -2, dtype=np.int64)  # [U', W]; -2 never matches a recommendation
    tgt[np.repeat(np.arange(len(keep)), n), np.arange(len(flat)) - np.repeat(np.cumsum(n) - n, n)] = flat
    tgt.sort(1)
    tgt[:, 1:][tgt[:, 1:] == tgt[:, :-1]] = -2  # a target listed twice counts once
    n_tgt = (tgt != -2).sum(1)  # [U']
    hit = np.concatenate([(rec[a:a + chunk, :, None] == tgt[a:a + chunk, None, :]).any(2)
                          for a in range(0, len(keep), chunk)]) & (rec >= 0)  # [U', K]
    discount = 1.0 / np.log2(np.arange(2, max(max(ks), rec.shape[1], tgt.shape[1]) + 2))
    ideal_at = np.concatenate([[0.0], np.cumsum(discount)])  # ideal DCG of the first i relevant items
    for k in ks:
        out[f"recall@{k}"] = float((hit[:, :k].sum(1) / n_tgt).mean())
        dcg = (hit[:, :k] * discount[: min(k, rec.shape[1])]).sum(1)
        out[f"ndcg@{k}"] = float((dcg / ideal_at[np.minimum(n_tgt, k)]).mean())
    return out


def topk_coverage(target_prefixes: torch.Tensor, draft_prefixes: torch.Tensor) -> torch.Tensor:
    """target [B, K, t], draft [B, N, t] beams (rows of -1 are padding) -> bool [B]: every target beam is among
    the draft's beams, the condition under which strict verification accepts the step."""
    same = (target_prefixes[:, :, None, :] == draft_prefixes[:, None, :, :]).all(-1)  # [B, K, N]
    found = same.any(-1) | (target_prefixes < 0).any(-1)  # padding target beams need no match
    return found.all(-1)
