"""Per-user exclusions: every decoder is exact over the catalog minus each user's excluded items.

beam_search equals transformers' constrained beam search with a per-user trie that omits the user's excluded items;
strict speculative decoding equals beam_search; DISC's law is P_S over the user's remaining items; the closed nodes
are exactly the trie nodes with no item left."""
import math

import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog, Exclusions
from decoding.disc import constrained_sample, disc_sample
from decoding.models import tiny_model
from decoding.reference import catalog_logprob, cpu_trie, generate_beam_search
from decoding.speculative import speculative_beam_search
from tests.helpers import SPECIALS, assert_same_ranking, left_padded_prompts, random_catalog, trained_model

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]  # 8 users, all different prompt lengths: left padding
HF_PAD = -1e8  # transformers fills a user's missing beams with sequences scored about -1e9


@pytest.fixture(scope="module")
def catalog():
    return random_catalog(400, 4, 8, seed=11)


def under(cat: Catalog, item_id: int, levels: int) -> list[int]:
    """Every item sharing the first `levels` code tokens with item_id."""
    row = cat.tokens[cat.item_ids == item_id][0]
    return cat.item_ids[(cat.tokens[:, :levels] == row[:levels]).all(1)].tolist()


def exclusion_lists(cat: Catalog, top: torch.Tensor, k: int, seed: int = 0) -> list[list[int]]:
    """One list of excluded item ids per user, from the users' unrestricted top items top [8, >= 2]: none; the top-k
    themselves; every item under the top item's first-level prefix (a whole first-level subtree dead); the subtrees
    of the two best first-level prefixes plus 30 random items; all but 3 items (fewer than k left); 50 random items,
    repeats and ids the catalog does not hold; every item under the top item's second-level prefix; none."""
    g = torch.Generator().manual_seed(seed)
    ids = cat.item_ids
    rand = lambda n: ids[torch.randperm(len(ids), generator=g)[:n]].tolist()  # noqa: E731
    top = top.tolist()
    keep3 = torch.randperm(len(ids), generator=g)[:3]
    return [[], top[1][:k], under(cat, top[2][0], 1), under(cat, top[3][0], 1) + under(cat, top[3][1], 1) + rand(30),
            [i for j, i in enumerate(ids.tolist()) if j not in keep3.tolist()], rand(50) + rand(5) + [-7, 10 ** 9],
            under(cat, top[6][0], 2), []]


