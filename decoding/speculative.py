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

No work is padded to the batch: users are kept sorted by their number of drafted steps g, so that draft step i runs
on the first rows only (the users that draft it). The last drafted step is never run through the draft: only the
target needs its scores, and the next round's first draft forward carries the K sequences of it that were accepted
(when a user accepted them all) together with the beams' new tokens.

Relaxed verification (`verification="relaxed"`): the draft samples K sequences per step (sampling-based beam
search); draw i accepts the i-th with probability min(1, P_i / Q_i) and the first rejected draw is resampled from the
residual, so every step is K draws without replacement from the target's P: the output has exactly the distribution
of `beam_search(target, do_sample=True)`. This differs from the AtSpeed paper's relaxed scheme, whose draft samples
N >= K sequences per step and verifies them against the target's distribution: with K draws per step the drafted set
IS the proposal of the K draws, which is what makes one draw per drafted sequence exact; with N > K sequences the
acceptance test would have to account for which K of them the draws pick. `draft_beams` is therefore K in relaxed
mode, and any other value is refused rather than ignored.

Read top to bottom: `speculative_beam_search` (the loop), `start`, `first_step`, `draft_steps`, `verify`, `accept`
(`target_step`, `defer_correction`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from decoding.beam import Prefix, check_prompts, children, forward, prefill, prompt_tree, rank_by_score
from decoding.catalog import Catalog, Exclusions
from decoding.draws import Generator, select, stream, uniform
from decoding.search import Children, Recommendations, candidates, expand_beams, gumbel_like, pick, sample_beams
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
    kids: Children  # [A, K, D] the beams' children with their next-token log-probs (stale where pending)
    pending: torch.Tensor  # [A] the beams' last tokens are not in the tree yet
    parent: torch.Tensor  # [A, K] tree node of a pending beam's parent (-1: the prompt)
    carry: torch.Tensor  # [A] draft only: the pending beams' parents are not in the tree yet either
    carry_token: torch.Tensor  # [A, K] their tokens (the last drafted step, accepted)
    carry_parent: torch.Tensor  # [A, K] tree nodes of their parents

    def select(self, users: torch.Tensor) -> None:
        self.tree.select_users(users, self.cache)
        self.leaf, self.kids, self.pending, self.parent = (
            self.leaf[users],
            self.kids.select(users),
            self.pending[users],
            self.parent[users],
        )
        self.carry, self.carry_token, self.carry_parent = (
            self.carry[users],
            self.carry_token[users],
            self.carry_parent[users],
        )

    def pending_block(self, last_token: torch.Tensor, alive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The tokens to add before anything else this round -> (tokens [A, Q], parents [A, Q], block depth): the
        pending beams' last tokens (K per user, dummies elsewhere), preceded by the carried parents of theirs (K more,
        a block of two levels) when some user carries."""
        k = alive.shape[1]
        use = self.pending[:, None] & alive
        if not self.carry.any():
            return torch.where(use, last_token, 0), torch.where(use, self.parent, -1), 1
        carried = self.carry[:, None] & alive
        base = self.tree.num_nodes
        tokens = torch.cat([torch.where(carried, self.carry_token, 0), torch.where(use, last_token, 0)], 1)
        under = torch.where(carried, base + self.parent, self.parent)  # a carried user's parent: the carried node
        parents = torch.cat([torch.where(carried, self.carry_parent, -1), torch.where(use, under, -1)], 1)
        return tokens, parents, 2 if k else 1

    def take_pending(self, kids: Children, first_node: int) -> None:
        """The pending beams' tokens are now tree nodes first_node .. first_node + K - 1, scored `kids`."""
        k = self.leaf.shape[1]
        self.kids = kids.where(self.pending, self.kids)
        self.leaf = torch.where(self.pending[:, None], first_node + torch.arange(k, device=self.leaf.device), self.leaf)
        self.pending = torch.zeros_like(self.pending)
        self.carry = torch.zeros_like(self.carry)

    def follow(self, ok: torch.Tensor, kids: Children, leaf: torch.Tensor) -> None:
        """Users ok [A] move their beams onto tree nodes leaf [A, K] already scored (kids [A, K, D])."""
        self.kids = kids.where(ok, self.kids)
        self.leaf = torch.where(ok[:, None], leaf, self.leaf)

    def defer(self, users: torch.Tensor, beam_parent: torch.Tensor, alive: torch.Tensor) -> None:
        """Users [A] take beams that are not in this tree yet, children of their beams beam_parent [A, K]: their
        tokens enter with the next forward."""
        parent = torch.where(alive, self.leaf.gather(1, beam_parent.clamp(min=0)), -1)
        self.parent = torch.where(users[:, None], parent, self.parent)
        self.pending = self.pending | users

    def defer_carried(
        self,
        users: torch.Tensor,
        beam_parent: torch.Tensor,
        alive: torch.Tensor,
        token: torch.Tensor,
        parent: torch.Tensor,
    ) -> None:
        """Users [A] take beams whose parents (tokens [A, K] under tree nodes parent [A, K]: the last drafted step,
        accepted, never run through this model) are not in the tree either: both enter with the next forward."""
        self.carry = self.carry | users
        self.carry_token = torch.where(users[:, None], token, self.carry_token)
        self.carry_parent = torch.where(users[:, None], parent, self.carry_parent)
        self.parent = torch.where(users[:, None] & alive, beam_parent.clamp(min=0), self.parent)  # index in the block
        self.pending = self.pending | users

    def compact(self, alive: torch.Tensor) -> None:
        """Keeps the paths of the accepted beams (of their parents, where pending; of the carried nodes' parents,
        where carrying); drops every other node."""
        nodes = torch.where(
            self.carry[:, None], self.carry_parent, torch.where(self.pending[:, None], self.parent, self.leaf)
        )
        kept = self.tree.keep_paths(torch.where(alive, nodes, -1), self.cache)
        self.leaf = torch.where(self.pending[:, None], self.leaf, kept)
        self.parent = torch.where(self.pending[:, None] & ~self.carry[:, None], kept, self.parent)
        self.carry_parent = torch.where(self.carry[:, None], kept, self.carry_parent)


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

    def where(self, use: torch.Tensor, other: Step) -> Step:
        """This step for the users use [A], `other` for the rest."""
        pick_ = lambda a, b: torch.where(use[:, None], a, b)  # noqa: E731
        return Step(
            pick_(self.score, other.score),
            pick_(self.parent, other.parent),
            pick_(self.token, other.token),
            pick_(self.node, other.node),
            other.weight,
            other.flat,
        )


@dataclass
class Extend:
    """One beam step over the catalog: the exact top-`count` extensions (strict) or `count` draws without
    replacement (relaxed), from beams scored `score` [A, W] whose children are `kids` [A, W, D]; children closed for
    a user by `exclude` (rows: the active users, selected with them) are never candidates, for the draft either."""

    catalog: Catalog
    relaxed: bool
    temperature: float
    generator: Generator  # relaxed: torch's, or per-user draws (rows: the active users, selected with them)
    exclude: Exclusions | None = None
    round: int = 0  # the round being decoded: with `site`, names a call's per-user draws

    def __call__(self, kids: Children, score: torch.Tensor, count: int, site: tuple[int, ...] = ()) -> Step:
        if self.relaxed:
            return Step(*sample_beams(kids, score, count, self.temperature, self.draws(*site)))
        return Step(*expand_beams(kids, score, count))

    def draws(self, *site: int) -> Generator:
        """The random numbers of one call site of this round (per-user draws: tagged by round and site)."""
        return stream(self.generator, self.round, *site)

    def score(self, model, hidden: torch.Tensor, node: torch.Tensor) -> Children:
        """The children of tree nodes at catalog nodes node [A, Q] (any levels) from their hidden states."""
        return children(model, hidden, self.catalog, node, max(self.catalog.max_children), self.exclude)


@dataclass
class Beams:
    """The K accepted beams of each active user: the target's exact top-K (strict) or K draws (relaxed)."""

    tokens: torch.Tensor  # [A, K, L] code tokens so far, -1 beyond the depth and on dead beams
    score: torch.Tensor  # [A, K] sequence log-probs under the target, -inf = dead
    node: torch.Tensor  # [A, K] catalog node, -1 = dead
    depth: torch.Tensor  # [A] tokens generated

    def select(self, users: torch.Tensor) -> Beams:
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
    or into the beams for j = 1) [A, N]; their children under the draft [A, N, D] and draft tree nodes [A, N] (none
    for the last drafted step, never run through the draft); the step they were drawn by (relaxed verification
    needs its weights and draws)."""

    node: torch.Tensor
    token: torch.Tensor
    parent: torch.Tensor
    kids: Children | None
    tree: torch.Tensor | None
    step: Step
    parent_tree: torch.Tensor  # [A, N] draft tree node of each sequence's parent (-1: the prompt)

    def under_draft(self, idx: torch.Tensor) -> tuple[Children, torch.Tensor]:
        """The drafted sequences idx [A, K] -> their children under the draft [A, K, D] and draft tree nodes [A, K]."""
        return self.kids.take(idx), self.tree.gather(1, idx)


@dataclass
class Verification:
    """One round's drafts and their verification: the steps g [A] each user drafted, the drafted sets D_1 ..
    D_max(g), and the target's verify forward over them: the children of every column of its block scored
    [A, K + steps * N, D] (the K beams' columns, then N per drafted step), the block's first column being tree node
    `first`."""

    g: torch.Tensor
    drafts: list[Drafted]
    kids: Children
    first: int

    def under_target(self, j: int, idx: torch.Tensor) -> tuple[Children, torch.Tensor]:
        """The drafted sequences idx [A, K] of D_j -> their children under the target [A, K, D] and target tree
        nodes [A, K]."""
        k, n = idx.shape[1], self.drafts[j - 1].node.shape[1]
        column = k + (j - 1) * n + idx  # [A, K] block columns
        return self.kids.take(column), self.first + column


@dataclass
class LastStep:
    """The beams accepted onto their user's last drafted step, whose nodes the draft never ran (no draft scores, no
    draft tree nodes): which users' beams stand there [A], and their tokens and the draft tree nodes of their parents
    [A, K], which the draft's next forward carries."""

    on: torch.Tensor
    token: torch.Tensor
    parent: torch.Tensor

    @staticmethod
    def none(a: int, k: int, device) -> LastStep:
        zeros = torch.zeros(a, k, dtype=torch.int64, device=device)
        return LastStep(torch.zeros(a, dtype=torch.bool, device=device), zeros, zeros)

    def update(self, on: torch.Tensor, drafted: Drafted, idx: torch.Tensor) -> LastStep:
        """Users on [A] accepted their last drafted step `drafted`, moving onto its sequences idx [A, K]."""
        token = torch.where(on[:, None], drafted.token.gather(1, idx), self.token)
        return LastStep(on, token, torch.where(on[:, None], drafted.parent_tree.gather(1, idx), self.parent))


