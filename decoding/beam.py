"""Exact constrained beam search over a catalog with shared-prefix tree attention.

prefill once per user -> L steps: score the K beams' children (catalog CSR), keep the top K
(beam, token) pairs, append them to the token tree, one forward over K tree tokens per user.

Returns what `model.generate(num_beams=k, num_return_sequences=k, max_new_tokens=L, length_penalty=0.0,
prefix_allowed_tokens_fn=<trie>)` returns: scores are sums of log_softmax over the full vocabulary (float32).

`beam_search` is the entry point of both engines: it runs this eager engine, or dispatches `engine="compiled"` to
decoding/compiled.py; the pieces both share (the result, the scored children, the selection) live below both, in
decoding/search.py. The forwards every decoder shares live here too: `prefill` (each prompt once, continuing a
shared `Prefix` when the prompts have one), `forward` (tree nodes into the tree cache, decoding/cache.py) and
`children` (the log-probs of a node's catalog children from the chunked head, decoding/head.py: no [B, Q, V] tensor
is ever formed).
"""

from __future__ import annotations

import warnings
import weakref

import torch

from decoding.cache import TreeCache
from decoding.catalog import Catalog, Exclusions
from decoding.compiled import compiled_beam_search, runs_eager
from decoding.draws import stream
from decoding.models import check_window, with_cache
from decoding.search import (
    NEG_INF,
    Children,
    Recommendations,
    candidates,
    head_of,
    pick,
    sample_beams,
    topk_stable,
)
from decoding.stats import Meter, beam_batch_kv
from decoding.tree import TokenTree, prompt_position_ids


class Prefix:
    """Token ids [P] that start every prompt (a prompt template's fixed text): prefilled once per model and kept,
    so that each batch's prompts continue from it (the prompt-level analogue of the token tree). Exact: causal
    attention makes the prefix's keys and values independent of what follows."""

    def __init__(self, ids):
        self.ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        self._kv: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return self.ids.numel()

    @torch.no_grad()
    def kv(self, model) -> list:
        """The prefix's keys and values under `model`, per layer ([1, H_kv, P, D] each), computed on first use."""
        if model not in self._kv:
            cache = TreeCache(len(self))
            ids = self.ids.to(model.device)[None]
            with_cache(
                model.base_model,
                cache,
                input_ids=ids,
                position_ids=torch.arange(len(self), device=ids.device)[None],
                use_cache=True,
            )
            self._kv[model] = cache.prefix_kv()
        return self._kv[model]


def children(
    model, hidden: torch.Tensor, catalog: Catalog, node: torch.Tensor, width: int, exclude: Exclusions | None = None
) -> Children:
    """hidden [B, Q, H] at tree nodes whose catalog nodes are node [B, Q] (-1 = dead) -> their children scored;
    a child closed for its row's user by `exclude` (every item under it excluded) is no child."""
    b, q = node.shape
    tok, child, valid = (x.view(b, q, -1) for x in catalog.children(node.flatten(), width))  # [B, Q, D]
    if exclude is not None:
        valid = valid & exclude.open(child)
        child = torch.where(valid, child, -1)
    scores = head_of(model).score(hidden.reshape(b * q, -1), torch.where(valid, tok, -1).view(b * q, -1))
    logp = scores.logp.view(b, q, -1)
    broken = (~torch.isfinite(scores.lse) | torch.isnan(scores.logits).any(1)).view(b, q)
    return Children(tok, child, logp.masked_fill(~valid, NEG_INF), broken)


def prefill(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    meter: Meter | None = None,
    role: str = "target",
    prefix: Prefix | None = None,
    capacity: int = 0,
):
    """Left-padded prompts [B, S] (continuing `prefix` when given) -> (tree cache holding each prompt once, with
    room for `capacity` more columns; the last position's hidden states [B, H])."""
    b, s = input_ids.shape
    p = len(prefix) if prefix is not None else 0
    cache = TreeCache(p + s + capacity)
    if prefix is not None:
        cache.start(b, prefix.kv(model))
        attention_mask = torch.cat([attention_mask.new_ones(b, p), attention_mask], 1)
    hidden = with_cache(
        model.base_model,
        cache,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=prompt_position_ids(attention_mask)[:, p:],
        use_cache=True,
    ).last_hidden_state
    if meter is not None:
        meter.forward(role, input_ids)
    return cache, hidden[:, -1]


