"""Exact constrained beam search over a catalog with shared-prefix tree attention.

prefill once per user -> L steps: score the K beams' children (catalog CSR), keep the top K
(beam, token) pairs, append them to the token tree, one forward over K tree tokens per user.

Returns what `model.generate(num_beams=k, num_return_sequences=k, max_new_tokens=L, length_penalty=0.0,
prefix_allowed_tokens_fn=<trie>)` returns: scores are sums of log_softmax over the full vocabulary (float32).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from decoding.catalog import Catalog
from decoding.models import check_window
from decoding.stats import Meter, beam_batch_kv
from decoding.tree import TokenTree, prompt_position_ids


@dataclass
class Recommendations:
    item_ids: torch.Tensor  # [B, k] int64, -1 where fewer than k items exist
    token_ids: torch.Tensor  # [B, k, L] int64, -1 on padding
    scores: torch.Tensor  # [B, k] float32, sorted descending, -inf on padding
    stats: dict = field(default_factory=dict)  # the base keys of decoding/stats.py, plus the mode's extras


def prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, meter: Meter | None = None,
            role: str = "target"):
    """Left-padded prompts [B, S] -> (cache holding each prompt once, next-token logprobs [B, V] float32)."""
    cache = DynamicCache()  # full-attention layers: a sliding window is applied through the mask, never by eviction
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=prompt_position_ids(attention_mask),
                past_key_values=cache, use_cache=True, logits_to_keep=1)
    if meter is not None:
        meter.forward(role, input_ids)
    return cache, out.logits[:, -1].float().log_softmax(-1)


def tree_forward(model, tree: TokenTree, cache: DynamicCache, tokens: torch.Tensor, parent: torch.Tensor,
                 block_depth: int = 1, meter: Meter | None = None, role: str = "target") -> torch.Tensor:
    """Adds tokens [B, Q] as tree nodes under parent [B, Q]; returns next-token logprobs [B, Q, V] float32."""
    mask, position_ids = tree.add(parent, model.dtype, block_depth)
    out = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                use_cache=True)
    if meter is not None:
        meter.forward(role, tokens)
    return out.logits.float().log_softmax(-1)


def check_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, catalog: Catalog, *models) -> None:
    """What every decoder needs of its inputs: [B, S] left-padded prompts on the catalog's device, and models whose
    attention window (if any) covers the longest prompt plus an item."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
                         "must both be [B, S]")
    if catalog.device != input_ids.device:
        raise ValueError(f"catalog is on {catalog.device} but input_ids on {input_ids.device}: use catalog.to(...)")
    if (attention_mask[:, -1] == 0).any():
        raise ValueError("prompts must be left-padded: attention_mask[:, -1] is 0 in rows "
                         f"{(attention_mask[:, -1] == 0).nonzero().flatten().tolist()[:10]}")
    longest = int(attention_mask.sum(1).max()) if input_ids.numel() else 0
    for model in models:
        check_window(model.config, longest + catalog.code_len, type(model).__name__)


def non_finite(logp: torch.Tensor) -> torch.Tensor:
    """Log-probs [..., V] -> bool [...]: the row holds a NaN or an infinity where a real distribution holds none
    (NaN or infinite logits, e.g. a float16 overflow, make log_softmax NaN)."""
    return ~torch.isfinite(logp.amax(-1))


