"""What every beam search shares, whichever engine runs it: the result (`Recommendations`), the scored children of
query nodes (`Children`), the model's chunked head (`head_of`), and the selection of the next beams: every (beam,
child) extension (`candidates`), the stable top-k (`topk_stable`, ties to the lower (beam, token) pair), the chosen
candidates' beams, tokens and nodes (`pick`), and sampling beam search's Gumbel draw (`sample_beams`).

The eager engine (decoding/beam.py) and the compiled engine (decoding/compiled.py) both build on these; `beam_search`
(decoding/beam.py) dispatches to either.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from decoding.draws import Generator, gumbel
from decoding.head import Head
from decoding.stats import PHASES

if TYPE_CHECKING:
    from decoding.catalog import Catalog, Exclusions

NEG_INF = float("-inf")
SUMMED = (*PHASES, "target_forwards", "draft_forwards", "target_tokens", "draft_tokens")  # Recommendations.concat
_HEADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class Recommendations:
    item_ids: torch.Tensor  # [B, k] int64, -1 where fewer than k items exist
    token_ids: torch.Tensor  # [B, k, L] int64, -1 on padding
    scores: torch.Tensor  # [B, k] float32, sorted descending, -inf on padding
    stats: dict = field(default_factory=dict)  # the base keys of decoding/stats.py, plus the mode's extras

    @classmethod
    def of(cls, catalog: Catalog, node, tokens, scores, stats: dict, exclude: Exclusions | None = None):
        """A decoder's semantic IDs per user, best first: leaves node [B, K] (-1 = none), their tokens [B, K, L] and
        scores [B, K] -> the users' lists (`Catalog.listing`: the items each semantic ID names for its user, under
        `exclude`), each item with its semantic ID's tokens and score. stats stay per semantic ID."""
        item, source = catalog.listing(node, exclude)  # [B, K]
        live, at = source >= 0, source.clamp(min=0)
        tokens = tokens.gather(1, at[:, :, None].expand(-1, -1, tokens.shape[2]))
        return cls(
            item, torch.where(live[:, :, None], tokens, -1), torch.where(live, scores.gather(1, at), NEG_INF), stats
        )

    @classmethod
    def concat(cls, parts: list[Recommendations]) -> Recommendations:
        """Consecutive slices of one batch's users, decoded one after the other -> one result, as if decoded at once:
        rows concatenated; per-user stats ([B, ...] tensors) concatenated, other tensors (histograms) summed; phases,
        forwards and tokens summed; the other numbers (KV peaks, cache sizes) the largest, since the slices held
        their caches one at a time."""
        if len(parts) == 1:
            return parts[0]
        sizes = [p.item_ids.shape[0] for p in parts]
        stats = {}
        for key, first in parts[0].stats.items():
            values = [p.stats[key] for p in parts]
            if isinstance(first, torch.Tensor):
                per_user = all(v.dim() >= 1 and v.shape[0] == n for v, n in zip(values, sizes))
                stats[key] = torch.cat(values) if per_user else torch.stack(values).sum(0)
            elif key in SUMMED:
                stats[key] = sum(values)
            else:
                stats[key] = max(values)
        return cls(
            torch.cat([p.item_ids for p in parts]),
            torch.cat([p.token_ids for p in parts]),
            torch.cat([p.scores for p in parts]),
            stats,
        )