@torch.no_grad()
def speculative_beam_search(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    catalog: Catalog,
    k: int,
    draft_beams: int | None = None,
    gamma: int | None = None,
    verification: str = "strict",
    temperature: float = 1.0,
    generator: Generator = None,
    prefix: Prefix | None = None,
    exclude: Exclusions | None = None,
) -> Recommendations:
    """input_ids, attention_mask [B, S] left-padded (continuing `prefix` when given; per-user exclusions `exclude`
    as in beam_search) -> exactly `beam_search(target, ...)`'s top-k items per user (strict; draft_beams N defaults
    to max(40, k)), or a draw of `beam_search(target, do_sample=True, ...)` (relaxed: the draft proposes the K
    sequences that the K draws verify, so draft_beams is K). `generator`: torch's, or per-user draws
    (decoding/draws.py: a user's draws are then the same in any batch).
    stats: the base keys (decoding/stats.py) plus accepted_steps [B], drafted_steps [B], rounds [B] and
    accepted_hist [gamma + 1]: (user, round) pairs by the number of drafted steps the round accepted."""
    code_len = catalog.code_len
    gamma = code_len if gamma is None else gamma
    relaxed = verification == "relaxed"
    n = (k if relaxed else max(40, k)) if draft_beams is None else draft_beams
    check_arguments(
        target, draft, input_ids, attention_mask, catalog, k, n, gamma, verification, temperature, prefix, exclude
    )
    b, dev = input_ids.shape[0], input_ids.device
    extend = Extend(catalog, relaxed, temperature, generator, exclude)
    meter = Meter(dev)
    room = (k + n) * code_len
    with meter.phase("prefill"):
        tgt = start(target, "target", input_ids, attention_mask, k, meter, extend, prefix, room)
        drf = start(draft, "draft", input_ids, attention_mask, k, meter, extend, prefix, room)
    meter.kv(b * (tgt.cache.length + drf.cache.length))
    broken = tgt.kids.broken[:, 0] | (relaxed & drf.kids.broken[:, 0])  # [B] NaN / inf log-probs
    beams = first_step(extend, tgt, k, code_len)  # step 1 is free: the prefill gives the target's log-probs
    for side in (tgt, drf):  # the beams' tokens enter both trees with the next forward
        side.pending = torch.ones_like(side.pending)

    users = torch.arange(b, device=dev)  # original row of each active user
    out = beams.select(users)
    accepted, drafted, rounds = (torch.zeros(b, dtype=torch.int64, device=dev) for _ in range(3))
    accepted_hist = torch.zeros(gamma + 1, dtype=torch.int64, device=dev)
    if code_len == 1:  # done after the free step
        users = users[:0]
    for r in itertools.count():
        if not users.numel():
            break
        extend.round = r  # every active user's r-th round
        g = (code_len - 1 - beams.depth).clamp(max=gamma)  # [A] steps drafted (sorted: descending)
        with meter.phase("draft"):
            drafts = draft_steps(drf, beams, g, n, extend, meter)
        with meter.phase("verify"):
            verification = Verification(g, drafts, *verify(tgt, beams, drafts, extend, meter))
        broken[users] |= verification.kids.broken.any(1)
        if relaxed:  # relaxed verification also weighs the draft's numbers
            for kids in [drf.kids] + [d.kids for d in drafts if d.kids is not None]:
                broken[users] |= kids.broken.any(1)
        meter.kv(users.numel() * (tgt.cache.length + drf.cache.length))  # both caches are largest right here
        accepted_now = accept(tgt, drf, beams, verification, extend)  # [A]
        accepted[users] += accepted_now
        accepted_hist += torch.bincount(accepted_now, minlength=gamma + 1)
        drafted[users] += g
        rounds[users] += 1

        done = beams.depth >= code_len
        if done.any():
            for name in ("tokens", "score", "node"):
                getattr(out, name)[users[done]] = getattr(beams, name)[done]
        # the users left, sorted by next round's drafted steps (descending: by depth), so draft step i runs on a prefix
        left = (~done).nonzero().flatten()
        order = left[torch.sort(beams.depth[left], stable=True).indices]
        if order.numel() != done.numel() or not torch.equal(order, torch.arange(done.numel(), device=dev)):
            users, beams = users[order], beams.select(order)
            extend.exclude = extend.exclude.select(order) if extend.exclude is not None else None
            extend.generator = select(extend.generator, order)
            tgt.select(order)
            drf.select(order)
        if users.numel():  # pruned branches leave both caches
            tgt.compact(beams.score > NEG_INF)
            drf.compact(beams.score > NEG_INF)

    if relaxed:  # drawn in sampling order: rank by score, as the sampling-based beam search does
        out.score, out.node, out.tokens = rank_by_score(out.score, out.node, out.tokens)
    stats = meter.result(
        beam_batch_kv(b, k, input_ids.shape[1], code_len),
        accepted_steps=accepted,
        drafted_steps=drafted,
        rounds=rounds,
        accepted_hist=accepted_hist,
        non_finite=broken,
    )
    return Recommendations.of(catalog, out.node, out.tokens, out.score, stats, exclude)