def topk_stable(scores: torch.Tensor, k: int):
    """scores [B, C] -> (values [B, k], indices [B, k]): descending, ties to the lower index; -inf padded."""
    b, c = scores.shape
    if c < k:
        scores = torch.cat([scores, scores.new_full((b, k - c), float("-inf"))], 1)
    values, indices = torch.sort(scores, dim=1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def candidates(catalog: Catalog, logp: torch.Tensor, score: torch.Tensor, node: torch.Tensor, width: int | None):
    """Every (beam, valid child) extension of W beams, beam-major, children by ascending token.
    logp [B, W, V], score [B, W] (-inf = dead beam), node [B, W] (catalog nodes, any levels, -1 = dead); `width` >=
    their widest node (default: any level's) -> (sequence scores [B, W*D] (-inf = none), tokens, nodes [B, W*D], D)."""
    b, w, _ = logp.shape
    child_tok, child_node, valid = (x.view(b, w, -1) for x in catalog.children(node.flatten(), width))  # [B, W, D]
    cand = (score[:, :, None] + logp.gather(2, child_tok)).masked_fill(~valid, float("-inf"))  # [B, W, D]
    return cand.view(b, -1), child_tok.view(b, -1), child_node.view(b, -1), child_tok.shape[2]


def pick(cand: torch.Tensor, tok: torch.Tensor, child: torch.Tensor, d: int, flat: torch.Tensor):
    """Chosen candidates flat [B, k] (may point past the end: none) -> score, parent beam, token, node [B, k]."""
    n = cand.shape[1]
    top = torch.where(flat < n, cand.gather(1, flat.clamp(max=n - 1)), float("-inf"))
    alive = top > float("-inf")
    flat = torch.where(alive, flat, 0)
    return (top, torch.where(alive, flat // d, -1), torch.where(alive, tok.gather(1, flat), 0),
            torch.where(alive, child.gather(1, flat), -1))


def expand_beams(catalog: Catalog, logp: torch.Tensor, score: torch.Tensor, node: torch.Tensor, k: int,
                 width: int | None = None):
    """Top-k (beam, token) extensions -> score, parent beam, token, child node [B, k] (-1 / -inf = none).
    Ties go to the lower (beam, token) pair."""
    cand, tok, child, d = candidates(catalog, logp, score, node, width)
    return pick(cand, tok, child, d, topk_stable(cand, k)[1])


def gumbel_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float64).clamp(1e-300, 1.0)
    return -torch.log(-torch.log(u))


def sample_beams(catalog: Catalog, logp: torch.Tensor, score: torch.Tensor, node: torch.Tensor, k: int,
                 width: int | None, temperature: float, generator: torch.Generator | None):
    """Sampling-based beam step: k (beam, token) pairs drawn WITHOUT replacement with probability proportional to
    exp((score + log p(token)) / temperature) over the valid children (Gumbel top-k), in draw order.
    -> score, parent beam, token, node [B, k], the candidates' log-weights [B, W*D] and the drawn flat indices [B, k]."""
    cand, tok, child, d = candidates(catalog, logp, score, node, width)
    weight = cand.double() / temperature
    flat = topk_stable((weight + gumbel_like(weight, generator)).float(), k)[1]  # draw order
    return (*pick(cand, tok, child, d, flat), weight, flat)


@torch.no_grad()
def beam_search(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, catalog: Catalog, k: int,
                steps: int | None = None, do_sample: bool = False, temperature: float = 1.0,
                generator: torch.Generator | None = None) -> Recommendations:
    """input_ids, attention_mask [B, S] left-padded -> the top-k catalog items per user.
    `steps` < L stops early: token_ids are then the top-k prefixes [B, k, steps] and item_ids are -1.
    do_sample: sampling-based beam search, each step draws k (beam, token) pairs without replacement with
    probability proportional to exp(sequence log-prob / temperature) (the reference for relaxed speculation);
    the final k are returned by score, descending."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_prompts(input_ids, attention_mask, catalog, model)
    b, s = input_ids.shape
    depth = catalog.code_len if steps is None else steps
    if not 1 <= depth <= catalog.code_len:
        raise ValueError(f"steps must be in [1, {catalog.code_len}], got {steps}")
    meter = Meter(input_ids.device)
    with meter.phase("prefill"):
        cache, logp = prefill(model, input_ids, attention_mask, meter)  # logp [B, V]
    meter.kv(b * s)
    broken = non_finite(logp)  # [B] users whose log-probs were NaN or infinite somewhere

    tree = TokenTree.from_prompt(attention_mask)
    score = torch.zeros(b, 1, device=input_ids.device)  # [B, W], W = 1 beam (the prompt) at level 0
    node = torch.zeros(b, 1, dtype=torch.int64, device=input_ids.device)
    leaf = torch.full((b, 1), -1, dtype=torch.int64, device=input_ids.device)  # tree node of each beam's last token
    tokens = torch.zeros(b, 1, 0, dtype=torch.int64, device=input_ids.device)  # [B, W, t]
    logp = logp[:, None, :]  # [B, W, V]
    for level in range(depth):
        width = catalog.max_children[level]
        if do_sample:
            score, beam, token, node, _, _ = sample_beams(catalog, logp, score, node, k, width, temperature, generator)
        else:
            score, beam, token, node = expand_beams(catalog, logp, score, node, k, width)
        alive = beam >= 0
        tokens = torch.cat([tokens.gather(1, beam.clamp(min=0)[:, :, None].expand(-1, -1, level)), token[:, :, None]], 2)
        if level == depth - 1:
            break
        parent = torch.where(alive, leaf.gather(1, beam.clamp(min=0)), -1)  # [B, k] tree node of the parent
        parent = tree.keep_paths(parent, cache)  # pruned branches leave the cache
        logp = tree_forward(model, tree, cache, token, parent, meter=meter)  # [B, k, V]
        broken |= non_finite(logp).any(1)
        meter.kv(b * tree.kv_len)  # each prompt once plus the tree tokens
        leaf = tree.num_nodes - k + torch.arange(k, device=input_ids.device).expand(b, k)

    if do_sample:  # drawn in sampling order: rank them by score
        order = torch.sort(score, dim=1, descending=True, stable=True).indices
        score, node, tokens = score.gather(1, order), node.gather(1, order), tokens.gather(
            1, order[:, :, None].expand_as(tokens))
    alive = node >= 0
    stats = meter.result(beam_batch_kv(b, k, s, depth),
                         kv_len=cache.get_seq_length(),  # padded prompt + tree tokens
                         kv_batch=cache.layers[0].keys.shape[0],  # cache rows: one per user
                         tree_tokens=tree.num_nodes, non_finite=broken)
    return Recommendations(
        item_ids=catalog.item_of_node(node) if depth == catalog.code_len else torch.full_like(node, -1),
        token_ids=torch.where(alive[:, :, None], tokens, -1),
        scores=torch.where(alive, score, float("-inf")),
        stats=stats,
    )
