"""A batch's per-user exclusions: the items each validated user must not be recommended (every item of its whole
history with decoding.exclude history, and its exclusion column's), as the catalog's closed trie nodes
(decoding/catalog.py Exclusions) and the metric row's counts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch

from decoding.catalog import Catalog, Exclusions
from decoding.codes import ragged_ranges
from operators.prompts import ragged_arrays
from operators.spec import Decoding


def excluded_items(histories, exclude=None, whole_history: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The items each user of a batch must not be recommended: every item of the whole history (whole_history, the
    `decoding.exclude: history` mode, not only the prompt's window) and those of the `exclude` lists (an exclusion
    column; a null row excludes nothing) -> (row [M], item id [M]), repeats kept. Columns: see `ragged_arrays`."""
    rows, items = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for column in ([histories] if whole_history else []) + ([exclude] if exclude is not None else []):
        values, starts, lengths, _ = ragged_arrays(column)  # [T], [B], [B]
        rows.append(np.repeat(np.arange(len(lengths), dtype=np.int64), lengths))
        items.append(values[ragged_ranges(starts, lengths)])
    return np.concatenate(rows), np.concatenate(items)


def batch_exclusions(good: pa.Table, catalog: Catalog, d: Decoding) -> tuple[Exclusions | None, dict]:
    """The validated users' exclusions (decoding.exclude: history, the exclusion column) on the catalog's device,
    None when nobody excludes anything -> (them, metrics: exclude_users, excluded_items (distinct items the index
    holds, summed over users), excluded_max (one user's most), exclude_unknown_ids (ids the catalog does not hold,
    ignored; items of the catalog no list may hold anyway are neither))."""
    column = good.column(d.exclude_column) if d.exclude_column in good.column_names else None
    row, item = excluded_items(good.column("history"), column, d.exclude == "history")  # [M], [M]
    counts = {
        "exclude_users": good.num_rows,
        "excluded_items": 0,
        "excluded_max": 0,
        "exclude_unknown_ids": int((~catalog.item_tokens.lookup(item)[1]).sum()),
    }
    if not len(item):
        return None, counts
    exclude = Exclusions.from_items(catalog, torch.from_numpy(row), torch.from_numpy(item), good.num_rows)
    per_user = exclude.per_user()  # [U]
    return exclude, {**counts, "excluded_items": int(per_user.sum()), "excluded_max": int(per_user.max())}
