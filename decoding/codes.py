"""Semantic-ID code tokens: their names (`<a_47>`: level letter, code) and their token ids.

Shared by the catalog index, prompt building and data preparation; and the duplicate policies (`duplicate_items`:
which items a semantic ID shared by several names, in which order). Parses Arrow arrays; opens no file.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3


# ---------------------------------------------------------------- code tokens


def level_letter(level: int) -> str:
    """Level 0 -> 'a', 1 -> 'b', ... (at most 26 levels)."""
    if not 0 <= level < 26:
        raise ValueError(f"level must be in [0, 26), got {level}")
    return chr(ord("a") + level)


def code_token(level: int, code: int) -> str:
    """(level 0, code 47) -> '<a_47>'."""
    return f"<{level_letter(level)}_{code}>"


def format_rows(rows, limit: int = 10) -> str:
    """Row numbers (array or tensor) -> '[3, 7, 9] and 4 more' for error messages."""
    rows = np.asarray(rows.cpu() if hasattr(rows, "cpu") else rows)
    shown = ", ".join(str(int(r)) for r in rows[:limit])
    more = f" and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"[{shown}]{more}"


def code_token_ids(tokenizer, semantic_ids: np.ndarray, name=code_token) -> np.ndarray:
    """Semantic IDs [N, L] (codes) -> token ids [N, L] int64 through the tokenizer's vocab; `name(level, code)` is
    the code token's name (`<a_47>` by default; a prompt template's `code`).

    Vectorised: one lookup table [L, max_code + 1] is built from the vocab, then indexed.
    Raises ValueError naming the code tokens missing from the vocabulary and the rows that use them.
    """
    sid = np.asarray(semantic_ids)
    if sid.ndim != 2:
        raise ValueError(f"semantic_ids must be a 2-D array [N, L], got shape {sid.shape}")
    n, levels = sid.shape
    if n == 0:
        return np.zeros((0, levels), dtype=np.int64)
    sid = sid.astype(np.int64, copy=False)
    vocab = tokenizer.get_vocab()  # {token: id}
    max_code = max(int(sid.max()), 0)
    table = np.full((levels, max_code + 1), -1, dtype=np.int64)  # [L, C]
    for j in range(levels):
        table[j] = [vocab.get(name(j, c), -1) for c in range(max_code + 1)]
    if (sid < 0).any():
        raise ValueError(f"negative codes in rows {format_rows(np.flatnonzero((sid < 0).any(axis=1)))}")
    ids = table[np.arange(levels)[None, :], sid]  # [N, L]
    missing = ids < 0  # [N, L]
    if missing.any():
        level, code = np.unique(np.stack([np.nonzero(missing)[1], sid[missing]], 1), axis=0).T  # the distinct ones
        names = [name(int(j), int(c)) for j, c in zip(level, code)]
        shown = ", ".join(names[:20]) + (f" and {len(names) - 20} more" if len(names) > 20 else "")
        raise ValueError(
            f"{len(names)} code tokens the catalog needs are missing from the tokenizer: {shown} "
            f"(used by rows {format_rows(np.flatnonzero(missing.any(axis=1)))})"
        )
    return ids


def semantic_id_matrix(table: pa.Table, name: str = "items.parquet", column: str = "semantic_id") -> np.ndarray:
    """The `semantic_id` list column of a catalog table -> int64 array [N, L].

    Raises ValueError naming `name` and the rows when the column is missing, null,
    ragged (not all rows have the same number of codes) or has negative codes.
    """
    if column not in table.column_names:
        raise ValueError(f"{name}: missing column {column!r} (has {table.column_names})")
    col = table.column(column).combine_chunks()  # ListArray [N]
    is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type) or pa.types.is_fixed_size_list(col.type)
    if not is_list or not pa.types.is_integer(col.type.value_type):
        raise ValueError(f"{name}: column {column!r} must be a list of ints, got {col.type}")
    n = len(col)
    if n == 0:
        return np.zeros((0, 0), dtype=np.int64)
    nulls = col.is_null().to_numpy(zero_copy_only=False)
    if nulls.any():
        raise ValueError(f"{name}: column {column!r} is null in rows {format_rows(np.flatnonzero(nulls))}")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)  # [N]
    levels = int(np.bincount(lengths).argmax())  # the common length
    if levels == 0:
        raise ValueError(
            f"{name}: column {column!r} has empty semantic ids in rows {format_rows(np.flatnonzero(lengths == 0))}"
        )
    ragged = np.flatnonzero(lengths != levels)
    if len(ragged):
        raise ValueError(
            f"{name}: column {column!r} is ragged: rows {format_rows(ragged)} do not have "
            f"{levels} codes like the other rows"
        )
    values = col.flatten()
    if values.null_count:
        rows = np.unique(np.flatnonzero(values.is_null().to_numpy(zero_copy_only=False)) // levels)
        raise ValueError(f"{name}: column {column!r} has null codes in rows {format_rows(rows)}")
    sid = values.to_numpy().astype(np.int64).reshape(n, levels)  # [N, L]
    negative = np.flatnonzero((sid < 0).any(axis=1))
    if len(negative):
        raise ValueError(f"{name}: column {column!r} has negative codes in rows {format_rows(negative)}")
    return sid


def ragged_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n): [sum(lengths)] int64, no Python loop."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths  # [R] where each range begins in the output
    return np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


POLICIES = "first | error | by:COLUMN | expand | expand:COLUMN"  # duplicate_items, in words
ORDERED = (pa.types.is_integer, pa.types.is_floating, pa.types.is_decimal, pa.types.is_temporal, pa.types.is_boolean)


def duplicate_policy(policy: str) -> tuple[str, str | None]:
    """A duplicate_items policy -> (kind: first, error, by or expand; the catalog column that orders the items of one
    semantic ID, highest value first, or None: by item id, lowest first). Refused (ValueError) unless one of
    POLICIES: `by` needs its column, `expand` may name one."""
    kind, colon, column = str(policy).partition(":")
    named = kind == "by" or (kind == "expand" and colon)  # a policy that orders by a column must name one
    if (
        kind not in ("first", "error", "by", "expand")
        or (named and not column)
        or (kind in ("first", "error") and colon)
    ):
        raise ValueError(f"duplicate_items must be one of {POLICIES}, got {policy!r}")
    return kind, column or None


def column_rank(table, column: str, source: str) -> np.ndarray:
    """A catalog table's column -> each row's rank by it [N] int64 (0 first): highest value first, null and NaN (no
    value) last, ties by item id (lowest first), the order in which `by:COLUMN` and `expand:COLUMN` list a semantic
    ID's items. A column the table lacks, or one whose values have no order (text, lists), is refused, naming it."""
    if column not in table.column_names:
        raise ValueError(f"{source}: missing column {column!r}, which duplicate_items orders items by")
    kind = table.schema.field(column).type
    if not any(is_(kind) for is_ in ORDERED):
        raise ValueError(
            f"{source}: column {column!r} (duplicate_items) must hold numbers, dates, times or booleans, got {kind}"
        )
    values = table.column(column)
    if pa.types.is_floating(kind):  # NaN is no value, as null is
        values = pc.if_else(pc.is_nan(values), pa.scalar(None, kind), values)
    keys = [("value", "descending", "at_end"), ("item_id", "ascending", "at_end")]
    order = pc.sort_indices(pa.table({"value": values, "item_id": table.column("item_id")}), sort_keys=keys)
    order = order.to_numpy()
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order))
    return rank
