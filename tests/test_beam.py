"""beam_search returns exactly what transformers' constrained beam search returns, only faster."""

import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.models import tiny_model
from tests.helpers import (
    SPECIALS,
    assert_same_ranking,
    hf_beam_search,
    left_padded_prompts,
    random_catalog,
    sequence_logprob,
)

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]  # 8 users, all different prompt lengths


@pytest.fixture(scope="module")
def catalog():
    return random_catalog(400, 4, 8, seed=11)


@pytest.mark.parametrize(
    "arch, attn", [("llama", "eager"), ("llama", "sdpa"), ("qwen2", "eager"), ("qwen2", "sdpa"), ("qwen3", "sdpa")]
)
@pytest.mark.parametrize("k", [1, 5, 20])
def test_equals_transformers_beam_search(catalog, arch, attn, k):
    model = tiny_model(arch, catalog.vocab_size, seed=k, attn_implementation=attn)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=k)
    rec = beam_search(model, ids, mask, catalog, k)
    items, tokens, scores = hf_beam_search(model, ids, mask, catalog, k)
    assert (items >= 0).all()  # transformers' beams are all catalog items here
    assert_same_ranking(rec.item_ids, rec.scores, items, scores)
    assert rec.scores.dtype == torch.float32 and (rec.scores[:, :-1] >= rec.scores[:, 1:]).all()
    assert torch.equal(catalog.lookup(rec.token_ids.view(-1, 4)).view(8, k), rec.item_ids)


@pytest.mark.parametrize("k", [5, 20])
def test_prefixes_with_fewer_than_k_continuations(k):
    # 3 first codes, at most 4 second codes, sparse third level: beams must spread over several parents
    g = torch.Generator().manual_seed(5)
    flat = torch.randperm(3 * 4 * 12, generator=g)[:60]
    digits = torch.stack([flat // 48, flat // 12 % 4, flat % 12], 1)
    cat = Catalog.from_token_ids(torch.arange(60), SPECIALS + torch.tensor([0, 3, 7]) + digits, SPECIALS + 19)
    level2 = torch.arange(cat.level_start[2], cat.level_start[3])
    assert cat.max_children[0] == 3 and cat.max_children[1] <= 4 and int(cat.num_children(level2).min()) < 5
    model = tiny_model("llama", cat.vocab_size, seed=7)
    ids, mask = left_padded_prompts(8, LENGTHS, cat.vocab_size, seed=3)
    rec = beam_search(model, ids, mask, cat, k)
    items, _, scores = hf_beam_search(model, ids, mask, cat, k)
    assert_same_ranking(rec.item_ids, rec.scores, items, scores)


def exhaustive_ranking(model, ids, mask, cat: Catalog):
    """Scores every catalog item for every user -> (item ids [B, N], scores [B, N]) sorted descending."""
    b, n = ids.shape[0], len(cat)
    seq = torch.cat([ids.repeat_interleave(n, 0), cat.tokens.repeat(b, 1)], 1)
    scores = sequence_logprob(model, seq, mask.repeat_interleave(n, 0), cat.code_len).view(b, n)
    order = scores.argsort(dim=1, descending=True, stable=True)
    return cat.item_ids[order], scores.gather(1, order)


def test_fewer_items_than_k_pads_and_ranks_everything():
    cat = random_catalog(7, 3, 4, seed=2)
    model = tiny_model("qwen2", cat.vocab_size, seed=1)
    ids, mask = left_padded_prompts(4, [5, 2, 9, 4], cat.vocab_size, seed=1)
    rec = beam_search(model, ids, mask, cat, 10)
    items, scores = exhaustive_ranking(model, ids, mask, cat)
    assert_same_ranking(rec.item_ids[:, :7], rec.scores[:, :7], items, scores)
    assert (rec.item_ids[:, 7:] == -1).all() and torch.isinf(rec.scores[:, 7:]).all()
    assert (rec.token_ids[:, 7:] == -1).all()


def test_wide_beam_is_exhaustive():
    # k at least the number of prefixes at every level: beam search must rank the whole catalog exactly
    cat = random_catalog(50, 3, 5, seed=9)
    model = tiny_model("llama", cat.vocab_size, seed=4, attn_implementation="eager")
    ids, mask = left_padded_prompts(3, [8, 3, 12], cat.vocab_size, seed=4)
    rec = beam_search(model, ids, mask, cat, 50)
    items, scores = exhaustive_ranking(model, ids, mask, cat)
    assert_same_ranking(rec.item_ids, rec.scores, items, scores)


def test_batch_of_users_equals_users_one_at_a_time(catalog):
    model = tiny_model("qwen2", catalog.vocab_size, seed=3)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=5)
    rec = beam_search(model, ids, mask, catalog, 5)
    for i in range(8):
        n = int(mask[i].sum())
        one = beam_search(model, ids[i : i + 1, -n:], mask[i : i + 1, -n:], catalog, 5)
        assert_same_ranking(one.item_ids, one.scores, rec.item_ids[i : i + 1], rec.scores[i : i + 1])


def test_deterministic_tie_break():
    # a model with constant logits: every item ties; the order must follow (beam, token) order, i.e. sorted rows
    cat = random_catalog(30, 2, 8, seed=1)
    model = tiny_model("llama", cat.vocab_size, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    ids, mask = left_padded_prompts(2, [4, 6], cat.vocab_size)
    rec = beam_search(model, ids, mask, cat, 30)
    assert torch.equal(rec.item_ids, cat.item_ids.expand(2, -1))


def test_bad_arguments():
    cat = random_catalog(10, 2, 4)
    model = tiny_model("llama", cat.vocab_size)
    ids, mask = left_padded_prompts(2, [3, 5], cat.vocab_size)
    with pytest.raises(ValueError, match="k must be >= 1"):
        beam_search(model, ids, mask, cat, 0)
    with pytest.raises(ValueError, match="must both be"):
        beam_search(model, ids, mask[:, 1:], cat, 3)
    with pytest.raises(ValueError, match=r"left-padded: attention_mask\[:, -1\] is 0 in rows \[0\]"):
        beam_search(model, ids, mask.flip(1), cat, 3)
