"""pipeline/prepare.py and jobs/prepare_data.py: tokenizer, Amazon Beauty, synthetic data."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from decoding.codes import code_token, code_token_ids
from pipeline.prepare import (
    build_tokenizer,
    prepare_beauty,
    synthetic_catalog,
    synthetic_histories,
    write_synthetic,
)

REPO = Path(__file__).resolve().parents[1]
BEAUTY = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "amazon-beauty"
needs_beauty = pytest.mark.skipif(not (BEAUTY / "items.parquet").is_file(), reason=f"{BEAUTY} not present")


def _lists(table: pa.Table, column: str) -> list:
    return table.column(column).to_pylist()


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_as_specified():
    tok = build_tokenizer(4, 256)
    assert len(tok) == 4 + 4 * 256
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.padding_side == "left"
    assert tok("<bos><a_1><b_2>")["input_ids"] == [1, 4 + 1, 4 + 256 + 2]  # no special token appended
    assert tok("<a_0><d_255><eos>")["input_ids"] == [4, 4 + 3 * 256 + 255, 2]
    assert tok(" <a_1>  <b_2> ")["input_ids"] == [5, 262]  # whitespace between tokens is dropped
    assert tok("<a_1>x<z_9>")["input_ids"] == [5, 3, 3]     # anything else is <unk>
    assert tok.decode([1, 5, 262]) == "<bos><a_1><b_2>"
    small = build_tokenizer(2, 8)
    assert small.convert_tokens_to_ids(["<a_7>", "<b_0>", "<b_7>"]) == [11, 12, 19]


def test_tokenizer_round_trip(tmp_path):
    tok = build_tokenizer(3, 16)
    tok.save_pretrained(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True, trust_remote_code=False)
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.padding_side == "left" and loaded.pad_token_id == 0 and loaded.bos_token_id == 1
    texts = ["<bos><a_1><b_2><c_15>", "<bos><a_3>"]
    assert loaded(texts)["input_ids"] == tok(texts)["input_ids"] == [[1, 5, 4 + 16 + 2, 4 + 32 + 15], [1, 7]]
    padded = loaded(texts, padding=True)
    assert padded["input_ids"][1] == [0, 0, 1, 7] and padded["attention_mask"][1] == [0, 0, 1, 1]


def test_code_token_ids_matches_per_token_conversion():
    tok = build_tokenizer(4, 256)
    sid = np.random.default_rng(0).integers(0, 256, size=(50, 4))
    ids = code_token_ids(tok, sid)
    expected = [[tok.convert_tokens_to_ids(code_token(j, int(c))) for j, c in enumerate(row)] for row in sid]
    assert ids.dtype == np.int64 and ids.shape == (50, 4)
    assert ids.tolist() == expected
    assert (ids == 4 + np.arange(4) * 256 + sid).all()


def test_code_token_ids_unknown_codes_raise():
    tok = build_tokenizer(2, 8)
    with pytest.raises(ValueError, match=r"2 code tokens .* missing from the tokenizer: <a_8>, <b_9> .*rows \[2, 3\]"):
        code_token_ids(tok, np.array([[0, 1], [7, 7], [8, 0], [1, 9]]))
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        code_token_ids(tok, np.array([[0, 1], [-1, 0]]))
    with pytest.raises(ValueError, match=r"rows \[0\]"):  # 3 levels, tokenizer has 2
        code_token_ids(tok, np.array([[0, 1, 2]]))


# ---------------------------------------------------------------- Amazon Beauty


@pytest.fixture(scope="module")
def beauty(tmp_path_factory):
    out = tmp_path_factory.mktemp("beauty")
    summary = prepare_beauty(BEAUTY, out, history_len=20)
    return summary, out


def _source_lists(split: str, catalog: set) -> dict:
    """user_id -> items of the source split, restricted to catalog items."""
    t = pq.read_table(BEAUTY / f"{split}.parquet")
    return {u: [i for i in items if i in catalog] for u, items in zip(_lists(t, "user_id"), _lists(t, "items"))}


@needs_beauty
def test_beauty_counts_and_collisions(beauty):
    summary, out = beauty
    assert (summary.items, summary.users, summary.levels, summary.codes) == (12_035, 19_383, 4, 256)
    items = pq.read_table(out / "items.parquet")
    assert items.num_rows == 12_035
    assert str(items.schema.field("semantic_id").type) == "list<element: int32>"
    for split in ("train", "valid", "test"):
        assert pq.read_metadata(out / f"{split}.parquet").num_rows == 19_383
    report = json.loads((out / "prepare.json").read_text())
    # The dataset README says "12 semantic IDs shared by two items"; the data has 9 shared
    # IDs (groups of 2, 2, 2, 2, 4, 2, 3, 2, 2) covering 21 items: 12 surplus items.
    collisions = report["semantic_id_collisions"]
    assert report["distinct_semantic_ids"] == summary.distinct_semantic_ids == 12_023
    assert len(collisions) == summary.colliding_semantic_ids == 9
    assert sum(len(c["item_ids"]) - 1 for c in collisions) == 12
    assert {"code_tokens": "<a_179><b_229><c_186><d_0>", "item_ids": [5699, 7329, 7680],
            "semantic_id": [179, 229, 186, 0]} in collisions
    # item 12035 appears in 15 train histories but is not in the catalog: dropped, reported
    assert report["dropped_unknown_items"]["train"] == {"interactions": 15, "users": 15, "item_ids": [12035]}
    assert report["interactions"] == {"train": 122_241 - 15, "valid": 9_316, "test": 7_313}
    assert set(report["sha256"]) == {"items.parquet", "train.parquet", "valid.parquet", "test.parquet"}


@needs_beauty
def test_beauty_histories_and_targets(beauty):
    _, out = beauty
    catalog = set(pq.read_table(BEAUTY / "items.parquet").column("item_id").to_pylist())
    train = _source_lists("train", catalog)
    test_src = pq.read_table(BEAUTY / "test.parquet")
    test = pq.read_table(out / "test.parquet")
    assert _lists(test, "user_id") == _lists(test_src, "user_id")
    assert _lists(test, "target_items") == _lists(test_src, "items")
    assert [h for h in _lists(test, "history")] == [train[u][-20:] for u in _lists(test, "user_id")]
    assert max(len(h) for h in _lists(test, "history")) == 20
    valid = pq.read_table(out / "valid.parquet")
    assert _lists(valid, "target_items") == _lists(pq.read_table(BEAUTY / "valid.parquet"), "items")
    assert _lists(valid, "history") == _lists(test, "history")
    out_train = pq.read_table(out / "train.parquet")
    assert _lists(out_train, "history") == [train[u] for u in _lists(out_train, "user_id")]


@needs_beauty
def test_beauty_items_and_tokenizer(beauty):
    _, out = beauty
    src = pq.read_table(BEAUTY / "items.parquet")
    items = pq.read_table(out / "items.parquet")
    assert items.column("item_id").to_pylist() == src.column("item_id").to_pylist()
    assert _lists(items, "semantic_id") == _lists(src, "semantic_id")
    assert _lists(items, "code_tokens") == _lists(src, "code_tokens")
    tok = AutoTokenizer.from_pretrained(out / "tokenizer", local_files_only=True, trust_remote_code=False)
    ids = code_token_ids(tok, np.array(_lists(items, "semantic_id")))
    assert ids[0].tolist() == tok("".join(items.column("code_tokens")[0].as_py()))["input_ids"]


def _tiny_source(folder: Path) -> Path:
    folder.mkdir()
    pq.write_table(pa.table({"item_id": [5, 6, 7], "semantic_id": [[0, 1], [1, 1], [0, 1]]}), folder / "items.parquet")
    for split, items in {"train": [[5, 6, 7], [6]], "valid": [[], [5]], "test": [[6], []]}.items():
        pq.write_table(pa.table({"user_id": [1, 2], "items": items}), folder / f"{split}.parquet")
    return folder


def test_prepare_tiny_source(tmp_path):
    src = _tiny_source(tmp_path / "src")
    summary = prepare_beauty(src, tmp_path / "out", history_len=2)
    assert (summary.levels, summary.codes, summary.colliding_semantic_ids) == (2, 2, 1)
    test = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert test == [{"user_id": 1, "history": [6, 7], "target_items": [6]},
                    {"user_id": 2, "history": [6], "target_items": []}]
    assert pq.read_table(tmp_path / "out" / "items.parquet").column("code_tokens").to_pylist()[1] == ["<a_1>", "<b_1>"]


def test_prepare_bad_inputs_name_file_and_column(tmp_path):
    src = _tiny_source(tmp_path / "src")
    pq.write_table(pa.table({"user_id": [1, 2], "item_list": [[6], []]}), src / "test.parquet")
    with pytest.raises(ValueError, match=r"test\.parquet: missing column\(s\) \['items'\]"):
        prepare_beauty(src, tmp_path / "out")
    (src / "valid.parquet").unlink()
    with pytest.raises(ValueError, match=r"valid\.parquet: file not found"):
        prepare_beauty(src, tmp_path / "out")
    pq.write_table(pa.table({"item_id": [5, 6, 7], "semantic_id": [[0, 1], [1], [0, 1]]}), src / "items.parquet")
    with pytest.raises(ValueError, match=r"items\.parquet: column 'semantic_id' is ragged: rows \[1\]"):
        prepare_beauty(src, tmp_path / "out")
    pq.write_table(pa.table({"item_id": [5, 5, 7], "semantic_id": [[0, 1], [1, 0], [0, 1]]}), src / "items.parquet")
    with pytest.raises(ValueError, match=r"items\.parquet: column 'item_id' has duplicated values \[5\]"):
        prepare_beauty(src, tmp_path / "out")


@needs_beauty
def test_beauty_missing_column(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("train.parquet", "valid.parquet", "test.parquet"):
        shutil.copyfile(BEAUTY / name, src / name)
    items = pq.read_table(BEAUTY / "items.parquet").drop_columns(["semantic_id"])
    pq.write_table(items, src / "items.parquet")
    with pytest.raises(ValueError, match=r"items\.parquet: missing column\(s\) \['semantic_id'\]"):
        prepare_beauty(src, tmp_path / "out")


# ---------------------------------------------------------------- synthetic


def test_synthetic_catalog_unique():
    cat = synthetic_catalog(20_000, levels=4, codes=256, seed=1)
    sid = np.array(cat.column("semantic_id").to_pylist())
    assert sid.shape == (20_000, 4) and sid.min() >= 0 and sid.max() < 256
    assert len(np.unique(sid, axis=0)) == 20_000
    ids = cat.column("item_id").to_numpy()
    assert len(np.unique(ids)) == 20_000 and not (np.diff(ids) > 0).all()  # unique, shuffled
    assert cat.column("code_tokens")[3].as_py() == [code_token(j, int(c)) for j, c in enumerate(sid[3])]
    dense = np.array(synthetic_catalog(16, levels=2, codes=4).column("semantic_id").to_pylist())
    assert sorted(map(tuple, dense)) == [(a, b) for a in range(4) for b in range(4)]
    with pytest.raises(ValueError, match="codes\\*\\*levels"):
        synthetic_catalog(17, levels=2, codes=4)


def test_synthetic_histories_lengths_and_items():
    item_ids = np.arange(100, 2100)
    users = synthetic_histories(3000, item_ids, seed=2, first_user_id=11)
    lengths = np.array([len(h) for h in _lists(users, "history")])
    assert lengths.min() >= 5 and 6 <= lengths.mean() <= 11 and np.median(lengths) <= 7
    assert users.column("user_id").to_pylist() == list(range(11, 3011))
    assert all(len(t) == 1 for t in _lists(users, "target_items"))
    flat = np.concatenate([np.concatenate(_lists(users, "history")), np.concatenate(_lists(users, "target_items"))])
    assert np.isin(flat, item_ids).all()


def test_write_synthetic_chunks(tmp_path):
    summary = write_synthetic(tmp_path, n_users=5000, n_items=20_000, seed=3, history_len=20, chunk_users=1500)
    assert summary.row_groups == 4
    items = pq.read_table(tmp_path / "items.parquet")
    assert items.num_rows == 20_000
    assert len(np.unique(np.array(_lists(items, "semantic_id")), axis=0)) == 20_000
    for name in ("train", "valid", "test"):
        meta = pq.read_metadata(tmp_path / f"{name}.parquet")
        assert (meta.num_rows, meta.num_row_groups) == (5000, 4)
    train, test = pq.read_table(tmp_path / "train.parquet"), pq.read_table(tmp_path / "test.parquet")
    valid = pq.read_table(tmp_path / "valid.parquet")
    assert train.column("user_id").to_pylist() == test.column("user_id").to_pylist() == list(range(1, 5001))
    histories = _lists(train, "history")  # leave-one-out: the last history item is the valid target
    assert min(map(len, histories)) >= 4
    full = [h + t for h, t in zip(histories, _lists(valid, "target_items"))]
    assert all(len(t) == 1 for t in _lists(valid, "target_items"))
    assert _lists(valid, "history") == [h[-20:] for h in histories]
    assert _lists(test, "history") == [h[-20:] for h in full]
    catalog = items.column("item_id").to_numpy()
    assert np.isin(np.concatenate(histories), catalog).all()
    assert np.isin(np.concatenate(_lists(test, "target_items")), catalog).all()
    tok = AutoTokenizer.from_pretrained(tmp_path / "tokenizer", local_files_only=True, trust_remote_code=False)
    assert code_token_ids(tok, np.array(_lists(items, "semantic_id"))[:5]).shape == (5, 4)
    assert json.loads((tmp_path / "prepare.json").read_text())["users"] == 5000


def test_cli_synthetic(tmp_path):
    out = tmp_path / "synth"
    run = subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--synthetic", "--users", "300",
                          "--items", "2000", "--levels", "3", "--codes", "32", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert (summary["users"], summary["items"], summary["levels"], summary["codes"]) == (300, 2000, 3, 32)
    assert pq.read_metadata(out / "test.parquet").num_rows == 300
    bad = subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--synthetic", "--users", "0", "--items", "5",
                          "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--users: expected an integer >= 1, got 0" in bad.stderr


# ---------------------------------------------------------------- the LC-Rec layout

def test_lcrec_format_with_every_problem_reported(tmp_path):
    """An LC-Rec index JSON and sequential_*.txt files -> the project's parquet contracts; collisions, bad index
    entries, malformed lines and unknown items are counted and listed with line numbers, never silently dropped."""
    src = tmp_path / "lcrec"
    src.mkdir()
    index = {str(i): [f"<a_{i % 3}>", f"<b_{i}>", f"<c_{2 * i}>"] for i in range(7)}
    index["7"] = index["0"]  # shares item 0's semantic ID
    index["8"] = ["<a_1>", "<b_2>"]  # too short
    index["9"] = ["<b_1>", "<a_2>", "<c_3>"]  # out of level order
    (src / "Toy.index.json").write_text(json.dumps(index))
    (src / "sequential_train.txt").write_text("1 0 1 2\n2 3 4\n\n3 5 abc\n4 6 99 1\n2 5\n5\n")
    (src / "sequential_valid.txt").write_text("1 3\n2 5\n")
    (src / "sequential_test.txt").write_text("1 4\n4 2\n")
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--format", "lcrec", "--source", str(src),
                          "--out", str(out), "--history-len", "3"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert (summary["items"], summary["colliding_semantic_ids"], summary["index_problems"]) == (8, 1, 2)
    assert summary["malformed_lines"] == {"train": 3, "valid": 0, "test": 0}
    assert summary["dropped_interactions"] == {"train": 1, "valid": 0, "test": 0}
    items = pq.read_table(out / "items.parquet")
    assert items["item_id"].to_pylist() == list(range(8))
    assert _lists(items, "semantic_id")[5] == [2, 5, 10] and _lists(items, "code_tokens")[5] == ["<a_2>", "<b_5>",
                                                                                                 "<c_10>"]
    report = json.loads((out / "prepare.json").read_text())
    assert [c["item_ids"] for c in report["semantic_id_collisions"]] == [[0, 7]]
    assert sorted(p["item"] for p in report["index_problems"]["entries"]) == ["8", "9"]
    lines = report["lines"]["train"]
    assert [(m["line"], m["reason"]) for m in lines["malformed"]] == [
        (4, "not all fields are integers"), (6, "user 2 listed again"), (7, "a user without items")]
    assert lines["unknown"] == [{"line": 5, "user": 4, "items": [99]}]
    train, valid, test = (pq.read_table(out / f"{s}.parquet").to_pylist() for s in ("train", "valid", "test"))
    assert train == [{"user_id": 1, "history": [0, 1, 2]}, {"user_id": 2, "history": [3, 4]},
                     {"user_id": 4, "history": [6, 1]}]
    assert [(r["user_id"], r["history"], r["target_items"]) for r in valid] == [
        (1, [0, 1, 2], [3]), (2, [3, 4], [5]), (4, [6, 1], [])]
    # a test user's history is its train + valid items (the last history_len of them)
    assert [(r["user_id"], r["history"], r["target_items"]) for r in test] == [
        (1, [1, 2, 3], [4]), (2, [3, 4, 5], []), (4, [6, 1], [2])]
    bad = subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--format", "lcrec", "--out", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--format lcrec needs --source DIR" in bad.stderr
    (src / "sequential_valid.txt").unlink()
    missing = subprocess.run([sys.executable, "-m", "jobs.prepare_data", "--format", "lcrec", "--source", str(src),
                              "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 1 and "sequential_valid.txt: file not found" in missing.stderr
