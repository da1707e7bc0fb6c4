"""DISC: asymptotically unbiased constrained sampling (dynamic importance sampling, DISC paper Algorithm 1), with
the exact CSR mask or parallel prefix verification (PPV, Algorithm 2) over the model's top-M tokens.

Constrained decoding samples token by token from the model's distribution renormalised over the valid tokens:
a proposal a has probability q(a) = p(a) / x(a), x(a) = prod_t (valid mass at step t). Accepting a with probability
x(a) makes accepted proposals exactly p restricted to the catalog, P_S(a) = p(a) / (1 - p_b). DISC tries `rounds`
proposals; if none is accepted it importance-resamples among `rounds` fresh proposals with weights x. The rounds
are independent until acceptance, so all 2 * rounds proposals are decoded together as tree nodes over the single
prompt prefill, and the first accepted one (in order) is kept: the sequential algorithm's distribution.

k distinct items per user: the first k distinct items of a sequence of independent draws (sampling without
replacement). Draws run in passes: the first pass launches k draws at once; a later pass launches one draw per item
still missing, and a draw launched in pass e excludes the items decided before pass e (a trie node closes once
every item under it is excluded), standing for the draws that would have repeated them. For a sampler whose law on
C minus S is its law on C conditioned on C minus S (P_S, DISC's limit) this is exactly successive sampling, item
after item each excluding the ones before; for plain constrained (trie) sampling, whose renormalisation moves with
S, it is a different law (stated and tested in tests/test_disc.py); k = 1 is unaffected. The score of an item is its
sequence log-probability under the model (temperature 1); items come back sorted by score.

A user's trie nodes are scored once: every node a proposal reaches is run through the model the first time any of
the user's proposals (of any draw) reaches it, and its children's log-probs are kept (`Expanded`) for every later
proposal: proposals that share a node share its forward, and the tree is never reset between draws.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

import torch

from decoding.beam import Prefix, check_prompts, forward, prefill, prompt_tree
from decoding.cache import TreeCache
from decoding.catalog import Catalog, Exclusions, count_at
from decoding.draws import GOLDEN, Generator, UserDraws, gumbel, mix, stream, uniform, unit
from decoding.search import Recommendations, head_of
from decoding.stats import Meter, beam_batch_kv
from decoding.tree import TokenTree

NEG_INF = float("-inf")
PROPOSE, ACCEPT, RESAMPLE = 0, 1, 2  # the call sites of a pass's per-user draws (decoding/draws.py)
DRAW_STRIDE = 1 << 20  # per-user draws: element index of proposal j of a user's draw s = s * DRAW_STRIDE + j


@dataclass
class Expanded:
    """The trie nodes of one level scored so far, for every user, sorted by key = user * G + node: each one's tree
    node (-1: the prompt), its candidate next tokens (the catalog children, or the model's top-M for PPV), the child
    node each leads to (-1: none) and their logits (temperature 1) [E, C], and its log-normalisers at temperature 1
    and at the sampling temperature [E]. C is the level's widest node (or M): one store per level."""

    key: torch.Tensor
    tree: torch.Tensor
    token: torch.Tensor
    child: torch.Tensor
    logit: torch.Tensor
    lse: torch.Tensor
    lse_t: torch.Tensor
    broken: torch.Tensor  # [E] NaN or infinite scores

    @staticmethod
    def empty(device) -> Expanded:
        none = lambda dtype: torch.zeros(0, dtype=dtype, device=device)  # noqa: E731
        return Expanded(
            none(torch.int64),
            none(torch.int64),
            none(torch.int64),
            none(torch.int64),
            none(torch.float32),
            none(torch.float32),
            none(torch.float32),
            none(torch.bool),
        )

    def find(self, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys [...] -> (entry index, found) [...]."""
        if self.key.numel() == 0:
            return torch.zeros_like(key), torch.zeros_like(key, dtype=torch.bool)
        at = torch.searchsorted(self.key, key).clamp(max=self.key.numel() - 1)
        return at, self.key[at] == key

    def add(self, other: Expanded) -> Expanded:
        """The union (keys disjoint, same width), sorted again."""
        if self.key.numel() == 0:
            return other
        both = [torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in fields(Expanded)]
        order = torch.argsort(both[0])
        return Expanded(*(x[order] for x in both))


def token_gumbel(seed: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Gumbel noise [...] float64 keyed by (seed, key) through the SplitMix64 finaliser: a token's noise depends on
    the draw, the user, the proposal, the level and the token id only, not on where it sits among the candidates (so
    PPV with a top-M covering the vocabulary draws exactly what the exact mask draws), with no [B, P, V] tensor."""
    return -torch.log(-torch.log(unit(mix((key + seed) * GOLDEN))))


def drawn_counts(catalog: Catalog, draws: Draws, epochs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The items each draw must exclude: a draw launched in pass e excludes the distinct items of the draws decided
    before pass e. -> (sorted keys (user * E + e) * G + node of the nodes on those items' paths, how many excluded
    items lie under each) [U], E = epochs."""
    b, d = draws.open.shape
    g, dev = catalog.num_nodes, draws.paths.device
    leaf, at = draws.paths[:, :, -1], draws.decided_at  # [B, D]
    earlier = (at[:, None, :] < at[:, :, None]) | (
        (at[:, None, :] == at[:, :, None]) & torch.ones(d, d, dtype=torch.bool, device=dev).tril(-1)
    )
    repeat = ((leaf[:, :, None] == leaf[:, None, :]) & earlier & (at[:, None, :] >= 0)).any(2)  # [B, D]
    item = (at >= 0) & (leaf >= 0) & ~repeat  # [B, D] each distinct decided item once, at its first decision
    e = torch.arange(epochs, device=dev)
    member = item[:, :, None] & (at[:, :, None] < e)  # [B, D, E] the item is excluded in epoch e
    user = torch.arange(b, device=dev)[:, None, None, None]
    keys = (user * epochs + e[None, None, :, None]) * g + draws.paths[:, :, None, :]  # [B, D, E, L + 1]
    return torch.unique(keys[member[..., None] & (draws.paths[:, :, None, :] >= 0)], return_counts=True)


def open_children(
    catalog: Catalog,
    child: torch.Tensor,
    epoch: torch.Tensor,
    epochs: int,
    drawn: tuple[torch.Tensor, torch.Tensor],
    exclude: Exclusions | None = None,
) -> torch.Tensor:
    """child [B, P, C] node ids (-1 = none) of proposals launched in epoch [B, P], drawn: `drawn_counts`, exclude: the
    users' own exclusions -> bool [B, P, C]: the child still has an item its draw does not exclude (a node closes once
    all its items are; a drawn item is never an excluded one, so the two counts add)."""
    keys, counts = drawn
    b, g = child.shape[0], catalog.num_nodes
    user = torch.arange(b, device=child.device)[:, None, None]
    taken = count_at(keys, counts, (user * epochs + epoch[:, :, None]) * g + child.clamp(min=0))
    if exclude is not None:
        taken = taken + exclude.excluded(child)
    return (child >= 0) & (catalog.leaf_count[child.clamp(min=0)] > taken)


@dataclass
class Proposals:
    """The proposals one `propose` decodes together, token by token [B, P]: the pass that launched each one's draw
    (its epoch), the key of its Gumbel noise (with `seed` [1], or [B, 1, 1] per user: the user and the proposal),
    the trie node it stands on (-1 = dead), its tokens [B, P, L] and trie path [B, P, L + 1] so far, log x (float64)
    and log p (temperature 1)."""

    epoch: torch.Tensor
    seed: torch.Tensor
    key: torch.Tensor
    node: torch.Tensor
    tokens: torch.Tensor
    paths: torch.Tensor
    log_x: torch.Tensor
    log_p: torch.Tensor

    @staticmethod
    def start(wanted: torch.Tensor, epoch: torch.Tensor, code_len: int, generator: Generator, now: int) -> Proposals:
        """The proposal slots wanted [B, P] at the trie's root (the others dead) of draws launched in epoch [B, P],
        decoded in pass `now` (per-user draws: each user's seed for this pass, proposals keyed by their slot)."""
        (b, p), dev = wanted.shape, wanted.device
        node = torch.where(wanted, 0, -1)
        paths = torch.full((b, p, code_len + 1), -1, dtype=torch.int64, device=dev)
        paths[:, :, 0] = node
        slot = torch.arange(p, device=dev)[None, :].expand(b, p)  # a user's proposals are packed in draw order
        if isinstance(generator, UserDraws):
            seed, user = generator.at(PROPOSE, now).keys()[:, None, None], torch.zeros_like(slot)
        else:
            seed = torch.randint(1 << 62, (1,), generator=generator, device=generator.device if generator else "cpu")
            user = torch.arange(b, device=dev)[:, None].expand(b, p)
        return Proposals(
            epoch,
            seed.to(dev),
            (user * p + slot) * code_len,  # [B, P] (user, proposal) key base
            node,
            torch.zeros(b, p, code_len, dtype=torch.int64, device=dev),
            paths,
            torch.zeros(b, p, dtype=torch.float64, device=dev),
            torch.zeros(b, p, device=dev),
        )


@dataclass(eq=False)
class Proposer:
    """One batch's DISC state: the model, the catalog and the sampling settings (top_m: PPV over the model's top-M
    tokens, else the exact CSR mask; temperature; generator; the users' own `exclude`), the meter; after `start`, the
    prompt cache and token tree, the trie nodes scored so far (`stores`: one Expanded per level, extended in place)
    and the counts DISC's statistics need [B]: users whose log-probs were NaN or infinite, proposals decoded, and
    the sum and count of x over the live ones."""

    model: object
    catalog: Catalog
    top_m: int | None
    temperature: float
    generator: Generator  # torch's, or per-user draws (rows: the batch's users)
    exclude: Exclusions | None
    meter: Meter
    cache: TreeCache = field(init=False)
    tree: TokenTree = field(init=False)
    stores: list[Expanded] = field(init=False)
    broken: torch.Tensor = field(init=False)
    decoded: torch.Tensor = field(init=False)
    x_sum: torch.Tensor = field(init=False)
    x_count: torch.Tensor = field(init=False)

    def start(self, input_ids, attention_mask, prefix: Prefix | None, capacity: int) -> None:
        """Prefills the prompts [B, S] (continuing `prefix`; room for `capacity` tree nodes) and scores every user's
        trie root into stores[0]."""
        b, dev, g = input_ids.shape[0], input_ids.device, self.catalog.num_nodes
        with self.meter.phase("prefill"):
            self.cache, hidden = prefill(
                self.model, input_ids, attention_mask, self.meter, prefix=prefix, capacity=capacity
            )
            root = torch.zeros(b, dtype=torch.int64, device=dev)
            no_tree_node = torch.full((b,), -1, dtype=torch.int64, device=dev)
            self.stores = [
                self.score_nodes(hidden, root, root[:, None][:, :0], torch.arange(b, device=dev) * g, no_tree_node)
            ]
            self.stores += [Expanded.empty(dev) for _ in range(1, self.catalog.code_len)]
        self.meter.kv(b * self.cache.length)
        self.tree = prompt_tree(attention_mask, prefix)
        self.broken = torch.zeros(b, dtype=torch.bool, device=dev) | self.stores[0].broken
        self.decoded = torch.zeros(b, dtype=torch.int64, device=dev)
        self.x_sum = torch.zeros(b, dtype=torch.float64, device=dev)
        self.x_count = torch.zeros(b, dtype=torch.float64, device=dev)

    def score_nodes(
        self, hidden: torch.Tensor, node: torch.Tensor, prefix: torch.Tensor, key: torch.Tensor, tree: torch.Tensor
    ) -> Expanded:
        """hidden [R, H] of R trie nodes node [R] of one level t (tree nodes tree [R], keys user * G + node [R]),
        prefix [R, t] their tokens -> their Expanded entries (candidates: the children through the CSR index, or the
        model's top-M verified by PPV)."""
        head = head_of(self.model)
        if self.top_m is None:
            token, child, valid = self.catalog.children(node, self.catalog.max_children[prefix.shape[1]])
            token = torch.where(valid, token, -1)
            scores = head.score(hidden, token, self.temperature)
        else:
            none = torch.full((hidden.shape[0], 1), -1, device=hidden.device)
            scores = head.score(hidden, none, self.temperature, self.top_m)
            token, scores.logits = scores.top_tokens, scores.top_logits
            ok = self.catalog.verify(prefix, token)  # [R, M] PPV: binary search in the sorted rows
            below = self.catalog.child_node(node[:, None].expand_as(token).reshape(-1), token.reshape(-1))
            child = torch.where(ok, below.view(token.shape), -1)
        lse_t = scores.lse if scores.lse_t is None else scores.lse_t
        broken = ~torch.isfinite(scores.lse) | torch.isnan(scores.logits).any(1)
        return Expanded(key, tree, token, child, scores.logits, scores.lse, lse_t, broken)

    def expand_missing(self, node: torch.Tensor, parent_node: torch.Tensor, prefix: torch.Tensor) -> None:
        """Runs the level-t trie nodes node [B, P] (-1 = dead; parent_node [B, P] their parents, prefix [B, P, t]
        their tokens) that no proposal of their user reached before through the model, each once however many
        proposals stand on it (under its parent's tree node), and adds them to stores[t]."""
        b, t, g = node.shape[0], prefix.shape[2], self.catalog.num_nodes
        user = torch.arange(b, device=node.device)[:, None].expand_as(node)
        key = user * g + node.clamp(min=0)
        _, found = self.stores[t].find(key)
        missing = (node >= 0) & ~found
        if not missing.any():
            return
        new, first = torch.unique(key[missing], return_inverse=True)  # [M] sorted, distinct
        one = torch.zeros_like(new).scatter_(0, first, missing.nonzero()[:, 1])  # [M] one proposal standing on each
        who, what = new // g, new % g  # [M] user, node
        count = torch.bincount(who, minlength=b)  # [B]
        slot = torch.arange(new.numel(), device=new.device) - (torch.cumsum(count, 0) - count)[who]  # [M] per user
        q = int(count.max())
        block_tok = torch.zeros(b, q, dtype=torch.int64, device=node.device)
        block_par = torch.full((b, q), -1, dtype=torch.int64, device=node.device)
        block_tok[who, slot] = self.catalog.edge_tok[what - 1]  # the token leading into the node
        parents = self.stores[t - 1]
        block_par[who, slot] = parents.tree[parents.find(who * g + parent_node[who, one])[0]]  # (-1: the prompt)
        base = self.tree.num_nodes
        hidden = forward(self.model, self.tree, self.cache, block_tok, block_par, meter=self.meter)  # [B, Q, H]
        scored = self.score_nodes(hidden[who, slot], what, prefix[who, one], new, base + slot)
        self.stores[t] = self.stores[t].add(scored)

    @torch.no_grad()
    def propose(self, wanted: torch.Tensor, epoch: torch.Tensor, epochs: int, drawn):
        """Constrained samples, token by token, for the proposal slots wanted [B, P] (the others stay dead) of draws
        launched in epoch [B, P] (drawn: the items they exclude, `drawn_counts`, besides the users' own `exclude`),
        reusing every trie node scored before; counted into the statistics. -> tokens [B, P, L], paths [B, P, L + 1]
        (trie nodes, -1 = dead), log x [B, P], log p [B, P] (temperature 1)."""
        proposals = Proposals.start(wanted, epoch, self.catalog.code_len, self.generator, epochs - 1)
        for level in range(self.catalog.code_len):
            if level and not (proposals.node >= 0).any():
                break  # every proposal is dead (log x = -inf already)
            if level:
                self.expand_missing(proposals.node, proposals.paths[:, :, level - 1], proposals.tokens[:, :, :level])
                self.meter.kv(wanted.shape[0] * self.cache.length)
            self.next_token(proposals, level, epochs, drawn)
        self.count(wanted, proposals.log_x)
        return proposals.tokens, proposals.paths, proposals.log_x, proposals.log_p

    def next_token(self, proposals: Proposals, level: int, epochs: int, drawn) -> None:
        """Every live proposal draws its token at `level` from the model's tempered distribution renormalised over
        its open children (Gumbel-max with `token_gumbel` noise) and moves to that child; log x gains the log of the
        valid mass, log p the token's log-prob (temperature 1). A proposal with no open child dies (log x = -inf)."""
        b, g = proposals.node.shape[0], self.catalog.num_nodes
        node, store = proposals.node, self.stores[level]
        user = torch.arange(b, device=node.device)[:, None].expand_as(node)
        at, _ = store.find(user * g + node.clamp(min=0))  # [B, P] each proposal's entry
        tok, logit = store.token[at], store.logit[at]  # [B, P, C]
        self.broken |= (store.broken[at] & (node >= 0)).any(1)
        child = torch.where(node[:, :, None] >= 0, store.child[at], -1)  # [B, P, C]
        valid = open_children(self.catalog, child, proposals.epoch, epochs, drawn, self.exclude)
        cand = (logit.double() / self.temperature - store.lse_t[at][:, :, None].double()).masked_fill(~valid, NEG_INF)
        mass = cand.logsumexp(-1)  # log of the valid mass (tempered)
        key = (proposals.key + level)[:, :, None] * self.catalog.vocab_size + tok.clamp(min=0)
        pick = (cand + token_gumbel(proposals.seed, key)).argmax(-1, keepdim=True)  # a sample from the valid set
        alive = torch.isfinite(mass) & (node >= 0)
        proposals.log_x = torch.where(alive, proposals.log_x + mass, NEG_INF)
        proposals.tokens[:, :, level] = torch.where(alive, tok.gather(2, pick).squeeze(2), 0)
        proposals.node = torch.where(alive, child.gather(2, pick).squeeze(2), -1)
        proposals.paths[:, :, level + 1] = proposals.node
        proposals.log_p = proposals.log_p + (logit.gather(2, pick).squeeze(2) - store.lse[at])  # temperature 1

    def count(self, wanted: torch.Tensor, log_x: torch.Tensor) -> None:
        """Adds the proposals wanted [B, P] of one `propose` (log x [B, P]) to the statistics: proposals decoded,
        and x over the live ones (their mean estimates 1 - p_b)."""
        self.decoded += wanted.sum(1)
        live = wanted & torch.isfinite(log_x)
        self.x_sum += torch.where(live, log_x.exp(), 0).sum(1)
        self.x_count += live.sum(1)


def sample_items(
    model,
    input_ids,
    attention_mask,
    catalog: Catalog,
    k: int,
    rounds: int,
    disc: bool,
    top_m: int | None,
    temperature: float,
    generator,
    prefix: Prefix | None = None,
    waves: tuple[int, ...] = (2,),
    exclude: Exclusions | None = None,
):
    """k distinct items per user. Independent draws, keeping the first occurrence of each item in draw order, are
    sampling without replacement; a draw may also exclude items that earlier draws produced (it then stands for the
    draws it would have repeated until a new item). A draw is DISC (up to `rounds` proposals accepted in turn with
    probability x, else importance resampling among `rounds` fresh ones) or plain constrained sampling (one
    proposal, kept). Draws run in passes (one forward per code level each): every pass decodes, together, the next
    wave of proposals of every undecided draw (`waves`: how many a first-pass draw tries in its first passes, then
    all the rest) and fresh draws for the items still missing, so a draw costs about the 1 / (1 - p_b) proposals
    its sequential algorithm looks at, and a user typically needs two passes. `exclude`: per-user exclusions, closed
    to every draw as the drawn items are (the law is then P_S over the user's remaining items)."""
    if k < 1 or rounds < 1 or not temperature > 0 or (top_m is not None and top_m < 1):
        raise ValueError(
            f"need k, rounds, top_m >= 1 and temperature > 0; got k={k}, rounds={rounds}, "
            f"top_m={top_m}, temperature={temperature}"
        )
    check_prompts(input_ids, attention_mask, catalog, model, prefix=prefix, exclude=exclude)
    run = Proposer(model, catalog, top_m, temperature, generator, exclude, Meter(input_ids.device))
    run.start(input_ids, attention_mask, prefix, capacity=2 * k * catalog.code_len)
    draws = Draws.empty(input_ids.shape[0], catalog.code_len, input_ids.device)
    for epoch in itertools.count():
        draws.launch(draws.missing(k), epoch)
        if not draws.open.any():
            break
        draws.run_pass(run, rounds if disc else 0, waves, epoch)
    return recommendations(run, draws, k, input_ids.shape[1])


def first_distinct(draws: Draws, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first k distinct items of each user's draws (in draw order), ranked by score -> (their draws [B, k],
    live [B, k]: False where the user has fewer than k)."""
    leaf, score = draws.paths[:, :, -1], draws.score  # [B, D]
    d = leaf.shape[1]
    earlier = torch.ones(d, d, dtype=torch.bool, device=leaf.device).tril(-1)
    new = (leaf >= 0) & ~((leaf[:, :, None] == leaf[:, None, :]) & earlier).any(2)  # first occurrences
    keep = new & (new.long().cumsum(1) <= k)  # [B, D] the first k distinct items in draw order
    order = torch.sort(score.masked_fill(~keep, NEG_INF), dim=1, descending=True, stable=True).indices[:, :k]  # D >= k
    return order, keep.gather(1, order)


def recommendations(run: Proposer, draws: Draws, k: int, prompt_len: int) -> Recommendations:
    """The first k distinct items of each user's draws, by score, with DISC's statistics."""
    order, live = first_distinct(draws, k)  # [B, k]
    b, g = order.shape[0], run.catalog.num_nodes

    def pick(x: torch.Tensor) -> torch.Tensor:  # [B, D, ...] -> [B, k, ...]
        return x.gather(1, order.view(b, k, *([1] * (x.dim() - 2))).expand(b, k, *x.shape[2:]))

    stats = run.meter.result(
        beam_batch_kv(b, k, prompt_len, run.catalog.code_len),
        proposals=pick(draws.used).masked_fill(~live, 0).sum(1),  # as the sequential algorithm draws
        proposals_decoded=run.decoded,  # [B] proposals actually decoded, every pass
        acceptance_rate=(pick(draws.accepted) & live).sum(1) / live.sum(1).clamp(min=1),
        invalid_mass=1 - run.x_sum / run.x_count.clamp(min=1),  # p_b = 1 - E_q[x]
        importance_weight=pick(draws.log_x).masked_fill(~live, NEG_INF).exp(),  # x(a), returned items
        expanded_nodes=sum(torch.bincount(s.key // g, minlength=b) for s in run.stores),
        non_finite=run.broken,
    )
    return Recommendations.of(
        run.catalog,
        pick(draws.paths[:, :, -1]).masked_fill(~live, -1),
        pick(draws.tokens).masked_fill(~live[:, :, None], -1),
        pick(draws.score).masked_fill(~live, NEG_INF),
        stats,
        run.exclude,
    )


@dataclass
class Draws:
    """Every user's draws in draw order [B, D]: undecided (open), the pass that launched each (its epoch) and the
    one that decided it (-1: not yet), how many of its proposals in turn it has tried and in how many passes, and
    the kept proposal's tokens [B, D, L], trie path [B, D, L + 1] (-1: no item), score (log p), log x, the
    proposals its sequential algorithm used and whether one was accepted (False: importance-resampled)."""

    open: torch.Tensor
    epoch: torch.Tensor
    decided_at: torch.Tensor
    tried: torch.Tensor
    passes: torch.Tensor
    tokens: torch.Tensor
    paths: torch.Tensor
    score: torch.Tensor
    log_x: torch.Tensor
    used: torch.Tensor
    accepted: torch.Tensor
    serial: torch.Tensor  # [B, D] the draw's place among its user's draws (-1: a filler column), for per-user draws

    @staticmethod
    def empty(b: int, code_len: int, device) -> Draws:
        return Draws.blank(b, 0, code_len, device)

    @staticmethod
    def blank(b: int, d: int, code_len: int, device) -> Draws:
        full = lambda shape, v, dtype: torch.full(shape, v, dtype=dtype, device=device)  # noqa: E731
        return Draws(
            full((b, d), False, torch.bool),
            full((b, d), 0, torch.int64),
            full((b, d), -1, torch.int64),
            full((b, d), 0, torch.int64),
            full((b, d), 0, torch.int64),
            full((b, d, code_len), -1, torch.int64),
            full((b, d, code_len + 1), -1, torch.int64),
            full((b, d), NEG_INF, torch.float32),
            full((b, d), NEG_INF, torch.float64),
            full((b, d), 0, torch.float32),
            full((b, d), False, torch.bool),
            full((b, d), -1, torch.int64),
        )

    def missing(self, k: int) -> torch.Tensor:
        """[B] draws to launch: k minus the distinct items decided and the draws still open; none once a draw found
        nothing left to draw."""
        leaf, decided = self.paths[:, :, -1], self.decided_at >= 0
        d = leaf.shape[1]
        again = (
            (leaf[:, :, None] == leaf[:, None, :])
            & decided[:, None, :]
            & torch.ones(d, d, dtype=torch.bool, device=leaf.device).tril(-1)
        ).any(2)
        distinct = (decided & (leaf >= 0) & ~again).sum(1)
        exhausted = (decided & (leaf < 0)).any(1)
        return torch.where(exhausted, 0, k - distinct - self.open.sum(1)).clamp(min=0)

    def launch(self, need: torch.Tensor, epoch: int) -> None:
        """Appends need [B] open draws per user, launched in this pass."""
        m = int(need.max()) if need.numel() else 0
        if m == 0:
            return
        b, _, code_len = self.tokens.shape
        new = Draws.blank(b, m, code_len, need.device)
        new.open = torch.arange(m, device=need.device)[None, :] < need[:, None]
        new.epoch.fill_(epoch)
        launched = (self.serial >= 0).sum(1, keepdim=True)  # [B, 1]
        new.serial = torch.where(new.open, launched + torch.arange(m, device=need.device), -1)
        for f in fields(Draws):
            setattr(self, f.name, torch.cat([getattr(self, f.name), getattr(new, f.name)], 1))

    def run_pass(self, run: Proposer, r: int, waves: tuple[int, ...], epoch: int) -> None:
        """Decodes the next proposals of every open draw in one `propose` and decides the draws they settle."""
        final, turn = self.turns(r, waves)  # [B, D]
        n = torch.where(self.open, turn + torch.where(final, r, 0), 0)  # [B, D] proposals decoded this pass
        tokens, paths, log_x, log_p = self.decode(run, n, epoch)  # [B, D, W, ...]
        ok, first, pick = choose(log_x, turn, n, r, run.generator, self.serial, epoch)  # [B, D]
        done = self.open & (ok | final)
        kept_x = kept(log_x, pick)
        dead = done & ~torch.isfinite(kept_x)  # the kept proposal found no item left (x = 0)
        self.paths = torch.where(done[:, :, None], kept(paths, pick).masked_fill(dead[:, :, None], -1), self.paths)
        self.tokens = torch.where(done[:, :, None], kept(tokens, pick).masked_fill(dead[:, :, None], -1), self.tokens)
        self.score = torch.where(done, kept(log_p, pick).masked_fill(dead, NEG_INF), self.score)
        self.log_x = torch.where(done, kept_x, self.log_x)
        self.used = torch.where(done, torch.where(ok, self.tried + first + 1, 2 * r).float(), self.used)
        self.accepted = torch.where(done, ok, self.accepted)
        self.decided_at = torch.where(done, epoch, self.decided_at)
        self.tried = torch.where(self.open, self.tried + turn, self.tried)
        self.passes = self.passes + self.open.long()
        self.open = self.open & ~done

    def turns(self, r: int, waves: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """This pass, per draw [B, D]: whether it is the draw's final pass (which also decodes the r fresh
        proposals it would importance-resample among), and how many of its proposals in turn it tries."""
        if r == 0:  # constrained sampling: one proposal, kept
            return torch.ones_like(self.open), torch.ones_like(self.tried)
        # draws of the first pass go in waves, later ones (replacements) try everything at once
        size = torch.tensor([*waves, r], device=self.open.device)[self.passes.clamp(max=len(waves))]
        final = (self.epoch > 0) | (self.passes >= len(waves)) | (self.tried + size >= r)
        return final, torch.where(final, r - self.tried, size)

    def decode(self, run: Proposer, n: torch.Tensor, epoch: int) -> list[torch.Tensor]:
        """n [B, D] proposals of every draw, decoded side by side in one `propose` -> per draw: tokens
        [B, D, W, L], paths [B, D, W, L + 1], log x and log p [B, D, W] (W = max n; beyond a draw's n: filler)."""
        (b, d), dev = n.shape, n.device
        end = n.cumsum(1)  # [B, D]
        width = int(end[:, -1].max())
        pos = torch.arange(width, device=dev).expand(b, width).contiguous()
        slot = torch.searchsorted(end, pos, right=True).clamp(max=d - 1)  # [B, P] the draw of each proposal
        wanted = pos < end[:, -1:]
        drawn = drawn_counts(run.catalog, self, epoch + 1)
        decoded = run.propose(wanted, self.epoch.gather(1, slot), epoch + 1, drawn)
        w = int(n.max())
        j = torch.arange(w, device=dev)  # [W] proposal index within its draw's pass
        index = ((end - n)[:, :, None] + j).clamp(max=max(width - 1, 0)).view(b, d * w)  # [B, D * W]

        def per_draw(x: torch.Tensor) -> torch.Tensor:  # [B, P, ...] -> [B, D, W, ...]
            at = index.view(b, d * w, *([1] * (x.dim() - 2))).expand(b, d * w, *x.shape[2:])
            return x.gather(1, at).view(b, d, w, *x.shape[2:])

        return [per_draw(x) for x in decoded]


def choose(log_x: torch.Tensor, turn: torch.Tensor, n: torch.Tensor, r: int, generator: Generator, serial, now: int):
    """Each draw's kept proposal among the n [B, D] it decoded this pass (log x [B, D, W]): the first of the `turn`
    [B, D] in turn that is accepted, with probability x (always, for constrained sampling: r = 0), else one of the
    r fresh ones that follow them, resampled with weights x. -> (one was accepted, the first accepted, the kept
    proposal) [B, D]. Per-user draws key each proposal by pass `now`, its draw's serial [B, D] and its place j."""
    (b, d, w), dev = log_x.shape, log_x.device
    j = torch.arange(w, device=dev)  # [W]
    index = serial.clamp(min=0)[:, :, None] * DRAW_STRIDE + j  # [B, D, W] per-user draws' element keys
    in_turn = j < turn[:, :, None]  # [B, D, W]
    if r == 0:
        accept = in_turn
    else:
        u = uniform((b, d, w), stream(generator, ACCEPT, now), dev, index)
        accept = in_turn & (u.log() < log_x)
    ok, first = accept.any(2), accept.int().argmax(2)  # in order: the first accepted proposal
    fresh = log_x.masked_fill(in_turn | (j >= n[:, :, None]), NEG_INF)  # [B, D, W] the r fresh ones
    noise = gumbel((b, d, w), stream(generator, RESAMPLE, now), dev, index)
    return ok, first, torch.where(ok, first, (fresh + noise).argmax(2))  # else resample by x


def kept(x: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """x [B, D, W, ...] of each draw's proposals this pass -> the picked one's, pick [B, D] -> [B, D, ...]."""
    b, d = pick.shape
    return x.gather(2, pick.view(b, d, 1, *([1] * (x.dim() - 3))).expand(b, d, 1, *x.shape[3:])).squeeze(2)


def constrained_sample(
    model,
    input_ids,
    attention_mask,
    catalog: Catalog,
    k: int = 1,
    top_m: int | None = None,
    temperature: float = 1.0,
    generator: Generator = None,
    prefix: Prefix | None = None,
    exclude: Exclusions | None = None,
) -> Recommendations:
    """The trie-style baseline: k items per user, each sampled token by token from the model's distribution
    renormalised over the valid tokens (without replacement across the k). stats['importance_weight'] = x(a)."""
    return sample_items(
        model, input_ids, attention_mask, catalog, k, 1, False, top_m, temperature, generator, prefix, exclude=exclude
    )


def disc_sample(
    model,
    input_ids,
    attention_mask,
    catalog: Catalog,
    k: int,
    rounds: int = 4,
    top_m: int | None = None,
    temperature: float = 1.0,
    generator: Generator = None,
    prefix: Prefix | None = None,
    exclude: Exclusions | None = None,
) -> Recommendations:
    """k distinct items per user drawn with DISC (Algorithm 1): asymptotically the model's distribution restricted
    to the catalog minus the user's `exclude`d items (and to the items not drawn yet). stats: the base keys
    (decoding/stats.py) plus proposals [B] (sequential count), proposals_decoded, acceptance_rate [B], invalid_mass
    [B] (estimated p_b), importance_weight [B, k]."""
    return sample_items(
        model,
        input_ids,
        attention_mask,
        catalog,
        k,
        rounds,
        True,
        top_m,
        temperature,
        generator,
        prefix,
        exclude=exclude,
    )
