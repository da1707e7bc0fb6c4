"""OpenOneRec's published layout (github Kuaishou-OneRec/OpenOneRec, data/onerec_data: their RecIF release) -> the
project's contracts.

    onerec_bench_release.parquet   a row per user: uid, split (0: train), hist_video_pid and target_video_pid (lists of
                                   video pids, oldest first), and the other tasks' columns (hist_goods_pid,
                                   hist_longview_video_list, inter_user_profile_with_sid, inter_keyword_to_items, ...)
    video_ad_pid2sid.parquet       pid -> sid, a video's semantic ID (3 codes)

Every row is a user (`user_id` = uid). `history` is what their video recommendation prompt writes
(data/onerec_data/sft/video_rec.py: the last `history_len` pids of hist_video_pid, 512 there, less those pid2sid
lacks, which their prompt skips); `target_items` the target pids pid2sid holds. Test rows (split other than 0) keep
every other column as written, for templates that write them ({user:inter_user_profile_with_sid},
{history:hist_longview_video_list}); train rows are one sequence each, history then targets. The items carry
`popularity`, how often each pid occurs in the release's histories and targets, for `duplicate_items:
by:popularity` (their benchmark maps a semantic ID back to its most popular video). A pid2sid row without a usable
sid (not a list of non-negative integers, or of another length than the rest) or a pid listed twice refuses the
import, naming it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from decoding.codes import ragged_ranges
from pipeline.prepare.contract import (
    PrepareSummary,
    build_tokenizer,
    catalog_report,
    items_table,
    summarize,
    write_contract,
)
from pipeline.prepare.splits import SPLITS, length_summary
from pipeline.storage import sha256_file

METADATA, PID2SID = "onerec_bench_release.parquet", "video_ad_pid2sid.parquet"
HISTORY, TARGET = "hist_video_pid", "target_video_pid"
HIST_MAX_LEN = 512  # their video_rec.py's


def find_files(source: Path, pid2sid: Path | None = None) -> tuple[Path, Path]:
    """`source`: their metadata parquet, or the folder holding it (and pid2sid, unless given)."""
    source = Path(source)
    metadata = source / METADATA if source.is_dir() else source
    mapping = Path(pid2sid) if pid2sid else metadata.parent / PID2SID
    for path, what in ((metadata, "the metadata parquet"), (mapping, "the pid2sid parquet (--pid2sid)")):
        if not path.is_file():
            raise ValueError(f"{path}: not found ({what} of OpenOneRec's layout)")
    return metadata, mapping


def read_pid2sid(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """pid2sid -> (pids [N] sorted, their codes [N, L]); refused naming the row of a bad sid or a repeated pid."""
    t = pq.read_table(path)
    missing = [c for c in ("pid", "sid") if c not in t.column_names]
    if missing:
        raise ValueError(f"{path}: missing column(s) {missing} (has {t.column_names})")
    pids = t["pid"].combine_chunks()
    if not pa.types.is_integer(pids.type) or pids.null_count:
        raise ValueError(f"{path}: column pid must hold integer pids without nulls, got {pids.type}")
    sids = t["sid"].combine_chunks()
    try:
        lists = sids.cast(pa.list_(pa.int64()))
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raise ValueError(f"{path}: column sid must hold lists of integer codes, got {sids.type}") from None
    lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False)
    flat = pc.list_flatten(lists)
    levels = int(np.bincount(lengths).argmax()) if len(lengths) else 0
    bad = (lengths != levels) | lists.is_null().to_numpy(zero_copy_only=False)
    if flat.null_count or (flat.to_numpy(zero_copy_only=False) < 0).any():
        parents = pc.list_parent_indices(lists).to_numpy()
        values = flat.fill_null(-1).to_numpy(zero_copy_only=False)
        bad[np.unique(parents[values < 0])] = True
    if bad.any() or levels == 0:
        row = int(np.argmax(bad)) if bad.any() else 0
        raise ValueError(f"{path}: row {row}: sid {sids[row].as_py()!r} is not {levels} non-negative integer codes")
    ids = pids.to_numpy().astype(np.int64)
    order = np.argsort(ids, kind="stable")
    ids, codes = ids[order], flat.to_numpy().reshape(-1, levels)[order]
    repeated = np.flatnonzero(ids[1:] == ids[:-1])
    if len(repeated):
        raise ValueError(f"{path}: pid {int(ids[repeated[0]])} is listed {int((ids == ids[repeated[0]]).sum())} times")
    return ids, codes


def known_window(lists: pa.Array, pids: np.ndarray, last: int | None) -> tuple[pa.Array, int]:
    """Lists of pids [B] -> the pids pid2sid holds among each row's last `last` (None: all), in order, as list<int64>
    (a null row: empty), and how many were left out."""
    lists = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    lists = lists.cast(pa.list_(pa.int64()))
    offsets = lists.offsets.to_numpy().astype(np.int64)
    n = np.where(lists.is_null().to_numpy(zero_copy_only=False), 0, np.diff(offsets))  # [B]
    keep = n if last is None else np.minimum(n, last)
    values = lists.values.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    window = values[ragged_ranges(offsets[:-1] + n - keep, keep)]  # [T]
    at = np.minimum(np.searchsorted(pids, window), max(len(pids) - 1, 0))
    known = (pids[at] == window) if len(pids) else np.zeros(len(window), bool)
    row = np.repeat(np.arange(len(n)), keep)
    counts = np.bincount(row[known], minlength=len(n))
    out = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(counts)]), pa.int32()), window[known])
    return out, int((~known).sum())


def prepare_openonerec(source, out_dir, pid2sid: Path | None = None, history_len: int = HIST_MAX_LEN) -> PrepareSummary:
    """OpenOneRec's release (`find_files`) -> the project's contracts in `out_dir` (see the module's docstring)."""
    metadata, mapping = find_files(Path(source), pid2sid)
    pids, codes = read_pid2sid(mapping)
    meta = pq.read_table(metadata)
    missing = [c for c in ("uid", "split", HISTORY, TARGET) if c not in meta.column_names]
    if missing:
        raise ValueError(f"{metadata}: missing column(s) {missing} (has {meta.column_names})")
    tables, report = {}, {"dropped": {}, "history_length": {}}
    for split, rows in (
        ("test", meta.filter(pc.not_equal(meta["split"], 0))),
        ("train", meta.filter(pc.equal(meta["split"], 0))),
    ):
        tables[split], dropped, lengths = split_table(rows, pids, history_len, split == "train")
        report["dropped"][split], report["history_length"][split] = dropped, lengths
    tables["valid"] = tables["test"].slice(0, 0)
    popularity = item_popularity(meta, pids)
    items = items_table(pids, codes, int(codes.max()) + 1).append_column("popularity", pa.array(popularity))
    doc = {
        "source": str(metadata.resolve()),
        "format": "openonerec",
        "history_len": history_len,
        **catalog_report(pids, codes, int(codes.max()) + 1),
        "users": {s: tables[s].num_rows for s in SPLITS},
        "interactions": {s: int(pc.sum(pc.list_value_length(tables[s]["history"])).as_py() or 0) for s in SPLITS},
        "unknown_pids_left_out": report["dropped"],
        "history_length": report["history_length"],
        "sha256": {p.name: sha256_file(p) for p in (metadata, mapping)},
    }
    write_contract(out_dir, items, build_tokenizer(codes.shape[1], int(codes.max()) + 1), [tables], lambda: doc)
    dropped = {s: doc["unknown_pids_left_out"].get(s, {}).get("history", 0) for s in SPLITS}
    return summarize(out_dir, doc, int(codes.max()) + 1, history_len, dropped_interactions=dropped)


def split_table(rows: pa.Table, pids: np.ndarray, history_len: int, train: bool) -> tuple[pa.Table, dict, dict]:
    """One split's rows -> (its table: user_id, history and target_items with every other column, or for train one
    sequence each; the pids left out of histories and targets; the histories' lengths)."""
    history, dropped = known_window(rows[HISTORY], pids, history_len)
    target, dropped_target = known_window(rows[TARGET], pids, None)
    lengths = length_summary(pc.list_value_length(history).to_numpy().tolist())
    user = rows["uid"].cast(pa.int64())
    if train:
        joined = [h + t for h, t in zip(history.to_pylist(), target.to_pylist())]
        table = pa.table({"user_id": user, "history": pa.array(joined, pa.list_(pa.int64()))})
    else:
        rest = [c for c in rows.column_names if c not in ("uid", "split", HISTORY, TARGET)]
        table = pa.table({"user_id": user, "history": history, "target_items": target, **{c: rows[c] for c in rest}})
    return table, {"history": dropped, "target": dropped_target}, lengths


def item_popularity(meta: pa.Table, pids: np.ndarray) -> np.ndarray:
    """How often each pid [N] occurs in the release's histories and targets, every split [N] int64."""
    flat = [pc.list_flatten(meta[c]).cast(pa.int64()).drop_null().to_numpy() for c in (HISTORY, TARGET)]
    seen = np.concatenate(flat) if flat else np.zeros(0, np.int64)
    at = np.searchsorted(pids, seen)
    hit = at < len(pids)
    hit[hit] = pids[at[hit]] == seen[hit]
    return np.bincount(at[hit], minlength=len(pids)).astype(np.int64)
