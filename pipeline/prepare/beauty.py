"""Amazon Beauty's release layout (items/train/valid/test.parquet, amazon-beauty/README.md beside this file) -> the
project's contracts. BEAUTY_SOURCE is the copy this package carries (package data: nothing writes into it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from decoding.codes import format_rows, ragged_ranges, semantic_id_matrix
from operators.prompts import ragged_arrays
from pipeline.prepare.contract import SHOWN, PrepareSummary, Source, check_mismatches, code_tokens_array, write_source
from pipeline.prepare.splits import SPLITS, Interactions, sorted_unique

BEAUTY_FILES = ("items.parquet", "train.parquet", "valid.parquet", "test.parquet")
BEAUTY_SOURCE = Path(__file__).resolve().parent / "amazon-beauty"


def prepare_beauty(
    source_dir, out_dir, history_len: int = 20, codes: int | None = None, allow_mismatch: bool = False
) -> PrepareSummary:
    """Amazon Beauty folder -> the project's contracts in `out_dir` (see the package docstring).

    `codes` (codes per level of the tokenizer) defaults to max code + 1 over all levels
    of the catalog: 256 for Beauty. All items are kept, also those sharing a semantic ID
    (listed in prepare.json; the policy is applied when the catalog is loaded). History
    items that are not in the catalog refuse the import (contract.Mismatch, naming file, row and ids) unless
    `allow_mismatch`: then they are dropped, counted in prepare.json and the summary.
    """
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    return write_source(read_beauty(Path(source_dir), codes, allow_mismatch), out_dir, history_len)


def read_beauty(source_dir: Path, codes: int | None = None, allow_mismatch: bool = False) -> Source:
    """The release's four files, read and checked -> a Source (the dropped unknown items in its report)."""
    item_ids, sid, codes = _read_catalog(source_dir / "items.parquet", codes)  # [N], [N, L]
    read = {s: _read_split(source_dir / f"{s}.parquet", item_ids) for s in SPLITS}
    dropped = {s: r[1] for s, r in read.items()}
    found = [f for d in dropped.values() for f in d.pop("found")]
    check_mismatches("item ids", found, sum(d["interactions"] for d in dropped.values()), allow_mismatch)
    mismatches = {s: d["interactions"] for s, d in dropped.items()}
    return Source(
        source_dir,
        "beauty",
        item_ids,
        sid,
        codes,
        splits={s: r[0] for s, r in read.items()},
        files=[source_dir / f for f in BEAUTY_FILES],
        report={"dropped_unknown_items": dropped, "mismatches": mismatches, "allow_mismatch": allow_mismatch},
        summary={"dropped_interactions": mismatches, "mismatches": mismatches, "allow_mismatch": allow_mismatch},
    )


def _read_parquet(path: Path, columns: list[str]) -> pa.Table:
    """Read `columns` of `path`; ValueError naming the file (and column) when missing."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    names = pq.read_schema(path).names
    missing = [c for c in columns if c not in names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing} (has {names})")
    return pq.read_table(path, columns=columns)


def _int_ids(table: pa.Table, column: str, name: str) -> np.ndarray:
    """A non-null, unique integer id column -> int64 [N]."""
    col = table.column(column)
    if not pa.types.is_integer(col.type):
        raise ValueError(f"{name}: column {column!r} must be integer, got {col.type}")
    if col.null_count:
        rows = np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))
        raise ValueError(f"{name}: column {column!r} is null in rows {format_rows(rows)}")
    ids = col.to_numpy().astype(np.int64)
    ordered = np.sort(ids)
    dup = ordered[1:][ordered[1:] == ordered[:-1]]
    if len(dup):
        raise ValueError(f"{name}: column {column!r} has duplicated values {format_rows(sorted_unique(dup))}")
    return ids


def _read_catalog(path: Path, codes: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """items.parquet -> (item_ids [N], semantic_ids [N, L], codes), checking code_tokens if present."""
    names = pq.read_schema(path).names if path.is_file() else []
    columns = ["item_id", "semantic_id"] + (["code_tokens"] if "code_tokens" in names else [])
    table = _read_parquet(path, columns)
    item_ids = _int_ids(table, "item_id", str(path))  # [N]
    sid = semantic_id_matrix(table, str(path))  # [N, L]
    codes = int(sid.max()) + 1 if codes is None else codes
    if sid.max() >= codes:
        rows = np.flatnonzero((sid >= codes).any(axis=1))
        raise ValueError(f"{path}: semantic_id has codes >= codes={codes} in rows {format_rows(rows)}")
    if "code_tokens" in columns:
        _check_code_tokens(table.column("code_tokens").combine_chunks(), sid, codes, path)
    return item_ids, sid, codes


def _check_code_tokens(col: pa.Array, sid: np.ndarray, codes: int, path: Path) -> None:
    """The source's code_tokens column must spell the semantic_id column."""
    n, levels = sid.shape
    if not pa.types.is_list(col.type) or not pa.types.is_string(col.type.value_type):
        raise ValueError(f"{path}: column 'code_tokens' must be list<string>, got {col.type}")
    lengths = col.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    bad = lengths != levels  # [N]
    expected = code_tokens_array(sid, codes).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    if not bad.any():
        got = col.flatten().to_numpy(zero_copy_only=False)  # [N * L]
        bad = (got != expected).reshape(n, levels).any(axis=1)
    if bad.any():
        raise ValueError(f"{path}: code_tokens disagree with semantic_id in rows {format_rows(np.flatnonzero(bad))}")


def _read_split(path: Path, item_ids: np.ndarray) -> tuple[Interactions, dict]:
    """train/valid/test.parquet -> (its Interactions, dropped).

    Item ids missing from the catalog cannot be tokenized: they are dropped from the lists
    (order of the other items kept) and reported in `dropped` with the first rows that hold them (a copy of Beauty
    with the release text files' 1-based ids showed item 12035, one past the index, in 15 train histories: the
    symptom of shifted ids).
    """
    table = _read_parquet(path, ["user_id", "items"])
    user_ids = _int_ids(table, "user_id", str(path))
    col = table.column("items")
    is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
    if not is_list or not pa.types.is_integer(col.type.value_type):
        raise ValueError(f"{path}: column 'items' must be list<int64>, got {col.type}")
    values, starts, lengths, _ = ragged_arrays(col)  # null rows count as empty
    values = values[ragged_ranges(starts, lengths)]  # [T] compact, row-major
    row_of = np.repeat(np.arange(len(lengths)), lengths)  # [T]
    known = np.isin(values, item_ids)  # [T]
    bad_rows = np.unique(row_of[~known])  # [b]
    dropped = {
        "interactions": int((~known).sum()),
        "users": int(len(bad_rows)),
        "item_ids": np.unique(values[~known]).tolist(),
        "found": [
            f"{path}: row {r} (user_id {user_ids[r]}), column items: item ids "
            f"{sorted(set(values[(row_of == r) & ~known].tolist()))} are not in items.parquet"
            for r in bad_rows[:SHOWN].tolist()
        ],
    }
    values, row_of = values[known], row_of[known]
    lengths = np.bincount(row_of, minlength=len(lengths)).astype(np.int64)  # [U]
    return Interactions(user_ids, values, np.cumsum(lengths) - lengths, lengths), dropped