def check_arguments(
    target,
    draft,
    input_ids,
    attention_mask,
    catalog: Catalog,
    k: int,
    draft_beams: int,
    gamma: int,
    verification: str,
    temperature: float,
    prefix: Prefix | None,
    exclude: Exclusions | None = None,
) -> None:
    if verification not in ("strict", "relaxed"):
        raise ValueError(f"verification must be 'strict' or 'relaxed', got {verification!r}")
    if verification == "relaxed" and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if verification == "relaxed" and draft_beams != k:
        raise ValueError(
            f"relaxed verification drafts exactly k = {k} sequences per step (each verified by one "
            f"draw), so draft_beams = {draft_beams} cannot be honoured: leave it unset or set it to k"
        )
    if k < 1 or draft_beams < k or gamma < 1:
        raise ValueError(
            f"need 1 <= k <= draft_beams and gamma >= 1, got k={k}, draft_beams={draft_beams}, gamma={gamma}"
        )
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(
            f"target and draft vocabularies differ: {target.config.vocab_size} vs {draft.config.vocab_size}"
        )
    check_prompts(input_ids, attention_mask, catalog, target, draft, prefix=prefix, exclude=exclude)


def start(
    model, role: str, input_ids, attention_mask, k: int, meter: Meter, extend: Extend, prefix: Prefix | None, room: int
) -> Side:
    """Prefills the prompts once: a tree holding only them, every beam at the prompt."""
    cache, hidden = prefill(model, input_ids, attention_mask, meter, role, prefix, room)  # [A, H]
    a, dev = input_ids.shape[0], input_ids.device
    root = torch.zeros(a, 1, dtype=torch.int64, device=dev)
    kids = extend.score(model, hidden[:, None], root).take(root.expand(a, k))  # [A, K, D] (one row per beam)
    none = torch.full((a, k), -1, dtype=torch.int64, device=dev)
    no = torch.zeros(a, dtype=torch.bool, device=dev)
    tree = prompt_tree(attention_mask, prefix)
    return Side(model, role, tree, cache, none, kids, no, none.clone(), no.clone(), none.clone(), none.clone())


