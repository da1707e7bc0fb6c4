"""AtSpeed speculative beam search, batched across users: strict top-K verification (lossless) and relaxed
sampling verification.

Each round, for every unfinished user at depth d whose K accepted beams are the target's exact top-K at d:
  draft   the draft beam-searches N = `draft_beams` sequences for g = min(gamma, L - d - 1) steps, from the
          accepted beams (scored by the target) and adding its own log-probabilities: drafted sets D_1 .. D_g;
  verify  the target scores every drafted node of every step (plus the accepted beams' own tokens when they
          are not in its tree yet) in ONE forward pass over its token tree;
  accept  for j = 1 .. g the target's exact top-K T_j (expanded from the accepted beams with the target's own
          log-probabilities, exactly as `beam_search` does) is accepted iff every sequence of T_j is in D_j.
          At the first rejected step the output is T_j itself; if all g steps are accepted, T_{g+1} comes from
          the same forward pass. Either way a round advances a user by (accepted steps + 1) with one target
          forward, where beam search needs one forward per step (step 1 is free from the prefill in both).
The result equals `beam_search(target, ...)`. Users accept different numbers of steps, so one forward pass holds
users at different depths (per-node position ids, trie node ids that carry their level); finished users leave
the batch. Both models keep one tree over the single prompt prefill; rejected branches are compacted away and
accepted tokens are never recomputed.

Relaxed verification (`verification="relaxed"`): the draft samples K sequences per step (sampling-based beam
search, N = K); draw i accepts the i-th with probability min(1, P_i / Q_i) and the first rejected draw is resampled
from the residual, so every step is K draws without replacement from the target's P: the output has exactly the
distribution of `beam_search(target, do_sample=True)`.

Read top to bottom: `speculative_beam_search` (the loop), `start`, `first_step`, `draft`, `verify`, `accept`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.beam import (Recommendations, candidates, check_prompts, expand_beams, gumbel_like, non_finite, pick,
                           prefill, sample_beams, tree_forward)
from decoding.catalog import Catalog
from decoding.stats import Meter, beam_batch_kv
from decoding.tree import TokenTree

NEG_INF = float("-inf")


@dataclass
class Side:
    """One model's view: its token tree and cache, and where the K accepted beams of each user sit in it."""
    model: object
    role: str  # "target" or "draft"
    tree: TokenTree
    cache: object
    leaf: torch.Tensor  # [A, K] tree node of each beam's last token (-1: the prompt itself)
    logp: torch.Tensor  # [A, K, V] next-token log-probs at the beams (stale where pending)
    pending: torch.Tensor  # [A] the beams' last tokens are not in the tree yet
    parent: torch.Tensor  # [A, K] tree node of a pending beam's parent (-1: the prompt)

    def select(self, users: torch.Tensor) -> None:
        self.tree.select_users(users, self.cache)
        self.leaf, self.logp = self.leaf[users], self.logp[users]
        self.pending, self.parent = self.pending[users], self.parent[users]

    def add_pending(self, last_token: torch.Tensor, alive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block of K nodes per user holding the pending beams' last tokens (dummies elsewhere) -> (tokens, parents)."""
        use = self.pending[:, None] & alive
        return torch.where(use, last_token, 0), torch.where(use, self.parent, -1)

    def take_pending(self, logp: torch.Tensor, first_node: int) -> None:
        """The pending beams' tokens are now tree nodes first_node .. first_node + K - 1, with next-token log-probs
        logp [A, K, V]."""
        k = self.leaf.shape[1]
        self.logp = torch.where(self.pending[:, None, None], logp, self.logp)
        self.leaf = torch.where(self.pending[:, None], first_node + torch.arange(k, device=self.leaf.device),
                                self.leaf)
        self.pending = torch.zeros_like(self.pending)

    def follow(self, ok: torch.Tensor, logp: torch.Tensor, leaf: torch.Tensor) -> None:
        """Users ok [A] move their beams onto tree nodes leaf [A, K] already scored (logp [A, K, V])."""
        self.logp = torch.where(ok[:, None, None], logp, self.logp)
        self.leaf = torch.where(ok[:, None], leaf, self.leaf)

    def defer(self, users: torch.Tensor, beam_parent: torch.Tensor, alive: torch.Tensor) -> None:
        """Users [A] take beams that are not in this tree yet, children of their beams beam_parent [A, K]: their
        tokens enter with the next forward."""
        parent = torch.where(alive, self.leaf.gather(1, beam_parent.clamp(min=0)), -1)
        self.parent = torch.where(users[:, None], parent, self.parent)
        self.pending = self.pending | users

    def compact(self, alive: torch.Tensor) -> None:
        """Keeps the paths of the accepted beams (of their parents, where pending); drops every other node."""
        nodes = torch.where(self.pending[:, None], self.parent, self.leaf)
        kept = self.tree.keep_paths(torch.where(alive, nodes, -1), self.cache)
        self.leaf = torch.where(self.pending[:, None], self.leaf, kept)
        self.parent = torch.where(self.pending[:, None], kept, self.parent)

    def forward(self, tokens: torch.Tensor, parent: torch.Tensor, meter: Meter, block_depth: int = 1) -> torch.Tensor:
        return tree_forward(self.model, self.tree, self.cache, tokens, parent, block_depth, meter, self.role)


@dataclass
class Step:
    """K (or N) sequences one level below the beams: score, parent beam, token and catalog node [A, K] (-1 / -inf:
    none); relaxed: the candidates' log-weights [A, C] they were drawn with and the draws [A, K] in draw order."""
    score: torch.Tensor
    parent: torch.Tensor
    token: torch.Tensor
    node: torch.Tensor
    weight: torch.Tensor | None = None
    flat: torch.Tensor | None = None

    def where(self, use: torch.Tensor, other: "Step") -> "Step":
        """This step for the users use [A], `other` for the rest."""
        pick_ = lambda a, b: torch.where(use[:, None], a, b)  # noqa: E731
        return Step(pick_(self.score, other.score), pick_(self.parent, other.parent), pick_(self.token, other.token),
                    pick_(self.node, other.node), other.weight, other.flat)


@dataclass
class Extend:
    """One beam step over the catalog: the exact top-`count` extensions (strict) or `count` draws without
    replacement (relaxed), from beams scored `score` [A, W] at catalog nodes `node` [A, W] with next-token
    log-probs `logp` [A, W, V]."""
    catalog: Catalog
    relaxed: bool
    temperature: float
    generator: torch.Generator | None

    def __call__(self, logp: torch.Tensor, score: torch.Tensor, node: torch.Tensor, count: int) -> Step:
        width = max(self.catalog.max_children)
        if self.relaxed:
            return Step(*sample_beams(self.catalog, logp, score, node, count, width, self.temperature, self.generator))
        return Step(*expand_beams(self.catalog, logp, score, node, count, width))


@dataclass
class Beams:
    """The K accepted beams of each active user: the target's exact top-K (strict) or K draws (relaxed)."""
    tokens: torch.Tensor  # [A, K, L] code tokens so far, -1 beyond the depth and on dead beams
    score: torch.Tensor  # [A, K] sequence log-probs under the target, -inf = dead
    node: torch.Tensor  # [A, K] catalog node, -1 = dead
    depth: torch.Tensor  # [A] tokens generated

    def select(self, users: torch.Tensor) -> "Beams":
        return Beams(self.tokens[users], self.score[users], self.node[users], self.depth[users])

    def last_tokens(self) -> torch.Tensor:
        """The beams' last tokens [A, K] (0 at depth 0)."""
        col = (self.depth - 1).clamp(min=0)[:, None, None].expand(-1, self.tokens.shape[1], 1)
        return self.tokens.gather(2, col).squeeze(2).clamp(min=0)

    def advance(self, users: torch.Tensor, step: Step) -> None:
        """Users [A] move their beams one level down, to `step`'s sequences."""
        code_len = self.tokens.shape[2]
        live = step.node >= 0
        moved = self.tokens.gather(1, step.parent.clamp(min=0)[:, :, None].expand(-1, -1, code_len))
        at = self.depth.clamp(max=code_len - 1)[:, None, None].expand(-1, step.token.shape[1], 1)
        moved = torch.where(live[:, :, None], moved.scatter(2, at, step.token[:, :, None]), -1)
        self.tokens = torch.where(users[:, None, None], moved, self.tokens)
        self.score = torch.where(users[:, None], step.score, self.score)
        self.node = torch.where(users[:, None], step.node, self.node)
        self.depth = self.depth + users.long()


@dataclass
class Drafted:
    """The draft's sequences D_j at one drafted step: catalog node (-1 = none), token and parent (index into D_{j-1},
    or into the beams for j = 1) [A, N]; the draft's next-token log-probs at them [A, N, V] and their draft tree
    nodes [A, N]; the step they were drawn by (relaxed verification needs its weights and draws)."""
    node: torch.Tensor
    token: torch.Tensor
    parent: torch.Tensor
    logp: torch.Tensor
    tree: torch.Tensor
    step: Step


@torch.no_grad()
def speculative_beam_search(target, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, catalog: Catalog,
                            k: int, draft_beams: int = 40, gamma: int | None = None, verification: str = "strict",
                            temperature: float = 1.0, generator: torch.Generator | None = None) -> Recommendations:
    """input_ids, attention_mask [B, S] left-padded -> exactly `beam_search(target, ...)`'s top-k items per user
    (strict), or a draw of `beam_search(target, do_sample=True, ...)` (relaxed; `draft_beams` is then K: the draft
    proposes the K sequences that the K draws verify).
    stats: the base keys (decoding/stats.py) plus accepted_steps [B], drafted_steps [B], rounds [B] and
    accepted_hist [gamma + 1]: (user, round) pairs by the number of drafted steps the round accepted."""
    code_len = catalog.code_len
    gamma = code_len if gamma is None else gamma
    check_arguments(target, draft, input_ids, attention_mask, catalog, k, draft_beams, gamma, verification,
                    temperature)
    relaxed = verification == "relaxed"
    n = k if relaxed else draft_beams
    b, dev = input_ids.shape[0], input_ids.device
    extend = Extend(catalog, relaxed, temperature, generator)
    meter = Meter(dev)
    with meter.phase("prefill"):
        tgt = start(target, "target", input_ids, attention_mask, k, meter)
        drf = start(draft, "draft", input_ids, attention_mask, k, meter)
    meter.kv(b * (tgt.tree.kv_len + drf.tree.kv_len))
    broken = non_finite(tgt.logp[:, 0]) | (relaxed & non_finite(drf.logp[:, 0]))  # [B] NaN / inf log-probs
    beams = first_step(extend, tgt, k, code_len)  # step 1 is free: the prefill gives the target's log-probs
    for side in (tgt, drf):  # the beams' tokens enter both trees with the next forward
        side.pending = torch.ones_like(side.pending)

    users = torch.arange(b, device=dev)  # original row of each active user
    out = beams.select(users)
    accepted, drafted, rounds = (torch.zeros(b, dtype=torch.int64, device=dev) for _ in range(3))
    accepted_hist = torch.zeros(gamma + 1, dtype=torch.int64, device=dev)
    if code_len == 1:  # done after the free step
        users = users[:0]
    while users.numel():
        g = (code_len - 1 - beams.depth).clamp(max=gamma)  # [A] steps drafted: the one after them comes free
        with meter.phase("draft"):
            drafts = draft_steps(drf, beams, g, n, extend, meter)
        with meter.phase("verify"):
            logp_v = verify(tgt, beams, drafts, meter)  # [A, K + steps * N, V]
        # the target's numbers decide the output; relaxed verification also weighs the draft's
        broken[users] |= non_finite(logp_v).any(1) | (relaxed & non_finite(drf.logp).any(1))
        for d in drafts if relaxed else ():
            broken[users] |= non_finite(d.logp).any(1)
        meter.kv(users.numel() * (tgt.tree.kv_len + drf.tree.kv_len))  # both caches are largest right here
        accepted_now = accept(tgt, drf, beams, drafts, logp_v, g, extend)  # [A]
        accepted[users] += accepted_now
        accepted_hist += torch.bincount(accepted_now, minlength=gamma + 1)
        drafted[users] += g
        rounds[users] += 1

        done = beams.depth >= code_len
        if done.any():  # finished users leave the batch
            for name in ("tokens", "score", "node"):
                getattr(out, name)[users[done]] = getattr(beams, name)[done]
            keep = (~done).nonzero().flatten()
            users, beams = users[keep], beams.select(keep)
            tgt.select(keep)
            drf.select(keep)
        if users.numel():  # pruned branches leave both caches
            tgt.compact(beams.score > NEG_INF)
            drf.compact(beams.score > NEG_INF)

    if relaxed:  # drawn in sampling order: rank by score, as the sampling-based beam search does
        order = torch.sort(out.score, dim=1, descending=True, stable=True).indices
        out.score, out.node = out.score.gather(1, order), out.node.gather(1, order)
        out.tokens = out.tokens.gather(1, order[:, :, None].expand_as(out.tokens))
    stats = meter.result(beam_batch_kv(b, k, input_ids.shape[1], code_len), accepted_steps=accepted,
                         drafted_steps=drafted, rounds=rounds, accepted_hist=accepted_hist, non_finite=broken)
    return Recommendations(catalog.item_of_node(out.node), out.tokens, out.score, stats)


def check_arguments(target, draft, input_ids, attention_mask, catalog: Catalog, k: int, draft_beams: int, gamma: int,
                    verification: str, temperature: float) -> None:
    if verification not in ("strict", "relaxed"):
        raise ValueError(f"verification must be 'strict' or 'relaxed', got {verification!r}")
    if verification == "relaxed" and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if k < 1 or draft_beams < k or gamma < 1:
        raise ValueError(f"need 1 <= k <= draft_beams and gamma >= 1, got k={k}, draft_beams={draft_beams}, "
                         f"gamma={gamma}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft vocabularies differ: {target.config.vocab_size} vs "
                         f"{draft.config.vocab_size}")
    check_prompts(input_ids, attention_mask, catalog, target, draft)


def start(model, role: str, input_ids, attention_mask, k: int, meter: Meter) -> Side:
    """Prefills the prompts once: a tree holding only them, every beam at the prompt."""
    cache, logp = prefill(model, input_ids, attention_mask, meter, role)  # [A, V]
    a = input_ids.shape[0]
    none = torch.full((a, k), -1, dtype=torch.int64, device=input_ids.device)
    return Side(model, role, TokenTree.from_prompt(attention_mask), cache, none, logp[:, None, :].repeat(1, k, 1),
                torch.zeros(a, dtype=torch.bool, device=input_ids.device), none.clone())


def first_step(extend: Extend, tgt: Side, k: int, code_len: int) -> Beams:
    """Step 1 from the prefill's log-probs at the prompt: the K beams at depth 1."""
    b, dev = tgt.logp.shape[0], tgt.logp.device
    root = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    step = extend(tgt.logp[:, :1], root.float(), root, k)  # [B, K]
    tokens = torch.full((b, k, code_len), -1, dtype=torch.int64, device=dev)
    tokens[:, :, 0] = torch.where(step.node >= 0, step.token, -1)
    return Beams(tokens, step.score, step.node, torch.ones(b, dtype=torch.int64, device=dev))


def draft_steps(drf: Side, beams: Beams, g: torch.Tensor, n: int, extend: Extend, meter: Meter) -> list[Drafted]:
    """The draft beam-searches N sequences for g [A] steps from the accepted beams, one draft forward per step (plus
    one first for beams not yet in its tree) -> D_1 .. D_max(g); a user's steps beyond its g are dead nodes."""
    a, k = beams.score.shape
    steps = int(g.max())
    if steps and drf.pending.any():
        tok, par = drf.add_pending(beams.last_tokens(), beams.score > NEG_INF)
        first = drf.tree.num_nodes
        drf.take_pending(drf.forward(tok, par, meter), first)  # [A, K, V]
    drafts = []
    score, node, logp, tree = beams.score, beams.node, drf.logp, drf.leaf  # D_0: the beams
    for i in range(1, steps + 1):
        step = extend(logp, score, node, n)  # [A, N]
        live = (step.node >= 0) & (i <= g)[:, None]
        parent_tree = torch.where(live, tree.gather(1, step.parent.clamp(min=0)), -1)
        first = drf.tree.num_nodes
        logp = drf.forward(torch.where(live, step.token, 0), parent_tree, meter)  # [A, N, V]
        tree = (first + torch.arange(n, device=g.device)).expand(a, n)
        score, node = torch.where(live, step.score, NEG_INF), torch.where(live, step.node, -1)
        drafts.append(Drafted(node, step.token, step.parent.clamp(min=0), logp, tree, step))
    return drafts


def verify(tgt: Side, beams: Beams, drafts: list[Drafted], meter: Meter) -> torch.Tensor:
    """ONE target forward over a block of tree nodes per user: the beams' tokens where pending (K), then every
    drafted node of every step (N each), each under its parent -> next-token log-probs [A, K + steps * N, V].
    Node layout: block column c is tree node `base + c`, base = the tree's size before the block."""
    a, k = beams.score.shape
    dev = beams.score.device
    base = tgt.tree.num_nodes
    tok, par = tgt.add_pending(beams.last_tokens(), beams.score > NEG_INF)
    block_tok, block_par = [tok], [par]
    prev = torch.where(tgt.pending[:, None], base + torch.arange(k, device=dev), tgt.leaf)  # tree nodes of D_0
    for i, d in enumerate(drafts):
        n = d.node.shape[1]
        block_tok.append(torch.where(d.node >= 0, d.token, 0))
        block_par.append(torch.where(d.node >= 0, prev.gather(1, d.parent), -1))
        prev = (base + k + i * n + torch.arange(n, device=dev)).expand(a, n)
    logp = tgt.forward(torch.cat(block_tok, 1), torch.cat(block_par, 1), meter, block_depth=len(drafts) + 1)
    tgt.take_pending(logp[:, :k], base)
    return logp


def covered(t_node: torch.Tensor, d_node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict verification of one step: the target's top-K t_node [A, K] against the drafted set d_node [A, N] ->
    (every target sequence is drafted [A], drafted index of each target beam [A, K])."""
    hit = (t_node[:, :, None] == d_node[:, None, :]) & (d_node[:, None, :] >= 0)  # [A, K, N]
    return (hit.any(-1) | (t_node < 0)).all(-1), hit.int().argmax(-1)


def accept(tgt: Side, drf: Side, beams: Beams, drafts: list[Drafted], logp_v: torch.Tensor, g: torch.Tensor,
           extend: Extend) -> torch.Tensor:
    """Step by step j = 1 .. steps + 1: the target's own step T_j from the beams (strict: its exact top-K; relaxed:
    K draws that accept the drafted sequences in order with probability min(1, P_i / Q_i)). A user whose step j is
    verified (T_j covered by D_j; relaxed: all K draws accepted) moves its beams onto the drafted nodes, whose
    target and draft log-probs this round already computed, and goes on to j + 1. At the first rejected step, or
    after the last drafted one, its beams become T_j (the correction or the free bonus step), pending in both trees
    until the next forward, and it stops. -> accepted steps [A] this round."""
    a, k = beams.score.shape
    code_len = beams.tokens.shape[2]
    accepting = torch.ones(a, dtype=torch.bool, device=g.device)
    accepted_now = torch.zeros(a, dtype=torch.int64, device=g.device)
    for j in range(1, len(drafts) + 2):
        take = accepting & (beams.depth < code_len)  # these users' beams advance to T_j
        t = extend(tgt.logp, beams.score, beams.node, k)  # T_j: fresh where nothing was drafted
        ok = torch.zeros_like(take)
        if j <= len(drafts):
            d = drafts[j - 1]
            drafted_here = take & (j <= g)
            if extend.relaxed:  # the draws that accept the drafted sequences, in their order
                cand, tok, child, width = candidates(extend.catalog, tgt.logp, beams.score, beams.node,
                                                     max(extend.catalog.max_children))
                drawn, all_accepted = relaxed_draws(t.weight, d.step.weight, d.step.flat, extend.generator)
                t = Step(*pick(cand, tok, child, width, drawn)).where(drafted_here, t)
                ok = drafted_here & all_accepted
                idx = torch.arange(k, device=g.device).expand(a, k)  # accepted = the drafted set, in its order
            else:
                all_drafted, idx = covered(t.node, d.node)
                ok = drafted_here & all_drafted
        stop = take & ~ok  # a correction or the bonus step: not in the trees yet
        for side in (tgt, drf):
            side.defer(stop, t.parent, t.node >= 0)
        beams.advance(take, t)
        if j <= len(drafts):
            n = d.node.shape[1]
            base = tgt.tree.num_nodes - logp_v.shape[1]  # the verify block's first tree node
            rows = k + (j - 1) * n + idx  # block columns of the matched drafted nodes
            tgt.follow(ok, gather_rows(logp_v, rows), base + rows)
            drf.follow(ok, gather_rows(d.logp, idx), d.tree.gather(1, idx))
        accepted_now += ok.long()
        accepting = ok
    return accepted_now


def gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [A, N, ...], idx [A, K] -> [A, K, ...]."""
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


def relaxed_draws(p_weight: torch.Tensor, q_weight: torch.Tensor, proposals: torch.Tensor, generator):
    """Relaxed sampling verification of one step, exact in distribution.
    p_weight, q_weight [A, C]: the target's and the draft's log-weights over the same candidates (-inf = none);
    proposals [A, k]: the draft's draws, without replacement from Q, in draw order. Draw i accepts proposal i with
    probability min(1, P_i / Q_i), P_i and Q_i being P and Q without the earlier draws; the first rejected draw is
    resampled from norm(max(0, P_i - Q_i)) and the later ones come from P. The k draws are then k draws without
    replacement from P, as in the target's sampling-based beam search.
    -> (drawn candidates [A, k] in draw order, C where none; all k proposals accepted [A])."""
    a, c = p_weight.shape
    k = proposals.shape[1]
    lp, lq = p_weight.log_softmax(-1), q_weight.log_softmax(-1)  # float64
    live = proposals < c
    prop = proposals.clamp(max=c - 1)
    p_d = torch.where(live, lp.gather(1, prop).exp(), 0.0)  # [A, k]
    q_d = torch.where(live, lq.gather(1, prop).exp(), 0.0)
    rest_p = (1 - (p_d.cumsum(1) - p_d)).clamp(min=1e-300)  # mass left before draw i
    rest_q = (1 - (q_d.cumsum(1) - q_d)).clamp(min=1e-300)
    ratio = (p_d / rest_p) / (q_d / rest_q).clamp(min=1e-300)
    u = torch.rand(a, k, generator=generator, device=p_weight.device, dtype=torch.float64)
    accept = (u < ratio) | ~live
    r = accept.long().cumprod(1).sum(1)  # [A] accepted draws before the first rejection (k: all)
    m = torch.arange(k, device=p_weight.device)
    taken = torch.zeros(a, c + 1, dtype=torch.bool, device=p_weight.device)
    taken.scatter_(1, torch.where((m < r[:, None]) & live, prop, c), True)
    taken = taken[:, :c]  # [A, C] the accepted proposals
    at = r.clamp(max=k - 1)[:, None]
    residual = (lp.exp() / rest_p.gather(1, at) - lq.exp() / rest_q.gather(1, at)).clamp(min=0).masked_fill(taken, 0)
    log_res = torch.where(residual > 0, residual.log(), float("-inf"))
    fallback = torch.where(taken, float("-inf"), lp)  # only if rounding left no residual mass
    log_res = torch.where(torch.isfinite(log_res).any(1, keepdim=True), log_res, fallback)
    x = (log_res + gumbel_like(log_res, generator)).argmax(1)  # [A] the resampled draw
    later = torch.where(taken | (torch.arange(c, device=p_weight.device) == x[:, None]), float("-inf"), lp)
    rest = torch.topk(later + gumbel_like(later, generator), k, dim=1)  # the remaining draws, from P
    rest_idx = torch.where(torch.isfinite(rest.values), rest.indices, c)
    drawn = torch.where(m < r[:, None], torch.where(live, prop, c),
                        torch.where(m == r[:, None], torch.where(torch.isfinite(lp.gather(1, x[:, None])), x[:, None], c),
                                    rest_idx.gather(1, (m - r[:, None] - 1).clamp(min=0))))
    return drawn, r >= k
