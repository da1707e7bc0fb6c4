"""The decoding engine at production shape: the chunked head (scores of the children, never [B, Q, V]), the tree
cache written in place, half precision within stated bounds, cheaper speculation, DISC sharing scored nodes, the
shared prompt prefix, grouped-query attention without repeated keys."""

import contextlib
import copy
from pathlib import Path

import pytest
import torch

from decoding.beam import Prefix, beam_search, head_of, prefill
from decoding.cache import TreeCache
from decoding.disc import disc_sample
from decoding.head import Head
from decoding.metrics import same_within_ties, topk_agreement
from decoding.models import load_model, tiny_model
from decoding.speculative import speculative_beam_search
from tests.helpers import (
    EPS32,
    WIDTH,
    assert_same_ranking,
    float32_atol,
    forced_scores,
    hf_beam_search,
    left_padded_prompts,
    random_catalog,
    tiny_gemma2,
    trained_model,
)

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]


@pytest.fixture(scope="module")
def setup():
    cat = random_catalog(400, 4, 8, seed=11)
    ids, mask = left_padded_prompts(8, LENGTHS, cat.vocab_size, seed=3)
    return cat, ids, mask


# ---------------------------------------------------------------- the head


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_log_softmax_over_the_full_vocabulary(temperature):
    """Many small chunks (a budget of 64 floats per chunk), the tokens asked for anywhere in the vocabulary, the
    top-M across chunks: equal to the full-vocabulary computation."""
    model = tiny_model("qwen2", 3000, seed=0)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    head = Head.of(model)
    full = head.chunk_logits(hidden, 0, 3000)  # [5, V]
    tokens = torch.tensor([[0, 5, 2999, -1], [1500, 1501, -1, -1], [7, 2048, 1024, 3], [-1] * 4, [2999, 0, 1, 2]])
    for budget in (64, 10_000, 1 << 20):
        head.budget = budget
        s = head.score(hidden, tokens, temperature, top_m=7)
        want = full.log_softmax(-1).gather(1, tokens.clamp(min=0))
        atol = float32_atol(full, terms=3000)  # chunk by chunk against at once: sums over V = 3000 in other orders
        torch.testing.assert_close(s.logp[tokens >= 0], want[tokens >= 0], atol=atol, rtol=0)
        assert torch.isinf(s.logits[tokens < 0]).all()
        torch.testing.assert_close(s.lse, full.logsumexp(-1), atol=atol, rtol=0)
        if temperature != 1.0:
            torch.testing.assert_close(s.lse_t, (full / temperature).logsumexp(-1), atol=atol / temperature, rtol=0)
        assert torch.equal(s.top_tokens, full.topk(7).indices) and torch.allclose(s.top_logits, full.topk(7).values)


def test_logit_transforms_and_a_foreign_head():
    """Gemma 2's final logit softcapping is applied (beam_search = transformers); a model whose logits are not its
    output layer applied to its last hidden state is refused, not scored differently."""
    cat = random_catalog(200, 3, 6, seed=0)
    gemma = tiny_gemma2(cat.vocab_size, final_logit_softcapping=3.0)
    ids, mask = left_padded_prompts(4, [5, 9, 3, 7], cat.vocab_size, seed=1)
    rec = beam_search(gemma, ids, mask, cat, 5)
    items, _, scores = hf_beam_search(gemma, ids, mask, cat, 5)
    assert torch.equal(rec.item_ids, items) and head_of(gemma).softcap == 3.0
    torch.testing.assert_close(rec.scores, scores, atol=float32_atol(rec.scores, scores), rtol=0)

    odd = tiny_model("llama", 50, seed=1)
    plain = odd.forward
    odd.forward = lambda *a, **kw: type(plain(*a, **kw))(logits=2 * plain(*a, **kw).logits)
    with pytest.raises(ValueError, match="logits are not its output layer applied to its last hidden state"):
        Head.of(odd)


# ---------------------------------------------------------------- the cache


