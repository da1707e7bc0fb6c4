"""Semantic IDs that name several items (duplicate_items `by:COLUMN` and `expand`), against a direct reference:
transformers' constrained beam search over each user's candidate semantic IDs (those with an item left to the user:
recommendable, not excluded), then each semantic ID turned into items in plain Python (decoding/reference.py
`sid_groups`, `listed_items`). Every mode honours the policy on the semantic IDs it finds or draws."""

import math

import numpy as np
import pyarrow as pa
import pytest
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog, Exclusions
from decoding.codes import column_rank, duplicate_policy
from decoding.disc import disc_sample
from decoding.draws import UserDraws, user_seeds
from decoding.models import tiny_model
from decoding.reference import generate_beam_search, listed_items, sid_groups, sid_trie
from decoding.speculative import speculative_beam_search
from tests.helpers import SPECIALS, assert_same_ranking, left_padded_prompts

LENGTHS = [3, 11, 6, 17, 9, 4, 14, 8]  # 8 users, every prompt length different: left padding
K, LEVELS, CODES = 5, 3, 6
HF_PAD = -1e8  # transformers fills a user's missing beams with sequences scored about -1e9


@pytest.fixture(scope="module")
def world():
    """90 semantic IDs over 3 x 6 codes naming 1 to 4 items each (about 200 items), a popularity column with ties,
    nulls and NaN, and a recommendable set that drops about one item in six (every item of one semantic ID
    among them); the catalogs `by:popularity` and `expand:popularity` build of it, and the plain Python groups."""
    g = np.random.default_rng(7)
    flat = g.choice(CODES**LEVELS, 90, replace=False)
    sids = np.stack([flat // CODES**2, flat // CODES % CODES, flat % CODES], 1)  # [90, 3]
    size = g.choice([1, 2, 3, 4], 90, p=[0.4, 0.3, 0.2, 0.1])
    tokens = SPECIALS + np.arange(LEVELS) * CODES + np.repeat(sids, size, 0)  # [N, 3] token ids
    n = len(tokens)
    ids = g.choice(np.arange(1000, 10_000), n, replace=False)
    pop = g.integers(0, 4, n).astype(float)  # few values: ties within a semantic ID
    pop[g.random(n) < 0.1] = np.nan
    value = [None if g.random() < 0.1 else float(v) for v in pop]
    served = g.random(n) > 1 / 6
    served[np.repeat(np.arange(90), size) == 0] = False  # no item of the first semantic ID is recommendable
    table = pa.table({"item_id": ids, "popularity": pa.array(value, pa.float64())})
    rank = column_rank(table, "popularity", "catalog")
    vocab = SPECIALS + LEVELS * CODES
    cats = {
        kind: Catalog.from_token_ids(ids, tokens, vocab, kind, recommendable=served, order=rank)
        for kind in ("by", "expand")
    }
    groups = sid_groups(ids.tolist(), tokens.tolist(), value, set(ids[served].tolist()))
    return {"cats": cats, "groups": groups, "ids": ids, "served": served, "size": size}


def test_the_policies_and_their_order(world):
    """by:COLUMN needs its column, expand may name one; a semantic ID lists its recommendable items, highest value
    first, null and NaN last, ties to the lowest item id; the counts of shared semantic IDs; a column that is
    missing or has no order is refused, naming it."""
    assert duplicate_policy("by:popularity") == ("by", "popularity") and duplicate_policy("expand") == ("expand", None)
    for bad in ("by", "by:", "expand:", "first:x", "last"):
        with pytest.raises(ValueError, match="duplicate_items must be one of"):
            duplicate_policy(bad)
    by, groups = world["cats"]["by"], world["groups"]
    ptr, listed = by.group_ptr.tolist(), by.listed.tolist()
    assert {tuple(r): listed[ptr[i] : ptr[i + 1]] for i, r in enumerate(by.tokens.tolist())} == groups
    assert len(by) == len(groups) < 90 and by.item_ids.tolist() == [listed[p] for p in ptr[:-1]]
    sizes = np.array([len(v) for v in groups.values()])
    assert by.collisions == (int((sizes > 1).sum()), int(sizes[sizes > 1].sum())) and by.collisions[0] > 20
    table = pa.table({"item_id": [5, 3, 9, 4, 8], "p": pa.array([2.0, None, 2.0, math.nan, 7.0])})
    assert column_rank(table, "p", "c").tolist() == [1, 3, 2, 4, 0]  # 8 (7.0), 5 and 9 (2.0), then 3 and 4 (none)
    with pytest.raises(ValueError, match="c: missing column 'q', which duplicate_items orders items by"):
        column_rank(table, "q", "c")
    with pytest.raises(ValueError, match="column 'item_id' .* must hold numbers"):
        column_rank(pa.table({"item_id": ["a"]}), "item_id", "c")


@pytest.fixture(scope="module")
def users(world):
    """A tiny model, 8 users' prompts, and each user's excluded items, aimed at its top semantic IDs of an
    unrestricted search (`exclusion_lists`), as Exclusions of either catalog."""
    by = world["cats"]["by"]
    model = tiny_model("qwen2", by.vocab_size, seed=1, attn_implementation="eager")
    ids, mask = left_padded_prompts(8, LENGTHS, by.vocab_size, seed=1)
    top = beam_search(model, ids, mask, by, K).token_ids  # [8, K, L]
    lists = exclusion_lists(world, top)
    user = torch.tensor([u for u, items in enumerate(lists) for _ in items], dtype=torch.int64)
    items = torch.tensor([i for e in lists for i in e], dtype=torch.int64)
    exclude = {kind: Exclusions.from_items(cat, user, items, 8) for kind, cat in world["cats"].items()}
    return {"model": model, "ids": ids, "mask": mask, "top": top, "lists": lists, "exclude": exclude}


def exclusion_lists(world, top: torch.Tensor) -> list[list[int]]:
    """Per user, from its unrestricted top semantic IDs top [8, K, L]: none; the best item of each of its first 3
    that name several items (each then names its next item); every item of its top one (no longer a candidate) and
    the best of its second; 40 random items; all but 3 items (fewer than K left); items that are not recommendable and
    ids the catalog lacks; all but the last item of each of its top 5; none."""
    g = np.random.default_rng(3)
    groups = world["groups"]
    sid = lambda u, j: groups[tuple(top[u, j].tolist())]  # noqa: E731
    listed = sorted(i for items in groups.values() for i in items)
    left = set(g.choice(listed, 3, replace=False).tolist())
    return [
        [],
        [sid(1, j)[0] for j in range(K) if len(sid(1, j)) > 1][:3],
        sid(2, 0) + sid(2, 1)[:1],
        g.choice(listed, 40).tolist(),
        [i for i in listed if i not in left],
        world["ids"][~world["served"]].tolist() + [-7, 10**9],
        [i for j in range(5) for i in sid(6, j)[:-1]],
        [],
    ]


def reference(model, ids, mask, cat: Catalog, groups: dict, lists: list, expand: bool):
    """transformers' beam search over each user's candidate semantic IDs, each turned into items in plain Python
    -> (item ids, scores [B, K]), padded with -1 and -inf."""
    tries = [sid_trie(groups, e) for e in lists]
    _, tokens, scores, _ = generate_beam_search(model, ids, mask, cat, K, tries)
    rows = []
    for t, s, e in zip(tokens.tolist(), scores.tolist(), lists):
        live = [j for j in range(K) if s[j] > HF_PAD]  # its filler beams (fewer than K candidates) dropped
        rows.append(listed_items([t[j] for j in live], [s[j] for j in live], groups, e, K, expand))
    return as_lists(rows)


def as_lists(rows: list[tuple[list, list]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per user (items, scores), each at most K -> item ids, scores [B, K], padded with -1 and -inf."""
    items = torch.full((len(rows), K), -1, dtype=torch.int64)
    scores = torch.full((len(rows), K), float("-inf"))
    for u, (i, s) in enumerate(rows):
        items[u, : len(i)], scores[u, : len(s)] = torch.tensor(i, dtype=torch.int64), torch.tensor(s)
    return items, scores


def of_own_ids(rec, groups: dict, lists: list, expand: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode's own semantic IDs (a `by` decode: one entry each), turned into items in plain Python."""
    rows = []
    for tokens, scores, e in zip(rec.token_ids.tolist(), rec.scores.tolist(), lists):
        live = [(t, s) for t, s in zip(tokens, scores) if t[0] >= 0]
        rows.append(listed_items([t for t, _ in live], [s for _, s in live], groups, e, K, expand))
    return as_lists(rows)


def test_beam_search_lists_what_the_reference_lists(world, users):
    """by:popularity and expand:popularity with per-user exclusions: beam search equals the reference, and `expand`
    is exactly by's semantic IDs, each expanded into its items left to the user in the column's order."""
    model, ids, mask, lists = users["model"], users["ids"], users["mask"], users["lists"]
    groups = world["groups"]
    rec = {}
    for kind, cat in world["cats"].items():
        rec[kind] = beam_search(model, ids, mask, cat, K, exclude=users["exclude"][kind])
        assert_same_ranking(
            rec[kind].item_ids, rec[kind].scores, *reference(model, ids, mask, cat, groups, lists, kind == "expand")
        )
    items, scores = of_own_ids(rec["by"], groups, lists, expand=True)
    assert torch.equal(rec["expand"].item_ids, items) and torch.equal(rec["expand"].scores, scores)
    sids = [[tuple(t) for t in row] for row in rec["by"].token_ids.tolist()]
    assert not set(sids[2]) & {tuple(t) for t in users["top"][2, :1].tolist()}  # wholly excluded: gone
    assert rec["expand"].item_ids[4].tolist()[3:] == [-1, -1] and (rec["expand"].item_ids[4, :3] >= 0).all()  # 3 left
    named = [
        (i, groups[sid][0]) for r, row in zip(rec["by"].item_ids.tolist(), sids) for i, sid in zip(r, row) if i >= 0
    ]
    assert any(i != best for i, best in named)  # an exclusion inside a shared semantic ID: it names its next item
    assert (rec["expand"].token_ids[:, 1:] == rec["expand"].token_ids[:, :-1]).all(2).any()  # one ID, several items


def test_every_mode_honours_the_policy(world, users):
    """atspeed-strict returns beam search's lists under either policy. atspeed-relaxed and DISC draw semantic IDs,
    each distinct and each with an item left to the user, the same ones under either policy (a draw never looks at
    a semantic ID's items), and list exactly what each policy makes of them."""
    model, ids, mask, lists = users["model"], users["ids"], users["mask"], users["lists"]
    draft = tiny_model("qwen2", model.config.vocab_size, seed=4, num_hidden_layers=1)
    seeds = user_seeds(0, list(range(8)), ids.device)
    modes = {
        "atspeed-strict": lambda c, e: speculative_beam_search(model, draft, ids, mask, c, K, gamma=2, exclude=e),
        "atspeed-relaxed": lambda c, e: speculative_beam_search(
            model, draft, ids, mask, c, K, verification="relaxed", generator=UserDraws(seeds), exclude=e
        ),
        "disc": lambda c, e: disc_sample(model, ids, mask, c, K, rounds=2, generator=UserDraws(seeds), exclude=e),
    }
    for name, run in modes.items():
        rec = {kind: run(cat, users["exclude"][kind]) for kind, cat in world["cats"].items()}
        live = rec["by"].token_ids[:, :, 0] >= 0  # [8, K] the semantic IDs found or drawn
        assert torch.equal(live, rec["by"].item_ids >= 0), name  # each names an item
        assert all(len(set(map(tuple, t[v].tolist()))) == int(v.sum()) for t, v in zip(rec["by"].token_ids, live))
        for kind in ("by", "expand"):
            items, scores = of_own_ids(rec["by"], world["groups"], lists, expand=kind == "expand")
            assert torch.equal(rec[kind].item_ids, items) and torch.equal(rec[kind].scores, scores), (name, kind)
            if name == "atspeed-strict":
                ref = beam_search(model, ids, mask, world["cats"][kind], K, exclude=users["exclude"][kind])
                assert_same_ranking(rec[kind].item_ids, rec[kind].scores, ref.item_ids, ref.scores)
