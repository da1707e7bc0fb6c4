"""operators/prompts.py (build_prompts), operators/validate.py (row rules) and the catalog's item-to-tokens map."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from decoding.catalog import Catalog, ItemTokens
from operators.prompts import build_prompts, ragged_ranges
from operators.validate import validate
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
    return Catalog.from_table(CATALOG, tok).item_tokens


def test_item_tokens(items, tok):
    assert items.item_ids.tolist() == [10, 20, 30] and items.levels == 2
    tokens, known = items.lookup(np.array([20, 99, 10, 5, 31]))
    assert known.tolist() == [True, False, True, False, False]
    assert tokens.tolist() == [T20, [-1, -1], T10, [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match=r"duplicate item ids: \[7\]"):
        ItemTokens.from_arrays(np.array([7, 8, 7]), np.zeros((3, 2)))
    # items sharing a semantic ID: one keeps it in the index, every one of them renders in prompts
    shared = pa.table({"item_id": [30, 10, 20, 40], "semantic_id": [[5, 0], [1, 2], [3, 4], [1, 2]]})
    cat = Catalog.from_table(shared, tok, on_duplicate="first")
    assert cat.duplicates == [(40, 10)] and len(cat) == 3
    assert cat.item_tokens.lookup(np.array([40, 10]))[0].tolist() == [T10, T10]


def test_exact_ids_left_padded(items):
    p = build_prompts([[10, 20], [30], [20, 10, 30]], items, BOS, PAD, history_len=5)
    assert p.input_ids.dtype == torch.int64 and p.attention_mask.dtype == torch.int64
    assert p.input_ids.tolist() == [
        [PAD, PAD, BOS, *T10, *T20],
        [PAD, PAD, PAD, PAD, BOS, *T30],
        [BOS, *T20, *T10, *T30],
    ]
    assert p.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1], [1] * 7]


def test_same_as_tokenizer_text(items, tok):
    history = [30, 10, 20, 10]
    p = build_prompts([history], items, tok.bos_token_id, tok.pad_token_id, history_len=20)
    sid = dict(zip(CATALOG.column("item_id").to_pylist(), CATALOG.column("semantic_id").to_pylist()))
    text = "<bos>" + "".join(f"<a_{sid[i][0]}><b_{sid[i][1]}>" for i in history)
    assert p.input_ids[0].tolist() == tok(text)["input_ids"]


def test_bad_rows_rejected_with_reasons(items):
    batch = pa.table({"user_id": pa.array([1, 2, 3, None, 5, 6, 7], pa.int64()),
                      "history": pa.array([[], [10, 99, 20, 98], None, [10], [20], [5], [99, 10, 20]],
                                          pa.list_(pa.int64()))})
    good, rejects = validate(batch, items, history_len=2)
    assert good["user_id"].to_pylist() == [5, 7]  # user 7's unknown item is older than the window: not used
    assert good["history"].to_pylist() == [[20], [99, 10, 20]]
    assert rejects.to_pylist() == [
        {"user_id": 1, "reason": "empty_history", "detail": "history has no items"},
        {"user_id": 2, "reason": "unknown_item", "detail": "item ids not in catalog: 98"},
        {"user_id": 3, "reason": "empty_history", "detail": "history is null"},
        {"user_id": None, "reason": "missing_user_id", "detail": "user_id is null"},
        {"user_id": 6, "reason": "unknown_item", "detail": "item ids not in catalog: 5"},
    ]
    wide, _ = validate(batch, items, history_len=5)  # the window now reaches user 2's 98 and user 7's 99
    assert wide["user_id"].to_pylist() == [5]
    assert validate(batch, items, 5)[1].to_pylist()[1] == {"user_id": 2, "reason": "unknown_item",
                                                           "detail": "item ids not in catalog: 98, 99"}
    strings = pa.table({"user_id": ["a", "b", "c"],
                        "history": pa.array([["10", "20"], ["x"], None], pa.list_(pa.string()))})
    good, rejects = validate(strings, items, history_len=5)
    assert good["user_id"].to_pylist() == ["a"] and good["history"].to_pylist() == [[10, 20]]
    assert [r["reason"] for r in rejects.to_pylist()] == ["bad_type", "empty_history"]
    with pytest.raises(ValueError, match=r"rows \[1\] have an empty history or items missing"):
        build_prompts([[10], [99]], items, BOS, PAD, history_len=5)  # prompts are rendered from validated rows


def test_history_len_keeps_most_recent(items):
    p = build_prompts([[10, 20, 30], [30, 20]], items, BOS, PAD, history_len=2)
    assert p.input_ids.tolist() == [[BOS, *T20, *T30], [BOS, *T30, *T20]]
    # an unknown item older than the window is not used, so the row is fine
    p = build_prompts([[99, 10, 20]], items, BOS, PAD, history_len=2)
    assert p.input_ids.tolist() == [[BOS, *T10, *T20]]
    with pytest.raises(ValueError, match="history_len"):
        build_prompts([[10]], items, BOS, PAD, history_len=0)


def test_arrow_input_same_as_lists(items):
    rows = [[10, 20], [30, 20, 10, 30], [20], [99, 30]]
    arrow = pa.array([[1]] + rows, pa.list_(pa.int64())).slice(1)  # sliced: offsets do not start at 0
    a = build_prompts(arrow, items, BOS, PAD, history_len=1)
    b = build_prompts(rows, items, BOS, PAD, history_len=1)
    c = build_prompts(pa.chunked_array([arrow.slice(0, 2), arrow.slice(2)]), items, BOS, PAD, history_len=1)
    for other in (b, c):
        assert torch.equal(a.input_ids, other.input_ids) and torch.equal(a.attention_mask, other.attention_mask)
    assert a.input_ids.tolist() == [[BOS, *T20], [BOS, *T30], [BOS, *T20], [BOS, *T30]]


def test_ragged_ranges():
    assert ragged_ranges(np.array([5, 0, 2]), np.array([2, 0, 3])).tolist() == [5, 6, 2, 3, 4]
