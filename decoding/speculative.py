"""AtSpeed speculative beam search with strict top-K verification, batched across users.

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
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from decoding.beam import Recommendations, candidates, expand_beams, gumbel_like, pick, prefill, sample_beams, tree_forward
from decoding.catalog import Catalog
from decoding.tree import TokenTree

NEG_INF = float("-inf")


@dataclass
class Side:
    """One model's view: its token tree and cache, and where the K accepted beams of each user sit in it."""
    model: object
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

    def compact(self, alive: torch.Tensor) -> None:
        """Keeps the paths of the accepted beams (of their parents, where pending); drops every other node."""
        nodes = torch.where(self.pending[:, None], self.parent, self.leaf)
        kept = self.tree.keep_paths(torch.where(alive, nodes, -1), self.cache)
        self.leaf = torch.where(self.pending[:, None], self.leaf, kept)
        self.parent = torch.where(self.pending[:, None], kept, self.parent)


def start(model, input_ids, attention_mask, k: int) -> Side:
    cache, logp = prefill(model, input_ids, attention_mask)  # [A, V]
    a = input_ids.shape[0]
    none = torch.full((a, k), -1, dtype=torch.int64, device=input_ids.device)
    return Side(model, TokenTree.from_prompt(attention_mask), cache, none, logp[:, None, :].repeat(1, k, 1),
                torch.zeros(a, dtype=torch.bool, device=input_ids.device), none.clone())


