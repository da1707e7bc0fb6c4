"""Prompts for generative recommenders: user histories -> left-padded token ids.

Prompt format (ARCHITECTURE.md section 3): `<bos>` followed by the L code tokens of
each of the last `history_len` history items, oldest first. No separator, no eos:

    <bos> <a_47><b_103><c_234><d_99> <a_130><b_66><c_209><d_146> ...

For Amazon Beauty (L = 4, history_len = 20) a prompt has at most 1 + 20 * 4 = 81 tokens.

The mapping from semantic IDs (codes) to code tokens and token ids is `decoding.codes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import torch

from decoding.codes import code_token_ids, format_rows, semantic_id_matrix

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


# ---------------------------------------------------------------- item tokens


@dataclass
class ItemTokens:
    """item_id -> its L code token ids, via a sorted id array and np.searchsorted."""

    item_ids: np.ndarray   # [N] int64, sorted ascending, unique
    token_ids: np.ndarray  # [N, L] int64, row i belongs to item_ids[i]

    @classmethod
    def from_arrays(cls, item_ids: np.ndarray, token_ids: np.ndarray) -> "ItemTokens":
        item_ids = np.asarray(item_ids, dtype=np.int64)
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if token_ids.ndim != 2 or len(token_ids) != len(item_ids):
            raise ValueError(f"token_ids must be [N, L] with N = {len(item_ids)}, got {token_ids.shape}")
        order = np.argsort(item_ids, kind="stable")
        item_ids, token_ids = item_ids[order], token_ids[order]
        dup = np.flatnonzero(item_ids[1:] == item_ids[:-1])
        if len(dup):
            raise ValueError(f"catalog item_id is not unique: duplicated ids {format_rows(np.unique(item_ids[dup]))}")
        return cls(item_ids=item_ids, token_ids=token_ids)

    @classmethod
    def from_catalog(cls, items: pa.Table, tokenizer, name: str = "items.parquet") -> "ItemTokens":
        """Catalog table (item_id, semantic_id) + tokenizer -> ItemTokens."""
        if "item_id" not in items.column_names:
            raise ValueError(f"{name}: missing column 'item_id' (has {items.column_names})")
        if items.column("item_id").null_count:
            nulls = np.flatnonzero(items.column("item_id").is_null().to_numpy(zero_copy_only=False))
            raise ValueError(f"{name}: column 'item_id' is null in rows {format_rows(nulls)}")
        item_ids = items.column("item_id").to_numpy().astype(np.int64)  # [N]
        token_ids = code_token_ids(tokenizer, semantic_id_matrix(items, name))  # [N, L]
        return cls.from_arrays(item_ids, token_ids)

    @property
    def levels(self) -> int:
        return self.token_ids.shape[1]

    def lookup(self, item_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """item ids [U] -> (token ids [U, L], known [U] bool); unknown rows hold -1."""
        item_ids = np.asarray(item_ids, dtype=np.int64)
        if len(self.item_ids) == 0:
            return np.full((len(item_ids), self.levels), -1, dtype=np.int64), np.zeros(len(item_ids), bool)
        pos = np.searchsorted(self.item_ids, item_ids)             # [U]
        pos = np.minimum(pos, len(self.item_ids) - 1)
        known = self.item_ids[pos] == item_ids                     # [U]
        tokens = np.where(known[:, None], self.token_ids[pos], -1)  # [U, L]
        return tokens, known


# ---------------------------------------------------------------- prompts


class Prompts(NamedTuple):
    input_ids: torch.Tensor       # [K, S] int64, left-padded with pad_id
    attention_mask: torch.Tensor  # [K, S] int64, 0 on padding
    bad: list                     # [(row_index, reason, detail)] for rows left out
    kept: np.ndarray              # [K] int64, batch row of each prompt row


def build_prompts(histories, item_tokens: ItemTokens, bos_id: int, pad_id: int,
                  history_len: int) -> Prompts:
    """Histories [B] (ragged item ids, oldest first) -> left-padded prompts for the good rows.

    Each prompt is `<bos>` + the code tokens of the last `history_len` items: 1 + n * L
    tokens; the batch is left-padded to its longest prompt S. Rows with an empty or null
    history ("empty_history") or with an item id missing from the catalog among the items
    used ("unknown_item", detail lists the ids) are left out and reported in `bad`;
    `kept` gives the batch row of every prompt row.
    """
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    values, starts, lengths, nulls = ragged_arrays(histories)  # [T], [B], [B], [B]
    n_rows = len(lengths)
    levels = item_tokens.levels

    used = np.minimum(lengths, history_len)                     # [B] items per prompt
    idx = ragged_ranges(starts + lengths - used, used)          # [U] the last `used` items
    items = values[idx]                                         # [U]
    row_of = np.repeat(np.arange(n_rows), used)                 # [U]
    tokens, known = item_tokens.lookup(items)                   # [U, L], [U]

    unknown_rows = np.zeros(n_rows, dtype=bool)
    unknown_rows[row_of[~known]] = True
    empty_rows = used == 0
    keep = ~empty_rows & ~unknown_rows                          # [B]

    first = np.cumsum(used) - used                              # [B] row r's items: items[first[r]:][:used[r]]
    bad = []
    for r in np.flatnonzero(~keep):
        if empty_rows[r]:
            bad.append((int(r), "empty_history", "history is null" if nulls[r] else "history has no items"))
        else:
            window = slice(first[r], first[r] + used[r])
            ids = np.unique(items[window][~known[window]])
            bad.append((int(r), "unknown_item", "item ids not in catalog: " + ", ".join(map(str, ids.tolist()))))

    kept = np.flatnonzero(keep).astype(np.int64)                # [K]
    n_tok = 1 + used[kept] * levels                             # [K]
    width = int(n_tok.max()) if len(kept) else 0                # S
    input_ids = np.full((len(kept), width), pad_id, dtype=np.int64)  # [K, S]
    left = width - n_tok                                        # [K] padding per row
    mask = (np.arange(width)[None, :] >= left[:, None]).astype(np.int64)  # [K, S]
    input_ids[np.arange(len(kept)), left] = bos_id

    # item tokens: item q of kept row k goes to columns left[k] + 1 + q * L + [0, L)
    take = keep[row_of]                                         # [U] items of kept rows
    k_of_item = np.cumsum(keep)[row_of[take]] - 1               # [U'] prompt row of each item
    q = idx[take] - (starts + lengths - used)[row_of[take]]     # [U'] position within the window
    cols = left[k_of_item, None] + 1 + q[:, None] * levels + np.arange(levels)[None, :]  # [U', L]
    input_ids[k_of_item[:, None], cols] = tokens[take]
    return Prompts(torch.from_numpy(input_ids), torch.from_numpy(mask), bad, kept)