def first_step(extend: Extend, tgt: Side, k: int, code_len: int) -> Beams:
    """Step 1 from the prefill's log-probs at the prompt: the K beams at depth 1."""
    b, dev = tgt.leaf.shape[0], tgt.leaf.device
    root = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    step = extend(tgt.kids.take(root), root.float(), k, (0,))  # [B, K]
    tokens = torch.full((b, k, code_len), -1, dtype=torch.int64, device=dev)
    tokens[:, :, 0] = torch.where(step.node >= 0, step.token, -1)
    return Beams(tokens, step.score, step.node, torch.ones(b, dtype=torch.int64, device=dev))


def add_pending(side: Side, beams: Beams, extend: Extend, meter: Meter, rows: int | None = None) -> None:
    """One forward of `side` over its pending block (see Side.pending_block), scoring the beams' children."""
    tok, par, depth = side.pending_block(beams.last_tokens(), beams.score > NEG_INF)
    first = side.tree.num_nodes + tok.shape[1] - beams.score.shape[1]  # the beams' block: the last K columns
    hidden = forward(side.model, side.tree, side.cache, tok, par, depth, meter, side.role, rows)
    kids = extend.score(side.model, hidden[:, -beams.score.shape[1] :], beams.node[: hidden.shape[0]])
    side.take_pending(pad_rows(kids, beams.score.shape[0]), first)