def test_tree_cache_is_written_in_place_and_grows_only_when_full(setup):
    cat, ids, mask = setup
    model = tiny_model("llama", cat.vocab_size, seed=1)
    seen = []
    update = TreeCache.update

    def watch(self, *args, **kwargs):  # every layer update: where layer 0's keys live
        out = update(self, *args, **kwargs)
        seen.append(self.layers[0].keys.data_ptr())
        return out

    TreeCache.update = watch
    try:
        beam_search(model, ids, mask, cat, 5)  # the prefill reserves room for k (L - 1) tree tokens
    finally:
        TreeCache.update = update
    assert len(set(seen)) == 1  # one buffer for the whole decode: no per-step copy of the cache
    cache, _ = prefill(model, ids, mask, capacity=0)  # no room: the first tree forward doubles the buffer
    assert cache.layers[0].keys.shape[2] == ids.shape[1] and cache.length == ids.shape[1]


# ---------------------------------------------------------------- half precision


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_head_writes_float32_logits_under_half_precision(dtype):
    """A half-precision head multiplies the half-precision hidden states and weights into float32 logits: equal to
    the exact product of those inputs within float32 rounding (several chunks, bias, the normaliser and the top-M
    included), where logits rounded to the model's dtype (as transformers computes them) are off by its spacing."""
    model = tiny_model("qwen2", 3000, seed=0, dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # logits around 16, as a trained model's
        model.lm_head.bias = torch.nn.Parameter(torch.randn(3000, dtype=dtype))
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact, cond = exact_logits(model.lm_head.weight, model.lm_head.bias, hidden)  # [5, V]
    tokens = torch.tensor([[0, 5, 2999, -1], [1500, 1501, -1, -1], [7, 2048, 1024, 3], [-1] * 4, [2999, 0, 1, 2]])
    head = Head(model.lm_head.weight, model.lm_head.bias, budget=4096, product="upcast")  # chunks of 1024 tokens
    assert Head.of(model).product == "upcast"  # on a CPU; CUDA multiplies into a float32 output instead
    s = head.score(hidden, tokens, top_m=7)
    assert s.logits.dtype == s.lse.dtype == torch.float32
    bound = float((WIDTH * EPS32 * cond).amax())  # float32 accumulation of 64 exact products (Higham 3.1)
    real = tokens >= 0
    assert (s.logits[real] - exact.gather(1, tokens.clamp(min=0))[real]).abs().max() <= bound
    assert (s.lse - exact.logsumexp(-1)).abs().max() <= bound + 3002 * EPS32 * exact.logsumexp(-1).abs().max()
    assert torch.equal(s.top_tokens, exact.topk(7).indices)
    assert (head.chunk_logits(hidden, 0, 3000) - exact).abs().max() <= bound
    rounded = Head(model.lm_head.weight, model.lm_head.bias, product="model").chunk_logits(hidden, 0, 3000)
    assert (rounded - exact).abs().max() > 20 * bound  # half of the dtype's spacing at the largest logits


# Half precision keeps the head in float32; what remains is the body's rounding, which depends on the CPU's kernels
# (ATEN_CPU_CAPABILITY, oneDNN's ISA) and on the trained weights. Every bound below comes from the dtype's spacing and
# the magnitudes of the run's own tensors, or from errors measured in the same run, never from a constant:
# - The head, in place: every Head.score call of the decode is recorded (hidden states in, logits and normalisers
#   out) and recomputed exactly in float64 from the same hidden states and weights. Half-precision products are exact
#   in float32, so a float32 head's only rounding is its accumulation of H terms: |error| <= H eps32 sum_h |x_h w_h|
#   (Higham, Accuracy and Stability, 3.1), and the normaliser's sum over V terms adds (V + 2) eps32. A head rounded to
#   the model's dtype is off by half its spacing at the logits' magnitude, which the test checks is above the bound.
# - The scores, end to end: each returned item scored by a plain forward of the same half-precision body with the
#   exact head (`forced_scores`). The tree's kernels and the plain forward's round the body differently: the last
#   hidden states differ by about the dtype's spacing, each logit by eps_dtype sum_h |x_h w_h| (COND below) and each
#   log-probability by twice that, so a score of L levels by at most 2 L eps_dtype COND (measured: 1-4% of it). A
#   dropped normaliser moves a score by the sum of L log-normalisers, far above.
# - Ranking, user by user: e_u is the largest score difference of an item both of user u's lists hold (the engine
#   against the reference), floored at the upper quartile over the group's users (a user whose items happened to
#   round alike does not get a tighter bound than a typical one) and at the float32 spacing of the scores. A user
#   whose reference search never had its k-th and (k+1)-th candidates within TIE_u = 2 e_u keeps the same items, in
#   the same order up to swaps within TIE_u; a user nearer a tie may legitimately get another list. A wrong tree
#   mask reorders users far from any tie.
# - The evidence is drawn, not hoped for: users come in groups of GROUP (fresh prompts, a model trained on them),
#   and each test draws groups until CLEAR users per k are clear of a near-tie, at most MAX_GROUPS (96 users).
#   Where the rounding is larger (another CPU, another kernel family), more groups are drawn; a test that reaches
#   the cap fails, naming the measured rounding: the engine's error then swamps a trained model's gaps.
GROUP, CLEAR, MAX_GROUPS = 16, 8, 6


class Users:
    """Groups of users over one catalog (4 codes per level: few candidates per step, so that most users are clear
    of near-ties), each group with its own prompts and tiny models trained on them, built when first asked for."""

    def __init__(self):
        self.catalog = random_catalog(200, 4, 4, seed=11)
        self.cache = {}

    def once(self, key, make):
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def prompts(self, g: int):  # [GROUP, S] ids, mask
        return self.once(("prompts", g), lambda: left_padded_prompts(GROUP, LENGTHS, self.catalog.vocab_size, 3 + g))

    def model(self, arch: str, g: int, dtype=torch.float32):
        def make():
            if dtype != torch.float32:
                return copy.deepcopy(self.model(arch, g)).to(dtype)
            return trained_model(arch, self.catalog, *self.prompts(g), seed=g)

        return self.once((arch, g, dtype), make)

    def reference(self, arch: str, g: int, k: int):
        """transformers' float32 beam search (the exact ranking) and the float32 search's closest calls [B]."""

        def make():
            model, (ids, mask) = self.model(arch, g), self.prompts(g)
            items, _, scores = hf_beam_search(model, ids, mask, self.catalog, k)
            return items, scores, beam_search(model, ids, mask, self.catalog, k).stats["tie_gap"]

        return self.once(("reference", arch, g, k), make)


@pytest.fixture(scope="module")
def users():
    return Users()


@contextlib.contextmanager
def head_calls():
    """Records every Head.score call inside the block: (head, hidden [R, H], tokens [R, D], Scores)."""
    calls, score = [], Head.score

    def spy(self, hidden, tokens, *args, **kwargs):
        out = score(self, hidden, tokens, *args, **kwargs)
        calls.append((self, hidden.clone(), tokens.clone(), out))
        return out

    Head.score = spy
    try:
        yield calls
    finally:
        Head.score = score


def exact_logits(weight, bias, hidden):
    """The exact head of half-precision inputs (float64) -> logits [R, V] and COND = sum_h |x_h w_h| (+ |bias|)."""
    x, w = hidden.detach().double(), weight.detach().double()
    logits, cond = x @ w.t(), x.abs() @ w.abs().t()
    if bias is not None:
        logits, cond = logits + bias.detach().double(), cond + bias.detach().double().abs()
    return logits, cond


def assert_float32_head(calls, dtype):
    """Every logit and normaliser the decode's head returned is the exact head of its own hidden states within
    float32 accumulation (above), and a head rounded to `dtype` would have broken that bound on these very rows."""
    assert calls, "the decode never called its head"
    seen = 0.0
    for head, hidden, tokens, s in calls:
        assert head.scale == 1.0 and head.softcap is None  # the tiny llama / qwen2 heads: a plain linear layer
        exact, cond = exact_logits(head.weight, head.bias, hidden)  # [R, V]
        bound = head.weight.shape[1] * EPS32 * cond  # [R, V]
        real, tok = tokens >= 0, tokens.clamp(min=0)
        err = (s.logits.double() - exact.gather(1, tok)).abs()  # [R, D]
        assert (err <= bound.gather(1, tok))[real].all(), f"logits off by {float(err[real].max()):.3g}"
        lse_bound = bound.amax(1) + (exact.shape[1] + 2) * EPS32 * exact.logsumexp(1).abs()  # [R]
        assert ((s.lse.double() - exact.logsumexp(1)).abs() <= lse_bound).all()
        rounded = (exact.to(dtype).double() - exact).abs()  # [R, V] what a head in the model's dtype is off by
        seen = max(seen, float((rounded / bound).amax()))
    assert seen > 1, "no row where a rounded head would break the float32 bound: the check has no power here"


def assert_scores(low, ids, mask, rec):
    """rec's scores are its items' log-probabilities under the same half-precision body, within 2 L eps COND."""
    exact = forced_scores(low, ids, mask, rec.token_ids)  # [B, K]
    b, k, code_len = rec.token_ids.shape
    seq = torch.cat([ids.repeat_interleave(k, 0), rec.token_ids.clamp(min=0).reshape(b * k, code_len)], 1)
    full = torch.cat([mask.repeat_interleave(k, 0), mask.new_ones(b * k, code_len)], 1)
    with torch.no_grad():
        hidden = low.base_model(input_ids=seq, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0))
    out = low.get_output_embeddings()
    cond = exact_logits(out.weight, out.bias, hidden.last_hidden_state[:, -code_len - 1 : -1])[1].amax()
    bound = 2 * code_len * torch.finfo(low.dtype).eps * float(cond)
    real = torch.isfinite(exact)
    err = (rec.scores.double() - exact)[real].abs()
    assert float(err.max()) <= bound, f"scores off by {float(err.max()):.3g}, above 2 L eps COND = {bound:.3g}"


