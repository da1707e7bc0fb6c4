"""The actor's output rows, from plain arrays: one batch's recommendations, its rejects (bad rows, users whose
log-probabilities were not finite, users left with no item) and its metric row, as one table whose rows carry a
`kind` ("rec", "reject", "metric"), so that one map over the users yields all three published tables (`TABLES`).

`Decoded` is what a batch's decode gives them: its users' items, scores, stats and precision audit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from decoding.stats import BASE_KEYS, PHASES

if TYPE_CHECKING:
    from operators.prompts import Prompts

NON_FINITE = (
    "the model's log-probabilities were NaN or infinite while decoding this user (e.g. a float16 "
    "overflow); its items would not be the model's"
)
NO_ITEMS = "no item is left to this user: every item a list may hold (recommendable, not blocked) is excluded for it"
TABLES = {
    "rec": ["user_id", "rank", "item_id", "score", "mode"],
    "reject": ["user_id", "reason", "detail"],
    "metric": ["metrics"],
}  # the published tables' columns, by output kind


def reject_schema(user_type: pa.DataType) -> pa.Schema:
    return pa.schema([("user_id", user_type), ("reason", pa.string()), ("detail", pa.string())])


def output_schema(user_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            ("kind", pa.string()),
            ("user_id", user_type),
            ("rank", pa.int32()),
            ("item_id", pa.int64()),
            ("score", pa.float32()),
            ("mode", pa.string()),
            ("reason", pa.string()),
            ("detail", pa.string()),
            ("metrics", pa.string()),
        ]
    )


def table_schema(kind: str, user_type: pa.DataType) -> pa.Schema:
    """The schema of one published table (TABLES[kind]'s columns of the output schema)."""
    schema = output_schema(user_type)
    return pa.schema([schema.field(n) for n in TABLES[kind]])


@dataclass
class Decoded:
    """One batch's decode, what its output rows are made from (rows: the validated users, U)."""

    mode: str  # the decoder that ran (decoding.mode = auto: the one whose turn it was)
    items: np.ndarray  # [U, k] int64, -1 where there is no item (a small catalog; a user with non-finite log-probs)
    scores: np.ndarray  # [U, k] float32, the target model's sequence log-probabilities
    broken: np.ndarray  # [U] bool: NaN / inf log-probabilities while decoding (rejected, never a short list)
    stats: dict  # the decoder's stats (decoding/stats.py); BASE_KEYS at 0 when no user was decoded
    audit: dict  # the precision audit's metrics (audit_*), {} when no user of the batch was audited

    @classmethod
    def empty(cls, mode: str, k: int) -> Decoded:
        """A batch without a valid row: nothing decoded."""
        none = np.zeros((0, k), np.int64), np.zeros((0, k), np.float32), np.zeros(0, bool)
        return cls(mode, *none, dict.fromkeys(BASE_KEYS, 0), {})

    def unsort(self, order: np.ndarray) -> Decoded:
        """Rows decoded in `order` [U] (row i is input row order[i]) -> the rows in input order."""
        back = np.argsort(order)
        return Decoded(self.mode, self.items[back], self.scores[back], self.broken[back], self.stats, self.audit)


def padding_metrics(stats: dict) -> dict:
    """A decode's prompt positions (the prefills' users x columns over every slice, the shared prefix left out),
    those that were left padding, their fraction, and the KV tokens of left padding held at the peak."""
    positions, padding = int(stats.get("prompt_positions", 0)), int(stats.get("prompt_padding", 0))
    return {
        "prompt_positions": positions,
        "prompt_padding": padding,
        "prompt_padding_fraction": padding / positions if positions else None,
        "kv_padding_tokens": int(stats.get("kv_padding_tokens", 0)),
    }


def recommendation_table(users: pa.Array, items: np.ndarray, scores: np.ndarray, mode: str) -> pa.Table:
    """users [U], items [U, k] (-1: no item), scores [U, k] -> the recommendations (TABLES["rec"]), one row per
    item, users in order and ranks 1.. within each."""
    row, rank = np.nonzero(items >= 0)  # fewer than k only when the catalog has fewer items
    return pa.table(
        {
            "user_id": users.take(pa.array(row, pa.int64())),
            "rank": pa.array((rank + 1).astype(np.int32)),
            "item_id": pa.array(items[row, rank]),
            "score": pa.array(scores[row, rank].astype(np.float32)),
            "mode": pa.array(np.full(len(row), mode, object), pa.string()),
        }
    )


def non_finite_rejects(users: pa.Array, broken: np.ndarray) -> pa.Table:
    """users [U], broken [U] bool -> the rejects (TABLES["reject"]) of the users whose log-probabilities were not
    finite while decoding."""
    return _rejects(users, broken, "non_finite_logits", NON_FINITE)


def no_items_rejects(users: pa.Array, items: np.ndarray, broken: np.ndarray) -> pa.Table:
    """users [U], items [U, k] (-1: none), broken [U] -> the rejects of the users left with no item at all (every
    item a list may hold is excluded for them), who are not broken."""
    return _rejects(users, no_items(items, broken), "no_items", NO_ITEMS)


def no_items(items: np.ndarray, broken: np.ndarray) -> np.ndarray:
    """items [U, k] (-1: none), broken [U] -> [U] bool: the users left with no item at all who are not broken."""
    return ~broken & (items < 0).all(1)


def _rejects(users: pa.Array, rows: np.ndarray, reason: str, detail: str) -> pa.Table:
    """users [U], rows [U] bool -> the rejects of those rows, each with `reason` and `detail`."""
    n = int(rows.sum())
    return pa.table(
        [users.filter(pa.array(rows)), pa.array([reason] * n, pa.string()), pa.array([detail] * n, pa.string())],
        schema=reject_schema(users.type),
    )


def output_table(recs: pa.Table, rejects: pa.Table, metric: dict, user_type: pa.DataType) -> pa.Table:
    """The batch's recommendations, rejects and metric row (JSON in `metrics`) as one table of the output schema,
    each row tagged with its `kind`."""
    schema = output_schema(user_type)
    tagged = [
        t.add_column(0, "kind", pa.array([kind] * t.num_rows, pa.string()))
        for t, kind in ((recs, "rec"), (rejects, "reject"))
    ]
    metrics = pa.table({"kind": ["metric"], "metrics": [json.dumps(metric)]})
    return pa.concat_tables([*tagged, metrics], promote_options="permissive").select(schema.names).cast(schema)


def batch_counts(
    users_in: int,
    items: np.ndarray,
    broken: np.ndarray,
    rejected: int,
    recommendations: int,
    prompts: Prompts,
    prefix_len: int,
) -> dict:
    """A batch's counts: its rows, the validated users (items [U, k], -1: none; broken [U]) that got a list and
    those whose list is shorter than k (fewer items left to them), rejects, items, and the prompt tokens (those
    rendered, prompts [U, S], plus the shared prefix each user's prefill skipped)."""
    users = len(broken)
    got = (items >= 0).sum(1)  # [U] items each user got
    listed = ~broken & (got > 0)  # [U]
    return {
        "users_in": users_in,
        "users_ok": int(listed.sum()),
        "users_short": int((listed & (got < items.shape[1])).sum()),
        "users_rejected": rejected,
        "recommendations": recommendations,
        "prompt_tokens": int(prompts.attention_mask.sum()) + prefix_len * users,
        "prefix_tokens_saved": prefix_len * users,
    }


def decoder_metrics(stats: dict, wall: float) -> dict:
    """A decoder's stats and the batch's wall time -> metric values: wall_s, the base stats (decoding/stats.py),
    other_s = the wall time outside the decoder (validation, prompts, output rows), and the speculative extras (mean
    accepted steps per round and their histogram; None for the other decoders)."""
    base = {key: float(stats[key]) if key in PHASES else int(stats[key]) for key in BASE_KEYS}
    accepted, rounds, hist = stats.get("accepted_steps"), stats.get("rounds"), stats.get("accepted_hist")  # [U], [U]
    mean = accepted is not None and len(accepted)
    return {
        "wall_s": wall,
        **base,
        "other_s": max(wall - sum(base[p] for p in PHASES), 0.0),
        "mean_accepted_steps": float((accepted.float() / rounds.clamp(min=1).float()).mean()) if mean else None,
        "accepted_hist": hist.tolist() if hist is not None else None,
    }
