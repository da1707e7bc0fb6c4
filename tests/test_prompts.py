"""operators/prompts.py: ItemTokens and build_prompts."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from operators.prompts import ItemTokens, build_prompts, ragged_ranges
from pipeline.prepare import build_tokenizer

# L = 2 levels, 8 codes: token id of (level j, code c) = 4 + 8 j + c
CATALOG = pa.table({"item_id": [30, 10, 20], "semantic_id": [[5, 0], [1, 2], [3, 4]]})
T10, T20, T30 = [4 + 1, 12 + 2], [4 + 3, 12 + 4], [4 + 5, 12 + 0]
BOS, PAD = 1, 0


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(2, 8)


@pytest.fixture(scope="module")
def items(tok):
    return ItemTokens.from_catalog(CATALOG, tok)


def test_item_tokens(items):
    assert items.item_ids.tolist() == [10, 20, 30] and items.levels == 2
    tokens, known = items.lookup(np.array([20, 99, 10, 5, 31]))
    assert known.tolist() == [True, False, True, False, False]
    assert tokens.tolist() == [T20, [-1, -1], T10, [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match=r"not unique: duplicated ids \[7\]"):
        ItemTokens.from_arrays(np.array([7, 8, 7]), np.zeros((3, 2)))


def test_exact_ids_left_padded(items):
    p = build_prompts([[10, 20], [30], [20, 10, 30]], items, BOS, PAD, history_len=5)
    assert p.input_ids.dtype == torch.int64 and p.attention_mask.dtype == torch.int64
    assert p.input_ids.tolist() == [
        [PAD, PAD, BOS, *T10, *T20],
        [PAD, PAD, PAD, PAD, BOS, *T30],
        [BOS, *T20, *T10, *T30],
    ]
    assert p.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1], [1] * 7]
    assert p.kept.tolist() == [0, 1, 2] and p.bad == []


def test_same_as_tokenizer_text(items, tok):
    history = [30, 10, 20, 10]
    p = build_prompts([history], items, tok.bos_token_id, tok.pad_token_id, history_len=20)
    sid = dict(zip(CATALOG.column("item_id").to_pylist(), CATALOG.column("semantic_id").to_pylist()))
    text = "<bos>" + "".join(f"<a_{sid[i][0]}><b_{sid[i][1]}>" for i in history)
    assert p.input_ids[0].tolist() == tok(text)["input_ids"]


def test_bad_rows_reported(items):
    p = build_prompts([[], [10, 99, 98, 99], None, [20], np.array([5])], items, BOS, PAD, history_len=5)
    assert p.kept.tolist() == [3]
    assert p.input_ids.tolist() == [[BOS, *T20]]
    assert p.bad == [
        (0, "empty_history", "history has no items"),
        (1, "unknown_item", "item ids not in catalog: 98, 99"),
        (2, "empty_history", "history is null"),
        (4, "unknown_item", "item ids not in catalog: 5"),
    ]
    none = build_prompts([[], [99]], items, BOS, PAD, history_len=5)
    assert tuple(none.input_ids.shape) == (0, 0) and none.kept.tolist() == [] and len(none.bad) == 2


def test_history_len_keeps_most_recent(items):
    p = build_prompts([[10, 20, 30], [30, 20]], items, BOS, PAD, history_len=2)
    assert p.input_ids.tolist() == [[BOS, *T20, *T30], [BOS, *T30, *T20]]
    # an unknown item older than the window is not used, so the row is fine
    p = build_prompts([[99, 10, 20]], items, BOS, PAD, history_len=2)
    assert p.input_ids.tolist() == [[BOS, *T10, *T20]] and p.bad == []
    with pytest.raises(ValueError, match="history_len"):
        build_prompts([[10]], items, BOS, PAD, history_len=0)


def test_arrow_input_same_as_lists(items):
    rows = [[10, 20], None, [30, 20, 10, 30], [], [99], [20]]
    arrow = pa.array([[1]] + rows, pa.list_(pa.int64())).slice(1)  # sliced: offsets do not start at 0
    a = build_prompts(arrow, items, BOS, PAD, history_len=3)
    b = build_prompts(rows, items, BOS, PAD, history_len=3)
    c = build_prompts(pa.chunked_array([arrow.slice(0, 2), arrow.slice(2)]), items, BOS, PAD, history_len=3)
    for other in (b, c):
        assert torch.equal(a.input_ids, other.input_ids) and torch.equal(a.attention_mask, other.attention_mask)
        assert a.kept.tolist() == other.kept.tolist() and a.bad == other.bad
    assert a.kept.tolist() == [0, 2, 5]


def test_ragged_ranges():
    assert ragged_ranges(np.array([5, 0, 2]), np.array([2, 0, 3])).tolist() == [5, 6, 2, 3, 4]
