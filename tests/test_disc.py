"""DISC on a catalog small enough to enumerate: unbiasedness (KL to the exact constrained distribution), the
paper's expected number of proposals, PPV = exact mask when top_m covers the vocabulary, k distinct items and their
exact law."""

import math

import pytest
import torch

from decoding.catalog import Catalog
from decoding.disc import constrained_sample, disc_sample
from decoding.draws import UserDraws, user_seeds
from decoding.models import tiny_model
from decoding.reference import catalog_logprob
from tests.helpers import EPS32, SPECIALS, WIDTH, float32_atol, left_padded_prompts, random_catalog

T = 0.5  # a low temperature puts almost all the model's mass on invalid sequences: p_b is large
DRAWS = 6000  # one batch of 6000 copies of one prompt: 6000 independent seeded draws
EPS64 = torch.finfo(torch.float64).eps


def mass_rtol(cat) -> float:
    """The float32 rounding of a valid mass x: a product of L masses, each a float32 sum over at most V
    exponentials of logits that sum WIDTH products (tests/helpers.float32_atol's argument, relative)."""
    return cat.code_len * (WIDTH + cat.vocab_size) * EPS32


@pytest.fixture(scope="module")
def setup():
    """3 levels x 6 codes: 40 of the 216 semantic IDs are items."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randperm(6**3, generator=g)[:40]
    digits = torch.stack([flat // 36, flat // 6 % 6, flat % 6], 1)
    cat = Catalog.from_token_ids(100 + torch.arange(40), SPECIALS + torch.arange(3) * 6 + digits, SPECIALS + 18)
    model = tiny_model("llama", cat.vocab_size, seed=3)
    ids, mask = left_padded_prompts(1, [5], cat.vocab_size, seed=0)
    return cat, model, ids, mask


def exact_constrained(model, ids, mask, cat):
    """Scores every item at temperature T -> (P_S over the catalog rows [N], invalid mass p_b)."""
    log_p = catalog_logprob(model, ids, mask, cat, temperature=T, chunk=16)  # [N], 3 chunks
    return (log_p - log_p.logsumexp(0)).exp(), 1 - log_p.exp().sum().item()


def kl_to(p_s, cat, items):
    """KL(P_S || empirical), the empirical distribution smoothed by +0.5 per item (finite, small bias)."""
    counts = (items[:, None] == cat.item_ids[None]).sum(0).double()
    q = (counts + 0.5) / (counts.sum() + 0.5 * len(cat))
    return float((p_s * (p_s.log() - q.log())).sum())


def test_disc_reduces_the_bias_of_constrained_sampling(setup):
    cat, model, ids, mask = setup
    p_s, p_b = exact_constrained(model, ids, mask, cat)
    assert p_b > 0.9  # the regime where constrained decoding is biased
    ids, mask = ids.repeat(DRAWS, 1), mask.repeat(DRAWS, 1)
    base = constrained_sample(model, ids, mask, cat, 1, temperature=T, generator=torch.Generator().manual_seed(1))
    kl = {"constrained": kl_to(p_s, cat, base.item_ids[:, 0])}
    for rounds in (1, 2, 4):
        rec = disc_sample(
            model, ids, mask, cat, 1, rounds=rounds, temperature=T, generator=torch.Generator().manual_seed(1)
        )
        kl[rounds] = kl_to(p_s, cat, rec.item_ids[:, 0])
        # the paper's expected number of proposals, E[k] = (1 - p_b^R) / (1 - p_b) + R p_b^R, within 4 std errors
        expected = (1 - p_b**rounds) / (1 - p_b) + rounds * p_b**rounds
        used = rec.stats["proposals"].double()
        assert abs(used.mean().item() - expected) < 4 * used.std().item() / math.sqrt(DRAWS) + 8 * EPS64 * expected
        invalid = rec.stats["invalid_mass"].double()  # [DRAWS] each user's estimate of p_b = 1 - E_q[x]
        assert abs(invalid.mean().item() - p_b) < 4 * invalid.std().item() / math.sqrt(DRAWS) + mass_rtol(cat)
    print("KL(P_S || .):", kl)
    assert kl[4] < kl[2] < kl[1]
    assert kl[4] * 4 < kl["constrained"]


def test_importance_weight_is_the_product_of_valid_masses(setup):
    cat, model, ids, mask = setup
    rec = constrained_sample(
        model, ids.repeat(5, 1), mask.repeat(5, 1), cat, 1, temperature=T, generator=torch.Generator().manual_seed(4)
    )
    for row in range(5):
        tokens = rec.token_ids[row, 0]
        log_x = 0.0
        for t in range(cat.code_len):
            seq = torch.cat([ids, tokens[None, :t]], 1)
            full = torch.ones_like(seq)
            with torch.no_grad():
                logits = model(input_ids=seq, attention_mask=full).logits[0, -1].double()
            p = (logits / T).softmax(-1)
            log_x += math.log(p[cat.allowed_next(tokens[None, :t])[0]].sum().item())
        assert rec.stats["importance_weight"][row, 0].item() == pytest.approx(math.exp(log_x), rel=mass_rtol(cat))


def test_top_m_covering_the_vocabulary_equals_the_exact_mask(setup):
    cat, model, ids, mask = setup
    ids, mask = ids.repeat(300, 1), mask.repeat(300, 1)
    exact = disc_sample(model, ids, mask, cat, 5, rounds=3, temperature=T, generator=torch.Generator().manual_seed(2))
    ppv = disc_sample(
        model,
        ids,
        mask,
        cat,
        5,
        rounds=3,
        top_m=cat.vocab_size + 5,
        temperature=T,
        generator=torch.Generator().manual_seed(2),
    )
    assert torch.equal(exact.item_ids, ppv.item_ids) and torch.equal(exact.scores, ppv.scores)
    small = disc_sample(
        model, ids, mask, cat, 5, rounds=3, top_m=3, temperature=T, generator=torch.Generator().manual_seed(2)
    )
    assert torch.isin(small.item_ids[small.item_ids >= 0], cat.item_ids).all()


@pytest.mark.parametrize("sampler", ["disc", "constrained"])
def test_k_distinct_catalog_items_padded_when_the_catalog_is_smaller(sampler):
    cat = random_catalog(7, 3, 4, seed=2)
    model = tiny_model("qwen2", cat.vocab_size, seed=1)
    ids, mask = left_padded_prompts(6, [5, 2, 9, 4, 7, 3], cat.vocab_size, seed=1)
    fn = disc_sample if sampler == "disc" else constrained_sample
    rec = fn(model, ids, mask, cat, 10, generator=torch.Generator().manual_seed(0))
    for items in rec.item_ids.tolist():
        assert sorted(items[:7]) == sorted(cat.item_ids.tolist()) and items[7:] == [-1, -1, -1]
    big = random_catalog(300, 3, 8, seed=4)
    model = tiny_model("llama", big.vocab_size, seed=1)
    rec = fn(
        model, *left_padded_prompts(6, [5, 2, 9], big.vocab_size), big, 12, generator=torch.Generator().manual_seed(0)
    )
    assert all(len(set(r)) == 12 for r in rec.item_ids.tolist()) and torch.isin(rec.item_ids, big.item_ids).all()
    assert (rec.scores[:, :-1] >= rec.scores[:, 1:]).all()
    torch.testing.assert_close(
        rec.scores,
        sequence_scores(model, *left_padded_prompts(6, [5, 2, 9], big.vocab_size), rec.token_ids),
        atol=float32_atol(rec.scores),
        rtol=0,
    )


def sequence_scores(model, ids, mask, tokens):
    """Sequence log-probabilities (temperature 1) of tokens [B, k, L] -> [B, k]."""
    from decoding.reference import sequence_logprob

    b, k, code_len = tokens.shape
    seq = torch.cat([ids.repeat_interleave(k, 0), tokens.reshape(b * k, code_len)], 1)
    return sequence_logprob(model, seq, mask.repeat_interleave(k, 0), code_len).view(b, k)


def test_bad_arguments(setup):
    cat, model, ids, mask = setup
    for kwargs in (dict(k=0), dict(k=2, rounds=0), dict(k=2, temperature=0.0), dict(k=2, top_m=0)):
        with pytest.raises(ValueError, match="need k, rounds, top_m"):
            disc_sample(model, ids, mask, cat, **kwargs)


def next_token_logprobs(model, ids, cat):
    """One unpadded prompt [1, S] -> log_softmax(logits / T) at each item's L prefixes [N, L, V] (float64)."""
    seq = torch.cat([ids.expand(len(cat), -1), cat.tokens], 1)  # [N, S + L]
    with torch.no_grad():
        logits = model(input_ids=seq, attention_mask=torch.ones_like(seq)).logits[:, ids.shape[1] - 1 : -1]
    return (logits.double() / T).log_softmax(-1)


