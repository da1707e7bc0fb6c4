"""Prompts for generative recommenders: user histories -> left-padded token ids.

Prompt format (ARCHITECTURE.md section 3): `<bos>` followed by the L code tokens of
each of the last `history_len` history items, oldest first. No separator, no eos:

    <bos> <a_47><b_103><c_234><d_99> <a_130><b_66><c_209><d_146> ...

For Amazon Beauty (L = 4, history_len = 20) a prompt has at most 1 + 20 * 4 = 81 tokens.

The mapping from semantic IDs (codes) to code tokens and token ids is `decoding.codes`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from decoding.catalog import ItemTokens
from decoding.codes import format_rows

# ---------------------------------------------------------------- ragged helpers


def ragged_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n): [sum(lengths)] int64, no Python loop."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    out_starts = np.cumsum(lengths) - lengths  # [R] where each range begins in the output
    return np.repeat(starts - out_starts, lengths) + np.arange(total, dtype=np.int64)


def ragged_arrays(histories) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A batch of histories -> (values [T] int64, starts [B], lengths [B], nulls [B] bool).

    Accepts a pyarrow (chunked) list array (zero-copy, no loop) or any sequence of
    int arrays / lists / None (e.g. the object column of a Ray numpy batch).
    """
    if isinstance(histories, pa.ChunkedArray):
        histories = histories.combine_chunks() if histories.num_chunks else pa.array([], pa.list_(pa.int64()))
    if isinstance(histories, (pa.ListArray, pa.LargeListArray)):
        offsets = histories.offsets.to_numpy().astype(np.int64)  # [B + 1]
        nulls = histories.is_null().to_numpy(zero_copy_only=False)
        lengths = np.where(nulls, 0, np.diff(offsets))
        values = histories.values
        if values.null_count:  # a null item id -> -1, reported as an unknown item
            values = values.fill_null(-1)
        values = values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        return values, offsets[:-1], lengths, nulls
    rows = list(histories)
    nulls = np.array([h is None for h in rows], dtype=bool)
    arrays = [np.zeros(0, np.int64) if h is None else np.asarray(h, dtype=np.int64).ravel() for h in rows]
    lengths = np.array([len(a) for a in arrays], dtype=np.int64)
    values = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    starts = np.cumsum(lengths) - lengths
    return values, starts, lengths, nulls


# ---------------------------------------------------------------- prompts


class Prompts(NamedTuple):
    input_ids: torch.Tensor       # [B, S] int64, left-padded with pad_id
    attention_mask: torch.Tensor  # [B, S] int64, 0 on padding


def history_window(histories, history_len: int):
    """The items a prompt uses: the last `history_len` of each history -> (item ids [U], row of each [U],
    items per row [B]). Histories: see `ragged_arrays`."""
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    values, starts, lengths, _ = ragged_arrays(histories)  # [T], [B], [B]
    used = np.minimum(lengths, history_len)  # [B]
    items = values[ragged_ranges(starts + lengths - used, used)]  # [U]
    return items, np.repeat(np.arange(len(lengths)), used), used


def build_prompts(histories, item_tokens: ItemTokens, bos_id: int, pad_id: int, history_len: int) -> Prompts:
    """Histories [B] (item ids, oldest first; validated: non-empty, every used item in the catalog, see
    operators/validate.py) -> left-padded prompts.

    Each prompt is `<bos>` + the code tokens of the last `history_len` items: 1 + n * L tokens; the batch is
    left-padded to its longest prompt S. No Python loop over users.
    """
    items, row_of, used = history_window(histories, history_len)  # [U], [U], [B]
    tokens, known = item_tokens.lookup(items)  # [U, L], [U]
    if (used == 0).any() or not known.all():
        bad = np.union1d(np.flatnonzero(used == 0), row_of[~known])
        raise ValueError(f"rows {format_rows(bad)} have an empty history or items missing from the catalog: "
                         "validate them first (operators.validate)")
    levels = item_tokens.levels
    n_tok = 1 + used * levels  # [B]
    width = int(n_tok.max()) if len(used) else 0  # S
    left = width - n_tok  # [B] padding per row
    input_ids = np.full((len(used), width), pad_id, dtype=np.int64)  # [B, S]
    mask = (np.arange(width)[None, :] >= left[:, None]).astype(np.int64)  # [B, S]
    input_ids[np.arange(len(used)), left] = bos_id
    # item q of row r goes to columns left[r] + 1 + q * L + [0, L)
    q = np.arange(len(items)) - np.repeat(np.cumsum(used) - used, used)  # [U] position within the window
    cols = left[row_of, None] + 1 + q[:, None] * levels + np.arange(levels)[None, :]  # [U, L]
    input_ids[row_of[:, None], cols] = tokens
    return Prompts(torch.from_numpy(input_ids), torch.from_numpy(mask))
