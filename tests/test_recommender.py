"""The actor's output tables from plain inputs (operators/recommender.py's pure functions), no model and no Ray: the
recommendations, the non-finite rejects, the counts, the decoder's metric values and the one output table, their
schemas and values checked against inputs built by hand."""

import json

import numpy as np
import pyarrow as pa
import pytest
import torch

from decoding.stats import BASE_KEYS, PHASES
from operators.batcher import length_order, trim_padding
from operators.outputs import (
    NO_ITEMS,
    NON_FINITE,
    TABLES,
    Decoded,
    batch_counts,
    decoder_metrics,
    no_items_rejects,
    non_finite_rejects,
    output_schema,
    output_table,
    padding_metrics,
    recommendation_table,
    table_schema,
)
from operators.prompts import Prompts

USERS = pa.array(["u1", "u2", "u3"])  # [U]
ITEMS = np.array([[7, 8, 9], [-1, -1, -1], [4, 5, -1]], np.int64)  # [U, k]: u2 none (broken), u3 two items
SCORES = np.array([[-0.5, -1.0, -2.0], [0.0, 0.0, 0.0], [-0.25, -3.0, -np.inf]], np.float32)
BROKEN = np.array([False, True, False])


def test_recommendation_table_is_one_row_per_item_in_rank_order():
    recs = recommendation_table(USERS, ITEMS, SCORES, "atspeed-strict")
    assert recs.schema == table_schema("rec", pa.string())
    assert recs.column_names == TABLES["rec"]
    assert recs.to_pydict() == {
        "user_id": ["u1", "u1", "u1", "u3", "u3"],
        "rank": [1, 2, 3, 1, 2],
        "item_id": [7, 8, 9, 4, 5],
        "score": [-0.5, -1.0, -2.0, -0.25, -3.0],
        "mode": ["atspeed-strict"] * 5,
    }
    empty = recommendation_table(pa.array([], pa.int64()), np.zeros((0, 3), np.int64), np.zeros((0, 3)), "beam")
    assert empty.num_rows == 0 and empty.schema == table_schema("rec", pa.int64())


def test_non_finite_rejects_name_each_broken_user():
    rejects = non_finite_rejects(USERS, BROKEN)
    assert rejects.schema == table_schema("reject", pa.string())
    assert rejects.to_pydict() == {"user_id": ["u2"], "reason": ["non_finite_logits"], "detail": [NON_FINITE]}
    none = non_finite_rejects(pa.array([1, 2], pa.int64()), np.zeros(2, bool))
    assert none.num_rows == 0 and none.schema == table_schema("reject", pa.int64())


def test_users_left_with_no_item_are_rejected_not_listed():
    items = np.array([[7, 8, 9], [-1, -1, -1], [-1, -1, -1], [4, -1, -1]], np.int64)  # u2 broken, u3 nothing left
    broken = np.array([False, True, False, False])
    users = pa.array(["u1", "u2", "u3", "u4"])
    rejects = no_items_rejects(users, items, broken)
    assert rejects.schema == table_schema("reject", pa.string())
    assert rejects.to_pydict() == {"user_id": ["u3"], "reason": ["no_items"], "detail": [NO_ITEMS]}
    mask = torch.ones(4, 2, dtype=torch.int64)
    counts = batch_counts(4, items, broken, 2, 4, Prompts(torch.zeros_like(mask), mask), 0)
    assert counts["users_ok"] == 2 and counts["users_short"] == 1  # u1 whole, u4 one item of three


def test_batch_counts():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1]])  # [U, S]: 6 rendered tokens
    prompts = Prompts(torch.zeros_like(mask), mask)
    counts = batch_counts(5, ITEMS, BROKEN, rejected=3, recommendations=5, prompts=prompts, prefix_len=4)
    assert counts == {
        "users_in": 5,
        "users_ok": 2,
        "users_short": 1,  # u3: two items of k = 3
        "users_rejected": 3,
        "recommendations": 5,
        "prompt_tokens": 6 + 3 * 4,
        "prefix_tokens_saved": 12,
    }