def constrained_law(log_p, cat, excluded: set[int]) -> torch.Tensor:
    """The law of one constrained (trie) draw from the items outside `excluded` (catalog rows) [N]: at each level,
    the next token sampled from the model renormalised over the tokens that still lead to an open item."""
    tokens, q = cat.tokens, torch.zeros(len(cat), dtype=torch.float64)
    open_rows = torch.tensor([i not in excluded for i in range(len(cat))])
    for a in range(len(cat)):
        if not open_rows[a]:
            continue
        prob = 1.0
        for t in range(cat.code_len):
            same = open_rows & (tokens[:, :t] == tokens[a, :t]).all(1)
            valid = tokens[same, t].unique()
            prob *= (log_p[a, t, tokens[a, t]] - log_p[a, t, valid].logsumexp(0)).exp().item()
        q[a] = prob
    return q


def pair_inclusion(first: torch.Tensor, then: torch.Tensor, parallel: bool) -> torch.Tensor:
    """Item inclusion probabilities [N] of k = 2 from a one-draw law first [N] and the law of a draw excluding item i,
    then [i, N]. parallel=False: successive sampling (draw, then draw from the rest). parallel=True: this module's
    passes: two independent draws; if they coincide on i, one more draw excluding i."""
    q = first
    if parallel:
        pair = 2 * q[:, None] * q[None, :] + (q**2)[:, None] * then + ((q**2)[:, None] * then).T
    else:
        pair = q[:, None] * then + (q[:, None] * then).T
    pair.fill_diagonal_(0)
    return pair.sum(1)  # pair [i, j] = P({i, j}), symmetric


