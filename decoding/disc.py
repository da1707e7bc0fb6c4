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
"""
from __future__ import annotations

import torch

from decoding.beam import Recommendations, check_prompts, gumbel_like, non_finite, prefill, tree_forward
from decoding.catalog import Catalog
from decoding.stats import Meter, beam_batch_kv
from decoding.tree import TokenTree


def open_children(catalog: Catalog, child: torch.Tensor, drawn_paths: torch.Tensor) -> torch.Tensor:
    """child [B, P, C] node ids (-1 = none), drawn_paths [B, E, L + 1] the node paths of the user's drawn items
    (-1 = none) -> bool [B, P, C]: the child still has an item that was not drawn."""
    b, p, c = child.shape
    on_path = (child.reshape(b, p * c, 1, 1) == drawn_paths[:, None]).any(-1).sum(-1).view(b, p, c)  # [B, P, C]
    return (child >= 0) & (catalog.leaf_count[child.clamp(min=0)] > on_path)


def step_candidates(catalog: Catalog, logp_t: torch.Tensor, node: torch.Tensor, prefix: torch.Tensor,
                    drawn_paths: torch.Tensor, level: int, top_m: int | None):
    """Valid next tokens of P proposals per user. logp_t [B, P, V] (tempered log-probs), node [B, P] (-1 = dead),
    prefix [B, P, t] -> (tokens [B, P, C], child nodes [B, P, C], valid [B, P, C]).
    top_m None: the exact children (CSR); else PPV of the model's top-M tokens."""
    b, p, v = logp_t.shape
    if top_m is None:
        tok, child, _ = (x.view(b, p, -1) for x in catalog.children(node.flatten(), catalog.max_children[level]))
    else:
        tok = logp_t.topk(min(top_m, v), dim=-1).indices  # [B, P, M]
        ok = catalog.verify(prefix.reshape(b * p, level), tok.reshape(b * p, -1)).view(tok.shape)
        child = torch.where(ok, catalog.child_node(node[:, :, None].expand_as(tok).reshape(-1), tok.reshape(-1))
                            .view(tok.shape), -1)
    child = torch.where(node[:, :, None] >= 0, child, -1)
    return tok, child, open_children(catalog, child, drawn_paths)


@torch.no_grad()
def propose(model, tree: TokenTree, cache, prompt_logp: torch.Tensor, catalog: Catalog, proposals: int,
            drawn_paths: torch.Tensor, top_m: int | None, temperature: float, generator, meter: Meter):
    """`proposals` constrained samples per user, token by token, as tree nodes over the prompt.
    -> tokens [B, P, L], paths [B, P, L + 1] (trie nodes, -1 = dead), log x [B, P], log p [B, P] (temperature 1),
    users whose log-probs were NaN or infinite [B]."""
    b, dev = prompt_logp.shape[0], prompt_logp.device
    code_len = catalog.code_len
    node = torch.zeros(b, proposals, dtype=torch.int64, device=dev)
    tokens = torch.zeros(b, proposals, code_len, dtype=torch.int64, device=dev)
    paths = torch.full((b, proposals, code_len + 1), -1, dtype=torch.int64, device=dev)
    paths[:, :, 0] = 0
    log_x = torch.zeros(b, proposals, dtype=torch.float64, device=dev)
    log_p = torch.zeros(b, proposals, device=dev)
    logp = prompt_logp[:, None, :].expand(b, proposals, -1)  # [B, P, V] model log-probs, temperature 1
    parent = torch.full((b, proposals), -1, dtype=torch.int64, device=dev)
    broken = torch.zeros(b, dtype=torch.bool, device=dev)
    for level in range(code_len):
        if level:
            logp = tree_forward(model, tree, cache, tokens[:, :, level - 1], parent, meter=meter)  # [B, P, V]
            broken |= non_finite(logp).any(1)
            meter.kv(b * tree.kv_len)
            parent = tree.num_nodes - proposals + torch.arange(proposals, device=dev).expand(b, proposals)
        logp_t = (logp / temperature).log_softmax(-1).double() if temperature != 1.0 else logp.double()
        tok, child, valid = step_candidates(catalog, logp_t, node, tokens[:, :, :level], drawn_paths, level, top_m)
        noise = gumbel_like(logp_t, generator)  # [B, P, V], drawn over the whole vocabulary in every mode
        cand = logp_t.gather(2, tok).masked_fill(~valid, float("-inf"))  # [B, P, C]
        mass = cand.logsumexp(-1)  # log of the valid mass
        pick = (cand + noise.gather(2, tok)).argmax(-1, keepdim=True)  # a sample from the renormalised valid set
        alive = torch.isfinite(mass) & (node >= 0)
        log_x = torch.where(alive, log_x + mass, float("-inf"))
        token = tok.gather(2, pick).squeeze(2)
        tokens[:, :, level] = torch.where(alive, token, 0)
        node = torch.where(alive, child.gather(2, pick).squeeze(2), -1)
        paths[:, :, level + 1] = node
        log_p = log_p + logp.gather(2, tokens[:, :, level:level + 1]).squeeze(2)
    return tokens, paths, log_x, log_p, broken