def draft_steps(drf: Side, beams: Beams, g: torch.Tensor, n: int, extend: Extend, meter: Meter) -> list[Drafted]:
    """The draft beam-searches N sequences for g [A] steps from the accepted beams (users sorted by g, descending):
    draft step i runs on the users with g >= i only, and the last step is expanded but not run through the draft.
    -> D_1 .. D_max(g); a user's steps beyond its g are dead."""
    a, k = beams.score.shape
    steps = int(g.max())
    if steps and drf.pending.any():
        add_pending(drf, beams, extend, meter, int((g >= 1).sum()))
    drafts = []
    score, node, kids, tree = beams.score, beams.node, drf.kids, drf.leaf  # D_0: the beams
    for i in range(1, steps + 1):
        step = extend(kids, score, n, (1, i))  # [A, N]
        live = (step.node >= 0) & (i <= g)[:, None]
        parent_tree = torch.where(live, tree.gather(1, step.parent.clamp(min=0)), -1)
        score, node = torch.where(live, step.score, NEG_INF), torch.where(live, step.node, -1)
        d = Drafted(node, step.token, step.parent.clamp(min=0), None, None, step, parent_tree)
        if i < steps:  # the draft's scores at D_i: needed to draft D_{i+1} (only by the users with g > i)
            rows = int((g > i).sum())
            first = drf.tree.num_nodes
            hidden = forward(
                drf.model,
                drf.tree,
                drf.cache,
                torch.where(live, step.token, 0),
                parent_tree,
                meter=meter,
                role=drf.role,
                rows=rows,
            )
            kids = pad_rows(extend.score(drf.model, hidden, node[:rows]), a)
            tree = (first + torch.arange(n, device=g.device)).expand(a, n)
            d.kids, d.tree = kids, tree
        drafts.append(d)
    return drafts


