"""Offline recommendation metrics, draft/target alignment measures, and the distances of sampled items to an exact
distribution over the catalog (DISC's bias) (pure tensors / numpy)."""

from __future__ import annotations

import numpy as np
import torch

from decoding.catalog import Catalog


def recall_ndcg(recommended: np.ndarray, targets, ks=(5, 10, 20), chunk: int = 65536) -> dict:
    """recommended [U, K] item ids (-1 = none, best first); targets: U lists of relevant item ids.
    Recall@k = |top-k ∩ targets| / |targets|, NDCG@k with binary relevance; users without targets are skipped
    (the paper's convention). Returns {"recall@k": ..., "ndcg@k": ..., "users": n}."""
    lengths = np.array([0 if t is None else len(t) for t in targets], dtype=np.int64)  # [U]
    flat = np.concatenate(
        [np.asarray(t, dtype=np.int64) for t in targets if t is not None and len(t)] or [np.zeros(0, np.int64)]
    )
    return recall_ndcg_flat(recommended, flat, lengths, ks, chunk)


def recall_ndcg_flat(
    recommended: np.ndarray, flat: np.ndarray, lengths: np.ndarray, ks=(5, 10, 20), chunk: int = 65536
) -> dict:
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
    hit = np.concatenate(
        [(rec[a : a + chunk, :, None] == tgt[a : a + chunk, None, :]).any(2) for a in range(0, len(keep), chunk)]
    ) & (rec >= 0)  # [U', K]
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


def distances(p_s: torch.Tensor, q: torch.Tensor, catalog: Catalog) -> dict:
    """Two distributions over the catalog rows [N] -> total variation distance over the items and over the first
    code's (level a) marginal, and KL(P_S || q)."""
    level_a = lambda p: p.new_zeros(catalog.vocab_size).index_add_(0, catalog.tokens[:, 0], p)  # noqa: E731 [V]
    return {
        "tv_items": 0.5 * float((p_s - q).abs().sum()),
        "tv_level_a": 0.5 * float((level_a(p_s) - level_a(q)).abs().sum()),
        "kl": float((torch.special.xlogy(p_s, p_s) - p_s * q.log()).sum()),
    }


def draw_stats(p_s: torch.Tensor, x: torch.Tensor, drawn: torch.Tensor, catalog: Catalog) -> dict:
    """P_S [N], valid masses x [N], drawn [D] catalog rows -> TV of the empirical distribution to P_S (items, level a),
    KL(P_S || empirical smoothed by +0.5 per item), and the mean x of the drawn items with its standard error."""
    if (drawn < 0).any():
        raise RuntimeError(f"{int((drawn < 0).sum())} draws are not catalog items")
    counts = torch.bincount(drawn, minlength=p_s.numel()).to(p_s.dtype)  # [N]
    smoothed = (counts + 0.5) / (counts.sum() + 0.5 * counts.numel())  # [N]
    return {
        **distances(p_s, counts / counts.sum(), catalog),
        "kl": distances(p_s, smoothed, catalog)["kl"],
        "mean_x": float(x[drawn].mean()),
        "mean_x_se": float(x[drawn].std() / drawn.numel() ** 0.5),
    }


def mean_over_users(cells: list[dict]) -> dict:
    """Per-user dicts of numbers -> their mean; standard errors (`*_se`) combine as those of a mean."""
    return {
        key: float(np.sqrt(np.sum(np.square([c[key] for c in cells]))) / len(cells))
        if key.endswith("_se")
        else float(np.mean([c[key] for c in cells]))
        for key in cells[0]
    }


def same_within_ties(
    items_a: torch.Tensor, scores_a: torch.Tensor, items_b: torch.Tensor, tie: float | torch.Tensor
) -> torch.Tensor:
    """Two engines' lists [B, K] -> bool [B]: the same items in the same order, up to swaps of items whose scores (by
    scores_a, descending) are within `tie` (one bound, or one per user [B]) of each other (near-ties that rounding
    may order either way)."""
    out = []
    ties = torch.as_tensor(tie, dtype=torch.float64).expand(items_a.shape[0]).tolist()
    for a, b, s, tie in zip(items_a.tolist(), items_b.tolist(), scores_a.tolist(), ties):
        same, i = True, 0
        while i < len(a) and same:
            j = i + 1
            while j < len(a) and abs(s[j] - s[i]) <= tie:
                j += 1
            same, i = sorted(a[i:j]) == sorted(b[i:j]), j
        out.append(same)
    return torch.tensor(out, dtype=torch.bool)


def topk_agreement(
    ref_items: torch.Tensor, ref_scores: torch.Tensor, items: torch.Tensor, scores: torch.Tensor
) -> dict:
    """A reference top-K [U, K] (item ids, -1 = none; scores) against another engine's [U, K] -> per user [U]:
    `identical` (the same items in the same order), `overlap` (the share of the reference's items the other list
    holds, in any order) and `score_diff` (the largest |score difference| of an item both lists hold; 0 if none)."""
    ref_items, items = ref_items.cpu(), items.cpu()
    both = (ref_items[:, :, None] == items[:, None, :]) & (ref_items[:, :, None] >= 0)  # [U, K, K]
    real = (ref_items >= 0).sum(1).clamp(min=1)  # [U]
    diff = (ref_scores.cpu().float()[:, :, None] - scores.cpu().float()[:, None, :]).abs()  # [U, K, K]
    return {
        "identical": (ref_items == items).all(1),
        "overlap": both.any(2).sum(1) / real,
        "score_diff": torch.where(both, diff, 0.0).amax((1, 2)),
    }
