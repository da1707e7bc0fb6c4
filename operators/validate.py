"""Row validation, the one home of every row rule: bad rows become rejects with a reason, never a failed run.

Reasons, in order of precedence (a row gets the first that applies):
    missing_user_id   user_id is null
    bad_type          history, or another history the prompt template writes ({history:COLUMN}), is not a list of
                      integer item ids, or a text field it writes ({user:COLUMN}) is not valid UTF-8 (the detail
                      names the column)
    bad_exclude_items the exclusion column (`exclude_items` by default), when the input has it, is not a list of integer
                      item ids (null: nothing excluded; ids the catalog does not hold are ignored, not rejected)
    empty_history     history is null or has no items (another history may be null or empty: it writes no items)
    unknown_item      an item a prompt would use (the last `history_len` of history, each other history's window) is
                      not in the catalog, or is null; the detail lists them (and names the column, for another history)
    prompt_too_long   after rendering (`fitted`): the prompt is longer than decoding.max_prompt_tokens, with as few
                      history items as decoding.too_long allows
Duplicate user ids are a rule across batches: the nightly graph applies it (`duplicates` finds them).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from decoding.catalog import ItemTokens
from operators.outputs import reject_schema
from operators.prompt_parts import not_utf8
from operators.prompts import Prompts, Renderer, history_window

_INT_LIST = pa.list_(pa.int64())


def validate(
    batch: pa.Table,
    items: ItemTokens,
    history_len: int | dict[str, int],
    exclude_column: str = "exclude_items",
    carry: list[str] | tuple = (),
) -> tuple[pa.Table, pa.Table]:
    """A histories batch (user_id, history, optionally `exclude_column`) -> (good rows: user_id, history list<int64>
    and, when the batch has it, exclude_column list<int64>; rejects: user_id, reason, detail). `history_len`: the
    window of `history`, or {history column: window} for every history a prompt writes (`history` first; the others
    carried as list<int64>); `carry`: more columns kept as they are (the template's user fields). Vectorised: Python
    runs only over the rejected rows' details (and over the rows of a column that does not cast to lists of
    integers)."""
    good, rejects, _ = validate_rows(batch, items, history_len, exclude_column, carry)
    return good, rejects


def validate_rows(
    batch: pa.Table,
    items: ItemTokens,
    history_len: int | dict[str, int],
    exclude_column: str = "exclude_items",
    carry: list[str] | tuple = (),
) -> tuple[pa.Table, pa.Table, np.ndarray]:
    """`validate`, and which of the batch's rows were rejected [B] bool (the good rows and the rejects each keep the
    batch's order)."""
    windows = history_len if isinstance(history_len, dict) else {"history": history_len}
    users = batch.column("user_id").combine_chunks()
    lists = {c: _as_int_lists(batch.column(c).combine_chunks(), c) for c in windows}
    history = lists["history"][0]
    exclude, bad_exclude = _exclusion_lists(batch, exclude_column)
    reasons = Reasons(len(users))
    reasons.mark(np.flatnonzero(users.is_null().to_numpy(zero_copy_only=False)), "missing_user_id", "user_id is null")
    for c in windows:
        reasons.mark_each(lists[c][1], "bad_type")
    for c in carry:
        reasons.mark_each(_bad_text(batch.column(c).combine_chunks(), c), "bad_type")
    reasons.mark_each(bad_exclude, "bad_exclude_items")
    _mark_empty(reasons, history)
    for c, w in windows.items():
        _mark_unknown(reasons, lists[c][0], items, w, "" if c == "history" else f" (in {c})")
    columns = {c: lists[c][0] for c in windows}
    columns |= {exclude_column: exclude} if exclude is not None else {}
    columns |= {c: batch.column(c).combine_chunks() for c in carry if c not in columns}
    return *reasons.split(users, columns), reasons.reason != None  # noqa: E711 (object array: elementwise)


class Reasons:
    """Each row's reject reason and detail while the rules run, in the module's order: a row keeps the first."""

    def __init__(self, rows: int):
        self.reason = np.full(rows, None, dtype=object)  # [B] None: no rule applies (yet)
        self.detail = np.full(rows, None, dtype=object)  # [B]

    def mark(self, rows: np.ndarray, why: str, details) -> None:
        """The rows not marked yet get the reason `why` and `details` (one text, or a function of those rows)."""
        free = rows[self.reason[rows] == None]  # noqa: E711 (object array: elementwise)
        self.reason[free] = why
        self.detail[free] = details(free) if callable(details) else details

    def mark_each(self, details: dict[int, str], why: str) -> None:
        """The rows of {row: detail} get the reason `why` and their own detail."""
        self.mark(np.array(sorted(details), dtype=np.int64), why, lambda rows: [details[r] for r in rows])

    def split(self, users: pa.Array, columns: dict[str, pa.Array]) -> tuple[pa.Table, pa.Table]:
        """users [B] and their columns [B] -> (the unmarked rows: user_id and the columns; the rejects)."""
        bad = self.reason != None  # noqa: E711
        keep, rows = (pa.array(np.flatnonzero(b), pa.int64()) for b in (~bad, bad))
        reasons = pa.array(self.reason[bad].tolist(), pa.string()), pa.array(self.detail[bad].tolist(), pa.string())
        rejects = pa.table([users.take(rows), *reasons], schema=reject_schema(users.type))
        return pa.table({"user_id": users.take(keep), **{n: c.take(keep) for n, c in columns.items()}}), rejects


