"""Row validation: bad rows become rejects with a reason, never a failed run."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

_INT_LIST = pa.list_(pa.int64())


def normalize(batch: pa.Table) -> tuple[pa.Table, list[tuple]]:
    """A histories batch (user_id, history) -> (rows with a user id and a non-empty list<int64> history,
    rejects [(user_id, reason, detail)]). Reasons: missing_user_id, empty_history, bad_type."""
    users, history = batch.column("user_id").combine_chunks(), batch.column("history").combine_chunks()
    rejects, keep = [], []
    ints, bad_type = _as_int_lists(history)
    for i, (user, hist) in enumerate(zip(users.to_pylist(), ints.to_pylist())):
        if user is None:
            rejects.append((None, "missing_user_id", "user_id is null"))
        elif i in bad_type:
            rejects.append((user, "bad_type", bad_type[i]))
        elif not hist:
            rejects.append((user, "empty_history", "history is null" if hist is None else "history has no items"))
        else:
            keep.append(i)
    idx = pa.array(keep, pa.int64())
    return pa.table({"user_id": users.take(idx), "history": ints.take(idx)}), rejects


def _as_int_lists(history: pa.Array) -> tuple[pa.Array, dict]:
    """history -> (list<int64> with nulls where unusable, {row: why} for rows of the wrong type)."""
    if pa.types.is_list(history.type) or pa.types.is_large_list(history.type):
        try:
            return history.cast(_INT_LIST), {}
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # some elements are not integers: find them row by row
    out, bad = [], {}
    for i, value in enumerate(history.to_pylist()):
        if value is None:
            out.append(None)
            continue
        try:
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError
            out.append([_integer(v) for v in value])
        except (TypeError, ValueError):
            out.append(None)
            bad[i] = f"history must be a list of integer item ids, got {str(value)[:80]!r}"
    return pa.array(out, _INT_LIST), bad


def _integer(value) -> int:
    if isinstance(value, bool) or value is None:
        raise TypeError
    if isinstance(value, float) and not value.is_integer():
        raise ValueError
    return int(value)


def duplicates(user_ids: pa.Array) -> pa.Array:
    """The user ids that occur more than once."""
    counts = pc.value_counts(user_ids)
    return counts.field("values").filter(pc.greater(counts.field("counts"), 1))