def test_decoder_metrics():
    stats = {key: 0 for key in BASE_KEYS} | {"prefill_s": 0.5, "decode_s": 1.0, "target_forwards": 3}
    plain = decoder_metrics(stats, wall=2.0)
    assert plain["wall_s"] == 2.0 and plain["other_s"] == 0.5 and plain["target_forwards"] == 3
    assert all(type(plain[key]) is (float if key in PHASES else int) for key in BASE_KEYS)
    assert plain["mean_accepted_steps"] is None and plain["accepted_hist"] is None
    assert decoder_metrics(stats, wall=1.0)["other_s"] == 0.0  # never below zero
    spec = stats | {
        "accepted_steps": torch.tensor([4, 3, 0]),  # [U] over rounds [U]: 2, 1.5, 0 (no round: counted as 0)
        "rounds": torch.tensor([2, 2, 0]),
        "accepted_hist": torch.tensor([1, 2, 1]),
    }
    got = decoder_metrics(spec, wall=2.0)
    assert got["mean_accepted_steps"] == pytest.approx((2 + 1.5 + 0) / 3) and got["accepted_hist"] == [1, 2, 1]


def test_output_table_tags_every_row_with_its_kind():
    recs = recommendation_table(USERS, ITEMS, SCORES, "beam")
    rejects = pa.concat_tables(
        [
            pa.table({"user_id": ["u0"], "reason": ["empty_history"], "detail": ["history has no items"]}),
            non_finite_rejects(USERS, BROKEN),
        ]
    )
    metric = {"users_in": 4, "accepted_hist": None}
    out = output_table(recs, rejects, metric, pa.string())
    assert out.schema == output_schema(pa.string())
    assert out["kind"].to_pylist() == ["rec"] * 5 + ["reject"] * 2 + ["metric"]
    assert out.slice(0, 5).select(TABLES["rec"]).equals(recs)
    assert out.slice(5, 2).select(TABLES["reject"]).to_pydict() == rejects.to_pydict()
    assert json.loads(out["metrics"][7].as_py()) == metric and out["metrics"].null_count == 7
    assert out.slice(5, 3)["item_id"].null_count == 3 and out.slice(0, 5)["reason"].null_count == 5


def test_an_empty_decode():
    d = Decoded.empty("disc", 4)
    assert d.items.shape == (0, 4) and d.scores.dtype == np.float32 and d.broken.shape == (0,) and d.audit == {}
    assert decoder_metrics(d.stats, 0.1)["mean_accepted_steps"] is None
    out = output_table(
        recommendation_table(pa.array([], pa.int64()), d.items, d.scores, "disc"),
        non_finite_rejects(pa.array([], pa.int64()), d.broken),
        {"users_in": 0},
        pa.int64(),
    )
    assert out["kind"].to_pylist() == ["metric"] and out.schema == output_schema(pa.int64())


def test_length_order_is_the_same_for_any_permutation():
    """Rows by prompt length, then user id: the same users in any order give the same decode order of users."""
    mask = torch.tensor([[0, 0, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1]])  # lengths 1 3 2 1
    users = pa.array(["d", "a", "c", "b"])
    order = length_order(mask, users)
    assert order.dtype == np.int64 and users.take(pa.array(order)).to_pylist() == ["b", "d", "c", "a"]
    perm = np.array([2, 0, 3, 1])
    again = length_order(mask[perm], users.take(pa.array(perm)))
    assert users.take(pa.array(perm)).take(pa.array(again)).to_pylist() == ["b", "d", "c", "a"]


def test_decoded_rows_go_back_to_input_order():
    order = np.array([2, 0, 1])  # decode row i is input row order[i]
    d = Decoded("beam", ITEMS[order], SCORES[order], BROKEN[order], {}, {}).unsort(order)
    assert (d.items == ITEMS).all() and (d.scores == SCORES).all() and (d.broken == BROKEN).all()


def test_trim_padding_drops_only_columns_no_user_needs():
    ids = torch.tensor([[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]])
    mask = (ids > 0).long()
    i, m = trim_padding(ids, mask)
    assert i.tolist() == [[0, 5, 6], [7, 8, 9]] and m.tolist() == [[0, 1, 1], [1, 1, 1]]


def test_padding_metrics():
    got = padding_metrics({"prompt_positions": 40, "prompt_padding": 10, "kv_padding_tokens": 20})
    assert got == {
        "prompt_positions": 40,
        "prompt_padding": 10,
        "prompt_padding_fraction": 0.25,
        "kv_padding_tokens": 20,
    }
    assert padding_metrics(dict.fromkeys(BASE_KEYS, 0))["prompt_padding_fraction"] is None  # nothing decoded