def sample_items(model, input_ids, attention_mask, catalog: Catalog, k: int, rounds: int, disc: bool,
                 top_m: int | None, temperature: float, generator):
    """k draws per user without replacement; each draw is DISC (2 * rounds proposals) or plain constrained
    sampling (one proposal, always kept)."""
    if k < 1 or rounds < 1 or not temperature > 0 or (top_m is not None and top_m < 1):
        raise ValueError(f"need k, rounds, top_m >= 1 and temperature > 0; got k={k}, rounds={rounds}, "
                         f"top_m={top_m}, temperature={temperature}")
    check_prompts(input_ids, attention_mask, catalog, model)
    b, dev, code_len = input_ids.shape[0], input_ids.device, catalog.code_len
    meter = Meter(dev)
    with meter.phase("prefill"):
        cache, prompt_logp = prefill(model, input_ids, attention_mask, meter)
    meter.kv(input_ids.numel())
    broken = non_finite(prompt_logp)  # [B] users whose log-probs were NaN or infinite somewhere
    tree = TokenTree.from_prompt(attention_mask)
    proposals = 2 * rounds if disc else 1
    drawn_paths = torch.full((b, k, code_len + 1), -1, dtype=torch.int64, device=dev)
    out_node = torch.full((b, k), -1, dtype=torch.int64, device=dev)
    out_tokens = torch.full((b, k, code_len), -1, dtype=torch.int64, device=dev)
    out_score = torch.full((b, k), float("-inf"), device=dev)
    used = torch.zeros(b, k, device=dev)  # proposals of the sequential algorithm, per draw
    accepted = torch.zeros(b, k, dtype=torch.bool, device=dev)
    mean_x = torch.zeros(b, k, dtype=torch.float64, device=dev)
    out_log_x = torch.full((b, k), float("-inf"), dtype=torch.float64, device=dev)
    for draw in range(k):
        tokens, paths, log_x, log_p, broken_now = propose(model, tree, cache, prompt_logp, catalog, proposals,
                                                          drawn_paths, top_m, temperature, generator, meter)
        broken |= broken_now
        tree.keep_paths(torch.full((b, 1), -1, dtype=torch.int64, device=dev), cache)  # back to the prompt alone
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
                         non_finite=broken)
    return Recommendations(catalog.item_of_node(out_node.gather(1, order)),
                           out_tokens.gather(1, order[:, :, None].expand_as(out_tokens)),
                           out_score.gather(1, order), stats)


def constrained_sample(model, input_ids, attention_mask, catalog: Catalog, k: int = 1, top_m: int | None = None,
                       temperature: float = 1.0, generator: torch.Generator | None = None) -> Recommendations:
    """The trie-style baseline: k items per user, each sampled token by token from the model's distribution
    renormalised over the valid tokens (without replacement across the k). stats['importance_weight'] = x(a)."""
    return sample_items(model, input_ids, attention_mask, catalog, k, 1, False, top_m, temperature, generator)


def disc_sample(model, input_ids, attention_mask, catalog: Catalog, k: int, rounds: int = 4, top_m: int | None = None,
                temperature: float = 1.0, generator: torch.Generator | None = None) -> Recommendations:
    """k distinct items per user drawn with DISC (Algorithm 1): asymptotically the model's distribution restricted
    to the catalog (and to the items not drawn yet). stats: the base keys (decoding/stats.py) plus proposals [B]
    (sequential count), proposals_decoded, acceptance_rate [B], invalid_mass [B] (estimated p_b),
    importance_weight [B, k]."""
    return sample_items(model, input_ids, attention_mask, catalog, k, rounds, True, top_m, temperature, generator)
