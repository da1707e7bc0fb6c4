"""Data preparation: the code-token tokenizer, Amazon Beauty and the LC-Rec layout in the project's contracts, and
synthetic catalogs / histories for scale tests. One module per source (beauty, lcrec, synthetic); the splits (splits);
the tokenizer and the written contract (contract).

Outputs (ARCHITECTURE.md section 3), in `out_dir`:
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

from pipeline.prepare.beauty import BEAUTY_FILES, prepare_beauty, read_beauty
from pipeline.prepare.contract import (
    INSTRUCTION_TEXT,
    ITEMS,
    PrepareSummary,
    Source,
    build_text_tokenizer,
    build_tokenizer,
    catalog_report,
    code_tokens_array,
    items_table,
    prepared,
    semantic_id_array,
    semantic_id_collisions,
    write_contract,
    write_source,
)
from pipeline.prepare.lcrec import (
    LCREC_SPLITS,
    REPORTED,
    LcrecSplit,
    apply_offset,
    check_id_offset,
    code_token_pattern,
    find_lcrec_index,
    prepare_lcrec,
    read_lcrec,
    read_lcrec_index,
    read_lcrec_split,
)
from pipeline.prepare.splits import (
    SPLIT_CONVENTION,
    SPLITS,
    Interactions,
    length_summary,
    list_array,
    sorted_unique,
    split_report,
    split_tables,
    tail_lists,
)
from pipeline.prepare.synthetic import (
    BEAUTY_LENGTH_MU,
    BEAUTY_LENGTH_SIGMA,
    BEAUTY_ZIPF_ALPHA,
    BEAUTY_ZIPF_OFFSET,
    MIN_HISTORY,
    SYNTHETIC_SPLITS,
    SyntheticSummary,
    synthetic_catalog,
    synthetic_histories,
    write_synthetic,
)

__all__ = [
    "build_tokenizer",
    "build_text_tokenizer",
    "prepare_beauty",
    "prepare_lcrec",
    "find_lcrec_index",
    "PrepareSummary",
    "SPLIT_CONVENTION",
    "SYNTHETIC_SPLITS",
    "synthetic_catalog",
    "synthetic_histories",
    "write_synthetic",
    "SyntheticSummary",
    "prepared",
    "write_contract",
    "split_tables",
    "Interactions",
]
