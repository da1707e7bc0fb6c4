"""Data preparation: the code-token tokenizer, Amazon Beauty, the LC-Rec layout and MiniOneRec's in the project's
contracts, and synthetic catalogs / histories for scale tests. One module per source (beauty, lcrec, minionerec,
synthetic: MiniOneRec's rows are their own units, string keys, see minionerec.py); the splits (splits);
the tokenizer and the written contract (contract).

Outputs (docs/architecture.md, "Data contracts"), in `out_dir`:
    items.parquet      item_id int64, semantic_id list<int32> [L], code_tokens list<string> [L]
    train.parquet      user_id int64, history list<int64> (all train items, chronological)
    valid.parquet      user_id, history (last history_len train items), target_items (valid items)
    test.parquet       user_id, history (last history_len train + valid items), target_items (test items)
(SPLIT_CONVENTION: the AtSpeed paper's protocol; synthetic data is leave-one-out)
    tokenizer/         build_tokenizer(L, codes).save_pretrained(...)
    prepare.json       counts, semantic-ID collisions, history lengths, source sha256s
Every source is written by contract.write_contract: items.parquet last, through a temporary name and a rename, after
removing the one an earlier import left; a folder is prepared when its items.parquet exists (`prepared`), so an
import killed part-way never leaves a folder that looks done.
"""

from pipeline.prepare.beauty import BEAUTY_SOURCE, prepare_beauty
from pipeline.prepare.contract import (
    PrepareSummary,
    build_chat_tokenizer,
    build_text_tokenizer,
    build_tokenizer,
    prepared,
    write_contract,
)
from pipeline.prepare.lcrec import find_lcrec_index, prepare_lcrec
from pipeline.prepare.minionerec import prepare_minionerec
from pipeline.prepare.splits import SPLIT_CONVENTION, Interactions, split_tables
from pipeline.prepare.synthetic import (
    SYNTHETIC_SPLITS,
    SyntheticSummary,
    synthetic_catalog,
    synthetic_histories,
    write_synthetic,
)

__all__ = [
    "prepare_source",
    "BEAUTY_SOURCE",
    "SPLIT_CONVENTION",
    "SYNTHETIC_SPLITS",
    "Interactions",
    "PrepareSummary",
    "SyntheticSummary",
    "build_chat_tokenizer",
    "build_text_tokenizer",
    "build_tokenizer",
    "find_lcrec_index",
    "prepare_beauty",
    "prepare_lcrec",
    "prepare_minionerec",
    "prepared",
    "split_tables",
    "synthetic_catalog",
    "synthetic_histories",
    "write_contract",
    "write_synthetic",
]


def prepare_source(
    fmt: str,
    source,
    out,
    history_len: int,
    *,
    category=None,
    code_token=None,
    index=None,
    id_offset=None,
    allow_mismatch: bool = False,
    pid2sid=None,
):
    """An import of `source` in format `fmt` (beauty, lcrec, minionerec, openonerec) into `out` -> its summary; each
    format takes the options of its layout (`genrec-batch prepare`'s flags)."""
    from pipeline.prepare.openonerec import prepare_openonerec

    if fmt == "lcrec":
        return prepare_lcrec(source, out, history_len=history_len, code_token=code_token, index=index,
                             id_offset=id_offset, allow_mismatch=allow_mismatch)  # fmt: skip
    if fmt == "openonerec":
        return prepare_openonerec(source, out, pid2sid, history_len)
    if fmt == "minionerec":
        return prepare_minionerec(source, out, category, code_token=code_token, allow_mismatch=allow_mismatch)
    return prepare_beauty(source, out, history_len=history_len, allow_mismatch=allow_mismatch)
