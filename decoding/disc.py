"""DISC: asymptotically unbiased constrained sampling (dynamic importance sampling, DISC paper Algorithm 1), with
the exact CSR mask or parallel prefix verification (PPV, Algorithm 2) over the model's top-M tokens.

Constrained decoding samples token by token from the model's distribution renormalised over the valid tokens:
a proposal a has probability q(a) = p(a) / x(a), x(a) = prod_t (valid mass at step t). Accepting a with probability
x(a) makes accepted proposals exactly p restricted to the catalog, P_S(a) = p(a) / (1 - p_b). DISC tries `rounds`
proposals; if none is accepted it importance-resamples among `rounds` fresh proposals with weights x. The rounds
are independent until acceptance, so all 2 * rounds proposals are decoded together as tree nodes over the single
prompt prefill, and the first accepted one (in order) is kept: the sequential algorithm's distribution.

k distinct items per user: k draws in sequence, each excluding the items already drawn from that user's constraint
set (a trie node closes once every item under it has been drawn). The score of an item is its sequence
log-probability under the model (temperature 1); items come back sorted by score.

A user's trie nodes are scored once: every node a proposal reaches is run through the model the first time any of
the user's proposals (of any draw) reaches it, and its children's log-probs are kept (`Expanded`) for every later
proposal: proposals that share a node share its forward, and the tree is never reset between draws.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.beam import (Prefix, Recommendations, check_prompts, forward, gumbel_like, head_of, prefill)
from decoding.catalog import Catalog
from decoding.stats import Meter, beam_batch_kv
from decoding.tree import TokenTree

NEG_INF = float("-inf")


@dataclass
class Expanded:
    """The trie nodes of every user scored so far, sorted by key = user * G + node: each one's tree node (-1: the
    prompt), its candidate next tokens (the catalog children, or the model's top-M for PPV) and their logits
    (temperature 1) [E, C], and its log-normalisers at temperature 1 and at the sampling temperature [E]."""
    key: torch.Tensor
    tree: torch.Tensor
    token: torch.Tensor
    logit: torch.Tensor
    lse: torch.Tensor
    lse_t: torch.Tensor
    broken: torch.Tensor  # [E] NaN or infinite scores

    def find(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys [...] -> (entry index, found) [...]."""
        at = torch.searchsorted(self.key, key).clamp(max=max(self.key.numel() - 1, 0))
        return at, (self.key.numel() > 0) & (self.key[at] == key)

    def add(self, other: "Expanded") -> "Expanded":
        """The union (keys disjoint), sorted again."""
        width = max(self.token.shape[1], other.token.shape[1])
        widen = lambda x, v: torch.cat([x, x.new_full((x.shape[0], width - x.shape[1]), v)], 1)  # noqa: E731
        merged = Expanded(torch.cat([self.key, other.key]), torch.cat([self.tree, other.tree]),
                          torch.cat([widen(self.token, -1), widen(other.token, -1)]),
                          torch.cat([widen(self.logit, NEG_INF), widen(other.logit, NEG_INF)]),
                          torch.cat([self.lse, other.lse]), torch.cat([self.lse_t, other.lse_t]),
                          torch.cat([self.broken, other.broken]))
        order = torch.argsort(merged.key)
        return Expanded(*(x[order] for x in (merged.key, merged.tree, merged.token, merged.logit, merged.lse,
                                             merged.lse_t, merged.broken)))


def score_nodes(model, hidden: torch.Tensor, catalog: Catalog, node: torch.Tensor, key: torch.Tensor,
                tree: torch.Tensor, top_m: int | None, temperature: float) -> Expanded:
    """hidden [R, H] of R trie nodes node [R] -> their Expanded entries (candidates: the children, or the top-M)."""
    if top_m is None:
        token, _, valid = catalog.children(node, max(catalog.max_children))
        scores = head_of(model).score(hidden, torch.where(valid, token, -1), temperature)
        token = torch.where(valid, token, -1)
    else:
        scores = head_of(model).score(hidden, torch.full((hidden.shape[0], 1), -1, device=hidden.device),
                                      temperature, top_m)
        token, scores.logits = scores.top_tokens, scores.top_logits
    lse_t = scores.lse if scores.lse_t is None else scores.lse_t
    broken = ~torch.isfinite(scores.lse) | torch.isnan(scores.logits).any(1)
    return Expanded(key, tree, token, scores.logits, scores.lse, lse_t, broken)


def token_gumbel(seed: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [...] float64 keyed by (seed, key) through the SplitMix64 finaliser: a token's noise depends on
    the draw, the user, the proposal, the level and the token id only, not on where it sits among the candidates (so
    PPV with a top-M covering the vocabulary draws exactly what the exact mask draws), with no [B, P, V] tensor."""
    x = (key + seed) * -7046029254386353131  # 0x9E3779B97F4A7C15, wrapping int64 arithmetic
    x = (x ^ ((x >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    u = (((x >> 11) & ((1 << 53) - 1)).double() + 0.5) / 2.0 ** 53  # (0, 1)
    return -torch.log(-torch.log(u))


def open_children(catalog: Catalog, child: torch.Tensor, drawn_paths: torch.Tensor) -> torch.Tensor:
    """child [B, P, C] node ids (-1 = none), drawn_paths [B, E, L + 1] the node paths of the user's drawn items
    (-1 = none) -> bool [B, P, C]: the child still has an item that was not drawn."""
    b, p, c = child.shape
    on_path = (child.reshape(b, p * c, 1, 1) == drawn_paths[:, None]).any(-1).sum(-1).view(b, p, c)  # [B, P, C]
    return (child >= 0) & (catalog.leaf_count[child.clamp(min=0)] > on_path)


def expand_missing(model, tree: TokenTree, cache, catalog: Catalog, store: Expanded, node: torch.Tensor,
                   parent_node: torch.Tensor, top_m: int | None, temperature: float, meter: Meter) -> Expanded:
    """Runs the trie nodes node [B, P] (-1 = dead) that no proposal of their user reached before through the model,
    each once however many proposals stand on it (under its parent's tree node), and adds them to the store."""
    b, g = node.shape[0], catalog.node_ptr.numel() - 1
    user = torch.arange(b, device=node.device)[:, None].expand_as(node)
    key = user * g + node.clamp(min=0)
    _, found = store.find(key)
    missing = (node >= 0) & ~found
    if not missing.any():
        return store
    new, first = torch.unique(key[missing], return_inverse=True)  # [M] sorted, distinct
    parent = torch.zeros_like(new).scatter_(0, first, parent_node[missing])  # [M] any proposal's parent: the same
    who, what = new // g, new % g  # [M] user, node
    count = torch.bincount(who, minlength=b)  # [B]
    slot = torch.arange(new.numel(), device=new.device) - (torch.cumsum(count, 0) - count)[who]  # [M] within its user
    q = int(count.max())
    block_tok = torch.zeros(b, q, dtype=torch.int64, device=node.device)
    block_par = torch.full((b, q), -1, dtype=torch.int64, device=node.device)
    block_tok[who, slot] = catalog.edge_tok[what - 1]  # the token leading into the node
    block_par[who, slot] = store.tree[store.find(who * g + parent)[0]]  # the parent's tree node (-1: prompt)
    base = tree.num_nodes
    hidden = forward(model, tree, cache, block_tok, block_par, meter=meter)  # [B, Q, H]
    return store.add(score_nodes(model, hidden[who, slot], catalog, what, new, base + slot, top_m, temperature))


@torch.no_grad()
def propose(model, tree: TokenTree, cache, store: Expanded, catalog: Catalog, proposals: int, drawn_paths: torch.Tensor,
            top_m: int | None, temperature: float, generator, meter: Meter):
    """`proposals` constrained samples per user, token by token, reusing every trie node scored before.
    -> tokens [B, P, L], paths [B, P, L + 1] (trie nodes, -1 = dead), log x [B, P], log p [B, P] (temperature 1),
    users whose log-probs were NaN or infinite [B], the store with the newly scored nodes."""
    b, dev = drawn_paths.shape[0], drawn_paths.device
    code_len, g = catalog.code_len, catalog.node_ptr.numel() - 1
    node = torch.zeros(b, proposals, dtype=torch.int64, device=dev)
    tokens = torch.zeros(b, proposals, code_len, dtype=torch.int64, device=dev)
    paths = torch.full((b, proposals, code_len + 1), -1, dtype=torch.int64, device=dev)
    paths[:, :, 0] = 0
    log_x = torch.zeros(b, proposals, dtype=torch.float64, device=dev)
    log_p = torch.zeros(b, proposals, device=dev)
    broken = torch.zeros(b, dtype=torch.bool, device=dev)
    user = torch.arange(b, device=dev)[:, None].expand(b, proposals)
    seed = torch.randint(1 << 62, (1,), generator=generator, device=generator.device if generator else "cpu").to(dev)
    who = (user * proposals + torch.arange(proposals, device=dev)) * code_len  # [B, P] (user, proposal) key base
    for level in range(code_len):
        if level:
            store = expand_missing(model, tree, cache, catalog, store, node, paths[:, :, level - 1], top_m,
                                   temperature, meter)
            meter.kv(b * cache.length)
        at, _ = store.find(user * g + node.clamp(min=0))  # [B, P] each proposal's entry
        tok, logit = store.token[at], store.logit[at]  # [B, P, C]
        broken |= (store.broken[at] & (node >= 0)).any(1)
        if top_m is None:
            child = torch.where(tok >= 0, catalog.child_node(node[:, :, None].expand_as(tok).reshape(-1),
                                                             tok.clamp(min=0).reshape(-1)).view(tok.shape), -1)
        else:  # PPV: is prefix + candidate a prefix of an item (binary search in the sorted rows)
            ok = catalog.verify(tokens[:, :, :level].reshape(b * proposals, level),
                                tok.reshape(b * proposals, -1)).view(tok.shape)
            child = torch.where(ok, catalog.child_node(node[:, :, None].expand_as(tok).reshape(-1),
                                                       tok.reshape(-1)).view(tok.shape), -1)
        child = torch.where(node[:, :, None] >= 0, child, -1)
        valid = open_children(catalog, child, drawn_paths)
        cand = (logit.double() / temperature - store.lse_t[at][:, :, None].double()).masked_fill(~valid, NEG_INF)
        mass = cand.logsumexp(-1)  # log of the valid mass (tempered)
        noise = token_gumbel(seed, ((who + level)[:, :, None] * catalog.vocab_size + tok.clamp(min=0)))
        pick = (cand + noise).argmax(-1, keepdim=True)  # a sample from the valid set
        alive = torch.isfinite(mass) & (node >= 0)
        log_x = torch.where(alive, log_x + mass, NEG_INF)
        token = tok.gather(2, pick).squeeze(2)
        tokens[:, :, level] = torch.where(alive, token, 0)
        node = torch.where(alive, child.gather(2, pick).squeeze(2), -1)
        paths[:, :, level + 1] = node
        log_p = log_p + (logit.gather(2, pick).squeeze(2) - store.lse[at])  # temperature 1
    return tokens, paths, log_x, log_p, broken, store


def sample_items(model, input_ids, attention_mask, catalog: Catalog, k: int, rounds: int, disc: bool,
                 top_m: int | None, temperature: float, generator, prefix: Prefix | None = None):
    """k draws per user without replacement; each draw is DISC (2 * rounds proposals) or plain constrained
    sampling (one proposal, always kept)."""
    if k < 1 or rounds < 1 or not temperature > 0 or (top_m is not None and top_m < 1):
        raise ValueError(f"need k, rounds, top_m >= 1 and temperature > 0; got k={k}, rounds={rounds}, "
                         f"top_m={top_m}, temperature={temperature}")
    check_prompts(input_ids, attention_mask, catalog, model, prefix=prefix)
    b, dev, code_len = input_ids.shape[0], input_ids.device, catalog.code_len
    proposals = 2 * rounds if disc else 1
    meter = Meter(dev)
    with meter.phase("prefill"):
        cache, hidden = prefill(model, input_ids, attention_mask, meter, prefix=prefix,
                                capacity=min(k * proposals, 64) * (code_len - 1))
        root = torch.zeros(b, dtype=torch.int64, device=dev)
        store = score_nodes(model, hidden, catalog, root, torch.arange(b, device=dev) * (catalog.node_ptr.numel() - 1),
                            torch.full((b,), -1, dtype=torch.int64, device=dev), top_m, temperature)
    meter.kv(b * cache.length)
    broken = store.broken.clone()  # [B] users whose log-probs were NaN or infinite somewhere
    tree = TokenTree.from_prompt(attention_mask, len(prefix) if prefix is not None else 0)
    drawn_paths = torch.full((b, k, code_len + 1), -1, dtype=torch.int64, device=dev)
    out_node = torch.full((b, k), -1, dtype=torch.int64, device=dev)
    out_tokens = torch.full((b, k, code_len), -1, dtype=torch.int64, device=dev)
    out_score = torch.full((b, k), float("-inf"), device=dev)
    used = torch.zeros(b, k, device=dev)  # proposals of the sequential algorithm, per draw
    accepted = torch.zeros(b, k, dtype=torch.bool, device=dev)
    mean_x = torch.zeros(b, k, dtype=torch.float64, device=dev)
    out_log_x = torch.full((b, k), float("-inf"), dtype=torch.float64, device=dev)
    for draw in range(k):
        tokens, paths, log_x, log_p, broken_now, store = propose(model, tree, cache, store, catalog, proposals,
                                                                 drawn_paths, top_m, temperature, generator, meter)
        broken |= broken_now
        if disc:  # accept proposal i with probability x; else importance-resample the fresh half by x
            u = torch.rand(b, rounds, generator=generator, device=dev, dtype=torch.float64)
            accept = u.log() < log_x[:, :rounds]  # [B, R]
            first = accept.int().argmax(1)  # the first accepted, in order
            fresh = log_x[:, rounds:]
            resampled = rounds + (fresh + gumbel_like(fresh, generator)).argmax(1)
            ok = accept.any(1)
            choice = torch.where(ok, first, resampled)
            used[:, draw] = torch.where(ok, first + 1, 2 * rounds).float()
            accepted[:, draw] = ok
        else:  # the baseline keeps its one proposal
            choice = torch.zeros(b, dtype=torch.int64, device=dev)
            used[:, draw] = 1.0
            accepted[:, draw] = True
        mean_x[:, draw] = log_x.exp().mean(1)
        live = torch.isfinite(log_x.gather(1, choice[:, None])).squeeze(1)  # an item is left to draw
        path = paths[torch.arange(b, device=dev), choice]  # [B, L + 1]
        drawn_paths[:, draw] = torch.where(live[:, None], path, -1)
        out_node[:, draw] = torch.where(live, path[:, -1], -1)
        out_tokens[:, draw] = torch.where(live[:, None], tokens[torch.arange(b, device=dev), choice], -1)
        out_score[:, draw] = torch.where(live, log_p.gather(1, choice[:, None]).squeeze(1), float("-inf"))
        out_log_x[:, draw] = log_x.gather(1, choice[:, None]).squeeze(1)
    order = torch.sort(out_score, dim=1, descending=True, stable=True).indices
    live = out_node >= 0
    stats = meter.result(beam_batch_kv(b, k, input_ids.shape[1], code_len),
                         proposals=used.masked_fill(~live, 0).sum(1),  # as the sequential algorithm draws them
                         proposals_decoded=proposals * k,
                         acceptance_rate=(accepted & live).sum(1) / live.sum(1).clamp(min=1),
                         invalid_mass=1 - (mean_x * live).sum(1) / live.sum(1).clamp(min=1),  # p_b = 1 - E_q[x]
                         importance_weight=out_log_x.gather(1, order).exp(),  # x(a) of each returned item
                         expanded_nodes=torch.bincount(store.key // (catalog.node_ptr.numel() - 1), minlength=b),
                         non_finite=broken)
    return Recommendations(catalog.item_of_node(out_node.gather(1, order)),
                           out_tokens.gather(1, order[:, :, None].expand_as(out_tokens)),
                           out_score.gather(1, order), stats)


def constrained_sample(model, input_ids, attention_mask, catalog: Catalog, k: int = 1, top_m: int | None = None,
                       temperature: float = 1.0, generator: torch.Generator | None = None,
                       prefix: Prefix | None = None) -> Recommendations:
    """The trie-style baseline: k items per user, each sampled token by token from the model's distribution
    renormalised over the valid tokens (without replacement across the k). stats['importance_weight'] = x(a)."""
    return sample_items(model, input_ids, attention_mask, catalog, k, 1, False, top_m, temperature, generator, prefix)


def disc_sample(model, input_ids, attention_mask, catalog: Catalog, k: int, rounds: int = 4, top_m: int | None = None,
                temperature: float = 1.0, generator: torch.Generator | None = None,
                prefix: Prefix | None = None) -> Recommendations:
    """k distinct items per user drawn with DISC (Algorithm 1): asymptotically the model's distribution restricted
    to the catalog (and to the items not drawn yet). stats: the base keys (decoding/stats.py) plus proposals [B]
    (sequential count), proposals_decoded, acceptance_rate [B], invalid_mass [B] (estimated p_b),
    importance_weight [B, k]."""
    return sample_items(model, input_ids, attention_mask, catalog, k, rounds, True, top_m, temperature, generator,
                        prefix)