def last_tokens(tokens: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """tokens [A, K, L], depth [A] -> the beams' last tokens [A, K] (0 at depth 0)."""
    col = (depth - 1).clamp(min=0)[:, None, None].expand(-1, tokens.shape[1], 1)
    return tokens.gather(2, col).squeeze(2).clamp(min=0)


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


@torch.no_grad()
def speculative_beam_search(target, draft, input_ids: torch.Tensor, attention_mask: torch.Tensor, catalog: Catalog,
                            k: int, draft_beams: int = 40, gamma: int | None = None, verification: str = "strict",
                            temperature: float = 1.0, generator: torch.Generator | None = None) -> Recommendations:
    """input_ids, attention_mask [B, S] left-padded -> exactly `beam_search(target, ...)`'s top-k items per user.
    stats: target_forwards, draft_forwards, accepted_steps [B], drafted_steps [B], rounds [B], seconds per phase,
    accepted_hist [gamma + 1]: (user, round) pairs by the number of drafted steps the round accepted; kv_tokens: the
    most KV tokens target and draft held together, against kv_tokens_beam_batch of a batch beam search."""
    code_len = catalog.code_len
    gamma = code_len if gamma is None else gamma
    if verification not in ("strict", "relaxed"):
        raise ValueError(f"verification must be 'strict' or 'relaxed', got {verification!r}")
    if verification == "relaxed" and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    relaxed = verification == "relaxed"
    if k < 1 or draft_beams < k or gamma < 1:
        raise ValueError(f"need 1 <= k <= draft_beams and gamma >= 1, got k={k}, draft_beams={draft_beams}, "
                         f"gamma={gamma}")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"target and draft vocabularies differ: {target.config.vocab_size} vs "
                         f"{draft.config.vocab_size}")
    if catalog.device != input_ids.device or (attention_mask[:, -1] == 0).any():
        raise ValueError("catalog and prompts must be on one device, and prompts left-padded")
    b, dev = input_ids.shape[0], input_ids.device
    n = k if relaxed else draft_beams  # relaxed: the draft samples k sequences per step, each verified by a draw
    width = max(catalog.max_children)
    clock = {"prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0}
    t0 = time.perf_counter()
    tgt, drf = start(target, input_ids, attention_mask, k), start(draft, input_ids, attention_mask, k)
    clock["prefill_s"] = time.perf_counter() - t0
    forwards = {"target": 1, "draft": 1}

    # step 1 is free: the prefill already gives the target's log-probs at the prompt
    root = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    if relaxed:
        score, _, first, node, _, _ = sample_beams(catalog, tgt.logp[:, :1], root.float(), root, k, width,
                                                   temperature, generator)
    else:
        score, _, first, node = expand_beams(catalog, tgt.logp[:, :1], root.float(), root, k, width)  # [B, K]
    tokens = torch.full((b, k, code_len), -1, dtype=torch.int64, device=dev)
    tokens[:, :, 0] = torch.where(node >= 0, first, -1)
    depth = torch.ones(b, dtype=torch.int64, device=dev)
    for side in (tgt, drf):  # the beams' tokens enter both trees with the next forward
        side.pending = torch.ones_like(side.pending)
    users = torch.arange(b, device=dev)  # original row of each active user
    out_tokens, out_score, out_node = tokens.clone(), score.clone(), node.clone()
    accepted, drafted, rounds = (torch.zeros(b, dtype=torch.int64, device=dev) for _ in range(3))
    accepted_hist = torch.zeros(gamma + 1, dtype=torch.int64, device=dev)
    kv_peak = b * (tgt.tree.kv_len + drf.tree.kv_len)  # KV tokens held by target + draft

    if code_len == 1:  # done after the free step
        users = users[:0]
    while users.numel():
        a = users.numel()
        # [A] steps drafted this round: the step after the last drafted one is free (from the verify pass)
        g = (code_len - 1 - depth).clamp(max=gamma)
        steps = int(g.max())
        alive = score > NEG_INF  # [A, K]

        # ---- draft: N beams for g steps from the accepted beams, one draft forward per step
        t1 = time.perf_counter()
        if steps and drf.pending.any():
            tok, par = drf.add_pending(last_tokens(tokens, depth), alive)
            logp = tree_forward(draft, drf.tree, drf.cache, tok, par)  # [A, K, V]
            drf.logp = torch.where(drf.pending[:, None, None], logp, drf.logp)
            drf.leaf = torch.where(drf.pending[:, None], drf.tree.num_nodes - k + torch.arange(k, device=dev), drf.leaf)
            drf.pending = torch.zeros_like(drf.pending)
            forwards["draft"] += 1
        drafts = []  # per step: node, token, parent index, draft logp, draft tree node  ([A, N] / [A, N, V])
        cur_score, cur_node, cur_logp, cur_tree = score, node, drf.logp, drf.leaf
        for i in range(1, steps + 1):
            if relaxed:  # Q: the draft's own sampling-based beam step, recorded for the verification
                s, parent, tok, nd, q_weight, flat = sample_beams(catalog, cur_logp, cur_score, cur_node, n, width,
                                                                  temperature, generator)
            else:
                s, parent, tok, nd = expand_beams(catalog, cur_logp, cur_score, cur_node, n, width)
                q_weight, flat = None, None
            live = (nd >= 0) & (i <= g)[:, None]
            par_tree = torch.where(live, cur_tree.gather(1, parent.clamp(min=0)), -1)
            logp = tree_forward(draft, drf.tree, drf.cache, torch.where(live, tok, 0), par_tree)  # [A, N, V]
            forwards["draft"] += 1
            tree_idx = (drf.tree.num_nodes - n + torch.arange(n, device=dev)).expand(a, n)
            drafts.append((torch.where(live, nd, -1), tok, parent.clamp(min=0), logp, tree_idx, q_weight, flat))
            cur_score, cur_node, cur_logp, cur_tree = torch.where(live, s, NEG_INF), torch.where(live, nd, -1), logp, tree_idx
        clock["draft_s"] += time.perf_counter() - t1

        # ---- verify: every drafted node of every step (and pending beams) in ONE target forward
        t2 = time.perf_counter()
        base = tgt.tree.num_nodes
        tok, par = tgt.add_pending(last_tokens(tokens, depth), alive)
        block_tok, block_par = [tok], [par]
        prev = torch.where(tgt.pending[:, None], base + torch.arange(k, device=dev), tgt.leaf)  # accepted beams
        for i, (nd, tok, parent, *_) in enumerate(drafts):
            block_tok.append(torch.where(nd >= 0, tok, 0))
            block_par.append(torch.where(nd >= 0, prev.gather(1, parent), -1))
            prev = (base + k + i * n + torch.arange(n, device=dev)).expand(a, n)
        logp_v = tree_forward(target, tgt.tree, tgt.cache, torch.cat(block_tok, 1), torch.cat(block_par, 1),
                              block_depth=steps + 1)  # [A, K + steps * N, V]
        forwards["target"] += 1
        kv_peak = max(kv_peak, a * (tgt.tree.kv_len + drf.tree.kv_len))  # both caches are largest right here
        tgt.logp = torch.where(tgt.pending[:, None, None], logp_v[:, :k], tgt.logp)
        tgt.leaf = torch.where(tgt.pending[:, None], base + torch.arange(k, device=dev), tgt.leaf)
        tgt.pending = torch.zeros_like(tgt.pending)
        clock["verify_s"] += time.perf_counter() - t2

        # ---- accept: the target's exact top-K step by step, while it is covered by the drafted set
        accepting = torch.ones(a, dtype=torch.bool, device=dev)
        accepted_now = torch.zeros(a, dtype=torch.int64, device=dev)  # [A] steps this round accepted
        t_pending, d_pending = torch.zeros_like(accepting), torch.zeros_like(accepting)
        for j in range(1, steps + 2):
            take = accepting & (depth < code_len)  # these users' beams advance to T_j
            if relaxed:  # T_j: k draws without replacement from the target's P (fresh where nothing was drafted)
                t_score, t_parent, t_tok, t_node, p_weight, _ = sample_beams(catalog, tgt.logp, score, node, k, width,
                                                                             temperature, generator)
            else:  # T_j: the target's exact top-K
                t_score, t_parent, t_tok, t_node = expand_beams(catalog, tgt.logp, score, node, k, width)
            ok = torch.zeros_like(take)
            if j <= steps:
                d_node, _, _, d_logp, d_tree, q_weight, flat = drafts[j - 1]
                drafted_here = take & (j <= g)
                if relaxed:  # draws that accept the drafted sequences, in their order
                    cand, tok, child, d = candidates(catalog, tgt.logp, score, node, width)
                    drawn, ok = relaxed_draws(p_weight, q_weight, flat, generator)
                    verified = pick(cand, tok, child, d, drawn)
                    t_score, t_parent, t_tok, t_node = (torch.where(drafted_here[:, None], v, w)
                                                        for v, w in zip(verified, (t_score, t_parent, t_tok, t_node)))
                    idx = torch.arange(n, device=dev).expand(a, n)  # accepted = the drafted set, in its order
                    ok = drafted_here & ok
                else:
                    hit = (t_node[:, :, None] == d_node[:, None, :]) & (d_node[:, None, :] >= 0)  # [A, K, N]
                    idx = hit.int().argmax(-1)  # [A, K] drafted node holding each target beam
                    ok = drafted_here & (hit.any(-1) | (t_node < 0)).all(-1)
            pend = take & ~ok  # correction (rejected step) or bonus step: not in the trees yet
            live_t = t_node >= 0
            new_t_parent = torch.where(live_t, tgt.leaf.gather(1, t_parent.clamp(min=0)), -1)
            new_d_parent = torch.where(live_t, drf.leaf.gather(1, t_parent.clamp(min=0)), -1)
            moved = tokens.gather(1, t_parent.clamp(min=0)[:, :, None].expand(-1, -1, code_len))
            moved = moved.scatter(2, depth.clamp(max=code_len - 1)[:, None, None].expand(-1, k, 1), t_tok[:, :, None])
            moved = torch.where(live_t[:, :, None], moved, -1)
            tokens = torch.where(take[:, None, None], moved, tokens)
            score = torch.where(take[:, None], t_score, score)
            node = torch.where(take[:, None], t_node, node)
            depth = depth + take.long()
            if j <= steps:
                rows = base + k + (j - 1) * n + idx  # target tree nodes of the matched drafted nodes
                tgt.logp = torch.where(ok[:, None, None], gather_rows(logp_v[:, k + (j - 1) * n: k + j * n], idx), tgt.logp)
                tgt.leaf = torch.where(ok[:, None], rows, tgt.leaf)
                drf.logp = torch.where(ok[:, None, None], gather_rows(d_logp, idx), drf.logp)
                drf.leaf = torch.where(ok[:, None], d_tree.gather(1, idx), drf.leaf)
            tgt.parent = torch.where(pend[:, None], new_t_parent, tgt.parent)
            drf.parent = torch.where(pend[:, None], new_d_parent, drf.parent)
            t_pending, d_pending = t_pending | pend, d_pending | pend
            accepted_now += ok.long()
            accepting = ok
        tgt.pending, drf.pending = t_pending, d_pending
        accepted[users] += accepted_now
        accepted_hist += torch.bincount(accepted_now, minlength=gamma + 1)
        drafted[users] += g
        rounds[users] += 1

        done = depth >= code_len
        if done.any():  # finished users leave the batch
            out_tokens[users[done]], out_score[users[done]], out_node[users[done]] = tokens[done], score[done], node[done]
            keep = (~done).nonzero().flatten()
            users, depth, score, node, tokens = users[keep], depth[keep], score[keep], node[keep], tokens[keep]
            tgt.select(keep)
            drf.select(keep)
        if users.numel():  # pruned branches leave both caches
            tgt.compact(score > NEG_INF)
            drf.compact(score > NEG_INF)

    if relaxed:  # drawn in sampling order: rank by score, as the sampling-based beam search does
        order = torch.sort(out_score, dim=1, descending=True, stable=True).indices
        out_score, out_node = out_score.gather(1, order), out_node.gather(1, order)
        out_tokens = out_tokens.gather(1, order[:, :, None].expand_as(out_tokens))
    stats = {**clock, "target_forwards": forwards["target"], "draft_forwards": forwards["draft"],
             "accepted_steps": accepted, "drafted_steps": drafted, "rounds": rounds,
             "accepted_hist": accepted_hist, "kv_tokens": kv_peak,
             "kv_tokens_beam_batch": b * k * (input_ids.shape[1] + code_len - 1)}  # a batch beam search's KV
    return Recommendations(catalog.item_of_node(out_node), out_tokens, out_score, stats)
