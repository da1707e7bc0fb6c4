"""The written contract of a data folder (docs/architecture.md, "Data contracts"): the code-token tokenizer, the
catalog's columns, prepare.json's catalog counts, and `write_contract`, the one writer every source goes through:
the tables, the tokenizer and prepare.json first, `items.parquet` last, through a temporary name and a rename. A
folder is prepared when its `items.parquet` exists (`prepared`; the Makefile's `$(DATA)/items.parquet` target and
every reader check that file), so an import killed part-way leaves a folder that a rerun imports again."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from decoding.codes import SPECIAL_TOKENS, code_token, code_token_ids
from pipeline.prepare.splits import SPLIT_CONVENTION, SPLITS, Interactions, split_report, split_tables
from pipeline.storage import sha256_file

ITEMS = "items.parquet"
ITEMS_TMP = "items.parquet.tmp"  # renamed to ITEMS when everything else is written


def prepared(folder) -> bool:
    """Is `folder` a complete data folder? Its items.parquet is renamed into place last, by `write_contract`."""
    return (Path(folder) / ITEMS).is_file()


def write_contract(
    out_dir: Path, items: pa.Table, tokenizer, tables: Iterable[dict[str, pa.Table]], report: Callable[[], dict]
) -> dict:
    """Writes a data folder: `tables` ({name: table} chunks, one parquet row group per chunk; `<name>.parquet`),
    `tokenizer/`, `prepare.json` (= report(), asked once the tables are written), then `items` through
    items.parquet.tmp and a rename. An existing items.parquet is removed first: until this import's is renamed into
    place, the folder is not prepared, even where an earlier import had completed it. -> the report."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ITEMS).unlink(missing_ok=True)
    tokenizer.save_pretrained(out_dir / "tokenizer")
    _write_chunks(out_dir, tables)
    doc = report()
    (out_dir / "prepare.json").write_text(json.dumps(doc, indent=2))
    pq.write_table(items, out_dir / ITEMS_TMP, row_group_size=1_000_000)
    (out_dir / ITEMS_TMP).replace(out_dir / ITEMS)
    return doc


def _write_chunks(out_dir: Path, chunks: Iterable[dict[str, pa.Table]]) -> None:
    """{name: table} chunks -> `<name>.parquet`, a row group per chunk (every chunk names the same tables)."""
    writers = {}
    with ExitStack() as stack:
        for chunk in chunks:
            for name, table in chunk.items():
                if name not in writers:
                    writers[name] = stack.enter_context(pq.ParquetWriter(out_dir / f"{name}.parquet", table.schema))
                writers[name].write_table(table, row_group_size=max(table.num_rows, 1))
            chunk = table = None  # nothing of a chunk is kept while the next one is made


# ---------------------------------------------------------------- the tokenizer


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
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Split(Regex(r"<[^<>]+>"), behavior="isolated"),
        ]
    )
    tk.decoder = decoders.Fuse()  # decode -> "<bos><a_1><b_2>", no spaces
    tk.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
    )


INSTRUCTION_TEXT = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:",
    "### Response:",
    "The user has interacted with items in chronological order.",
    "Can you predict the next possible item that the user may expect?",
    "Here is the purchase history of a user. Recommend the next item the user is likely to buy.",
]


# Qwen2's pre-tokenizer split (its tokenizer.json): ":\n" stays one piece, as "### Response:\n" -> 3 tokens
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_text_tokenizer(levels: int, codes: int, vocab_size: int = 600, code_tokens: bool = True, style="llama"):
    """A tokenizer of the kind LLM recommenders have, for tests and benchmarks of prompt templates without a hub: a
    byte-level BPE trained here in seconds (the `tokenizers` library) on instruction-style text with numbered lists;
    with code_tokens, the code tokens `<a_0>` .. added as tokens of their own (tokenizer.add_tokens, the LC-Rec
    recipe). style "llama": it adds <s> itself like Llama's (ids <pad> 0, <s> 1, </s> 2); "qwen": Qwen2's split, no
    BOS token, EOS `<|endoftext|>` (id 0) that also pads, as MiniOneRec's Qwen models have."""
    from tokenizers import processors

    if style not in ("llama", "qwen"):
        raise ValueError(f"style must be llama or qwen, got {style!r}")
    raw = _trained_bpe(style, vocab_size)
    if style == "qwen":
        tok = PreTrainedTokenizerFast(
            tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left"
        )
    else:
        raw.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", raw.token_to_id("<s>"))]
        )
        tok = PreTrainedTokenizerFast(
            tokenizer_object=raw, bos_token="<s>", eos_token="</s>", pad_token="<pad>", padding_side="left"
        )
    if code_tokens:
        tok.add_tokens([code_token(j, c) for j in range(levels) for c in range(codes)])
    return tok