@dataclass
class Children:
    """The catalog children of query nodes with the model's next-token log-probs (log_softmax over the full
    vocabulary, float32): token, node (-1 = none), logp (-inf = none) [B, Q, D]; broken [B, Q]: non-finite scores."""

    token: torch.Tensor
    node: torch.Tensor
    logp: torch.Tensor
    broken: torch.Tensor

    def take(self, idx: torch.Tensor) -> Children:
        """The query nodes idx [B, K] of every row -> Children [B, K, D]."""
        rows = lambda x: x.gather(1, idx[:, :, None].expand(-1, -1, x.shape[2]))  # noqa: E731
        return Children(rows(self.token), rows(self.node), rows(self.logp), self.broken.gather(1, idx))

    def where(self, use: torch.Tensor, other: Children) -> Children:
        """These children for rows use [B] (or query nodes use [B, Q]), `other`'s elsewhere."""
        u = use if use.dim() == 2 else use[:, None]
        return Children(
            torch.where(u[..., None], self.token, other.token),
            torch.where(u[..., None], self.node, other.node),
            torch.where(u[..., None], self.logp, other.logp),
            torch.where(u, self.broken, other.broken),
        )

    def select(self, users: torch.Tensor) -> Children:
        return Children(self.token[users], self.node[users], self.logp[users], self.broken[users])


def head_of(model) -> Head:
    """The model's chunked head (checked once per model against its own logits)."""
    if model not in _HEADS:
        _HEADS[model] = Head.of(model)
    return _HEADS[model]


def topk_stable(scores: torch.Tensor, k: int):
    """scores [B, C] -> (values [B, k], indices [B, k]): descending, ties to the lower index; -inf padded."""
    b, c = scores.shape
    if c < k:
        scores = torch.cat([scores, scores.new_full((b, k - c), NEG_INF)], 1)
    values, indices = torch.sort(scores, dim=1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def candidates(kids: Children, score: torch.Tensor):
    """Every (beam, valid child) extension of W beams, beam-major, children by ascending token.
    kids [B, W, D] (the beams' children), score [B, W] (-inf = dead beam) -> (sequence scores [B, W*D] (-inf = none),
    tokens, nodes [B, W*D], D)."""
    b, w, d = kids.logp.shape
    cand = score[:, :, None] + kids.logp  # [B, W, D], -inf where no child or dead beam
    return cand.view(b, -1), kids.token.reshape(b, -1), kids.node.reshape(b, -1), d


def pick(cand: torch.Tensor, tok: torch.Tensor, child: torch.Tensor, d: int, flat: torch.Tensor):
    """Chosen candidates flat [B, k] (may point past the end: none) -> score, parent beam, token, node [B, k]."""
    n = cand.shape[1]
    top = torch.where(flat < n, cand.gather(1, flat.clamp(max=n - 1)), NEG_INF)
    alive = top > NEG_INF
    flat = torch.where(alive, flat, 0)
    return (
        top,
        torch.where(alive, flat // d, -1),
        torch.where(alive, tok.gather(1, flat), 0),
        torch.where(alive, child.gather(1, flat), -1),
    )


def expand_beams(kids: Children, score: torch.Tensor, k: int):
    """Top-k (beam, token) extensions -> score, parent beam, token, child node [B, k] (-1 / -inf = none).
    Ties go to the lower (beam, token) pair."""
    cand, tok, child, d = candidates(kids, score)
    return pick(cand, tok, child, d, topk_stable(cand, k)[1])


def gumbel_like(x: torch.Tensor, generator: Generator) -> torch.Tensor:
    """Gumbel noise shaped like x [B, ...] float64: torch's generator, or per-user draws (decoding/draws.py)."""
    return gumbel(x.shape, generator, x.device)


def sample_beams(kids: Children, score: torch.Tensor, k: int, temperature: float, generator: Generator):
    """Sampling-based beam step: k (beam, token) pairs drawn WITHOUT replacement with probability proportional to
    exp((score + log p(token)) / temperature) over the valid children (Gumbel top-k), in draw order.
    -> score, parent beam, token, node [B, k], the candidates' log-weights [B, W*D], the drawn flat indices [B, k]."""
    cand, tok, child, d = candidates(kids, score)
    weight = cand.double() / temperature
    flat = topk_stable((weight + gumbel_like(weight, generator)).float(), k)[1]  # draw order
    return (*pick(cand, tok, child, d, flat), weight, flat)