def _exclusion_lists(batch: pa.Table, column: str) -> tuple[pa.Array | None, dict]:
    """The batch's exclusion column as list<int64> (None when the batch has none) and {row: why} for its bad rows:
    not a list of integers, or a null inside the list (no item id either)."""
    if column not in batch.column_names:
        return None, {}
    exclude, bad = _as_int_lists(batch.column(column).combine_chunks(), column)
    flat = pc.list_flatten(exclude)
    if flat.null_count:
        nulls = np.unique(pc.list_parent_indices(exclude).to_numpy()[flat.is_null().to_numpy(zero_copy_only=False)])
        bad.update({int(r): f"{column} holds a null item id" for r in nulls})
    return exclude, bad


def _bad_text(column: pa.Array, name: str) -> dict:
    """A text column -> {row: why} for its values that are not valid UTF-8 (a writer that let a lone surrogate
    through)."""
    return {int(r): f"{name} is not valid UTF-8 text" for r in not_utf8(column)}


def _mark_empty(reasons: Reasons, history: pa.Array) -> None:
    nulls = history.is_null().to_numpy(zero_copy_only=False)
    empty = pc.fill_null(pc.list_value_length(history), 0).to_numpy(zero_copy_only=False) == 0
    reasons.mark(np.flatnonzero(nulls), "empty_history", "history is null")
    reasons.mark(np.flatnonzero(empty), "empty_history", "history has no items")


def _mark_unknown(reasons: Reasons, history: pa.Array, items: ItemTokens, history_len: int, where: str = "") -> None:
    """Rows whose prompt window (the last history_len items) holds an item the catalog does not (or a null id): the
    detail lists them (`where`: which history, when not `history`)."""
    used_items, row_of, _ = history_window(history, history_len)  # [U], [U]
    known = items.lookup(used_items)[1]
    unknown_row, unknown_id = row_of[~known], used_items[~known]
    reasons.mark(
        np.unique(unknown_row),
        "unknown_item",
        lambda rows: [
            "item ids not in catalog: " + ", ".join(map(str, np.unique(unknown_id[unknown_row == r]).tolist())) + where
            for r in rows
        ],
    )


def _as_int_lists(column: pa.Array, name: str) -> tuple[pa.Array, dict]:
    """A column -> (list<int64> with nulls where unusable, {row: why} for rows of the wrong type)."""
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        try:
            return column.cast(_INT_LIST), {}
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass  # some elements are not integers: find them row by row
    out, bad = [], {}
    for i, value in enumerate(column.to_pylist()):
        if value is None:
            out.append(None)
            continue
        try:
            if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
                raise TypeError
            out.append([_integer(v) for v in value])
        except (TypeError, ValueError):
            out.append(None)
            bad[i] = f"{name} must be a list of integer item ids, got {str(value)[:80]!r}"
    return pa.array(out, _INT_LIST), bad


def _integer(value) -> int:
    if isinstance(value, bool) or value is None:
        raise TypeError
    if isinstance(value, float) and not value.is_integer():
        raise ValueError
    return int(value)


def fitted(good: pa.Table, rejects: pa.Table, kept: np.ndarray, limit: int | None) -> tuple[pa.Table, pa.Table]:
    """The validated rows whose prompt fits (kept [G] bool, the renderer's) and the rejects with the rest added:
    prompt_too_long, naming the bound."""
    if kept.all():
        return good, rejects
    users = good.column("user_id").combine_chunks()
    reasons = Reasons(len(users))
    why = f"the prompt is longer than decoding.max_prompt_tokens ({limit}) with its fewest history items"
    reasons.mark(np.flatnonzero(~kept), "prompt_too_long", why)
    kept_rows, too_long = reasons.split(users, {c: good.column(c) for c in good.column_names if c != "user_id"})
    return kept_rows, pa.concat_tables([rejects, too_long])


class Rendered(NamedTuple):
    """A batch's rows B validated and rendered: U users to decode, R rejected."""

    good: pa.Table  # [U] the valid rows whose prompt fits
    rejects: pa.Table  # [R] the others, with their reasons
    prompts: Prompts  # [U, S] the good rows' prompts
    rows: np.ndarray  # [U] each good row's place in the batch
    reject_rows: np.ndarray  # [R] each reject's place in the batch


def rendered(renderer: Renderer, batch: pa.Table, items, d, skip: int) -> Rendered:
    """A batch -> its valid rows whose prompt fits, the rejects, those rows' prompts without their first `skip` tokens
    and where each came from: operators/validate.py's rules, then the renderer's bound (prompt_too_long)."""
    good, rejects, bad = validate_rows(batch, items, renderer.windows, d.exclude_column, renderer.user_columns)
    prompts = renderer.render(good, items, skip)
    good, rejects = fitted(good, rejects, prompts.kept, renderer.max_prompt_tokens)
    rows = np.flatnonzero(~bad)  # [G] the validated rows
    kept = prompts.kept if prompts.kept is not None else np.ones(len(rows), bool)  # [G]
    return Rendered(good, rejects, prompts, rows[kept], np.concatenate([np.flatnonzero(bad), rows[~kept]]))


def duplicates(user_ids: pa.Array) -> pa.Array:
    """The user ids that occur more than once."""
    counts = pc.value_counts(user_ids)
    return counts.field("values").filter(pc.greater(counts.field("counts"), 1))