def clear_users(ref_items, ref_scores, ref_gap, rec) -> int:
    """Asserts that users clear of a near-tie (gap >= TIE_u, above) keep the reference's ranking; returns how many."""
    e = topk_agreement(ref_items, ref_scores, rec.item_ids, rec.scores)["score_diff"]  # [B]
    floor = max(float(e.quantile(0.75)), EPS32 * float(ref_scores[ref_items >= 0].abs().max()))
    tie = 2 * e.clamp(min=floor)  # [B] TIE_u
    clear = ref_gap >= tie  # [B] users without a near-tie at any selection
    same = same_within_ties(ref_items, ref_scores, rec.item_ids, tie)  # [B]
    assert same[clear].all(), f"users {clear.nonzero()[:, 0][~same[clear]].tolist()} lost their ranking"
    return int(clear.sum())


def assert_ranking_evidence(decode, k: int):
    """decode(g, k) -> (ref items, ref scores, ref gap, rec) for group g: groups are drawn until CLEAR users are
    clear of a near-tie (each one's ranking asserted), at most MAX_GROUPS."""
    clear, errors = 0, []
    for g in range(MAX_GROUPS):
        items, scores, gap, rec = decode(g, k)
        clear += clear_users(items, scores, gap, rec)
        errors.append(float(topk_agreement(items, scores, rec.item_ids, rec.scores)["score_diff"].median()))
        if clear >= CLEAR:
            return
    raise AssertionError(
        f"k = {k}: {clear} of {GROUP * MAX_GROUPS} users clear of the engine's rounding (median score difference "
        f"per group {[f'{e:.3g}' for e in errors]}): it swamps a trained model's gaps"
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_half_precision_keeps_the_float32_ranking_of_a_trained_model(users, dtype, arch):
    """beam_search in half precision against transformers in float32 (the exact ranking): its scores are the half
    body's with a float32 head (nearer the exact head than rounding the head would put them), and users clear of
    the measured rounding keep their ranking."""

    def decode(g, k):
        low, (ids, mask) = users.model(arch, g, dtype), users.prompts(g)
        with head_calls() as calls:
            rec = beam_search(low, ids, mask, users.catalog, k)
        assert rec.scores.dtype == torch.float32
        assert_float32_head(calls, dtype)
        assert_scores(low, ids, mask, rec)
        return *users.reference(arch, g, k), rec

    for k in (5, 10):
        assert_ranking_evidence(decode, k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_strict_speculative_equals_beam_search(users, dtype):
    """Strict speculation in half precision against beam search in the same dtype: the same ranking up to the
    measured difference of the two tree shapes' kernels, and the float32 head in both."""
    cat = users.catalog
    draft = tiny_model("qwen2", cat.vocab_size, seed=5, num_hidden_layers=1, dtype=dtype)

    def decode(g, k):
        target, (ids, mask) = users.model("llama", g, dtype), users.prompts(g)
        ref = beam_search(target, ids, mask, cat, k)
        with head_calls() as calls:
            rec = speculative_beam_search(target, draft, ids, mask, cat, k, draft_beams=2 * k)
        assert_float32_head(calls, dtype)
        assert_scores(target, ids, mask, rec)
        return ref.item_ids, ref.scores, ref.stats["tie_gap"], rec

    for k in (5, 20):
        assert_ranking_evidence(decode, k)


# ---------------------------------------------------------------- cheaper speculation and DISC


def test_the_last_drafted_step_is_carried_not_run_through_the_draft(setup):
    """With the target as its own draft (N = K: every step accepted), L = 4, gamma = 2: one round drafts D_1 and D_2;
    the draft runs the pending beams and D_1 only (D_2's scores are the target's business), so it processes the
    prompts, K pending tokens and N drafted tokens per user: one drafted step fewer than it drafts."""
    cat, ids, mask = setup
    model = tiny_model("llama", cat.vocab_size, seed=1)
    b, s, k = *ids.shape, 5
    rec = speculative_beam_search(model, model, ids, mask, cat, k, draft_beams=k, gamma=2)
    st = rec.stats
    assert torch.equal(st["rounds"], torch.ones(b, dtype=torch.int64)) and (st["accepted_steps"] == 2).all()
    assert st["draft_forwards"] == 3 and st["draft_tokens"] == b * s + b * k + b * k
    assert torch.equal(rec.item_ids, beam_search(model, ids, mask, cat, k).item_ids)


def test_disc_scores_each_trie_node_once_per_user(setup):
    """Proposals that reach a node share its forward, across the k draws: far fewer tree tokens than proposals x
    levels x draws (the tree is never reset), the same items as sampling without the sharing would draw."""
    cat, ids, mask = setup
    model = tiny_model("llama", cat.vocab_size, seed=3)
    with torch.no_grad():
        model.lm_head.weight.mul_(6)  # peaked: the proposals concentrate on a few prefixes, as trained models do
    k, rounds = 10, 4
    rec = disc_sample(model, ids, mask, cat, k, rounds=rounds, generator=torch.Generator().manual_seed(0))
    b, s = ids.shape
    tree_tokens = rec.stats["target_tokens"] - b * s
    unshared = k * 2 * rounds * (cat.code_len - 1)  # per user: every proposal's nodes run again for every draw
    assert (rec.stats["expanded_nodes"] <= unshared / 2).all()  # distinct trie nodes scored per user
    assert tree_tokens < 0.6 * unshared * b  # what the forwards processed, users padded to the busiest
    assert all(len(set(r)) == k for r in rec.item_ids.tolist())


# ---------------------------------------------------------------- the shared prompt prefix


def test_a_shared_prefix_prefilled_once_is_exact(setup):
    """Every decoder continuing a Prefix (the template's fixed text, prefilled once per model) returns what it
    returns on the full prompts; the prefix is computed once and reused."""
    cat, ids, mask = setup
    target = tiny_model("llama", cat.vocab_size, seed=1)
    draft = tiny_model("qwen2", cat.vocab_size, seed=5, num_hidden_layers=1)
    fixed = torch.randint(4, cat.vocab_size, (7,), generator=torch.Generator().manual_seed(9))
    full_ids = torch.cat([fixed.expand(len(ids), -1), ids], 1)
    full_mask = torch.cat([torch.ones(len(ids), 7, dtype=mask.dtype), mask], 1)
    # left padding now sits between the prefix and each user's tokens: positions skip it
    prefix = Prefix(fixed)
    g = lambda: torch.Generator().manual_seed(4)  # noqa: E731
    for decode in (
        lambda i, m, **kw: beam_search(target, i, m, cat, 10, **kw),
        lambda i, m, **kw: speculative_beam_search(target, draft, i, m, cat, 10, **kw),
        lambda i, m, **kw: disc_sample(target, i, m, cat, 5, generator=g(), **kw),
    ):
        want = decode(*repack(full_ids, full_mask))
        got = decode(ids, mask, prefix=prefix)
        assert_same_ranking(got.item_ids, got.scores, want.item_ids, want.scores)
        assert got.stats["target_tokens"] < want.stats["target_tokens"]  # the prefix is not prefilled again
    assert len(prefix._kv) == 2  # target and draft: computed once each


def repack(ids, mask):
    """Full prompts [prefix | pad | user tokens] -> left-padded ones [pad | prefix | user tokens]."""
    order = torch.sort(mask, dim=1, stable=True).indices  # padding first, then the real tokens in order
    return ids.gather(1, order), mask.gather(1, order)


# ---------------------------------------------------------------- grouped-query attention


def test_grouped_query_attention_without_repeated_keys_is_exact(setup, tmp_path):
    cat, ids, mask = setup
    tiny_model("llama", cat.vocab_size, seed=0).save_pretrained(tmp_path)  # 4 query heads, 2 key/value heads
    gqa, plain = load_model(tmp_path), load_model(tmp_path, attn_implementation="sdpa")
    assert gqa.config._attn_implementation == "sdpa_gqa"
    a, b = beam_search(gqa, ids, mask, cat, 10), beam_search(plain, ids, mask, cat, 10)
    assert torch.equal(a.item_ids, b.item_ids)
    torch.testing.assert_close(a.scores, b.scores, atol=float32_atol(a.scores, b.scores), rtol=0)


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_count_is_the_models_own(arch, tied):
    """parameter_count(config) equals the number of parameters transformers builds for the config, exactly."""
    from transformers import AutoModelForCausalLM

    from decoding.memory import parameter_count
    from decoding.models import tiny_config

    config = tiny_config(arch, 50)
    config.tie_word_embeddings = tied
    model = AutoModelForCausalLM.from_config(config)
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters())


def test_the_sizing_page_is_current_and_its_qwen2_shapes_are_the_published_sizes():
    """docs/sizing.md is pipeline.sizing's page; its Qwen2 shapes count the parameters of the published models
    (Qwen2.5-0.5B: 494,032,768; 1.5B: 1,543,714,304; 7B: 7,615,616,512)."""
    from pipeline.sizing import page, sizing_rows

    counts = {r["model"]: r["params"] for r in sizing_rows()}
    assert counts == {"0.5B": 494_032_768, "1.5B": 1_543_714_304, "7B": 7_615_616_512}
    assert (Path(__file__).parents[1] / "docs" / "sizing.md").read_text() == page()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fit_batch_covers_the_tree_cache_and_shrinks_with_the_shape(arch):
    """The per-user estimate behind the GPU batch covers what a decode really holds per user (every layer's keys and
    values over the padded prompt and the K(L-1) tree tokens); the batch that fits shrinks with the prompt and K and
    grows with free memory, clamped to [1, most]."""
    from decoding.memory import bytes_per_user, decode_bytes_per_user, fit_batch

    cat = random_catalog(300, 3, 8, seed=0)
    model = tiny_model(arch, cat.vocab_size, seed=0)
    ids, mask = left_padded_prompts(6, [9, 17, 30], cat.vocab_size, seed=1)
    k = 5
    with torch.no_grad():
        cache, _ = prefill(model, ids, mask, capacity=k * (cat.code_len - 1))
        beam_search(model, ids, mask, cat, k)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) / 6
    per_user = decode_bytes_per_user(model, ids.shape[1], k, cat.code_len, torch.float32)
    assert held <= per_user == bytes_per_user(model.config, ids.shape[1], k * (cat.code_len - 1), k, torch.float32)
    assert decode_bytes_per_user(model, 300, k, cat.code_len, torch.float32) > per_user  # longer prompts
    assert decode_bytes_per_user(model, ids.shape[1], 4 * k, cat.code_len, torch.float32) > per_user  # wider beams
    assert decode_bytes_per_user(model, ids.shape[1], k, cat.code_len, torch.bfloat16) < per_user  # half the bytes
    assert (
        decode_bytes_per_user(model, ids.shape[1], k, cat.code_len, torch.float32, "atspeed-strict", model) > per_user
    )  # a draft's cache besides the target's
    gib = 1 << 30
    small, large = (fit_batch(per_user, n * gib, head_bytes=0, most=10**9) for n in (1, 8))
    assert small == int(0.8 * gib // per_user) and large > small  # 20% headroom kept back
    assert fit_batch(per_user, 8 * gib, head_bytes=0, most=64) == 64 and fit_batch(per_user, 1000) == 1