def verify(tgt: Side, beams: Beams, drafts: list[Drafted], extend: Extend, meter: Meter) -> tuple[Children, int]:
    """ONE target forward over a block of tree nodes per user: the beams' tokens where pending (K), then every
    drafted node of every step (N each), each under its parent -> (their children scored [A, K + steps * N, D],
    the tree node of the block's first column)."""
    a, k = beams.score.shape
    dev = beams.score.device
    base = tgt.tree.num_nodes
    tok, par, _ = tgt.pending_block(beams.last_tokens(), beams.score > NEG_INF)
    block_tok, block_par, block_node = [tok], [par], [beams.node]
    prev = torch.where(tgt.pending[:, None], base + torch.arange(k, device=dev), tgt.leaf)  # tree nodes of D_0
    for i, d in enumerate(drafts):
        n = d.node.shape[1]
        block_tok.append(torch.where(d.node >= 0, d.token, 0))
        block_par.append(torch.where(d.node >= 0, prev.gather(1, d.parent), -1))
        block_node.append(d.node)
        prev = (base + k + i * n + torch.arange(n, device=dev)).expand(a, n)
    hidden = forward(
        tgt.model,
        tgt.tree,
        tgt.cache,
        torch.cat(block_tok, 1),
        torch.cat(block_par, 1),
        len(drafts) + 1,
        meter,
        tgt.role,
    )
    kids = extend.score(tgt.model, hidden, torch.cat(block_node, 1))
    tgt.take_pending(kids.take(torch.arange(k, device=dev).expand(a, k)), base)
    return kids, base