@pytest.mark.parametrize("draws", ["torch", "per-user"])
def test_k_distinct_draws_follow_the_stated_law(setup, draws):
    """k = 2 on the enumerable catalog, DRAWS users. Constrained sampling: the inclusion frequency of every item
    equals its exact probability under the pass scheme (two independent draws, a third excluding the repeated item
    when they coincide). Each frequency is a mean of DRAWS independent Bernoullis: |z| < 4.5 for all 40 items fails
    a correct sampler with probability < 40 * 7e-6 = 3e-4, and rejects a 0.03 error on a probability of 0.3
    (sd 0.006) with probability > 0.99. DISC: the frequencies approach successive sampling from P_S (the law this
    scheme has for DISC's limit) as rounds grow. Draws from torch's generator, or per user (decoding/draws.py: one
    seed per row, DRAWS users)."""
    cat, model, ids, mask = setup
    log_p = next_token_logprobs(model, ids, cat)
    q = constrained_law(log_p, cat, set())
    then = torch.stack([constrained_law(log_p, cat, {i}) for i in range(len(cat))])  # [N, N]
    expected = pair_inclusion(q, then, parallel=True)
    assert expected.sum().item() == pytest.approx(2.0)
    ids, mask = ids.repeat(DRAWS, 1), mask.repeat(DRAWS, 1)

    def gen(seed: int):
        return torch.Generator().manual_seed(seed) if draws == "torch" else UserDraws(user_seeds(seed, range(DRAWS)))

    rec = constrained_sample(model, ids, mask, cat, 2, temperature=T, generator=gen(5))
    assert (rec.item_ids[:, 0] != rec.item_ids[:, 1]).all()
    freq = (rec.item_ids[:, :, None] == cat.item_ids).any(1).double().mean(0)  # [N]
    z = (freq - expected) / (expected * (1 - expected) / DRAWS).clamp(min=1e-12).sqrt()
    assert z.abs().max() < 4.5, z
    p_s, _ = exact_constrained(model, ids[:1], mask[:1], cat)
    successive = pair_inclusion(p_s, p_s[None, :] / (1 - p_s[:, None]) * (1 - torch.eye(len(cat))), parallel=False)
    assert torch.allclose(
        successive, pair_inclusion(p_s, p_s[None, :] / (1 - p_s[:, None]) * (1 - torch.eye(len(cat))), parallel=True)
    )  # for P_S, the passes are successive sampling
    tv = {}
    for rounds in (1, 4):
        rec = disc_sample(model, ids, mask, cat, 2, rounds=rounds, temperature=T, generator=gen(6))
        freq = (rec.item_ids[:, :, None] == cat.item_ids).any(1).double().mean(0)
        tv[rounds] = (freq - successive).abs().sum().item() / 2
    print("TV(inclusion, successive P_S):", tv)
    assert tv[4] < tv[1]