def prompt_tree(attention_mask: torch.Tensor, prefix: Prefix | None = None) -> TokenTree:
    """The token tree a decoder grows over its prefilled prompts [B, S] (left-padded, continuing `prefix`)."""
    return TokenTree.from_prompt(attention_mask, len(prefix) if prefix is not None else 0)


def rank_by_score(score: torch.Tensor, node: torch.Tensor, tokens: torch.Tensor):
    """Sequences in draw order (sampling) -> ranked by score, descending, ties in draw order: score, node [B, K],
    tokens [B, K, L]."""
    order = torch.sort(score, dim=1, descending=True, stable=True).indices  # [B, K]
    return score.gather(1, order), node.gather(1, order), tokens.gather(1, order[:, :, None].expand_as(tokens))


def forward(
    model,
    tree: TokenTree,
    cache: TreeCache,
    tokens: torch.Tensor,
    parent: torch.Tensor,
    block_depth: int = 1,
    meter: Meter | None = None,
    role: str = "target",
    rows: int | None = None,
) -> torch.Tensor:
    """Adds tokens [B, Q] as tree nodes under parent [B, Q] (see TokenTree.add) -> their hidden states [B, Q, H].
    rows: only the first rows run (users sorted so that the ones with work come first); the other users' new nodes
    are dead columns, never attended."""
    mask, position_ids = tree.add(parent, model.dtype, block_depth)
    r = tokens.shape[0] if rows is None else rows
    hidden = with_cache(
        model.base_model,
        cache,
        input_ids=tokens[:r],
        attention_mask=mask[:r],
        position_ids=position_ids[:r],
        use_cache=True,
    ).last_hidden_state
    if meter is not None:
        meter.forward(role, tokens[:r])
    return hidden


def check_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    catalog: Catalog,
    *models,
    prefix: Prefix | None = None,
    exclude: Exclusions | None = None,
) -> None:
    """What every decoder needs of its inputs: [B, S] left-padded prompts on the catalog's device, models whose
    attention window (if any) covers the longest prompt (with its prefix) plus an item, and exclusions (if any) for
    exactly these users, built for this catalog on its device."""
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} must both be [B, S]"
        )
    if catalog.device != input_ids.device:
        raise ValueError(f"catalog is on {catalog.device} but input_ids on {input_ids.device}: use catalog.to(...)")
    if (attention_mask[:, -1] == 0).any():
        raise ValueError(
            "prompts must be left-padded: attention_mask[:, -1] is 0 in rows "
            f"{(attention_mask[:, -1] == 0).nonzero().flatten().tolist()[:10]}"
        )
    if exclude is not None and (
        exclude.rows.shape[0] != input_ids.shape[0]
        or exclude.nodes != catalog.num_nodes
        or exclude.rows.device != catalog.device
    ):
        raise ValueError(
            f"exclude holds {exclude.rows.shape[0]} users of a {exclude.nodes}-node trie on "
            f"{exclude.rows.device}; the prompts have {input_ids.shape[0]} users and the catalog "
            f"{catalog.num_nodes} nodes on {catalog.device}"
        )
    longest = (int(attention_mask.sum(1).max()) if input_ids.numel() else 0) + (len(prefix) if prefix else 0)
    for model in models:
        check_window(model.config, longest + catalog.code_len, type(model).__name__)