def as_pairs(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-user lists -> (user [M], item [M])."""
    user = torch.tensor([u for u, items in enumerate(lists) for _ in items], dtype=torch.int64)
    return user, torch.tensor([i for items in lists for i in items], dtype=torch.int64)


def remaining(cat: Catalog, lists: list[list[int]]) -> list[int]:
    return [int((~torch.isin(cat.item_ids, torch.tensor(items, dtype=torch.int64))).sum()) for items in lists]


def hf_with_tries(model, ids, mask, cat: Catalog, k: int, lists):
    """transformers with one trie per user -> (item ids, scores [B, k]); its filler beams (a user with fewer than k
    items left) become padding (-1, -inf), as beam_search returns them."""
    items, _, scores, _ = generate_beam_search(model, ids, mask, cat, k, [cpu_trie(cat, e) for e in lists])
    pad = scores < HF_PAD
    return items.masked_fill(pad, -1), scores.masked_fill(pad, float("-inf"))


def assert_respects(rec, lists, left: list[int], k: int):
    """No user gets an excluded item; each gets min(k, items left) distinct items, then padding."""
    for u, items in enumerate(lists):
        got = rec.item_ids[u]
        n = min(k, left[u])
        assert not torch.isin(got, torch.tensor(items, dtype=torch.int64)).any(), u
        assert (got[:n] >= 0).all() and (got[n:] == -1).all() and len(set(got[:n].tolist())) == n, (u, got)
        assert torch.isinf(rec.scores[u, n:]).all() and (rec.token_ids[u, n:] == -1).all()


# ------------------------------------------------------------------ the structure


def test_closed_nodes_are_exactly_the_nodes_with_no_item_left(catalog):
    cat = catalog
    top = cat.item_ids[:8 * 20].view(8, 20)
    lists = exclusion_lists(cat, top, 5)
    ex = Exclusions.from_items(cat, *as_pairs(lists), 8)
    nodes = torch.arange(cat.num_nodes)
    for u, items in enumerate(lists):
        left = ~torch.isin(cat.item_ids, torch.tensor(items, dtype=torch.int64))  # [N] rows still allowed
        expect = {}
        for row in left.nonzero().flatten().tolist():  # brute force: walk each remaining item's path
            expect.update(dict.fromkeys(cat.node_of(cat.tokens[row:row + 1, :t]).item()
                                        for t in range(cat.code_len + 1)))
        got = ex.select(torch.full((cat.num_nodes,), u)).open(cat, nodes)  # row i: user u, node i
        assert set(got.nonzero().flatten().tolist()) == set(expect), u
        assert ex.select(torch.tensor([u])).per_user().item() == len(cat) - int(left.sum())
    assert not ex.open(cat, torch.full((8, 3), -1)).any()  # no node is no candidate


def test_leaf_of_ignores_unknown_ids_and_dropped_duplicates():
    cat = Catalog.from_token_ids(torch.tensor([7, 3, 9, 5]), torch.tensor([[4, 6], [4, 7], [5, 6], [4, 6]]), 8,
                                 on_duplicate="first")
    assert cat.duplicates == [(5, 7)]
    leaf = cat.leaf_of(torch.tensor([3, 5, 7, 9, 11, -1]))
    assert (leaf[[1, 4, 5]] == -1).all()
    assert cat.item_of_node(leaf[[0, 2, 3]]).tolist() == [3, 7, 9]
    ex = Exclusions.from_items(cat, torch.tensor([0, 0, 1, 1]), torch.tensor([5, 11, 7, 7]), 3)
    assert ex.per_user().tolist() == [0, 1, 0]  # a dropped duplicate is not its kept twin; repeats count once
    with pytest.raises(ValueError, match=r"users must lie in \[0, 3\)"):
        Exclusions.from_items(cat, torch.tensor([3]), torch.tensor([7]), 3)


# ------------------------------------------------------------------ beam search


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [1, 5, 20])
def test_beam_search_equals_transformers_with_per_user_tries(catalog, arch, k):
    model = tiny_model(arch, catalog.vocab_size, seed=k, attn_implementation="eager")
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=k)
    top = beam_search(model, ids, mask, catalog, max(k, 2)).item_ids  # what the exclusions must bite into
    lists = exclusion_lists(catalog, top, k, seed=k)
    left = remaining(catalog, lists)
    assert left[4] == 3 and min(left) < k or k <= 3  # one user with fewer than k items left
    rec = beam_search(model, ids, mask, catalog, k, exclude=Exclusions.from_items(catalog, *as_pairs(lists), 8))
    items, scores = hf_with_tries(model, ids, mask, catalog, k, lists)
    assert_same_ranking(rec.item_ids, rec.scores, items, scores)
    assert_respects(rec, lists, left, k)
    assert not torch.equal(rec.item_ids[1:7], top[1:7, :k])  # the exclusions changed the lists


def test_no_exclusions_and_slices_are_exact(catalog):
    model = tiny_model("qwen2", catalog.vocab_size, seed=3)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=5)
    plain = beam_search(model, ids, mask, catalog, 5)
    none = beam_search(model, ids, mask, catalog, 5, exclude=Exclusions.none(catalog, 8))
    assert torch.equal(none.item_ids, plain.item_ids) and torch.equal(none.scores, plain.scores)
    lists = exclusion_lists(catalog, plain.item_ids, 5)
    ex = Exclusions.from_items(catalog, *as_pairs(lists), 8)
    whole = beam_search(model, ids, mask, catalog, 5, exclude=ex)
    rows = torch.arange(3, 7)  # a slice of the batch, as the actor decodes slices
    n = int(mask[rows].sum(1).max())
    part = beam_search(model, ids[rows, -n:], mask[rows, -n:], catalog, 5, exclude=ex.select(rows))
    assert_same_ranking(part.item_ids, part.scores, whole.item_ids[rows], whole.scores[rows], atol=1e-5)
    with pytest.raises(ValueError, match="exclude holds 8 users"):
        beam_search(model, ids[:2], mask[:2], catalog, 5, exclude=ex)


# ------------------------------------------------------------------ speculative decoding


@pytest.mark.parametrize("draft_seed, k", [(99, 5), (5, 20)])
def test_strict_speculative_equals_beam_search_with_exclusions(catalog, draft_seed, k):
    target = tiny_model("llama", catalog.vocab_size, seed=1)
    draft = tiny_model("qwen2", catalog.vocab_size, seed=draft_seed, num_hidden_layers=1, hidden_size=32, head_dim=8)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=3)
    lists = exclusion_lists(catalog, beam_search(target, ids, mask, catalog, k).item_ids, k, seed=1)
    ex = Exclusions.from_items(catalog, *as_pairs(lists), 8)
    ref = beam_search(target, ids, mask, catalog, k, exclude=ex)
    assert_respects(ref, lists, remaining(catalog, lists), k)
    for n, gamma in ((k, 1), (2 * k, 2), (40, catalog.code_len)):
        rec = speculative_beam_search(target, draft, ids, mask, catalog, k, draft_beams=max(n, k), gamma=gamma,
                                      exclude=ex)
        assert_same_ranking(rec.item_ids, rec.scores, ref.item_ids, ref.scores)
        assert len(set(rec.stats["rounds"].tolist())) > 1 or gamma == catalog.code_len  # users left at other rounds


def test_sampling_decoders_never_return_an_excluded_item(catalog):
    target = tiny_model("llama", catalog.vocab_size, seed=1)
    ids, mask = left_padded_prompts(8, LENGTHS, catalog.vocab_size, seed=3)
    lists = exclusion_lists(catalog, beam_search(target, ids, mask, catalog, 5).item_ids, 5, seed=2)
    ex, left = Exclusions.from_items(catalog, *as_pairs(lists), 8), remaining(catalog, lists)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert_respects(beam_search(target, ids, mask, catalog, 5, do_sample=True, generator=g(), exclude=ex), lists,
                    left, 5)
    assert_respects(speculative_beam_search(target, target, ids, mask, catalog, 5, verification="relaxed",
                                            generator=g(), exclude=ex), lists, left, 5)
    for sampler in (constrained_sample, disc_sample):
        rec = sampler(target, ids, mask, catalog, 5, generator=g(), exclude=ex)
        assert_respects(rec, lists, left, 5)
        rec = sampler(target, ids, mask, catalog, 5, top_m=6, generator=g(), exclude=ex)  # PPV candidates
        assert not any(torch.isin(rec.item_ids[u], torch.tensor(e, dtype=torch.int64)).any() for u, e in
                       enumerate(lists))
