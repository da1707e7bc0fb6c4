"""The evaluation splits, built one way for every source: a split's interactions as ragged arrays (`Interactions`),
and the train / valid / test tables SPLIT_CONVENTION makes of them (`split_tables`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decoding.codes import ragged_ranges
from operators.prompts import ragged_arrays

# How the evaluation splits are built from the time-ordered train / valid / test interactions (the AtSpeed paper's
# protocol, its code's data.py): written into prepare.json and quoted by jobs.evaluate and the training reports.
SPLIT_CONVENTION = {
    "train": "every train item, chronological (each prefix a training sample)",
    "valid": "history = the user's train items (the last history_len); targets = the valid items",
    "test": "history = the user's train + valid items (the last history_len); targets = the test items",
    "evaluation": "users without targets are skipped",
}
SPLITS = ("train", "valid", "test")


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique for 1-D ints by sort + mask (numpy 2.x np.unique takes 15 s on 11M int64)."""
    values = np.sort(values)
    keep = np.ones(len(values), dtype=bool)
    keep[1:] = values[1:] != values[:-1]
    return values[keep]


def list_array(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """Rows values[starts[i] : starts[i] + lengths[i]] -> list<int64> array [R]."""
    idx = ragged_ranges(starts, lengths)  # [sum(lengths)]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[idx].astype(np.int64)))


def tail_lists(values, starts, lengths, n: int) -> pa.ListArray:
    """The last min(len, n) items of every row -> list<int64> array [R]."""
    used = np.minimum(lengths, n)
    return list_array(values, starts + lengths - used, used)


def length_summary(lengths) -> dict:
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        return {"count": 0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99]).tolist()
    return {
        "count": int(len(lengths)),
        "min": int(lengths.min()),
        "p50": p50,
        "mean": float(lengths.mean()),
        "p90": p90,
        "p99": p99,
        "max": int(lengths.max()),
    }


@dataclass
class Interactions:
    """One split's interactions: user_ids[i]'s items, chronological, are values[starts[i] : starts[i] + lengths[i]]."""

    user_ids: np.ndarray  # [U] int64
    values: np.ndarray  # [T] int64
    starts: np.ndarray  # [U] int64
    lengths: np.ndarray  # [U] int64

    @classmethod
    def from_lists(cls, users: dict[int, list[int]]) -> Interactions:
        """{user: items} (a text file's lines) -> rows in ascending user order."""
        user_ids = np.array(sorted(users), dtype=np.int64)  # [U]
        values, starts, lengths, _ = ragged_arrays([users[u] for u in user_ids.tolist()])
        return cls(user_ids, values, starts, lengths)

    def lists(self) -> pa.ListArray:
        return list_array(self.values, self.starts, self.lengths)

    def tails(self, n: int) -> pa.ListArray:
        return tail_lists(self.values, self.starts, self.lengths, n)

    def aligned(self, user_ids: np.ndarray) -> Interactions:
        """The rows of `user_ids` [U] in that order; a user not in this split gets an empty row."""
        src_users, src_starts, src_lengths = self.user_ids, self.starts, self.lengths
        if np.array_equal(src_users, user_ids):
            return self
        if len(src_users) == 0:
            src_users, src_starts, src_lengths = np.full(1, -1), np.zeros(1, np.int64), np.zeros(1, np.int64)
        order = np.argsort(src_users)
        pos = np.minimum(np.searchsorted(src_users, user_ids, sorter=order), len(order) - 1)
        row = order[pos]  # [U] source row of each user
        found = src_users[row] == user_ids
        return Interactions(
            user_ids, self.values, np.where(found, src_starts[row], 0), np.where(found, src_lengths[row], 0)
        )

    def then(self, later: Interactions) -> Interactions:
        """Row i = this row i, then `later`'s row i (the same users in the same order)."""
        if later.values is self.values and np.array_equal(later.starts, self.starts + self.lengths):
            return Interactions(self.user_ids, self.values, self.starts, self.lengths + later.lengths)  # adjacent
        rows = np.arange(len(self.lengths))
        values = np.concatenate(
            [
                self.values[ragged_ranges(self.starts, self.lengths)],
                later.values[ragged_ranges(later.starts, later.lengths)],
            ]
        )  # [T + T']
        key = np.concatenate([np.repeat(2 * rows, self.lengths), np.repeat(2 * rows + 1, later.lengths)])
        lengths = self.lengths + later.lengths  # [U]
        return Interactions(
            self.user_ids, values[np.argsort(key, kind="stable")], np.cumsum(lengths) - lengths, lengths
        )


def split_tables(train: Interactions, valid: Interactions, test: Interactions, history_len: int) -> dict[str, pa.Table]:
    """The three splits' interactions -> the train / valid / test tables, as SPLIT_CONVENTION says: train holds every
    train item of its users; a valid user's history is its train items, a test user's its train + valid items (the
    last history_len of them), and the split's own items are its targets. Every user of valid / test gets a row."""
    valid_history = train.aligned(valid.user_ids)
    test_history = train.aligned(test.user_ids).then(valid.aligned(test.user_ids))
    return {
        "train": pa.table({"user_id": pa.array(train.user_ids, pa.int64()), "history": train.lists()}),
        "valid": _eval_table(valid, valid_history, history_len),
        "test": _eval_table(test, test_history, history_len),
    }


def _eval_table(targets: Interactions, history: Interactions, history_len: int) -> pa.Table:
    """(user_id, history = the last history_len items of `history`, target_items = the split's items)."""
    return pa.table(
        {
            "user_id": pa.array(targets.user_ids, pa.int64()),
            "history": history.tails(history_len),
            "target_items": targets.lists(),
        }
    )


def split_report(splits: dict[str, Interactions], tables: dict[str, pa.Table]) -> dict:
    """prepare.json's counts of the splits: users, users with targets, interactions, history lengths."""
    return {
        "users": {s: len(tables[s]) for s in SPLITS},
        "users_with_targets": {s: int((splits[s].lengths > 0).sum()) for s in ("valid", "test")},
        "interactions": {s: int(splits[s].lengths.sum()) for s in SPLITS},
        "history_length": {
            "train": length_summary(splits["train"].lengths),
            "test_prompt": length_summary(pc.list_value_length(tables["test"]["history"]).to_numpy()),
        },
    }