def covered(t_node: torch.Tensor, d_node: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Strict verification of one step: the target's top-K t_node [A, K] against the drafted set d_node [A, N] ->
    (every target sequence is drafted [A], drafted index of each target beam [A, K])."""
    hit = (t_node[:, :, None] == d_node[:, None, :]) & (d_node[:, None, :] >= 0)  # [A, K, N]
    return (hit.any(-1) | (t_node < 0)).all(-1), hit.int().argmax(-1)


def accept(tgt: Side, drf: Side, beams: Beams, verification: Verification, extend: Extend) -> torch.Tensor:
    """Step by step j = 1 .. steps + 1: the target's own step T_j from the beams (`target_step`). A user whose step
    j is verified moves its beams onto the drafted nodes, whose target and draft scores this round already computed,
    and goes on to j + 1. At the first rejected step, or after the last drafted one, its beams become T_j (the
    correction or the free bonus step), pending in both trees until the next forward, and it stops; after the last
    drafted step, whose nodes the draft never ran, the draft carries them too. -> accepted steps [A] this round."""
    (a, k), g, drafts = beams.score.shape, verification.g, verification.drafts
    accepting = torch.ones(a, dtype=torch.bool, device=g.device)
    accepted_steps = torch.zeros(a, dtype=torch.int64, device=g.device)
    last = LastStep.none(a, k, g.device)
    for j in range(1, len(drafts) + 2):
        drafted = drafts[j - 1] if j <= len(drafts) else None
        moving = accepting & (beams.depth < beams.tokens.shape[2])  # these users' beams advance to T_j
        step, accepted, idx = target_step(extend, tgt, beams, drafted, moving & (j <= g), j)
        defer_correction(tgt, drf, moving & ~accepted, step, last)
        beams.advance(moving, step)
        if drafted is not None:
            tgt.follow(accepted, *verification.under_target(j, idx))
            last = last.update(accepted & (j == g), drafted, idx)
            if drafted.kids is not None:  # the draft ran D_j: every user's step but its last
                drf.follow(accepted & ~last.on, *drafted.under_draft(idx))
        accepted_steps += accepted.long()
        accepting = accepted
    return accepted_steps


def target_step(
    extend: Extend, tgt: Side, beams: Beams, drafted: Drafted | None, drafting: torch.Tensor, j: int
) -> tuple[Step, torch.Tensor, torch.Tensor | None]:
    """T_j, the target's own step from the beams (strict: its exact top-K; relaxed, for the users drafting [A]: K
    draws that accept the drafted sequences D_j in order with probability min(1, P_i / Q_i)), and whether it
    verifies D_j (strict: every sequence of T_j was drafted; relaxed: all K draws accepted).
    -> (T_j [A, K], accepted [A], the drafted index of each sequence of T_j [A, K]; None past the last drafted step)."""
    a, k = beams.score.shape
    step = extend(tgt.kids, beams.score, k, (2, j))  # T_j: fresh where nothing was drafted
    if drafted is None:
        return step, torch.zeros_like(drafting), None
    if not extend.relaxed:
        all_drafted, idx = covered(step.node, drafted.node)
        return step, drafting & all_drafted, idx
    cand, tok, child, width = candidates(tgt.kids, beams.score)
    drawn, all_accepted = relaxed_draws(step.weight, drafted.step.weight, drafted.step.flat, extend.draws(3, j))
    step = Step(*pick(cand, tok, child, width, drawn)).where(drafting, step)
    return step, drafting & all_accepted, torch.arange(k, device=drawn.device).expand(a, k)  # D_j, in its order


def defer_correction(tgt: Side, drf: Side, users: torch.Tensor, step: Step, last: LastStep) -> None:
    """Users [A] take T_j (`step`: the correction at their first rejected step, or the bonus step after the last
    drafted one), whose sequences are in neither tree yet: they enter both with the next forward, and the draft's
    together with their parents when those are the last drafted step's nodes, which the draft never ran."""
    alive = step.node >= 0
    tgt.defer(users, step.parent, alive)
    drf.defer(users & ~last.on, step.parent, alive)
    if (users & last.on).any():
        drf.defer_carried(users & last.on, step.parent, alive, last.token, last.parent)


def pad_rows(kids: Children, rows: int) -> Children:
    """Children of the first rows [A', Q, D] -> [rows, Q, D], the missing rows dead (no children)."""
    missing = rows - kids.token.shape[0]
    if not missing:
        return kids
    pad = lambda x, v: torch.cat([x, x.new_full((missing, *x.shape[1:]), v)])  # noqa: E731
    return Children(pad(kids.token, 0), pad(kids.node, -1), pad(kids.logp, NEG_INF), pad(kids.broken, False))


def relaxed_draws(p_weight: torch.Tensor, q_weight: torch.Tensor, proposals: torch.Tensor, generator: Generator):
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
    u = uniform((a, k), stream(generator, 0), p_weight.device)
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
    x = (log_res + gumbel_like(log_res, stream(generator, 1))).argmax(1)  # [A] the resampled draw (none: every
    # candidate is taken, fewer than k exist)
    x = torch.where(torch.isfinite(log_res.gather(1, x[:, None]))[:, 0], x, c)
    later = torch.where(taken | (torch.arange(c, device=p_weight.device) == x[:, None]), float("-inf"), lp)  # [A, C]
    rest = torch.topk(later + gumbel_like(later, stream(generator, 2)), k, dim=1)  # the remaining draws, from P
    rest_idx = torch.where(torch.isfinite(rest.values), rest.indices, c)
    drawn = torch.where(
        m < r[:, None],
        torch.where(live, prop, c),
        torch.where(
            m == r[:, None],
            x[:, None],
            rest_idx.gather(1, (m - r[:, None] - 1).clamp(min=0)),
        ),
    )
    return drawn, r >= k
