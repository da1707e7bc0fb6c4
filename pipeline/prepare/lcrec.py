"""LC-Rec's / AtSpeed's published layout -> the project's contracts: an index JSON (item id -> its code tokens) and
`sequential_{train,valid,test}.txt`, a line per user `user item item ...` (split by global time, as in the AtSpeed
paper)."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.prepare.contract import PrepareSummary, Source, check_mismatches, write_source
from pipeline.prepare.splits import Interactions, sorted_unique

LCREC_SPLITS = {"train": "sequential_train.txt", "valid": "sequential_valid.txt", "test": "sequential_test.txt"}
REPORTED = 1000  # problems listed by line in prepare.json (all are counted)


def code_token_pattern(code_token: str = "<{level}_{code}>") -> re.Pattern:
    """A code-token naming (decoding/templates.py: {level} letter, {level_index}, {code}) -> a regex whose groups
    are (level, code)."""
    parts = re.split(r"(\{level\}|\{level_index\}|\{code\})", code_token)
    groups = {"{level}": "(?P<level>[a-z])", "{level_index}": "(?P<level_index>\\d+)", "{code}": "(?P<code>\\d+)"}
    return re.compile("".join(groups.get(x, re.escape(x)) for x in parts))


def _load_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _is_index(doc, sample: int = 100) -> bool:
    """Does a JSON document map integer item ids to lists of strings (code tokens)? Looks at `sample` entries."""
    if not isinstance(doc, dict) or not doc:
        return False
    entries = list(itertools.islice(doc.items(), sample))
    return all(
        k.strip().lstrip("-").isdigit() and isinstance(v, list) and v and all(isinstance(t, str) for t in v)
        for k, v in entries
    )


def find_lcrec_index(source_dir: Path, index: Path | None = None) -> Path:
    """The index file: `index` when given, else the one JSON file in `source_dir` that maps item ids to lists of code
    tokens (the authors name it `<dataset>.LCRec-1e-3lr.json`, LC-Rec `<Dataset>.index.json`; item-feature and
    interaction JSONs map ids to objects or integer lists and are not candidates)."""
    if index is not None:
        if not Path(index).is_file():
            raise ValueError(f"--index {index}: file not found")
        return Path(index)
    if not source_dir.is_dir():
        raise ValueError(f"{source_dir}: folder not found")
    seen = sorted(source_dir.glob("*.json"))
    found = [p for p in seen if _is_index(_load_json(p))]
    if len(found) != 1:
        why = "no JSON file" if not found else f"{len(found)} JSON files ({', '.join(p.name for p in found)})"
        raise ValueError(
            f"{source_dir}: expected one LC-Rec index (a JSON file mapping item ids to lists of code "
            f"tokens), found {why} among {[p.name for p in seen]}; name it with --index FILE"
        )
    return found[0]


def read_lcrec_index(path: Path, code_token: str = "<{level}_{code}>") -> tuple[np.ndarray, np.ndarray, list]:
    """LC-Rec's index JSON {"<item id>": ["<a_47>", "<b_103>", ...], ...} -> (item ids [N], semantic ids [N, L],
    problems [{"item", "reason"}]); an entry whose tokens do not parse, are out of level order, or whose length
    differs from the common one is a problem (reported, not kept)."""
    index = _load_json(path)
    if not isinstance(index, dict) or not index:
        raise ValueError(f"{path}: expected a non-empty JSON object mapping item ids to lists of code tokens")
    pattern = code_token_pattern(code_token)
    levels = int(np.bincount([len(v) if isinstance(v, list) else 0 for v in index.values()]).argmax())
    item_ids, rows, problems = [], [], []
    for key, tokens in index.items():
        why = None
        if not key.strip().lstrip("-").isdigit():
            why = "item id is not an integer"
        elif not isinstance(tokens, list) or len(tokens) != levels:
            why = f"expected a list of {levels} code tokens, got {tokens!r}"[:200]
        else:
            matches = [pattern.fullmatch(t) if isinstance(t, str) else None for t in tokens]
            if not all(matches):
                why = f"not code tokens named like {code_token!r}: {tokens!r}"[:200]
            else:
                found = [ord(m["level"]) - 97 if "level" in m.groupdict() else int(m["level_index"]) for m in matches]
                if found != list(range(levels)):
                    why = f"code tokens out of level order: {tokens!r}"[:200]
        if why:
            problems.append({"item": key, "reason": why})
            continue
        item_ids.append(int(key))
        rows.append([int(m["code"]) for m in matches])
    if not rows:
        raise ValueError(f"{path}: no usable entry ({problems[:3]})")
    return np.array(item_ids, np.int64), np.array(rows, np.int64).reshape(len(rows), levels), problems


@dataclass
class LcrecSplit:
    """One interaction file as written: {user: (line number, items)} for users with items, the users listed without
    items (their line numbers), and the malformed lines (counted, the first REPORTED listed)."""

    file: str
    users: dict[int, tuple[int, list[int]]]
    without_items: dict[int, int]
    malformed: list[dict]
    n_malformed: int


def read_lcrec_split(path: Path) -> LcrecSplit:
    """One interaction file, a line per user `user item item ...` (chronological). A line `user` alone is a user
    without items in this split (the published valid and test files list every user); lines that are not integers,
    or list a user again, are malformed: counted and listed with their line numbers, left out."""
    if not path.is_file():
        raise ValueError(f"{path}: file not found")
    split = LcrecSplit(path.name, {}, {}, [], 0)
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            fields = line.split()
            if not fields:
                continue  # blank lines carry nothing
            why = None
            if not all(x.lstrip("-").isdigit() for x in fields):
                why = "not all fields are integers"
            elif int(fields[0]) in split.users or int(fields[0]) in split.without_items:
                why = f"user {fields[0]} listed again"
            if why:
                split.n_malformed += 1
                if len(split.malformed) < REPORTED:
                    split.malformed.append({"line": number, "reason": why, "text": line.strip()[:120]})
            elif len(fields) == 1:
                split.without_items[int(fields[0])] = number
            else:
                split.users[int(fields[0])] = (number, [int(x) for x in fields[1:]])
    return split


def _range(ids: np.ndarray) -> str:
    return f"{int(ids.min())}..{int(ids.max())}" if len(ids) else "none"


def check_id_offset(splits: dict[str, LcrecSplit], known: np.ndarray, offset: int | None, index_name: str) -> dict:
    """Compares the interaction files' item ids with the index's (sorted `known` [N]) -> the evidence (recorded in
    prepare.json). Without an explicit `offset`, ids that look shifted (some are unknown as written, and one constant
    offset makes every item known, e.g. the authors' sequential_*.txt counting from 1 against an index from 0)
    are refused with that evidence and the option to pass."""
    used = sorted_unique(
        np.fromiter((i for s in splits.values() for _, items in s.users.values() for i in items), np.int64)
    )  # [I] distinct
    shift = 0 if offset is None else offset
    unknown = (used + shift)[~np.isin(used + shift, known)]  # [u] after the offset
    evidence = {
        "index_ids": _range(known),
        "index_items": int(len(known)),
        "item_ids_used": _range(used),
        "distinct_items_used": int(len(used)),
        "offset": shift,
        "unknown_after_offset": int(len(unknown)),
        "unknown_examples": unknown[:10].tolist(),
    }
    if offset is not None or not len(unknown) or not len(used):
        return evidence
    for d in sorted({int(known.min() - used.min()), int(known.max() - used.max())} - {0}):
        if np.isin(used + d, known).all():
            zero = "id 0 is never used, " if used.min() > 0 and known.min() == 0 else ""
            are = "id is" if len(unknown) == 1 else "ids are"
            raise ValueError(
                f"the interaction files' item ids look shifted against the index {index_name}: it holds ids "
                f"{evidence['index_ids']} ({len(known):,} items), the files use ids {evidence['item_ids_used']} "
                f"({len(used):,} distinct); {zero}{len(unknown):,} distinct {are} not in the index as written "
                f"(e.g. {', '.join(map(str, unknown[:5].tolist()))}), and adding {d:+d} to every id makes every item "
                f"known. Rerun with --id-offset {d} (added to every user and item id of the interaction files), "
                f"or --id-offset 0 to import the ids as written"
            )
    return evidence


def apply_offset(split: LcrecSplit, known: np.ndarray, offset: int) -> tuple[dict[int, list[int]], dict]:
    """A split with `offset` added to every user and item id -> ({user: [known items]}, problems): items still not in
    the index are left out of the user's list, counted and listed with their line numbers (never dropped
    silently)."""
    known_set = set(known.tolist())
    users, unknown, n_unknown = {}, [], 0
    for user, (number, items) in split.users.items():
        items = [i + offset for i in items]
        missing = [i for i in items if i not in known_set]
        if missing:
            n_unknown += len(missing)
            if len(unknown) < REPORTED:
                unknown.append({"line": number, "user": user + offset, "items": missing[:20]})
        users[user + offset] = [i for i in items if i in known_set]
    return users, {
        "file": split.file,
        "users": len(users),
        "users_without_items": len(split.without_items),
        "malformed_lines": split.n_malformed,
        "unknown_items": n_unknown,
        "malformed": split.malformed,
        "unknown": unknown,
    }


def prepare_lcrec(
    source_dir,
    out_dir,
    history_len: int = 20,
    code_token: str = "<{level}_{code}>",
    index: Path | None = None,
    id_offset: int | None = None,
    allow_mismatch: bool = False,
) -> PrepareSummary:
    """LC-Rec's / AtSpeed's published layout -> the project's contracts in `out_dir` (as `prepare_beauty`): the index
    JSON (item id -> its code tokens; `index`, else found by `find_lcrec_index`) and `sequential_{train,valid,test}.txt`
    (split by global time, as in the AtSpeed paper). `id_offset` is added to every user and item id of the
    interaction files (-1 for the authors' files, which count from 1 where their index counts from 0); without it,
    ids that look shifted are refused (`check_id_offset`); items still unknown after the offset refuse the import
    (contract.Mismatch, naming file, line and ids) unless `allow_mismatch` (then left out of the lists, counted).
    Splits as SPLIT_CONVENTION. Counts, semantic-ID collisions, the id evidence, users without items, malformed
    lines and unknown items (with line numbers) go to prepare.json."""
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    source = read_lcrec(Path(source_dir), code_token, index, id_offset, allow_mismatch)
    return write_source(source, out_dir, history_len)


def read_lcrec(
    source_dir: Path,
    code_token: str = "<{level}_{code}>",
    index: Path | None = None,
    id_offset: int | None = None,
    allow_mismatch: bool = False,
) -> Source:
    """The index and the three interaction files, read and checked -> a Source: items in id order; train rows for the
    users with train lines, valid and test rows for every user of any file (their items, or none)."""
    index_path = find_lcrec_index(source_dir, index)
    item_ids, sid, index_problems = read_lcrec_index(index_path, code_token)
    order = np.argsort(item_ids)
    item_ids, sid = item_ids[order], sid[order]
    raw = {s: read_lcrec_split(source_dir / name) for s, name in LCREC_SPLITS.items()}
    ids = check_id_offset(raw, item_ids, id_offset, index_path.name)
    read = {s: apply_offset(r, item_ids, ids["offset"]) for s, r in raw.items()}
    lines = {s: r[1] for s, r in read.items()}
    mismatches = {s: n["unknown_items"] for s, n in lines.items()}
    found = unknown_items(source_dir, lines, index_path.name)
    check_mismatches("item ids (after the offset)", found, sum(mismatches.values()), allow_mismatch)
    allowed = {"mismatches": mismatches, "allow_mismatch": allow_mismatch}
    return Source(
        source_dir,
        "lcrec",
        item_ids,
        sid,
        int(sid.max()) + 1,
        lcrec_splits(raw, read, ids["offset"]),
        files=[index_path, *(source_dir / n for n in LCREC_SPLITS.values())],
        report={
            "index": index_path.name,
            "ids": ids,
            "lines": lines,
            "index_problems": {"count": len(index_problems), "entries": index_problems[:REPORTED]},
            **allowed,
        },
        summary=lcrec_summary(lines, len(index_problems), index_path, ids["offset"]) | allowed,
    )


def lcrec_summary(lines: dict[str, dict], index_problems: int, index_path: Path, offset: int) -> dict:
    """The LC-Rec fields of the printed summary: per split the unknown items left out, the malformed lines and the
    users listed without items; the index's problems, the index read and the id offset applied."""
    return {
        "dropped_interactions": {s: n["unknown_items"] for s, n in lines.items()},
        "malformed_lines": {s: n["malformed_lines"] for s, n in lines.items()},
        "index_problems": index_problems,
        "users_without_items": {s: n["users_without_items"] for s, n in lines.items()},
        "index": str(index_path),
        "id_offset": offset,
    }


def unknown_items(source_dir: Path, lines: dict[str, dict], index_name: str) -> list[str]:
    """The items still unknown after the offset (`apply_offset`'s problems per split) -> one description each,
    naming the file, line, user and ids."""
    return [
        f"{source_dir / n['file']}: line {u['line']} (user {u['user']}): item ids {u['items']} are not in the index "
        f"{index_name}"
        for n in lines.values()
        for u in n["unknown"]
    ]


def lcrec_splits(raw: dict[str, LcrecSplit], read: dict, offset: int) -> dict[str, Interactions]:
    """The interaction files' users (`raw`; their items with `offset` applied and the unknown ones dropped: `read`)
    -> train for the users with train lines, valid and test for every user of any file (their items, or none)."""
    users = [u + offset for r in raw.values() for u in [*r.users, *r.without_items]]
    everyone = sorted_unique(np.array(users, np.int64))  # [U]
    splits = {s: Interactions.from_lists(items) for s, (items, _) in read.items()}
    return splits | {s: splits[s].aligned(everyone) for s in ("valid", "test")}
