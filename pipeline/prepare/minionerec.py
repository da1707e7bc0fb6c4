"""MiniOneRec's published layout (github AkaliKong/MiniOneRec, `data/Amazon/`) -> the project's contracts.

    index/<Category>.index.json                 item id (from 0) -> its code tokens, {"0": ["<a_236>", "<b_231>", ...]}
    info/<Category>_5_2016-10-2018-11.txt       semantic id \\t title \\t item id, a line per item
    {train,valid,test}/<Category>_*.csv         user_id (a string, `A6948`), history_item_title, item_title,
                                                history_item_id, history_item_sid (Python-literal lists), item_id,
                                                item_sid: one row per evaluated interaction

Every CSV row is a unit of its own, as their evaluate.py scores it: a user with several test interactions has several
rows, none of them a duplicate. Its key, the `user_id` of the written tables, is the CSV's user id and the row's
number in its file (from 0, their result JSON's order): `A6948#17`; the CSV's own id stays beside it as
`source_user_id`. `history` is `history_item_id` as written (the prompt template's max_items takes the last ones),
`target_items` is `[item_id]`; train rows are written as one sequence, history then target. Every cell is parsed
strictly (a malformed one names its file, row, column and value); `history_item_sid`, `item_sid` and the info file's
semantic ids are checked against the index, and an unknown item id, a semantic id that differs or a history whose two
lists differ in length refuses the import (contract.Mismatch, naming file, row and values) unless it is allowed
(then recorded in prepare.json and the summary). The published snapshot keeps the train CSVs outside git: a missing
split is reported (its table written empty), never fatal for the others.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa

from pipeline.prepare.contract import (
    PrepareSummary,
    build_tokenizer,
    catalog_report,
    check_mismatches,
    items_table,
    summarize,
    write_contract,
)
from pipeline.prepare.lcrec import REPORTED, read_lcrec_index
from pipeline.prepare.splits import SPLITS, length_summary
from pipeline.storage import sha256_file

COLUMNS = ("user_id", "history_item_id", "history_item_sid", "item_id", "item_sid")
KEY = "<CSV user_id>#<the row's number in its CSV, from 0>"
CONVENTION = {
    "unit": "every CSV row (one evaluated interaction), keyed user_id = " + KEY,
    "source_user_id": "the CSV's user_id, as written",
    "history": "history_item_id, as written (the prompt template's max_items takes the last ones)",
    "target_items": "[item_id]",
    "train": "history_item_id + [item_id], one sequence per row (each prefix a training sample)",
}


@dataclass
class Layout:
    """Where one category's files are."""

    root: Path
    category: str
    index: Path
    info: Path | None
    csv: dict[str, Path | None]  # split -> file (None: missing)


def find_layout(source: Path, category: str | None = None) -> Layout:
    """`source`: the repository, its `data/Amazon`, or a folder holding index/, info/ and the split folders the same
    way; `category` (e.g. Office_Products), else the one category the index folder holds."""
    source = Path(source)
    root = next((r for r in (source, source / "data" / "Amazon") if (r / "index").is_dir()), None)
    if root is None:
        raise ValueError(f"{source}: no index/ folder here or in data/Amazon/ (MiniOneRec's layout)")
    found = sorted(p.name.removesuffix(".index.json") for p in (root / "index").glob("*.index.json"))
    if category is None:
        if len(found) != 1:
            raise ValueError(f"{root / 'index'}: categories {found}; name one with --category")
        category = found[0]
    index = root / "index" / f"{category}.index.json"
    if not index.is_file():
        raise ValueError(f"{index}: file not found (categories here: {found})")
    return Layout(
        root,
        category,
        index,
        _one(root / "info", category, ".txt"),
        {s: _one(root / s, category, ".csv") for s in SPLITS},
    )