def answer_scores(model, tree: TokenTree, cache: TreeCache, last, parent, score, answer, meter: Meter | None = None):
    """The k beams (score [B, k], -inf = dead) fed their last code tokens last [B, k] (under tree nodes parent [B, k],
    -1 = the prompt), then the forced answer tokens [T] one by one -> (score [B, k] plus each answer token's log-prob
    (log_softmax over the full vocabulary, float32), broken [B]: non-finite log-probs). T forwards of k tree tokens
    per user."""
    b, k = last.shape
    alive = score > NEG_INF
    broken = torch.zeros(b, dtype=torch.bool, device=last.device)
    fed = last
    for t in answer:
        hidden = forward(model, tree, cache, fed, parent, meter=meter)  # [B, k, H]
        asked = torch.where(alive, t, -1).reshape(b * k, 1)  # [B k, 1]
        scored = head_of(model).score(hidden.reshape(b * k, -1), asked)
        logp = scored.logp.view(b, k)
        broken |= (alive & ~torch.isfinite(logp)).any(1)
        score = torch.where(alive, score + logp, NEG_INF)
        parent = tree.num_nodes - k + torch.arange(k, device=last.device).expand(b, k)  # the nodes just added
        fed = t.expand(b, k)
    return score, broken


@torch.no_grad()
def beam_search(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    catalog: Catalog,
    k: int,
    steps: int | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    prefix: Prefix | None = None,
    exclude: Exclusions | None = None,
    engine: str = "eager",
    answer: torch.Tensor | None = None,
) -> Recommendations:
    """input_ids, attention_mask [B, S] left-padded (continuing `prefix` when given) -> the top-k catalog items per
    user (per user over the catalog minus its `exclude`d items, when given: a user with fewer than k left gets what is
    left, padded). The search is over semantic IDs; where one names several items, the top-k semantic IDs become the
    user's list as `Catalog.listing` says (duplicate_items by: one item each; expand: each item, cut at k).
    `steps` < L stops early: token_ids are then the top-k prefixes [B, k, steps] and item_ids are -1.
    do_sample: sampling-based beam search, each step draws k (beam, token) pairs without replacement with
    probability proportional to exp(sequence log-prob / temperature) (the reference for relaxed speculation);
    the final k are returned by score, descending. The tree keeps every node (at most k per level: no compaction
    pays for itself), written in place into a preallocated cache.
    stats: the base keys (decoding/stats.py), kv_len, kv_batch, tree_tokens, and tie_gap [B]: the smallest margin
    by which a kept beam beat the best dropped candidate at any step (inf when none was dropped; a user whose margin
    is below another engine's rounding error may legitimately get a different list from it).
    engine="compiled": the same search on fixed shapes per bucket, compiled (decoding/compiled.py); what it does not
    cover runs eager, saying why in stats["engine_note"].
    answer [T]: tokens the model writes after an item's codes (a template's answer suffix and EOS), forced and
    scored: the k beams of the last code step are extended by them, their log-probs added, and ranked again, as
    `model.generate` does when the constraint allows codes, then these tokens (MiniOneRec's evaluate.py: "\n" and EOS,
    length_penalty 0). tie_gap then also covers the final ranking's adjacent scores."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    check_prompts(input_ids, attention_mask, catalog, model, prefix=prefix, exclude=exclude)
    b, s = input_ids.shape
    dev = input_ids.device
    depth = catalog.code_len if steps is None else steps
    if not 1 <= depth <= catalog.code_len:
        raise ValueError(f"steps must be in [1, {catalog.code_len}], got {steps}")
    if engine not in ("eager", "compiled"):
        raise ValueError(f"engine must be eager or compiled, got {engine!r}")
    answer = None if answer is None or not len(answer) else torch.as_tensor(answer, dtype=torch.int64, device=dev)
    if answer is not None and (do_sample or depth != catalog.code_len):
        raise ValueError("answer tokens are scored after whole items of a beam search (no steps, no sampling)")
    note = {}
    if engine == "compiled" and answer is not None:
        note = {"engine_note": "answer tokens after the codes: the eager engine scores them"}
    elif engine == "compiled":  # fixed shapes per bucket (decoding/compiled.py), where it covers the call
        why = runs_eager(model, do_sample, exclude)
        if why is None:
            return compiled_beam_search(model, input_ids, attention_mask, catalog, k, steps, prefix=prefix)
        warnings.warn(f"engine='compiled' runs eager here: {why}", stacklevel=3)
        note = {"engine": "eager", "engine_note": why}
    meter = Meter(dev)
    with meter.phase("prefill"):
        extra = 0 if answer is None else len(answer)
        cache, hidden = prefill(
            model, input_ids, attention_mask, meter, prefix=prefix, capacity=k * (depth - 1 + extra)
        )
        root = torch.zeros(b, 1, dtype=torch.int64, device=dev)
        kids = children(model, hidden[:, None], catalog, root, catalog.max_children[0], exclude)  # [B, 1, D]
    meter.kv(b * cache.length)
    broken = kids.broken[:, 0]  # [B] users whose log-probs were NaN or infinite somewhere

    tree = prompt_tree(attention_mask, prefix)
    score = torch.zeros(b, 1, device=dev)  # [B, W], W = 1 beam (the prompt) at level 0
    leaf = torch.full((b, 1), -1, dtype=torch.int64, device=dev)  # tree node of each beam's last token
    tokens = torch.zeros(b, 1, 0, dtype=torch.int64, device=dev)  # [B, W, t]
    tie_gap = torch.full((b,), float("inf"), device=dev)  # [B] closest call between the k-th and (k+1)-th candidate
    for level in range(depth):
        if do_sample:
            score, beam, token, node, _, _ = sample_beams(kids, score, k, temperature, stream(generator, level))
        else:
            cand, tok, child, d = candidates(kids, score)
            values, flat = topk_stable(cand, k + 1)  # [B, k + 1]
            score, beam, token, node = pick(cand, tok, child, d, flat[:, :k])
            gap = values[:, k - 1] - values[:, k]
            tie_gap = torch.minimum(tie_gap, torch.where(torch.isnan(gap), float("inf"), gap))
        alive = beam >= 0
        tokens = torch.cat(
            [tokens.gather(1, beam.clamp(min=0)[:, :, None].expand(-1, -1, level)), token[:, :, None]], 2
        )
        if level == depth - 1:
            break
        parent = torch.where(alive, leaf.gather(1, beam.clamp(min=0)), -1)  # [B, k] tree node of the parent
        hidden = forward(model, tree, cache, token, parent, meter=meter)  # [B, k, H]
        kids = children(model, hidden, catalog, node, catalog.max_children[level + 1], exclude)  # [B, k, D]
        broken |= kids.broken.any(1)
        meter.kv(b * cache.length)  # each prompt once plus the tree tokens
        leaf = tree.num_nodes - k + torch.arange(k, device=dev).expand(b, k)

    if answer is not None:
        parent = torch.where(alive, leaf.gather(1, beam.clamp(min=0)), -1)  # [B, k] (-1: the prompt, or dead)
        score, broken_answer = answer_scores(model, tree, cache, token, parent, score, answer, meter)
        broken |= broken_answer
        score, node, tokens = rank_by_score(score, node, tokens)
        gap = torch.cat([score[:, :-1] - score[:, 1:], torch.full_like(score[:, :1], float("inf"))], 1)  # [B, k]
        tie_gap = torch.minimum(tie_gap, torch.where(torch.isnan(gap), float("inf"), gap).amin(1))  # final ranking
    if do_sample:  # drawn in sampling order: rank them by score
        score, node, tokens = rank_by_score(score, node, tokens)
    alive = node >= 0
    stats = meter.result(
        beam_batch_kv(b, k, s, depth),
        kv_len=cache.length,  # shared prefix + padded prompt + tree tokens
        kv_batch=cache.rows,  # cache rows: one per user
        tree_tokens=tree.num_nodes,
        non_finite=broken,
        tie_gap=tie_gap,
        **note,
    )
    tokens, score = torch.where(alive[:, :, None], tokens, -1), torch.where(alive, score, NEG_INF)
    if depth == catalog.code_len:
        return Recommendations.of(catalog, node, tokens, score, stats, exclude)
    return Recommendations(torch.full_like(node, -1), tokens, score, stats)