def _trained_bpe(style: str, vocab_size: int) -> Tokenizer:
    """`build_text_tokenizer`'s byte-level BPE, trained on INSTRUCTION_TEXT and numbered lists (and, for "qwen",
    MiniOneRec's prompt, split as Qwen2 splits)."""
    from tokenizers import trainers

    from decoding.templates import MINIONEREC_INSTRUCTION, MINIONEREC_PREFIX

    corpus = INSTRUCTION_TEXT * 20 + [", ".join(f"{i}. item" for i in range(1, n + 1)) for n in range(1, 60)]
    specials = ["<pad>", "<s>", "</s>"]
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if style == "qwen":
        corpus += [MINIONEREC_INSTRUCTION + MINIONEREC_PREFIX + "\n\n### Response:\n"] * 20
        specials = ["<|endoftext|>"]
        raw.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    return raw


CHAT_TEXT = [  # CJK, emoji, whitespace and newlines beside the instruction text: what chat prompts hold
    "你是一个智能推荐助手，能够根据用户的浏览历史预测用户可能感兴趣的下一个内容。",
    "用户画像：喜欢美食 🍜 和旅行 ✈️，常看 猫咪 🐱 视频。\n\n用户查询：周末去哪儿玩？",
    "以下是用户的浏览历史：\n请推荐用户可能感兴趣的下一个内容。 Recommend the next video!",
    "Title: Summer  sale 2024 — 50% off\t(limited)\n\n",
]
# A Qwen3-style chat template (ChatML turns; with enable_thinking false the last user turn ends with /no_think and an
# empty think block opens the answer), written here for tests and benchmarks
CHATML = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{%- if m.role == 'user' and loop.last and enable_thinking is defined and not enable_thinking %}"
    "{{- '/no_think' }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif -%}"
)


def build_chat_tokenizer(levels: int, codes: int, vocab_size: int = 900) -> PreTrainedTokenizerFast:
    """A tokenizer of the kind OneRec-style models have, for tests and benchmarks of chat templates: Qwen2's split
    over a byte-level BPE trained here on instruction, CJK and emoji text; the special tokens `<|endoftext|>` (EOS,
    pad), `<|im_start|>`, `<|im_end|>`; `<think>`, `</think>` added as tokens that are not special (Qwen3's); then,
    with tokenizer.add_tokens as OpenOneRec adds them, the code tokens `<s_a_0>` .. and `<|sid_begin|>`,
    `<|sid_end|>`; `CHATML` as its chat template."""
    from tokenizers import trainers

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    corpus = (INSTRUCTION_TEXT + CHAT_TEXT) * 20
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    raw.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left"
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens(["<think>", "</think>"])
    tok.add_tokens([f"<s_{chr(97 + j)}_{c}>" for j in range(levels) for c in range(codes)] + SID_MARKS)
    tok.chat_template = CHATML
    return tok


SID_MARKS = ["<|sid_begin|>", "<|sid_end|>"]


# ---------------------------------------------------------------- the catalog


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
        sid = semantic_ids[lo : lo + chunk]  # [n_c, L]
        flat = (sid.astype(np.int64) + level_base[None, :]).ravel()  # [n_c * L] index into names
        offsets = np.arange(0, len(sid) * levels + 1, levels, dtype=np.int32)
        chunks.append(pa.ListArray.from_arrays(pa.array(offsets), names.take(pa.array(flat))))
    return pa.chunked_array(chunks, type=pa.list_(pa.string()))


def items_table(item_ids: np.ndarray, semantic_ids: np.ndarray, codes: int) -> pa.Table:
    """item ids [N], semantic IDs [N, L] -> items.parquet's table: item_id, semantic_id, code_tokens."""
    return pa.table(
        {
            "item_id": pa.array(item_ids, pa.int64()),
            "semantic_id": semantic_id_array(semantic_ids),
            "code_tokens": code_tokens_array(semantic_ids, codes),
        }
    )