def _one(folder: Path, category: str, suffix: str) -> Path | None:
    """The file `<category>_*<suffix>` (or `<category><suffix>`) in `folder`; None when there is none."""
    files = sorted({*folder.glob(f"{category}_*{suffix}"), *folder.glob(f"{category}{suffix}")})
    if len(files) > 1:
        raise ValueError(f"{folder}: {len(files)} files for {category}: {[f.name for f in files]}")
    return files[0] if files else None


def read_info(path: Path | None, sid_of: dict[int, str]) -> dict:
    """The info file's `semantic id \\t title \\t item id` lines against the index: lines, and the items whose
    semantic id differs or that the index lacks (counted; the first REPORTED listed, with their line)."""
    if path is None:
        return {"file": None}
    differ, n, lines = [], 0, 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fields = line.split("\t")
        if not line.strip():
            continue
        lines += 1
        item = int(fields[-1]) if fields[-1].strip().isdigit() else None
        if item is None or sid_of.get(item) != fields[0].strip():
            n += 1
            if len(differ) < REPORTED:
                differ.append(
                    {"line": number, "item": fields[-1].strip(), "info": fields[0].strip(), "index": sid_of.get(item)}
                )
    return {"file": path.name, "lines": lines, "differ_from_index": n, "differences": differ}


def _blank(v: str) -> bool:
    return not v.strip()


def _user(v: str) -> str:
    if _blank(v):
        raise ValueError("is blank, expected a user id")
    return v


