"""Strict AtSpeed speculative beam search returns exactly beam_search(target), with fewer target forwards."""

import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.draws import UserDraws, user_seeds
from decoding.models import tiny_model
from decoding.speculative import speculative_beam_search
from tests.helpers import SPECIALS, assert_same_ranking, float32_atol, left_padded_prompts, random_catalog

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]


@pytest.fixture(scope="module")
def setup():
    cat = random_catalog(400, 4, 8, seed=11)
    target = tiny_model("llama", cat.vocab_size, seed=1)
    drafts = {
        "target": target,  # every drafted step is accepted when N = K
        "random": tiny_model("llama", cat.vocab_size, seed=99, num_hidden_layers=1),  # almost every step rejected
        "qwen2": tiny_model("qwen2", cat.vocab_size, seed=5, num_hidden_layers=1, hidden_size=32, head_dim=8),
    }
    ids, mask = left_padded_prompts(8, LENGTHS, cat.vocab_size, seed=3)
    return cat, target, drafts, ids, mask


@pytest.mark.parametrize("draft_name", ["target", "random", "qwen2"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_strict_equals_beam_search(setup, draft_name, k):
    cat, target, drafts, ids, mask = setup
    ref = beam_search(target, ids, mask, cat, k)
    for n in sorted({k, 2 * k, 40}):
        for gamma in (1, 2, cat.code_len):
            rec = speculative_beam_search(target, drafts[draft_name], ids, mask, cat, k, draft_beams=n, gamma=gamma)
            assert_same_ranking(rec.item_ids, rec.scores, ref.item_ids, ref.scores)
            assert torch.equal(rec.token_ids, ref.token_ids) or not torch.equal(rec.item_ids, ref.item_ids)
            st = rec.stats
            assert_forward_accounting(st, ref.stats["target_forwards"], cat.code_len)
            b, s = ids.shape  # both caches hold every prompt once, plus the drafted tree
            assert 2 * b * s < st["kv_tokens"] and st["kv_tokens_beam_batch"] == ref.stats["kv_tokens_beam_batch"]
            if draft_name == "target" and n == k:
                assert torch.equal(st["accepted_steps"], st["drafted_steps"])  # every drafted step accepted
                rounds = -(-(cat.code_len - 1) // (gamma + 1))  # each round: up to gamma accepted + 1 free step
                assert st["target_forwards"] == 1 + rounds


def assert_forward_accounting(st, beam_forwards: int, code_len: int):
    """Each user costs 1 + rounds target forwards (the batch: 1 + the most rounds); after the free first step a
    round advances a user by its accepted steps plus one: fewer forwards than beam_search whenever a user accepted
    a step, never more."""
    per_user = 1 + st["rounds"]
    assert st["target_forwards"] == int(per_user.max()) <= beam_forwards == code_len
    assert torch.equal(st["rounds"] + st["accepted_steps"], torch.full_like(st["rounds"], code_len - 1))
    accepted = st["accepted_steps"] > 0
    assert (per_user[accepted] < beam_forwards).all() and (per_user[~accepted] == beam_forwards).all()
    hist = st["accepted_hist"]  # (user, round) pairs by steps accepted in the round
    assert int(hist.sum()) == int(st["rounds"].sum())
    assert int((hist * torch.arange(len(hist))).sum()) == int(st["accepted_steps"].sum())


def test_random_draft_is_rejected_and_costs_no_extra_target_forward(setup):
    cat, target, drafts, ids, mask = setup
    rec = speculative_beam_search(target, drafts["random"], ids, mask, cat, 20, draft_beams=20)
    assert rec.stats["accepted_steps"].float().mean() < 0.5
    assert rec.stats["target_forwards"] <= beam_search(target, ids, mask, cat, 20).stats["target_forwards"]


def test_users_finish_at_different_rounds(setup):
    # a draft that is the target for some users' prompts and random for others is not possible, but a weak draft
    # makes users accept different numbers of steps: results stay exact per user
    cat, target, drafts, ids, mask = setup
    weak = tiny_model("llama", cat.vocab_size, seed=1, num_hidden_layers=1)
    weak.load_state_dict(target.state_dict(), strict=False)  # the target's embeddings and first layer
    rec = speculative_beam_search(target, weak, ids, mask, cat, 5, draft_beams=10, gamma=2)
    ref = beam_search(target, ids, mask, cat, 5)
    assert_same_ranking(rec.item_ids, rec.scores, ref.item_ids, ref.scores)
    assert_forward_accounting(rec.stats, ref.stats["target_forwards"], cat.code_len)
    assert len(set(rec.stats["rounds"].tolist())) > 1  # one forward held users at different depths


def test_fewer_items_than_k(setup):
    cat = random_catalog(7, 3, 4, seed=2)
    target = tiny_model("qwen2", cat.vocab_size, seed=1)
    draft = tiny_model("llama", cat.vocab_size, seed=2, num_hidden_layers=1)
    ids, mask = left_padded_prompts(3, [5, 2, 9], cat.vocab_size, seed=1)
    rec = speculative_beam_search(target, draft, ids, mask, cat, 10, draft_beams=10)
    ref = beam_search(target, ids, mask, cat, 10)
    assert torch.equal(rec.item_ids, ref.item_ids) and (rec.item_ids[:, 7:] == -1).all()
    torch.testing.assert_close(rec.scores, ref.scores, atol=float32_atol(rec.scores, ref.scores), rtol=0)


def test_bad_arguments(setup):
    cat, target, drafts, ids, mask = setup
    with pytest.raises(ValueError, match="k <= draft_beams"):
        speculative_beam_search(target, target, ids, mask, cat, 10, draft_beams=5)
    with pytest.raises(ValueError, match="verification must be 'strict'"):
        speculative_beam_search(target, target, ids, mask, cat, 5, verification="lossy")
    other = tiny_model("llama", cat.vocab_size + 3, num_hidden_layers=1)
    with pytest.raises(ValueError, match="vocabularies differ"):
        speculative_beam_search(target, other, ids, mask, cat, 5)


# ---------------------------------------------------------------- relaxed sampling verification


def chi2_critical(df: int, alpha_z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is alpha = 0.001."""
    return df * (1 - 2 / (9 * df) + alpha_z * (2 / (9 * df)) ** 0.5) ** 3


def homogeneity_chi2(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Two-sample chi-square test of equal distributions from category counts; sparse categories (expected < 5)
    are pooled into one bin. -> (statistic, degrees of freedom)."""
    order = torch.argsort(a + b, descending=True)
    a, b = a[order].double(), b[order].double()
    big = (a + b) / 2 >= 5
    a = torch.cat([a[big], a[~big].sum()[None]]) if (~big).any() else a
    b = torch.cat([b[big], b[~big].sum()[None]]) if (~big).any() else b
    expected = (a + b) / 2
    keep = expected > 0
    stat = (((a - expected) ** 2 + (b - expected) ** 2) / expected)[keep].sum()
    return float(stat), int(keep.sum()) - 1


def top1_counts(rec, catalog) -> torch.Tensor:
    ids = catalog.item_ids.sort().values
    return (rec.item_ids[:, :1] == ids[None]).sum(0)


def inclusion_counts(rec, catalog) -> torch.Tensor:
    """Runs whose K-set includes each catalog item [N] (each run a Bernoulli per item)."""
    ids = catalog.item_ids.sort().values
    return (rec.item_ids[:, :, None] == ids[None, None]).any(1).sum(0)


def inclusion_z(a: torch.Tensor, b: torch.Tensor, runs: int, alpha: float = 0.001) -> tuple[float, float]:
    """Two-sample test of equal inclusion probabilities for every item at once: per item a two-proportion z statistic
    (pooled variance), Bonferroni over the items seen -> (largest |z|, critical value at family-wise alpha)."""
    from statistics import NormalDist

    pooled = (a + b).double() / (2 * runs)
    seen = (pooled > 0) & (pooled < 1)
    z = (a - b).double()[seen] / runs / (pooled[seen] * (1 - pooled[seen]) * 2 / runs).sqrt()
    return float(z.abs().max()), NormalDist().inv_cdf(1 - alpha / (2 * int(seen.sum())))


@pytest.fixture(scope="module")
def small():
    """An enumerable catalog (24 items of 3 levels x 4 codes), a peaked target and two drafts."""
    cat = random_catalog(24, 3, 4, seed=3)
    target = tiny_model("llama", cat.vocab_size, seed=1)
    far = tiny_model("qwen2", cat.vocab_size, seed=7, num_hidden_layers=1)
    near = tiny_model("llama", cat.vocab_size, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(8)
        far.lm_head.weight.mul_(8)
        near.load_state_dict(target.state_dict())
        near.lm_head.weight.add_(
            0.5 * torch.randn(near.lm_head.weight.shape, generator=torch.Generator().manual_seed(0))
        )
    return cat, target, {"near": near, "far": far}


RUNS = 3000  # one batch of 3000 copies of one prompt: 3000 independent seeded runs


@pytest.mark.parametrize(
    "k, temperature, draft, draws",
    [(1, 1.0, "far", "torch"), (3, 1.0, "far", "torch"), (3, 1.0, "near", "torch"), (2, 0.7, "near", "torch")]
    + [(3, 1.0, "far", "per-user")],
)
def test_relaxed_matches_sampling_beam_search_in_distribution(small, k, temperature, draft, draws):
    """H0: relaxed speculative beam search returns the K-sets of the target's sampling-based beam search, drawing
    from torch's generator or per user (decoding/draws.py: 3000 user seeds, one per run).
    (1) The top-1 item: two-sample chi-square homogeneity test on 3000 runs each, alpha = 0.001. Power: a shift of
    0.05 probability between two items of probability about 0.2 (total variation 0.05) gives a noncentrality of
    about 3000 / 2 * 0.025 = 38, detected with probability about 0.87 at ~15 degrees of freedom.
    (2) The inclusion probability of every item in the K-set: per item a two-proportion z-test, Bonferroni over the
    (at most 24) items, family-wise alpha = 0.001, so |z| < 4.10. Power: with 3000 runs a shift of 0.064 in one
    item's inclusion probability near 0.5 (0.038 near 0.1) is detected with probability 0.8 or more."""
    cat, target, drafts = small
    ids, mask = left_padded_prompts(1, [6], cat.vocab_size, seed=0)
    ids, mask = ids.repeat(RUNS, 1), mask.repeat(RUNS, 1)
    ref = beam_search(
        target, ids, mask, cat, k, do_sample=True, temperature=temperature, generator=torch.Generator().manual_seed(11)
    )
    rel = speculative_beam_search(
        target,
        drafts[draft],
        ids,
        mask,
        cat,
        k,
        verification="relaxed",
        temperature=temperature,
        generator=torch.Generator().manual_seed(12) if draws == "torch" else UserDraws(user_seeds(12, range(RUNS))),
    )
    assert (rel.item_ids >= 0).all() and (rel.scores[:, :-1] >= rel.scores[:, 1:]).all()
    assert all(len(set(r)) == k for r in rel.item_ids.tolist())  # k distinct items
    stat, df = homogeneity_chi2(top1_counts(ref, cat), top1_counts(rel, cat))
    assert df >= 3 and stat < chi2_critical(df), (stat, df)
    z, critical = inclusion_z(inclusion_counts(ref, cat), inclusion_counts(rel, cat), RUNS)
    assert z < critical, (z, critical)


def test_relaxed_detects_a_different_distribution(small):
    """The test above has teeth: the same statistic rejects a sampler at another temperature."""
    cat, target, drafts = small
    ids, mask = left_padded_prompts(1, [6], cat.vocab_size, seed=0)
    ids, mask = ids.repeat(RUNS, 1), mask.repeat(RUNS, 1)
    ref = beam_search(target, ids, mask, cat, 3, do_sample=True, generator=torch.Generator().manual_seed(11))
    hot = speculative_beam_search(
        target,
        drafts["near"],
        ids,
        mask,
        cat,
        3,
        verification="relaxed",
        temperature=1.3,
        generator=torch.Generator().manual_seed(12),
    )
    stat, df = homogeneity_chi2(top1_counts(ref, cat), top1_counts(hot, cat))
    assert stat > chi2_critical(df)
    z, critical = inclusion_z(inclusion_counts(ref, cat), inclusion_counts(hot, cat), RUNS)
    assert z > critical, (z, critical)


@pytest.mark.parametrize("draft", ["near", "far"])
def test_relaxed_accepts_at_least_as_many_steps_as_strict(small, draft):
    cat, target, drafts = small
    ids, mask = left_padded_prompts(1, [6], cat.vocab_size, seed=0)
    ids, mask = ids.repeat(500, 1), mask.repeat(500, 1)
    strict = speculative_beam_search(target, drafts[draft], ids, mask, cat, 3, draft_beams=3)
    relaxed = speculative_beam_search(
        target, drafts[draft], ids, mask, cat, 3, verification="relaxed", generator=torch.Generator().manual_seed(5)
    )
    assert relaxed.stats["accepted_steps"].float().mean() >= strict.stats["accepted_steps"].float().mean()
    if draft == "near":
        assert relaxed.stats["accepted_steps"].float().mean() > strict.stats["accepted_steps"].float().mean()


# ---------------------------------------------------------------- strict verification that can fail


def clustered_catalog(fanout=(32, 6, 6, 8), codes: int = 32, seed: int = 0):
    """A 4-level catalog over `codes` codes per level whose every trie node has many children (fanout per level:
    32 x 6 x 6 x 8 = 9,216 items), so that N = 10 drafted beams never cover all of a step's candidates (K = 5
    beams x >= 6 children)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(1, 0, dtype=torch.int64)
    for width in fanout:  # each prefix gets `width` distinct codes
        pick = torch.stack([torch.randperm(codes, generator=g)[:width] for _ in range(rows.shape[0])])  # [P, w]
        rows = torch.cat([rows.repeat_interleave(width, 0), pick.reshape(-1, 1)], 1)
    tokens = SPECIALS + torch.arange(len(fanout)) * codes + rows
    return Catalog.from_token_ids(5000 + torch.randperm(len(rows), generator=g), tokens, SPECIALS + len(fanout) * codes)


@pytest.fixture(scope="module")
def wide():
    """The clustered catalog, a target, and a draft that agrees with the target on three quarters of the vocabulary
    and contradicts it on the rest (a random quarter of its output rows negated): users whose top candidates avoid
    the contradicted tokens accept drafted steps, the others are rejected, at different steps."""
    cat = clustered_catalog()
    target = tiny_model("llama", cat.vocab_size, seed=4)
    near = tiny_model("llama", cat.vocab_size, seed=4)
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
        near.load_state_dict(target.state_dict())
        flipped = torch.rand(cat.vocab_size, generator=torch.Generator().manual_seed(1)) < 0.25
        near.lm_head.weight[flipped] *= -1
    ids, mask = left_padded_prompts(24, [3, 11, 6, 17, 9, 4, 14, 8], cat.vocab_size, seed=7)
    return cat, target, near, ids, mask


def test_candidates_outnumber_the_drafted_beams(wide):
    """The premise of the tests below: at every step the K = 5 beams have more than N = 10 candidates, so strict
    acceptance depends on the draft and not on covering everything."""
    cat = wide[0]
    assert cat.vocab_size == SPECIALS + 4 * 32  # 32 codes per level, (almost) all in use
    assert all(len(cat.tokens[:, level].unique()) >= 30 for level in range(cat.code_len))
    children = cat.num_children(torch.arange(cat.level_start[cat.code_len]))
    assert int(children.min()) >= 6 and 5 * int(children.min()) > 10 and len(cat.tokens[:, 0].unique()) > 10


@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_strict_equals_beam_search_when_drafts_cannot_cover_every_candidate(wide, gamma):
    cat, target, near, ids, mask = wide
    ref = beam_search(target, ids, mask, cat, 5)
    rec = speculative_beam_search(target, near, ids, mask, cat, 5, draft_beams=10, gamma=gamma)
    assert_same_ranking(rec.item_ids, rec.scores, ref.item_ids, ref.scores)
    assert_forward_accounting(rec.stats, ref.stats["target_forwards"], cat.code_len)
    rounds, hist = rec.stats["rounds"], rec.stats["accepted_hist"]
    assert len(set(rounds.tolist())) > 1  # users finish in different rounds
    assert hist[0] > 0 and hist[1:].sum() > 0  # some rounds reject the first drafted step, others accept steps
    # random drafts are rejected: exactness does not come from accepting everything
    random = speculative_beam_search(
        target,
        tiny_model("llama", cat.vocab_size, seed=99, num_hidden_layers=1),
        ids,
        mask,
        cat,
        5,
        draft_beams=10,
        gamma=gamma,
    )
    assert random.stats["accepted_steps"].sum() < rec.stats["accepted_steps"].sum()
    assert_same_ranking(random.item_ids, random.scores, ref.item_ids, ref.scores)


def test_a_lenient_verifier_fails_the_exactness_check(wide, monkeypatch):
    """Mutation check: accept a step when all but one of the target's top-K sequences were drafted (a step strict
    verification must reject). The outputs then differ from beam_search, so the test above would catch it."""
    import decoding.speculative as spec

    cat, target, near, ids, mask = wide
    ref = beam_search(target, ids, mask, cat, 5)
    strict = spec.covered

    def lenient(t_node, d_node):
        _, idx = strict(t_node, d_node)
        hit = ((t_node[:, :, None] == d_node[:, None, :]) & (d_node[:, None, :] >= 0)).any(-1)  # [A, K]
        return hit.sum(-1) >= t_node.shape[1] - 1, idx

    monkeypatch.setattr(spec, "covered", lenient)
    rec = speculative_beam_search(target, near, ids, mask, cat, 5, draft_beams=10, gamma=3)
    differ = (rec.item_ids != ref.item_ids).any(1) | ((rec.scores - ref.scores).abs() > float32_atol(ref.scores)).any(1)
    assert differ.any()