def semantic_id_collisions(item_ids: np.ndarray, semantic_ids: np.ndarray) -> list[dict]:
    """Semantic IDs shared by more than one item: [{semantic_id, code_tokens, item_ids}]."""
    uniq, inverse, counts = np.unique(semantic_ids, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.ravel()
    out = []
    for g in np.flatnonzero(counts > 1):
        sid = uniq[g].tolist()
        out.append(
            {
                "semantic_id": sid,
                "code_tokens": "".join(code_token(j, c) for j, c in enumerate(sid)),
                "item_ids": sorted(item_ids[inverse == g].tolist()),
            }
        )
    return out


def catalog_report(item_ids: np.ndarray, semantic_ids: np.ndarray, codes: int) -> dict:
    """prepare.json's counts of the catalog: levels, codes, items, distinct semantic IDs and the ones items share."""
    collisions = semantic_id_collisions(item_ids, semantic_ids)
    n_items, levels = semantic_ids.shape
    return {
        "levels": levels,
        "codes": codes,
        "items": n_items,
        "distinct_semantic_ids": n_items - sum(len(c["item_ids"]) - 1 for c in collisions),
        "semantic_id_collisions": collisions,
    }


# ---------------------------------------------------------------- sources read from files

SHOWN = 5  # disagreements an error message names (prepare.json lists more; all are counted)


class Mismatch(ValueError):
    """A source's item ids or semantic IDs disagree with its index (the import exits 2 unless --allow-mismatch)."""


def check_mismatches(what: str, found: list[str], count: int, allow: bool) -> None:
    """`count` disagreements of the source with its index, the first of them described in `found` (each naming its
    file, row and values) -> Mismatch naming the first SHOWN, unless `allow` (--allow-mismatch: imported anyway, and
    prepare.json and the summary say so)."""
    if not count or allow:
        return
    more = f"; and {count - SHOWN} more" if count > SHOWN else ""
    raise Mismatch(
        f"{count} {what} disagree with the index: {'; '.join(found[:SHOWN])}{more}. A source from another index "
        "(another RQ-VAE run, ids shifted by one) would import wrong: fix the source, or rerun with "
        "--allow-mismatch to import it anyway (recorded in prepare.json)"
    )


@dataclass
class PrepareSummary:
    out_dir: str
    items: int
    distinct_semantic_ids: int
    colliding_semantic_ids: int
    users: int
    interactions: dict[str, int]  # written, after dropping unknown items
    dropped_interactions: dict[str, int]  # item ids not in the catalog, left out of the written lists, per split
    levels: int
    codes: int
    history_len: int | None  # None: histories as the source wrote them (MiniOneRec)
    malformed_lines: dict[str, int] = field(default_factory=dict)  # LC-Rec files: lines left out, per split
    index_problems: int = 0  # LC-Rec index entries left out
    users_without_items: dict[str, int] = field(default_factory=dict)  # LC-Rec files: users listed alone, per split
    index: str | None = None  # LC-Rec: the index file read
    id_offset: int = 0  # LC-Rec: added to every user and item id of the interaction files
    category: str | None = None  # MiniOneRec: the category read
    rows: dict[str, int | None] = field(default_factory=dict)  # MiniOneRec: CSV rows per split (None: no file)
    mismatches: dict[str, int] = field(default_factory=dict)  # ids / semantic IDs disagreeing with the index, per file
    allow_mismatch: bool = False  # imported with --allow-mismatch


@dataclass
class Source:
    """A source as read and checked, before anything is written."""

    folder: Path
    format: str  # "beauty" | "lcrec" (MiniOneRec's rows are their own units: minionerec.py writes them)
    item_ids: np.ndarray  # [N] int64
    semantic_ids: np.ndarray  # [N, L]
    codes: int
    splits: dict[str, Interactions]  # train, valid, test
    files: list[Path]  # hashed into prepare.json
    report: dict = field(default_factory=dict)  # the source's own prepare.json entries
    summary: dict = field(default_factory=dict)  # the source's own PrepareSummary fields


def write_source(source: Source, out_dir, history_len: int) -> PrepareSummary:
    """A source read from files -> its data folder (SPLIT_CONVENTION's tables, through `write_contract`) and the
    summary. prepare.json: the catalog's counts and collisions, the splits' counts, the source's own entries and the
    sha256 of every file read."""
    tokenizer = build_tokenizer(source.semantic_ids.shape[1], source.codes)
    code_token_ids(tokenizer, source.semantic_ids)  # every catalog code has a token
    tables = split_tables(*(source.splits[s] for s in SPLITS), history_len)
    report = {
        "source": str(Path(source.folder).resolve()),
        "format": source.format,
        "splits": SPLIT_CONVENTION,
        "history_len": history_len,
        **catalog_report(source.item_ids, source.semantic_ids, source.codes),
        **source.report,
        **split_report(source.splits, tables),
        "sha256": {p.name: sha256_file(p) for p in source.files},
    }
    items = items_table(source.item_ids, source.semantic_ids, source.codes)
    write_contract(out_dir, items, tokenizer, [tables], lambda: report)
    return summarize(out_dir, report, source.codes, history_len, **source.summary)


def summarize(out_dir, report: dict, codes: int, history_len: int | None, **source) -> PrepareSummary:
    """prepare.json's counts (`report`) -> the summary the import prints; `source`: the source's own fields."""
    return PrepareSummary(
        out_dir=str(Path(out_dir)),
        items=report["items"],
        distinct_semantic_ids=report["distinct_semantic_ids"],
        colliding_semantic_ids=len(report["semantic_id_collisions"]),
        users=report["users"]["test"],
        interactions=report["interactions"],
        levels=report["levels"],
        codes=codes,
        history_len=history_len,
        **source,
    )