def _item(v: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", v):
        raise ValueError("is not an item id (a non-negative integer)")
    return int(v)


def _literal_list(v: str, kind: type, expected: str) -> list:
    """A Python-literal list whose elements are all `kind` (bool is no int), else ValueError naming what was
    expected."""
    try:
        value = ast.literal_eval(v)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        value = None
    if not isinstance(value, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in value):
        raise ValueError(f"is not {expected}")
    return value


def _sid(v: str) -> str:
    if _blank(v):
        raise ValueError("is blank, expected a semantic id such as <a_1><b_2><c_3>")
    return v.strip()


PARSERS = {  # column -> how a cell is read (ValueError saying what it expected)
    "user_id": _user,
    "history_item_id": lambda v: _literal_list(v, int, "a Python-literal list of item ids, e.g. [12, 7]"),
    "history_item_sid": lambda v: _literal_list(v, str, "a Python-literal list of semantic ids, e.g. ['<a_1><b_2>']"),
    "item_id": _item,
    "item_sid": _sid,
}


def read_cells(path: Path) -> dict[str, list]:
    """One CSV -> its COLUMNS, every cell parsed (`PARSERS`); a malformed cell is a ValueError naming the file, the
    row (from 0, as the key counts), the column and the value."""
    try:
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable CSV ({e})") from None
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ValueError(f"{path}: missing columns {missing} (has {list(frame.columns)})")
    cells = {}
    for column in COLUMNS:
        parse, values = PARSERS[column], []
        for row, value in enumerate(frame[column]):
            try:
                values.append(parse(value))
            except ValueError as e:
                raise ValueError(f"{path}: row {row}, column {column}: {value[:120]!r} {e}") from None
        cells[column] = values
    return cells


def check_rows(cells: dict[str, list], sid_of: dict[int, str]) -> dict:
    """Every row's ids and semantic ids against the index -> counts of unknown items, semantic ids that differ and
    histories whose two lists differ in length, with the first REPORTED of each listed by row."""
    out = {"unknown_items": 0, "sid_differs": 0, "history_lengths_differ": 0, "unknown": [], "sid_differences": []}
    out["lengths"] = []
    rows = zip(cells["history_item_id"], cells["history_item_sid"], cells["item_id"], cells["item_sid"])
    for row, (items, sids, item, sid) in enumerate(rows):
        if len(items) != len(sids):
            out["history_lengths_differ"] += 1
            if len(out["lengths"]) < REPORTED:
                out["lengths"].append({"row": row, "history_item_id": len(items), "history_item_sid": len(sids)})
        for i, s in zip([*items, item], [*sids, sid]):
            if i not in sid_of:
                out["unknown_items"] += 1
                if len(out["unknown"]) < REPORTED:
                    out["unknown"].append({"row": row, "item": i})
            elif sid_of[i] != s.strip():
                out["sid_differs"] += 1
                if len(out["sid_differences"]) < REPORTED:
                    out["sid_differences"].append({"row": row, "item": i, "csv": s.strip(), "index": sid_of[i]})
    return out


def read_split(path: Path, sid_of: dict[int, str]) -> tuple[pa.Table, dict]:
    """One CSV -> its rows as a table (user_id = KEY, source_user_id, history, target_items) and the checks
    (`check_rows`)."""
    cells = read_cells(path)
    users = cells["user_id"]
    table = pa.table(
        {
            "user_id": pa.array([f"{u}#{r}" for r, u in enumerate(users)], pa.string()),
            "source_user_id": pa.array(users, pa.string()),
            "history": pa.array(cells["history_item_id"], pa.list_(pa.int64())),
            "target_items": pa.array([[t] for t in cells["item_id"]], pa.list_(pa.int64())),
        }
    )
    report = {"file": path.name, "rows": table.num_rows, "users": len(set(users)), **check_rows(cells, sid_of)}
    report["history_length"] = length_summary([len(h) for h in cells["history_item_id"]])
    return table, report


def mismatches(split: dict, folder: str) -> tuple[list[str], int]:
    """A split's (or the info file's) disagreements with the index -> (descriptions naming file, row and values;
    their count)."""
    where = f"{folder}/{split.get('file')}"
    found = [f"{where}: row {u['row']}: item {u['item']} is not in the index" for u in split.get("unknown", [])]
    found += [
        f"{where}: row {d['row']}: item {d['item']} has semantic id {d['csv']} here, {d['index']} in the index"
        for d in split.get("sid_differences", [])
    ]
    found += [
        f"{where}: row {x['row']}: history_item_id has {x['history_item_id']} items, history_item_sid "
        f"{x['history_item_sid']}"
        for x in split.get("lengths", [])
    ]
    found += [
        f"{where}: line {d['line']}: item {d['item']} has semantic id {d['info']} here, {d['index']} in the index"
        for d in split.get("differences", [])
    ]
    n = sum(split.get(k, 0) for k in ("unknown_items", "sid_differs", "history_lengths_differ", "differ_from_index"))
    return found, n


def absent(path: Path | None, category: str, folder: Path) -> str | None:
    """Why a split's CSV is not there to read (no file, an empty one, a Git LFS pointer: the published snapshot keeps
    the train CSVs outside git), or None."""
    if path is None:
        return f"no {category}_*.csv in {folder}"
    with open(path, "rb") as f:
        head = f.read(64)
    if not head:
        return f"{path.name} is empty"
    if head.startswith(b"version https://git-lfs"):
        return f"{path.name} is a Git LFS pointer, not the file: fetch it with git lfs pull"
    return None


def empty_split() -> pa.Table:
    return pa.table(
        {
            "user_id": pa.array([], pa.string()),
            "source_user_id": pa.array([], pa.string()),
            "history": pa.array([], pa.list_(pa.int64())),
            "target_items": pa.array([], pa.list_(pa.int64())),
        }
    )


def prepare_minionerec(
    source_dir, out_dir, category: str | None = None, code_token: str = "<{level}_{code}>", allow_mismatch=False
) -> PrepareSummary:
    """MiniOneRec's layout (`find_layout`) -> the project's contracts in `out_dir`: items from the index, every CSV
    row of every split present as its own unit (see the module's docstring), the checks and what was read in
    prepare.json. An id or semantic id that disagrees with the index (a CSV's, the info file's) is a Mismatch naming
    file, row and values, unless `allow_mismatch` (then imported as written, and recorded)."""
    layout = find_layout(Path(source_dir), category)
    item_ids, sid, index_problems = read_lcrec_index(layout.index, code_token)
    order = np.argsort(item_ids)
    item_ids, sid = item_ids[order], sid[order]
    sid_of = sid_strings(item_ids, sid, code_token)
    tables, splits = read_splits(layout, sid_of)
    info = read_info(layout.info, sid_of)
    found = {s: mismatches(r, s) for s, r in splits.items()} | {"info": mismatches(info, "info")}
    described, count = [d for f, _ in found.values() for d in f], sum(n for _, n in found.values())
    check_mismatches("ids or semantic ids", described, count, allow_mismatch)
    codes = int(sid.max()) + 1
    report = {
        "source": str(layout.root.resolve()),
        "format": "minionerec",
        "category": layout.category,
        "splits": CONVENTION,
        "history_len": None,
        **catalog_report(item_ids, sid, codes),
        "index": layout.index.name,
        "index_problems": {"count": len(index_problems), "entries": index_problems[:REPORTED]},
        "info": info,
        "rows": splits,
        "users": {s: tables[s].num_rows for s in SPLITS},
        "interactions": {s: int(sum(map(len, tables[s]["history"].to_pylist()))) for s in SPLITS},
        "mismatches": {s: n for s, (_, n) in found.items()},
        "allow_mismatch": allow_mismatch,
        "sha256": {p.name: sha256_file(p) for p in read_files(layout, splits)},
    }
    write_contract(
        out_dir, items_table(item_ids, sid, codes), build_tokenizer(sid.shape[1], codes), [tables], lambda: report
    )
    return summarize_minionerec(out_dir, report, layout, codes)


def summarize_minionerec(out_dir, report: dict, layout: Layout, codes: int) -> PrepareSummary:
    """prepare.json's counts -> the printed summary: rows are kept as written (nothing dropped: the nightly rejects
    an unknown item), the disagreements with the index counted (`mismatches`) and whether they were allowed."""
    return summarize(
        out_dir,
        report,
        codes,
        None,
        dropped_interactions={s: 0 for s in SPLITS},
        index_problems=report["index_problems"]["count"],
        index=str(layout.index),
        rows={s: r.get("rows") for s, r in report["rows"].items()},
        category=layout.category,
        mismatches=report["mismatches"],
        allow_mismatch=report["allow_mismatch"],
    )


def sid_strings(item_ids: np.ndarray, sid: np.ndarray, code_token: str) -> dict[int, str]:
    """Item ids [N] and their codes [N, L] -> {item id: its semantic id as the CSVs spell it, `<a_1><b_2>...`}."""
    names = [chr(97 + j) for j in range(sid.shape[1])]
    return {
        int(i): "".join(code_token.format(level=names[j], level_index=j, code=int(c)) for j, c in enumerate(r))
        for i, r in zip(item_ids, sid)
    }


def read_splits(layout: Layout, sid_of: dict[int, str]) -> tuple[dict[str, pa.Table], dict[str, dict]]:
    """Every split's CSV -> ({split: table}, {split: its checks}); a missing CSV is an empty table and the reason; the
    train rows become one sequence each, history then target."""
    tables, splits = {}, {}
    for s, path in layout.csv.items():
        why = absent(path, layout.category, layout.root / s)
        if why:
            tables[s], splits[s] = empty_split(), {"file": path and path.name, "missing": why}
        else:
            tables[s], splits[s] = read_split(path, sid_of)
    train = tables["train"]
    sequences = [h + t for h, t in zip(train["history"].to_pylist(), train["target_items"].to_pylist())]
    tables["train"] = pa.table(
        {
            "user_id": train["user_id"],
            "source_user_id": train["source_user_id"],
            "history": pa.array(sequences, pa.list_(pa.int64())),
        }
    )
    return tables, splits


def read_files(layout: Layout, splits: dict[str, dict]) -> list[Path]:
    """The files the import read (hashed into prepare.json): the index, the info file, the CSVs present."""
    return [
        layout.index,
        *([layout.info] if layout.info else []),
        *(p for s, p in layout.csv.items() if "rows" in splits[s]),
    ]
