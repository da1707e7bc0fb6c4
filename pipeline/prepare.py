"""Data preparation: the code-token tokenizer, Amazon Beauty in the project's contracts,
and synthetic catalogs / histories for scale tests.

Outputs (ARCHITECTURE.md section 3), in `out_dir`:
    items.parquet      item_id int64, semantic_id list<int32> [L], code_tokens list<string> [L]
    train.parquet      user_id int64, history list<int64> (all train items, chronological)
    valid.parquet      user_id, history (last history_len train items), target_items (valid items)
    test.parquet       user_id, history (last history_len train + valid items), target_items (test items)
(SPLIT_CONVENTION: the AtSpeed paper's protocol; synthetic data is leave-one-out)
    tokenizer/         build_tokenizer(L, codes).save_pretrained(...)
    prepare.json       counts, semantic-ID collisions, history lengths, source sha256s
items.parquet is written last, so a crash part-way never leaves a folder that looks done.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from decoding.codes import SPECIAL_TOKENS, code_token, code_token_ids, format_rows, semantic_id_matrix
from operators.prompts import ragged_arrays, ragged_ranges
from pipeline.storage import sha256_file

__all__ = [
    "build_tokenizer", "prepare_beauty", "prepare_lcrec", "find_lcrec_index", "PrepareSummary", "SPLIT_CONVENTION",
    "synthetic_catalog", "synthetic_histories", "write_synthetic", "SyntheticSummary",
]

BEAUTY_FILES = ("items.parquet", "train.parquet", "valid.parquet", "test.parquet")

# History lengths of synthetic users: n = 5 + floor(Y), Y ~ LogNormal(mu, sigma).
# Fitted once on /work/shared/datasets/amazon-beauty/train.parquet (19,383 users; train
# lengths min 2, median 5, mean 6.31, p99 31, max 165). 5-core data has >= 5 interactions
# per user, so the fit uses the 11,356 users with n >= 5 (median 6, mean 8.50, p90 14,
# p99 39, max 165): mu, sigma = mean, std of log(n - 4.5) (n - 4.5 is the midpoint of
# the Y interval that floors to n). Sampled: mean 8.27, p90 13, p99 33.
BEAUTY_LENGTH_MU = 0.6405
BEAUTY_LENGTH_SIGMA = 1.1684
# Item popularity, Zipf-Mandelbrot: P(rank r) ~ (r + offset) ** -alpha, r = 1, 2, ...
# Least-squares fit of log count vs log(rank + offset) over the 11,717 items seen in
# Beauty train (offset 100 -> slope -0.943). A plain Zipf (offset 0, slope -0.84) would
# give the top item 4% of all interactions instead of Beauty's 0.28% (0.18% here).
BEAUTY_ZIPF_ALPHA = 0.94
BEAUTY_ZIPF_OFFSET = 100
MIN_HISTORY = 5  # 5-core
# How the evaluation splits are built from the time-ordered train / valid / test interactions (the AtSpeed paper's
# protocol, its code's data.py): written into prepare.json and quoted by jobs.evaluate and the training reports.
SPLIT_CONVENTION = {
    "train": "every train item, chronological (each prefix a training sample)",
    "valid": "history = the user's train items (the last history_len); targets = the valid items",
    "test": "history = the user's train + valid items (the last history_len); targets = the test items",
    "evaluation": "users without targets are skipped",
}
SYNTHETIC_SPLITS = {  # write_synthetic: leave-one-out, like the real splits
    "train": "every user's items but the last two",
    "valid": "history = the train items (the last history_len); targets = the next item",
    "test": "history = the train + valid items (the last history_len); targets = one held-out next item",
    "evaluation": "every user has one target",
}

_LIST_INT64 = pa.list_(pa.int64())


# ---------------------------------------------------------------- tokenizer


def build_tokenizer(levels: int = 4, codes: int = 256) -> PreTrainedTokenizerFast:
    """Word-level tokenizer over `<pad> <bos> <eos> <unk>` + the code tokens, level-major.

    id(<pad>, <bos>, <eos>, <unk>) = 0, 1, 2, 3 and id(level j, code c) = 4 + j * codes + c,
    e.g. tok("<bos><a_1><b_2>").input_ids == [1, 5, 262] for codes = 256. Text is split into
    `<...>` pieces (whitespace between them is dropped; anything else becomes <unk>).
    No post-processor: no special token is ever added automatically. Left padding.
    """
    if not 1 <= levels <= 26:
        raise ValueError(f"levels must be in [1, 26], got {levels}")
    if codes < 1:
        raise ValueError(f"codes must be positive, got {codes}")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for j in range(levels):
        for c in range(codes):
            vocab[code_token(j, c)] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"<[^<>]+>"), behavior="isolated"),
    ])
    tk.decoder = decoders.Fuse()  # decode -> "<bos><a_1><b_2>", no spaces
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        padding_side="left",
    )


INSTRUCTION_TEXT = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:", "### Response:", "The user has interacted with items in chronological order.",
    "Can you predict the next possible item that the user may expect?",
    "Here is the purchase history of a user. Recommend the next item the user is likely to buy.",
]


def build_text_tokenizer(levels: int, codes: int, vocab_size: int = 600, code_tokens: bool = True):
    """A tokenizer of the kind LLM recommenders have, for tests and benchmarks of prompt templates without a hub: a
    byte-level BPE trained here in seconds (the `tokenizers` library) on instruction-style text with numbered lists,
    that adds <s> itself like Llama's; with code_tokens, the code tokens `<a_0>` .. added as tokens of their own
    (tokenizer.add_tokens, the LC-Rec recipe). Ids: <pad> 0, <s> 1, </s> 2."""
    from tokenizers import processors, trainers

    corpus = INSTRUCTION_TEXT * 20 + [", ".join(f"{i}. item" for i in range(1, n + 1)) for n in range(1, 60)]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  padding_side="left")
    if code_tokens:
        tok.add_tokens([code_token(j, c) for j in range(levels) for c in range(codes)])
    return tok


# ---------------------------------------------------------------- small helpers


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
        raise ValueError(f"{name}: column {column!r} has duplicated values {format_rows(_sorted_unique(dup))}")
    return ids


def list_array(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.ListArray:
    """Rows values[starts[i] : starts[i] + lengths[i]] -> list<int64> array [R]."""
    idx = ragged_ranges(starts, lengths)  # [sum(lengths)]
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values[idx].astype(np.int64)))


def tail_lists(values, starts, lengths, n: int) -> pa.ListArray:
    """The last min(len, n) items of every row -> list<int64> array [R]."""
    used = np.minimum(lengths, n)
    return list_array(values, starts + lengths - used, used)


def semantic_id_array(semantic_ids: np.ndarray) -> pa.ListArray:
    """[N, L] codes -> list<int32> array [N]."""
    n, levels = semantic_ids.shape
    offsets = np.arange(0, n * levels + 1, levels, dtype=np.int32)  # [N + 1]
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(semantic_ids.astype(np.int32).ravel()))


def code_tokens_array(semantic_ids: np.ndarray, codes: int, chunk: int = 1 << 20) -> pa.ChunkedArray:
    """[N, L] codes -> list<string> [N] of `<a_47>`-style names, built `chunk` rows at a time."""
    n, levels = semantic_ids.shape
    names = pa.array([code_token(j, c) for j in range(levels) for c in range(codes)])  # [L * codes]
    level_base = np.arange(levels, dtype=np.int64) * codes  # [L]
    chunks = []
    for lo in range(0, max(n, 1), chunk):
        sid = semantic_ids[lo:lo + chunk]                           # [n_c, L]
        flat = (sid.astype(np.int64) + level_base[None, :]).ravel()  # [n_c * L] index into names
        offsets = np.arange(0, len(sid) * levels + 1, levels, dtype=np.int32)
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets), names.take(pa.array(flat))))
    return pa.chunked_array(chunks, type=pa.list_(pa.string()))


def length_summary(lengths: np.ndarray) -> dict:
    lengths = np.asarray(lengths)
    if len(lengths) == 0:
        return {"count": 0}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99]).tolist()
    return {"count": int(len(lengths)), "min": int(lengths.min()), "p50": p50, "mean": float(lengths.mean()),
            "p90": p90, "p99": p99, "max": int(lengths.max())}


def semantic_id_collisions(item_ids: np.ndarray, semantic_ids: np.ndarray) -> list[dict]:
    """Semantic IDs shared by more than one item: [{semantic_id, code_tokens, item_ids}]."""
    uniq, inverse, counts = np.unique(semantic_ids, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    out = []
    for g in np.flatnonzero(counts > 1):
        sid = uniq[g].tolist()
        out.append({
            "semantic_id": sid,
            "code_tokens": "".join(code_token(j, c) for j, c in enumerate(sid)),
            "item_ids": sorted(item_ids[inverse == g].tolist()),
        })
    return out


# ---------------------------------------------------------------- Amazon Beauty


@dataclass
class PrepareSummary:
    out_dir: str
    items: int
    distinct_semantic_ids: int
    colliding_semantic_ids: int
    users: int
    interactions: dict[str, int]          # written, after dropping unknown items
    dropped_interactions: dict[str, int]  # item ids not in the catalog, per split
    levels: int
    codes: int
    history_len: int
    malformed_lines: dict[str, int] = field(default_factory=dict)  # LC-Rec files: lines left out, per split
    index_problems: int = 0  # LC-Rec index entries left out
    users_without_items: dict[str, int] = field(default_factory=dict)  # LC-Rec files: users listed alone, per split
    index: str | None = None  # LC-Rec: the index file read
    id_offset: int = 0  # LC-Rec: added to every user and item id of the interaction files


def _read_catalog(path: Path, codes: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    """items.parquet -> (item_ids [N], semantic_ids [N, L], codes), checking code_tokens if present."""
    names = pq.read_schema(path).names if path.is_file() else []
    columns = ["item_id", "semantic_id"] + (["code_tokens"] if "code_tokens" in names else [])
    table = _read_parquet(path, columns)
    item_ids = _int_ids(table, "item_id", str(path))            # [N]
    sid = semantic_id_matrix(table, str(path))                  # [N, L]
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
    bad = lengths != levels                                      # [N]
    expected = code_tokens_array(sid, codes).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    if not bad.any():
        got = col.flatten().to_numpy(zero_copy_only=False)       # [N * L]
        bad = (got != expected).reshape(n, levels).any(axis=1)
    if bad.any():
        raise ValueError(f"{path}: code_tokens disagree with semantic_id in rows {format_rows(np.flatnonzero(bad))}")


def _read_split(path: Path, item_ids: np.ndarray) -> tuple[np.ndarray, tuple, dict]:
    """train/valid/test.parquet -> (user_ids [U], (values [T], starts [U], lengths [U]), dropped).

    Item ids missing from the catalog cannot be tokenized: they are dropped from the lists
    (order of the other items kept) and reported in `dropped` (a copy of Beauty with the release text files'
    1-based ids showed item 12035, one past the index, in 15 train histories: the symptom of shifted ids).
    """
    table = _read_parquet(path, ["user_id", "items"])
    user_ids = _int_ids(table, "user_id", str(path))
    col = table.column("items")
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) or not pa.types.is_integer(col.type.value_type):
        raise ValueError(f"{path}: column 'items' must be list<int64>, got {col.type}")
    values, starts, lengths, _ = ragged_arrays(col)             # null rows count as empty
    values = values[ragged_ranges(starts, lengths)]             # [T] compact, row-major
    row_of = np.repeat(np.arange(len(lengths)), lengths)        # [T]
    known = np.isin(values, item_ids)                           # [T]
    dropped = {"interactions": int((~known).sum()), "users": int(len(np.unique(row_of[~known]))),
               "item_ids": np.unique(values[~known]).tolist()}
    values, row_of = values[known], row_of[known]
    lengths = np.bincount(row_of, minlength=len(lengths)).astype(np.int64)  # [U]
    starts = np.cumsum(lengths) - lengths
    return user_ids, (values, starts, lengths), dropped


def _aligned(user_ids, src_users, src_items) -> tuple:
    """Each of `user_ids`' rows of a ragged split (src_users [S], (values, starts, lengths)) -> (values, starts
    [U], lengths [U]); users not in the source get an empty row."""
    values, src_starts, src_lengths = src_items
    if len(src_users) == 0:
        src_users, src_starts, src_lengths = np.full(1, -1), np.zeros(1, np.int64), np.zeros(1, np.int64)
    order = np.argsort(src_users)
    pos = np.minimum(np.searchsorted(src_users, user_ids, sorter=order), len(order) - 1)
    row = order[pos]                                             # [U] source row of each user
    found = src_users[row] == user_ids
    return values, np.where(found, src_starts[row], 0), np.where(found, src_lengths[row], 0)


def _concat_rows(a: tuple, b: tuple) -> tuple:
    """Two ragged sets of U rows -> row i = a's row i then b's row i: (values [T], starts [U], lengths [U])."""
    (va, sa, la), (vb, sb, lb) = a, b
    values = np.concatenate([va[ragged_ranges(sa, la)], vb[ragged_ranges(sb, lb)]])
    rows = np.arange(len(la))
    key = np.concatenate([np.repeat(2 * rows, la), np.repeat(2 * rows + 1, lb)])  # a before b within a row
    lengths = la + lb
    return values[np.argsort(key, kind="stable")], np.cumsum(lengths) - lengths, lengths


def _eval_split(user_ids, items, history: tuple, history_len: int) -> pa.Table:
    """A valid/test split -> (user_id, history = the last history_len items of `history` [U rows], target_items)."""
    return pa.table({
        "user_id": pa.array(user_ids, pa.int64()),
        "history": tail_lists(*history, history_len),
        "target_items": list_array(*items),
    })


def prepare_beauty(source_dir, out_dir, history_len: int = 20, codes: int | None = None) -> PrepareSummary:
    """Amazon Beauty folder -> the project's contracts in `out_dir` (see module docstring).

    `codes` (codes per level of the tokenizer) defaults to max code + 1 over all levels
    of the catalog: 256 for Beauty. All items are kept, also those sharing a semantic ID
    (listed in prepare.json; the policy is applied when the catalog is loaded). History
    items that are not in the catalog are dropped and counted in prepare.json.
    """
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    item_ids, sid, codes = _read_catalog(source_dir / "items.parquet", codes)  # [N], [N, L]
    n_items, levels = sid.shape
    read = {s: _read_split(source_dir / f"{s}.parquet", item_ids) for s in ("train", "valid", "test")}
    splits = {s: r[:2] for s, r in read.items()}                # user_ids, (values, starts, lengths)
    dropped = {s: r[2] for s, r in read.items()}
    train_users, train_items = splits["train"]

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(levels, codes)
    code_token_ids(tokenizer, sid)  # every catalog code must have a token
    tokenizer.save_pretrained(out_dir / "tokenizer")

    pq.write_table(pa.table({"user_id": pa.array(train_users, pa.int64()),
                             "history": list_array(*train_items)}), out_dir / "train.parquet")
    eval_tables = {}
    for s in ("valid", "test"):  # SPLIT_CONVENTION: valid users' history = train, test users' = train + valid
        history = _aligned(splits[s][0], train_users, train_items)
        if s == "test":
            history = _concat_rows(history, _aligned(splits[s][0], *splits["valid"]))
        eval_tables[s] = _eval_split(*splits[s], history, history_len)
        pq.write_table(eval_tables[s], out_dir / f"{s}.parquet")

    collisions = semantic_id_collisions(item_ids, sid)
    interactions = {s: int(splits[s][1][2].sum()) for s in splits}
    report = {
        "source": str(source_dir.resolve()), "format": "beauty", "splits": SPLIT_CONVENTION,
        "history_len": history_len, "levels": levels, "codes": codes,
        "items": n_items,
        "distinct_semantic_ids": n_items - sum(len(c["item_ids"]) - 1 for c in collisions),
        "semantic_id_collisions": collisions,
        "users": {s: int(len(splits[s][0])) for s in splits},
        "users_with_targets": {s: int((splits[s][1][2] > 0).sum()) for s in ("valid", "test")},
        "interactions": interactions,
        "dropped_unknown_items": dropped,
        "history_length": {
            "train": length_summary(train_items[2]),
            "test_prompt": length_summary(eval_tables["test"].column("history").combine_chunks().value_lengths()),
        },
        "sha256": {f: sha256_file(source_dir / f) for f in BEAUTY_FILES},
    }
    (out_dir / "prepare.json").write_text(json.dumps(report, indent=2))
    pq.write_table(pa.table({
        "item_id": pa.array(item_ids, pa.int64()),
        "semantic_id": semantic_id_array(sid),
        "code_tokens": code_tokens_array(sid, codes),
    }), out_dir / "items.parquet")
    return PrepareSummary(
        out_dir=str(out_dir), items=n_items, distinct_semantic_ids=report["distinct_semantic_ids"],
        colliding_semantic_ids=len(collisions), users=report["users"]["test"], interactions=interactions,
        dropped_interactions={s: d["interactions"] for s, d in dropped.items()},
        levels=levels, codes=codes, history_len=history_len,
    )


# ---------------------------------------------------------------- the LC-Rec layout

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
    return all(k.strip().lstrip("-").isdigit() and isinstance(v, list) and v and all(isinstance(t, str) for t in v)
               for k, v in entries)


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
        raise ValueError(f"{source_dir}: expected one LC-Rec index (a JSON file mapping item ids to lists of code "
                         f"tokens), found {why} among {[p.name for p in seen]}; name it with --index FILE")
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
    used = _sorted_unique(np.fromiter((i for s in splits.values() for _, items in s.users.values() for i in items),
                                      np.int64))                                                      # [I] distinct
    shift = 0 if offset is None else offset
    unknown = (used + shift)[~np.isin(used + shift, known)]  # [u] after the offset
    evidence = {"index_ids": _range(known), "index_items": int(len(known)), "item_ids_used": _range(used),
                "distinct_items_used": int(len(used)), "offset": shift,
                "unknown_after_offset": int(len(unknown)), "unknown_examples": unknown[:10].tolist()}
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
                f"or --id-offset 0 to import the ids as written")
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
    return users, {"file": split.file, "users": len(users), "users_without_items": len(split.without_items),
                   "malformed_lines": split.n_malformed, "unknown_items": n_unknown,
                   "malformed": split.malformed, "unknown": unknown}


def prepare_lcrec(source_dir, out_dir, history_len: int = 20, code_token: str = "<{level}_{code}>",
                  index: Path | None = None, id_offset: int | None = None) -> PrepareSummary:
    """LC-Rec's / AtSpeed's published layout -> the project's contracts in `out_dir` (as `prepare_beauty`): the index
    JSON (item id -> its code tokens; `index`, else found by `find_lcrec_index`) and `sequential_{train,valid,test}.txt`
    (split by global time, as in the AtSpeed paper). `id_offset` is added to every user and item id of the
    interaction files (-1 for the authors' files, which count from 1 where their index counts from 0); without it,
    ids that look shifted are refused (`check_id_offset`). Splits as SPLIT_CONVENTION. Counts, semantic-ID
    collisions, the id evidence, users without items, malformed lines and unknown items (with line numbers) go to
    prepare.json."""
    if history_len <= 0:
        raise ValueError(f"history_len must be positive, got {history_len}")
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    index_path = find_lcrec_index(source_dir, index)
    item_ids, sid, index_problems = read_lcrec_index(index_path, code_token)
    order = np.argsort(item_ids)
    item_ids, sid = item_ids[order], sid[order]
    n_items, levels = sid.shape
    codes = int(sid.max()) + 1
    raw = {s: read_lcrec_split(source_dir / name) for s, name in LCREC_SPLITS.items()}
    ids = check_id_offset(raw, item_ids, id_offset, index_path.name)
    offset = ids["offset"]
    read = {s: apply_offset(r, item_ids, offset) for s, r in raw.items()}
    splits = {s: r[0] for s, r in read.items()}

    def table(users: list[int], history_of, target_of=None) -> pa.Table:
        hist = [history_of(u)[-history_len:] if target_of else history_of(u) for u in users]
        columns = {"user_id": pa.array(users, pa.int64()), "history": pa.array(hist, _LIST_INT64)}
        if target_of:
            columns["target_items"] = pa.array([target_of(u) for u in users], _LIST_INT64)
        return pa.table(columns)

    train = splits["train"]
    everyone = sorted({u + offset for r in raw.values() for u in [*r.users, *r.without_items]})
    tables = {
        "train": table(sorted(train), lambda u: train[u]),
        "valid": table(everyone, lambda u: train.get(u, []), lambda u: splits["valid"].get(u, [])),
        "test": table(everyone, lambda u: train.get(u, []) + splits["valid"].get(u, []),
                      lambda u: splits["test"].get(u, [])),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(levels, codes)
    code_token_ids(tokenizer, sid)  # every catalog code has a token
    tokenizer.save_pretrained(out_dir / "tokenizer")
    for name, t in tables.items():
        pq.write_table(t, out_dir / f"{name}.parquet")
    collisions = semantic_id_collisions(item_ids, sid)
    interactions = {s: int(sum(map(len, splits[s].values()))) for s in splits}
    report = {
        "source": str(source_dir.resolve()), "format": "lcrec", "index": index_path.name, "history_len": history_len,
        "levels": levels, "codes": codes, "items": n_items, "ids": ids, "splits": SPLIT_CONVENTION,
        "distinct_semantic_ids": n_items - sum(len(c["item_ids"]) - 1 for c in collisions),
        "semantic_id_collisions": collisions,
        "index_problems": {"count": len(index_problems), "entries": index_problems[:REPORTED]},
        "users": {s: len(tables[s]) for s in tables},
        "users_with_targets": {s: int((pc.list_value_length(tables[s]["target_items"]).to_numpy() > 0).sum())
                               for s in ("valid", "test")},
        "interactions": interactions,
        "lines": {s: r[1] for s, r in read.items()},
        "history_length": {"train": length_summary(np.array([len(v) for v in train.values()])),
                           "test_prompt": length_summary(pc.list_value_length(tables["test"]["history"]).to_numpy())},
        "sha256": {p.name: sha256_file(p) for p in [index_path, *(source_dir / n for n in LCREC_SPLITS.values())]},
    }
    (out_dir / "prepare.json").write_text(json.dumps(report, indent=2))
    pq.write_table(pa.table({"item_id": pa.array(item_ids, pa.int64()), "semantic_id": semantic_id_array(sid),
                             "code_tokens": code_tokens_array(sid, codes)}), out_dir / "items.parquet")
    return PrepareSummary(
        out_dir=str(out_dir), items=n_items, distinct_semantic_ids=report["distinct_semantic_ids"],
        colliding_semantic_ids=len(collisions), users=report["users"]["test"], interactions=interactions,
        dropped_interactions={s: r[1]["unknown_items"] for s, r in read.items()},
        levels=levels, codes=codes, history_len=history_len,
        malformed_lines={s: r[1]["malformed_lines"] for s, r in read.items()}, index_problems=len(index_problems),
        users_without_items={s: r[1]["users_without_items"] for s, r in read.items()},
        index=str(index_path), id_offset=offset)


# ---------------------------------------------------------------- synthetic data


def _sorted_unique(values: np.ndarray) -> np.ndarray:
    """np.unique for 1-D ints by sort + mask (numpy 2.x np.unique takes 15 s on 11M int64)."""
    values = np.sort(values)
    keep = np.ones(len(values), dtype=bool)
    keep[1:] = values[1:] != values[:-1]
    return values[keep]


def _distinct_integers(rng: np.random.Generator, n: int, population: int) -> np.ndarray:
    """n distinct integers of [0, population), uniformly at random, in random order: [n] int64.

    Dense case (n >= population / 4): a permutation of the population. Sparse case: draw
    with replacement and deduplicate until n distinct values exist (memory O(n), never
    O(population)), then keep a random n of them.
    """
    if n > population:
        raise ValueError(f"cannot draw {n} distinct values from {population}")
    if 4 * n >= population:
        return rng.permutation(population)[:n].astype(np.int64)
    keys = np.zeros(0, dtype=np.int64)
    while len(keys) < n:
        extra = n - len(keys)
        draw = rng.integers(0, population, size=extra + extra // 8 + 1024, dtype=np.int64)
        keys = _sorted_unique(np.concatenate([keys, draw]))
    return rng.permutation(keys)[:n]


def synthetic_catalog(n_items: int, levels: int = 4, codes: int = 256, seed=0) -> pa.Table:
    """A catalog of n_items with unique random semantic IDs: item_id, semantic_id, code_tokens.

    Item ids are 1_000_000 + a random permutation of arange(n_items) (unique, not row order).
    `seed` is an int, a SeedSequence or a Generator.
    """
    population = codes ** levels  # Python int: no overflow
    if n_items <= 0:
        raise ValueError(f"n_items must be positive, got {n_items}")
    if n_items > population:
        raise ValueError(f"n_items={n_items} > codes**levels={codes}**{levels}={population}: "
                         "not enough distinct semantic IDs")
    if population >= 2 ** 62:
        raise ValueError(f"codes**levels={population} is too large for synthetic catalogs (max 2**62)")
    rng = np.random.default_rng(seed)
    keys = _distinct_integers(rng, n_items, population)                        # [N]
    sid = np.empty((n_items, levels), dtype=np.int32)                          # [N, L]
    for j in range(levels):  # base-`codes` digits, most significant first
        sid[:, j] = (keys // codes ** (levels - 1 - j)) % codes
    del keys
    item_ids = 1_000_000 + rng.permutation(n_items).astype(np.int64)           # [N]
    return pa.table({
        "item_id": pa.array(item_ids),
        "semantic_id": semantic_id_array(sid),
        "code_tokens": code_tokens_array(sid, codes),
    })


def _popularity(catalog_item_ids: np.ndarray, alpha: float, rng: np.random.Generator,
                offset: float = BEAUTY_ZIPF_OFFSET):
    """Zipf-Mandelbrot popularity: (item ids by rank [N], cdf [N] float64); ranks at random."""
    ranked = rng.permutation(np.asarray(catalog_item_ids, dtype=np.int64))     # [N]
    cdf = np.cumsum((np.arange(1, len(ranked) + 1, dtype=np.float64) + offset) ** -alpha)
    cdf /= cdf[-1]
    return ranked, cdf


def synthetic_histories(n_users: int, catalog_item_ids: np.ndarray, seed=0, *, first_user_id: int = 1,
                        alpha: float = BEAUTY_ZIPF_ALPHA, max_len: int = 1000,
                        popularity=None) -> pa.Table:
    """n_users synthetic users: user_id, history list<int64> (full), target_items list<int64> [1].

    History length n = 5 + floor(LogNormal(BEAUTY_LENGTH_MU, BEAUTY_LENGTH_SIGMA)), capped at
    max_len; n + 1 items are drawn iid from a Zipf-Mandelbrot(alpha, BEAUTY_ZIPF_OFFSET)
    popularity over the catalog, ranks shuffled over the item ids (an item
    may repeat within a user, rarely); the last one is the held-out target. User ids are
    first_user_id + arange(n_users). `popularity` = _popularity(...) lets chunks share it.
    """
    if n_users < 0 or len(catalog_item_ids) == 0:
        raise ValueError(f"need n_users >= 0 and a non-empty catalog, got {n_users} users, "
                         f"{len(catalog_item_ids)} items")
    rng = np.random.default_rng(seed)
    ranked, cdf = popularity if popularity is not None else _popularity(catalog_item_ids, alpha, rng)
    y = rng.lognormal(BEAUTY_LENGTH_MU, BEAUTY_LENGTH_SIGMA, size=n_users)     # [U]
    lengths = np.minimum(MIN_HISTORY + np.floor(np.minimum(y, max_len)), max_len).astype(np.int64)
    total = lengths + 1                                                        # history + target
    rank = np.searchsorted(cdf, rng.random(int(total.sum())), side="right")    # [T]
    items = ranked[np.minimum(rank, len(ranked) - 1)]                          # [T]
    starts = np.cumsum(total) - total                                          # [U]
    return pa.table({
        "user_id": pa.array(first_user_id + np.arange(n_users, dtype=np.int64)),
        "history": list_array(items, starts, lengths),
        "target_items": list_array(items, starts + lengths, np.ones(n_users, dtype=np.int64)),
    })


@dataclass
class SyntheticSummary:
    out_dir: str
    users: int
    items: int
    levels: int
    codes: int
    history_len: int
    interactions: int
    row_groups: int
    history_length: dict = field(default_factory=dict)


def write_synthetic(out_dir, n_users: int, n_items: int, levels: int = 4, codes: int = 256, seed: int = 0,
                    *, history_len: int = 20, chunk_users: int = 1_000_000) -> SyntheticSummary:
    """Synthetic catalog + users in `out_dir`: items, train (histories without their last item), valid (that last
    item as target), test (last history_len items + 1 held-out target), tokenizer/, prepare.json. Users are generated and
    written `chunk_users` at a time (one parquet row group each)."""
    if n_users <= 0 or chunk_users <= 0 or history_len <= 0:
        raise ValueError(f"n_users, chunk_users and history_len must be positive, got "
                         f"{n_users}, {chunk_users}, {history_len}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    catalog_seed, users_seed = np.random.SeedSequence(seed).spawn(2)
    catalog = synthetic_catalog(n_items, levels, codes, seed=catalog_seed)
    catalog_ids = catalog.column("item_id").to_numpy()                         # [N]
    items_tmp = out_dir / "items.parquet.tmp"  # renamed last: the folder looks done only when it is
    pq.write_table(catalog, items_tmp, row_group_size=1_000_000)
    del catalog
    build_tokenizer(levels, codes).save_pretrained(out_dir / "tokenizer")

    rng = np.random.default_rng(users_seed)
    popularity = _popularity(catalog_ids, BEAUTY_ZIPF_ALPHA, rng)
    del catalog_ids
    train_schema = pa.schema([("user_id", pa.int64()), ("history", _LIST_INT64)])
    test_schema = pa.schema([("user_id", pa.int64()), ("history", _LIST_INT64), ("target_items", _LIST_INT64)])
    lengths, row_groups = [], 0
    # leave-one-out like the real splits: train = history without its last item, valid targets that item,
    # test targets the held-out next item (with the full history as prompt)
    with pq.ParquetWriter(out_dir / "train.parquet", train_schema) as train_w, \
         pq.ParquetWriter(out_dir / "valid.parquet", test_schema) as valid_w, \
         pq.ParquetWriter(out_dir / "test.parquet", test_schema) as test_w:
        for lo in range(0, n_users, chunk_users):
            n = min(chunk_users, n_users - lo)
            users = synthetic_histories(n, popularity[0], rng, first_user_id=1 + lo, popularity=popularity)
            history = users.column("history").combine_chunks()
            values, starts, lens, _ = ragged_arrays(history)
            train_w.write_table(pa.table({"user_id": users.column("user_id"),
                                          "history": list_array(values, starts, lens - 1)}), row_group_size=n)
            valid_w.write_table(pa.table({"user_id": users.column("user_id"),
                                          "history": tail_lists(values, starts, lens - 1, history_len),
                                          "target_items": list_array(values, starts + lens - 1,
                                                                     np.ones(n, dtype=np.int64))}),
                                row_group_size=n)
            test_w.write_table(users.set_column(1, "history", tail_lists(values, starts, lens, history_len)),
                               row_group_size=n)
            lengths.append(lens)
            row_groups += 1
            del users, history, values
    lengths = np.concatenate(lengths)
    summary = SyntheticSummary(
        out_dir=str(out_dir), users=n_users, items=n_items, levels=levels, codes=codes,
        history_len=history_len, interactions=int(lengths.sum()) + n_users, row_groups=row_groups,
        history_length=length_summary(lengths),
    )
    (out_dir / "prepare.json").write_text(json.dumps(
        {"synthetic": True, "splits": SYNTHETIC_SPLITS, "seed": seed, "chunk_users": chunk_users, "zipf_alpha": BEAUTY_ZIPF_ALPHA,
         "zipf_offset": BEAUTY_ZIPF_OFFSET,
         "length_lognormal": {"mu": BEAUTY_LENGTH_MU, "sigma": BEAUTY_LENGTH_SIGMA, "min": MIN_HISTORY},
         "semantic_id_collisions": [], **asdict(summary)}, indent=2))
    items_tmp.replace(out_dir / "items.parquet")
    return summary
