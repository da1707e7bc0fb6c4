"""DISC on a catalog small enough to enumerate: unbiasedness (KL to the exact constrained distribution), the
paper's expected number of proposals, PPV = exact mask when top_m covers the vocabulary, k distinct items."""
import math

import pytest
import torch

from decoding.catalog import Catalog
from decoding.disc import constrained_sample, disc_sample
from decoding.models import tiny_model
from decoding.reference import catalog_logprob
from tests.helpers import SPECIALS, left_padded_prompts, random_catalog

T = 0.5  # a low temperature puts almost all the model's mass on invalid sequences: p_b is large
DRAWS = 6000  # one batch of 6000 copies of one prompt: 6000 independent seeded draws


@pytest.fixture(scope="module")
def setup():
    """3 levels x 6 codes: 40 of the 216 semantic IDs are items."""
    g = torch.Generator().manual_seed(0)
    flat = torch.randperm(6 ** 3, generator=g)[:40]
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
        rec = disc_sample(model, ids, mask, cat, 1, rounds=rounds, temperature=T,
                          generator=torch.Generator().manual_seed(1))
        kl[rounds] = kl_to(p_s, cat, rec.item_ids[:, 0])
        # the paper's expected number of proposals, E[k] = (1 - p_b^R) / (1 - p_b) + R p_b^R, within 4 std errors
        expected = (1 - p_b ** rounds) / (1 - p_b) + rounds * p_b ** rounds
        used = rec.stats["proposals"].double()
        assert abs(used.mean().item() - expected) < 4 * used.std().item() / math.sqrt(DRAWS) + 1e-9
        assert abs(rec.stats["invalid_mass"].mean().item() - p_b) < 0.002  # p_b = 1 - E_q[x]
    print("KL(P_S || .):", kl)
    assert kl[4] < kl[2] < kl[1]
    assert kl[4] * 4 < kl["constrained"]


def test_importance_weight_is_the_product_of_valid_masses(setup):
    cat, model, ids, mask = setup
    rec = constrained_sample(model, ids.repeat(5, 1), mask.repeat(5, 1), cat, 1, temperature=T,
                             generator=torch.Generator().manual_seed(4))
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
        assert rec.stats["importance_weight"][row, 0].item() == pytest.approx(math.exp(log_x), rel=1e-4)


def test_top_m_covering_the_vocabulary_equals_the_exact_mask(setup):
    cat, model, ids, mask = setup
    ids, mask = ids.repeat(300, 1), mask.repeat(300, 1)
    exact = disc_sample(model, ids, mask, cat, 5, rounds=3, temperature=T, generator=torch.Generator().manual_seed(2))
    ppv = disc_sample(model, ids, mask, cat, 5, rounds=3, top_m=cat.vocab_size + 5, temperature=T,
                      generator=torch.Generator().manual_seed(2))
    assert torch.equal(exact.item_ids, ppv.item_ids) and torch.equal(exact.scores, ppv.scores)
    small = disc_sample(model, ids, mask, cat, 5, rounds=3, top_m=3, temperature=T,
                        generator=torch.Generator().manual_seed(2))
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
    rec = fn(model, *left_padded_prompts(6, [5, 2, 9], big.vocab_size), big, 12, generator=torch.Generator().manual_seed(0))
    assert all(len(set(r)) == 12 for r in rec.item_ids.tolist()) and torch.isin(rec.item_ids, big.item_ids).all()
    assert (rec.scores[:, :-1] >= rec.scores[:, 1:]).all()
    torch.testing.assert_close(rec.scores, sequence_scores(model, *left_padded_prompts(6, [5, 2, 9], big.vocab_size),
                                                           rec.token_ids), atol=1e-4, rtol=0)


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
