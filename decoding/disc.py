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


def drawn_counts(catalog: Catalog, drawn_paths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drawn_paths [B, E, L + 1] the trie paths of every user's drawn items (-1 = none) -> (sorted keys user * G + node
    of the nodes on them, how many drawn items lie under each) [U]."""
    b, g = drawn_paths.shape[0], catalog.node_ptr.numel() - 1
    keys = torch.arange(b, device=drawn_paths.device)[:, None, None] * g + drawn_paths
    return torch.unique(keys[drawn_paths >= 0], return_counts=True)


def open_children(catalog: Catalog, child: torch.Tensor, drawn: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """child [B, P, C] node ids (-1 = none), drawn: `drawn_counts` -> bool [B, P, C]: the child still has an item that
    was not drawn (a node closes once every item under it is drawn)."""
    keys, counts = drawn
    b, g = child.shape[0], catalog.node_ptr.numel() - 1
    query = torch.arange(b, device=child.device)[:, None, None] * g + child.clamp(min=0)
    at = torch.searchsorted(keys, query).clamp(max=max(keys.numel() - 1, 0))
    taken = torch.where((keys.numel() > 0) & (keys[at] == query), counts[at], 0) if keys.numel() else 0
    return (child >= 0) & (catalog.leaf_count[child.clamp(min=0)] > taken)


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
def propose(model, tree: TokenTree, cache, store: Expanded, catalog: Catalog, wanted: torch.Tensor,
            drawn_paths: torch.Tensor, top_m: int | None, temperature: float, generator, meter: Meter):
    """Constrained samples, token by token, for the proposal slots wanted [B, P] (the others stay dead), reusing every
    trie node scored before. -> tokens [B, P, L], paths [B, P, L + 1] (trie nodes, -1 = dead), log x [B, P],
    log p [B, P] (temperature 1), users whose log-probs were NaN or infinite [B], the store with the new nodes."""
    (b, proposals), dev = wanted.shape, drawn_paths.device
    code_len, g = catalog.code_len, catalog.node_ptr.numel() - 1
    node = torch.where(wanted, 0, -1)
    tokens = torch.zeros(b, proposals, code_len, dtype=torch.int64, device=dev)
    paths = torch.full((b, proposals, code_len + 1), -1, dtype=torch.int64, device=dev)
    paths[:, :, 0] = node
    log_x = torch.zeros(b, proposals, dtype=torch.float64, device=dev)
    log_p = torch.zeros(b, proposals, device=dev)
    broken = torch.zeros(b, dtype=torch.bool, device=dev)
    user = torch.arange(b, device=dev)[:, None].expand(b, proposals)
    seed = torch.randint(1 << 62, (1,), generator=generator, device=generator.device if generator else "cpu").to(dev)
    who = (user * proposals + torch.arange(proposals, device=dev)) * code_len  # [B, P] (user, proposal) key base
    drawn = drawn_counts(catalog, drawn_paths)
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
        valid = open_children(catalog, child, drawn)
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
    """k distinct items per user. Drawing independently and keeping the first occurrence of each item is sampling
    without replacement, so draws run in generations: each generation makes, in parallel, as many independent draws
    per user as items are missing, from the catalog without the items drawn before, and keeps the new ones in draw
    order. A draw is DISC (up to `rounds` proposals accepted in turn with probability x, else importance resampling
    among `rounds` fresh ones) or plain constrained sampling (one proposal, kept); its proposals are decoded lazily
    (`draw`), so a draw costs the proposals its sequential algorithm looks at, about 1 / (1 - p_b) of them."""
    if k < 1 or rounds < 1 or not temperature > 0 or (top_m is not None and top_m < 1):
        raise ValueError(f"need k, rounds, top_m >= 1 and temperature > 0; got k={k}, rounds={rounds}, "
                         f"top_m={top_m}, temperature={temperature}")
    check_prompts(input_ids, attention_mask, catalog, model, prefix=prefix)
    b, dev, code_len = input_ids.shape[0], input_ids.device, catalog.code_len
    g = catalog.node_ptr.numel() - 1
    meter = Meter(dev)
    with meter.phase("prefill"):
        cache, hidden = prefill(model, input_ids, attention_mask, meter, prefix=prefix, capacity=2 * k * code_len)
        root = torch.zeros(b, dtype=torch.int64, device=dev)
        store = score_nodes(model, hidden, catalog, root, torch.arange(b, device=dev) * g,
                            torch.full((b,), -1, dtype=torch.int64, device=dev), top_m, temperature)
    meter.kv(b * cache.length)
    tree = TokenTree.from_prompt(attention_mask, len(prefix) if prefix is not None else 0)
    run = Draws(model, tree, cache, store, catalog, rounds if disc else 0, top_m, temperature, generator, meter)
    run.broken |= store.broken
    drawn_paths = torch.full((b, k, code_len + 1), -1, dtype=torch.int64, device=dev)
    out = {"tokens": torch.full((b, k, code_len), -1, dtype=torch.int64, device=dev),
           "score": torch.full((b, k), NEG_INF, device=dev), "used": torch.zeros(b, k, device=dev),
           "accepted": torch.zeros(b, k, dtype=torch.bool, device=dev),
           "log_x": torch.full((b, k), NEG_INF, dtype=torch.float64, device=dev)}
    count = torch.zeros(b, dtype=torch.int64, device=dev)
    exhausted = torch.zeros(b, dtype=torch.bool, device=dev)
    while ((count < k) & ~exhausted).any():
        need = torch.where(exhausted, 0, k - count)  # [B] draws this generation: the items missing
        m = int(need.max())
        d = run.draw(torch.arange(m, device=dev)[None, :] < need[:, None], drawn_paths)  # [B, m] draws
        leaf = d["paths"][:, :, -1]  # [B, m] the drawn item's trie node, -1: none left
        seen = (leaf[:, :, None] == drawn_paths[:, None, :, -1]).any(-1)  # drawn in an earlier generation
        earlier = (leaf[:, :, None] == leaf[:, None, :]) & torch.ones(m, m, dtype=torch.bool, device=dev).tril(-1)
        new = (leaf >= 0) & ~seen & ~earlier.any(-1)  # [B, m] first occurrences, in draw order
        slot = count[:, None] + new.long().cumsum(1) - 1  # [B, m] where each new item goes
        keep = new & (slot < k)
        rows, cols = keep.nonzero(as_tuple=True)
        drawn_paths[rows, slot[rows, cols]] = d["paths"][rows, cols]
        for name in out:
            out[name][rows, slot[rows, cols]] = d[name][rows, cols]
        exhausted |= ~(leaf >= 0).any(1) & (need > 0)  # nothing left to draw for these users
        count += keep.sum(1)
    order = torch.sort(out["score"], dim=1, descending=True, stable=True).indices
    live = out["score"] > NEG_INF
    node = drawn_paths[:, :, -1]
    stats = meter.result(beam_batch_kv(b, k, input_ids.shape[1], code_len),
                         proposals=out["used"].masked_fill(~live, 0).sum(1),  # as the sequential algorithm draws them
                         proposals_decoded=run.decoded,  # [B] proposals actually decoded, every generation
                         acceptance_rate=(out["accepted"] & live).sum(1) / live.sum(1).clamp(min=1),
                         invalid_mass=1 - run.x_sum / run.x_count.clamp(min=1),  # p_b = 1 - E_q[x]
                         importance_weight=out["log_x"].gather(1, order).exp(),  # x(a) of each returned item
                         expanded_nodes=torch.bincount(run.store.key // g, minlength=b), non_finite=run.broken)
    return Recommendations(catalog.item_of_node(node.gather(1, order)),
                           out["tokens"].gather(1, order[:, :, None].expand_as(out["tokens"])),
                           out["score"].gather(1, order), stats)


class Draws:
    """Independent draws for many (user, draw) pairs at once, their proposals decoded lazily in waves: wave w decodes
    the w-th proposal of every draw still undecided (accepted with probability x), and once few draws are left the
    rest of their proposals at once: the sequential algorithm's outcome, in a few forwards per level."""

    def __init__(self, model, tree, cache, store: Expanded, catalog: Catalog, rounds: int, top_m, temperature,
                 generator, meter: Meter, single_waves: int = 2):
        self.model, self.tree, self.cache, self.store, self.catalog = model, tree, cache, store, catalog
        self.rounds, self.top_m, self.temperature, self.generator, self.meter = (rounds, top_m, temperature,
                                                                                 generator, meter)
        self.single_waves = single_waves
        b, dev = tree.prompt_mask.shape[0], tree.prompt_mask.device
        self.broken = torch.zeros(b, dtype=torch.bool, device=dev)
        self.decoded = torch.zeros(b, dtype=torch.int64, device=dev)
        self.x_sum = torch.zeros(b, dtype=torch.float64, device=dev)
        self.x_count = torch.zeros(b, dtype=torch.float64, device=dev)

    def propose(self, wanted: torch.Tensor, drawn_paths: torch.Tensor):
        """Proposal slots wanted [B, P] -> (tokens [B, P, L], paths [B, P, L + 1], log x [B, P], log p [B, P])."""
        tokens, paths, log_x, log_p, broken, self.store = propose(
            self.model, self.tree, self.cache, self.store, self.catalog, wanted, drawn_paths, self.top_m,
            self.temperature, self.generator, self.meter)
        self.broken |= broken
        self.decoded += wanted.sum(1)
        live = wanted & torch.isfinite(log_x)
        self.x_sum += torch.where(live, log_x.exp(), 0).sum(1)
        self.x_count += live.sum(1)
        return tokens, paths, log_x, log_p

    def draw(self, wanted: torch.Tensor, drawn_paths: torch.Tensor) -> dict:
        """Draws wanted [B, m] -> per draw the kept proposal's tokens [B, m, L], paths [B, m, L + 1], score (log p),
        log x, proposals the sequential algorithm used, accepted (False: importance-resampled)."""
        b, m = wanted.shape
        dev, code_len, r = wanted.device, self.catalog.code_len, self.rounds
        out = {"tokens": torch.full((b, m, code_len), -1, dtype=torch.int64, device=dev),
               "paths": torch.full((b, m, code_len + 1), -1, dtype=torch.int64, device=dev),
               "score": torch.full((b, m), NEG_INF, device=dev), "log_x": torch.full((b, m), NEG_INF,
                                                                                       dtype=torch.float64, device=dev),
               "used": torch.zeros(b, m, device=dev), "accepted": torch.zeros(b, m, dtype=torch.bool, device=dev)}
        open_ = wanted.clone()  # draws not decided yet

        def keep(chosen: torch.Tensor, tokens, paths, log_x, log_p, used, accepted):
            """Draws chosen [B, m] keep these proposals [B, m]."""
            for name, value in (("tokens", tokens), ("paths", paths)):
                out[name] = torch.where(chosen[:, :, None], value, out[name])
            for name, value in (("score", log_p), ("log_x", log_x), ("used", used), ("accepted", accepted)):
                out[name] = torch.where(chosen, value, out[name])

        if r == 0:  # constrained sampling: one proposal, always kept
            tokens, paths, log_x, log_p = self.propose(wanted, drawn_paths)
            keep(wanted, tokens, paths, log_x, log_p, torch.ones_like(log_p), torch.ones_like(wanted))
            return self.dead_to_none(out)
        for j in range(min(self.single_waves, r)):  # proposal j + 1 of every open draw
            tokens, paths, log_x, log_p = self.propose(open_, drawn_paths)
            u = torch.rand(b, m, generator=self.generator, device=dev, dtype=torch.float64)
            ok = open_ & (u.log() < log_x)
            keep(ok, tokens, paths, log_x, log_p, torch.full_like(log_p, j + 1), torch.ones_like(ok))
            open_ &= ~ok
        left = r - min(self.single_waves, r)  # proposals still to try in turn, then the r fresh ones
        if open_.any():
            slots = open_[:, :, None].expand(b, m, left + r).reshape(b, m * (left + r))
            tokens, paths, log_x, log_p = (x.view(b, m, left + r, *x.shape[2:]) for x in self.propose(slots,
                                                                                                     drawn_paths))
            u = torch.rand(b, m, left, generator=self.generator, device=dev, dtype=torch.float64)
            accept = u.log() < log_x[:, :, :left]  # [B, m, left]
            first = accept.int().argmax(2) if left else torch.zeros(b, m, dtype=torch.int64, device=dev)
            fresh = log_x[:, :, left:]  # [B, m, r]
            resampled = left + (fresh + gumbel_like(fresh, self.generator)).argmax(2)
            ok = accept.any(2)  # in order: the first accepted proposal
            pick = torch.where(ok, first, resampled)[:, :, None]  # [B, m, 1]
            used = torch.where(ok, r - left + first + 1, 2 * r).float()
            take = lambda x: x.gather(2, pick.view(b, m, 1, *([1] * (x.dim() - 3))).expand(  # noqa: E731
                b, m, 1, *x.shape[3:])).squeeze(2)
            keep(open_, take(tokens), take(paths), take(log_x), take(log_p), used, ok)
        return self.dead_to_none(out)

    @staticmethod
    def dead_to_none(out: dict) -> dict:
        """A draw whose kept proposal found no item left (x = 0) holds no item."""
        dead = ~torch.isfinite(out["log_x"])
        out["paths"] = out["paths"].masked_fill(dead[:, :, None], -1)
        out["tokens"] = out["tokens"].masked_fill(dead[:, :, None], -1)
        out["score"] = out["score"].masked_fill(dead, NEG_INF)
        return out


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
