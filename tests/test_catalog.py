"""Catalog index: CSR allowed_next, PPV verify and lookup against brute force; bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decoding.catalog import Catalog
from pipeline.prepare import BEAUTY_SOURCE
from tests.helpers import random_catalog

BEAUTY = BEAUTY_SOURCE


def brute_allowed(rows: list[tuple], prefix: tuple, vocab: int) -> list[bool]:
    nxt = {r[len(prefix)] for r in rows if r[: len(prefix)] == prefix}
    return [v in nxt for v in range(vocab)]


def brute_verify(rows: list[tuple], prefix: tuple, cand: int) -> bool:
    return any(r[: len(prefix) + 1] == prefix + (cand,) for r in rows)


def random_prefixes(rows, t, n, vocab, g):
    """Half real prefixes of catalog rows, half random token tuples (mostly invalid)."""
    real = [rows[i][:t] for i in torch.randint(len(rows), (n // 2,), generator=g).tolist()]
    rand = [tuple(x) for x in torch.randint(vocab, (n - n // 2, t), generator=g).tolist()]
    return real + rand


catalogs = st.tuples(st.integers(1, 4), st.integers(2, 6), st.integers(1, 80), st.integers(0, 10**6))


@settings(max_examples=60, deadline=None)
@given(catalogs)
def test_allowed_next_verify_lookup_match_brute_force(spec):
    levels, codes, n, seed = spec
    n = min(n, codes**levels)
    cat = random_catalog(n, levels, codes, seed=seed, skew=0.5)
    rows = [tuple(r) for r in cat.tokens.tolist()]
    g = torch.Generator().manual_seed(seed)
    for t in range(levels):
        prefixes = random_prefixes(rows, t, 16, cat.vocab_size, g)
        prefix = torch.tensor(prefixes, dtype=torch.int64).view(len(prefixes), t)
        got = cat.allowed_next(prefix)
        want = torch.tensor([brute_allowed(rows, p, cat.vocab_size) for p in prefixes])
        assert torch.equal(got, want)
        cands = torch.randint(cat.vocab_size, (len(prefixes), 7), generator=g)
        cands[:, 0] = cat.tokens[torch.randint(n, (len(prefixes),), generator=g), t]  # some valid candidates
        got = cat.verify(prefix, cands)
        want = torch.tensor([[brute_verify(rows, p, c) for c in cs] for p, cs in zip(prefixes, cands.tolist())])
        assert torch.equal(got, want)
        assert torch.equal(got, cat.allowed_next(prefix).gather(1, cands))  # PPV agrees with CSR
    full = torch.cat([cat.tokens, torch.randint(cat.vocab_size, (20, levels), generator=g)])
    item_of = dict(zip(rows, cat.item_ids.tolist()))
    want = torch.tensor([item_of.get(tuple(r), -1) for r in full.tolist()])
    assert torch.equal(cat.lookup(full), want)


def test_children_walk_the_trie_by_node_id():
    cat = random_catalog(200, 3, 6, seed=4, skew=0.7)
    node = torch.zeros(1, dtype=torch.int64)
    for level in range(3):  # follow one item down the trie through child node ids
        assert cat.level_of(node).item() == level
        tok, child, valid = cat.children(node, cat.max_children[level])
        j = (tok[0] == cat.tokens[57, level]) & valid[0]
        node = child[0][j]
        assert node.numel() == 1
    assert cat.item_of_node(node).item() == cat.item_ids[57].item()
    leaves = cat.node_of(cat.tokens)
    assert torch.equal(leaves, cat.level_start[3] + torch.arange(len(cat)))  # level-L nodes are the sorted rows
    assert torch.equal(cat.item_of_node(leaves), cat.item_ids) and (cat.num_children(leaves) == 0).all()
    assert (cat.leaf_count[leaves] == 1).all() and cat.leaf_count[0] == len(cat)
    for t in range(1, 3):  # items under a prefix node = rows sharing the prefix
        prefix = cat.tokens[57:58, :t]
        want = (cat.tokens[:, :t] == prefix).all(1).sum()
        assert cat.leaf_count[cat.node_of(prefix)].item() == want.item()
    mixed = torch.tensor([0, int(cat.node_of(cat.tokens[5:6, :1])), int(cat.node_of(cat.tokens[5:6, :2]))])
    tok, child, valid = cat.children(mixed)  # beams at three different levels in one call
    assert torch.equal(valid.sum(1), cat.num_children(mixed))
    assert cat.tokens[5, 1].item() in tok[1][valid[1]].tolist() and cat.tokens[5, 2].item() in tok[2][valid[2]].tolist()
    assert cat.node_of(torch.tensor([[0, 0]])).item() == -1


def test_small_hand_catalog():
    cat = Catalog.from_token_ids([10, 11, 12, 13], [[5, 1], [5, 2], [6, 1], [4, 3]], vocab_size=7)
    assert cat.allowed_next(torch.zeros(1, 0, dtype=torch.int64)).nonzero()[:, 1].tolist() == [4, 5, 6]
    assert cat.allowed_next(torch.tensor([[5], [6], [3]])).nonzero().tolist() == [[0, 1], [0, 2], [1, 1]]
    assert cat.verify(torch.tensor([[5]]), torch.tensor([[2, 3, 1]])).tolist() == [[True, False, True]]
    assert cat.lookup(torch.tensor([[6, 1], [6, 2], [4, 3]])).tolist() == [12, -1, 13]
    assert cat.max_children == [3, 2]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(item_ids=[1, 2], token_ids=[[4, 5], [4]], vocab_size=8), r"ragged code lengths: rows \[1\]"),
        (dict(item_ids=[1, 2], token_ids=[[4, 5], [-1, 5]], vocab_size=8), r"outside \[0, 8\) in rows \[1\]"),
        (dict(item_ids=[1, 2], token_ids=[[4, 5], [4, 8]], vocab_size=8), r"outside \[0, 8\) in rows \[1\]"),
        (dict(item_ids=[7, 7], token_ids=[[4, 5], [4, 6]], vocab_size=8), r"duplicate item ids: \[7\]"),
        (
            dict(item_ids=[1, 2, 3], token_ids=[[4, 5], [4, 6], [4, 5]], vocab_size=8),
            r"input rows \[2\] repeat rows \[0\]",
        ),
        (dict(item_ids=[1, 2], token_ids=[[4, 5], [4, 6]], vocab_size=8, on_duplicate="last"), "on_duplicate"),
        (dict(item_ids=[], token_ids=torch.zeros(0, 2, dtype=torch.int64), vocab_size=8), "empty"),
    ],
)
def test_bad_catalogs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Catalog.from_token_ids(**kwargs)


def test_duplicate_policy_first_keeps_first_item():
    cat = Catalog.from_token_ids([1, 2, 3, 4], [[4, 5], [4, 6], [4, 5], [4, 5]], vocab_size=8, on_duplicate="first")
    assert len(cat) == 2
    assert cat.duplicates == [(3, 1), (4, 1)]
    assert cat.lookup(torch.tensor([[4, 5]])).item() == 1


@pytest.fixture(scope="module")
def beauty():
    from pipeline.prepare import build_tokenizer

    tok = build_tokenizer(4, 256)
    return tok, Catalog.from_parquet(BEAUTY / "items.parquet", tok, on_duplicate="first")


def test_beauty_catalog_collisions(beauty):
    tok, cat = beauty
    assert len(cat) == 12023 and len(cat.duplicates) == 12
    with pytest.raises(ValueError, match="12 items share a semantic ID"):
        Catalog.from_parquet(BEAUTY / "items.parquet", tok)


def test_beauty_catalog_matches_brute_force(beauty):
    _, cat = beauty
    rows = [tuple(r) for r in cat.tokens.tolist()]
    g = torch.Generator().manual_seed(0)
    for t in range(4):
        prefixes = random_prefixes(rows, t, 64, cat.vocab_size, g)
        prefix = torch.tensor(prefixes, dtype=torch.int64).view(len(prefixes), t)
        nxt = {}
        for r in rows:
            nxt.setdefault(r[:t], set()).add(r[t])
        want = torch.zeros(len(prefixes), cat.vocab_size, dtype=torch.bool)
        for i, p in enumerate(prefixes):
            want[i, sorted(nxt.get(p, ()))] = True
        assert torch.equal(cat.allowed_next(prefix), want)
        cands = torch.randint(cat.vocab_size, (len(prefixes), 50), generator=g)
        assert torch.equal(cat.verify(prefix, cands), want.gather(1, cands))


def test_from_parquet_bad_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.prepare import build_tokenizer

    tok = build_tokenizer(2, 4)
    pq.write_table(pa.table({"item_id": [1, 2], "codes": [[0, 1], [1, 1]]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match=r"a.parquet: missing column 'semantic_id'"):
        Catalog.from_parquet(tmp_path / "a.parquet", tok)
    pq.write_table(pa.table({"item_id": [1, 2, 3], "semantic_id": [[0, 1], [1, 1, 2], [2, 2]]}), tmp_path / "b.parquet")
    with pytest.raises(ValueError, match=r"b.parquet: column 'semantic_id' is ragged: rows \[1\]"):
        Catalog.from_parquet(tmp_path / "b.parquet", tok)
    pq.write_table(pa.table({"item_id": [1, 2], "semantic_id": [[0, 1], [1, 9]]}), tmp_path / "c.parquet")
    with pytest.raises(
        ValueError,
        match=r"c.parquet: 1 code tokens the catalog needs are missing from the tokenizer: "
        r"<b_9> \(used by rows \[1\]\)",
    ):
        Catalog.from_parquet(tmp_path / "c.parquet", tok)
