"""pipeline/prepare/ and jobs/prepare_data.py: tokenizer, Amazon Beauty, LC-Rec, synthetic data, the splits and the
written contract (an interrupted import leaves a folder that is not prepared)."""

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from decoding.codes import code_token, code_token_ids
from jobs.prepare_data import main as prepare_data
from pipeline.prepare import (
    BEAUTY_SOURCE,
    Interactions,
    build_tokenizer,
    prepare_beauty,
    prepare_lcrec,
    prepared,
    split_tables,
    synthetic_catalog,
    synthetic_histories,
    write_synthetic,
)
from pipeline.prepare.contract import Mismatch

REPO = Path(__file__).resolve().parents[1]
BEAUTY = BEAUTY_SOURCE


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
    assert tok("<a_1>x<z_9>")["input_ids"] == [5, 3, 3]  # anything else is <unk>
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
    assert {
        "code_tokens": "<a_179><b_229><c_186><d_0>",
        "item_ids": [5699, 7329, 7680],
        "semantic_id": [179, 229, 186, 0],
    } in collisions
    # the ids are the release index's (0-based): every history item is in the catalog. (An earlier copy kept the
    # release text files' 1-based ids: item 12035, one past the index, was "unknown" in 15 train histories.)
    assert all(d == {"interactions": 0, "users": 0, "item_ids": []} for d in report["dropped_unknown_items"].values())
    assert report["mismatches"] == summary.mismatches == {"train": 0, "valid": 0, "test": 0}
    assert report["allow_mismatch"] is summary.allow_mismatch is False
    assert report["interactions"] == {"train": 122_241, "valid": 9_316, "test": 7_313}
    train = pq.read_table(out / "train.parquet")
    assert train["user_id"].to_pylist() == list(range(19_383))
    # the release's first line is "1 1955 28 12031 2758 2273 9634": user 0, items one lower
    assert train["history"][0].as_py() == [1954, 27, 12030, 2757, 2272, 9633]
    assert set(report["sha256"]) == {"items.parquet", "train.parquet", "valid.parquet", "test.parquet"}


def test_beauty_histories_and_targets(beauty):
    _, out = beauty
    catalog = set(pq.read_table(BEAUTY / "items.parquet").column("item_id").to_pylist())
    train, valid_src = _source_lists("train", catalog), _source_lists("valid", catalog)
    test_src = pq.read_table(BEAUTY / "test.parquet")
    test = pq.read_table(out / "test.parquet")
    assert _lists(test, "user_id") == _lists(test_src, "user_id")
    assert _lists(test, "target_items") == _lists(test_src, "items")
    # the AtSpeed paper's protocol: a test user's history is the train + valid items, a valid user's the train items
    assert _lists(test, "history") == [(train[u] + valid_src[u])[-20:] for u in _lists(test, "user_id")]
    assert max(len(h) for h in _lists(test, "history")) == 20
    valid = pq.read_table(out / "valid.parquet")
    assert _lists(valid, "target_items") == _lists(pq.read_table(BEAUTY / "valid.parquet"), "items")
    assert _lists(valid, "history") == [train[u][-20:] for u in _lists(valid, "user_id")]
    assert _lists(valid, "history") != _lists(test, "history")
    out_train = pq.read_table(out / "train.parquet")
    assert _lists(out_train, "history") == [train[u] for u in _lists(out_train, "user_id")]


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
    assert test == [
        {"user_id": 1, "history": [6, 7], "target_items": [6]},
        {"user_id": 2, "history": [6, 5], "target_items": []},
    ]  # train + valid items
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


def test_beauty_ids_the_catalog_lacks_are_refused_unless_allowed(tmp_path, capsys):
    """A history item the catalog lacks (ids shifted by one, another catalog): exit 2 naming the file, row, user and
    ids, nothing written; --allow-mismatch drops it from the list, and prepare.json and the summary count it."""
    src = _tiny_source(tmp_path / "src")
    pq.write_table(pa.table({"user_id": [1, 2], "items": [[5, 8, 6, 9], [6]]}), src / "train.parquet")
    args = ["--source", str(src), "--out", str(tmp_path / "out"), "--history-len", "2"]
    assert prepare_data(args) == 2
    err = capsys.readouterr().err
    assert "2 item ids disagree with the index" in err
    assert f"{src / 'train.parquet'}: row 0 (user_id 1), column items: item ids [8, 9] are not in items.parquet" in err
    assert "--allow-mismatch" in err and not (tmp_path / "out").exists()
    assert prepare_data([*args, "--allow-mismatch"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["allow_mismatch"] and summary["mismatches"] == {"train": 2, "valid": 0, "test": 0}
    assert summary["dropped_interactions"] == {"train": 2, "valid": 0, "test": 0}
    report = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert report["allow_mismatch"] and report["dropped_unknown_items"]["train"]["item_ids"] == [8, 9]
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert train[0] == {"user_id": 1, "history": [5, 6]}  # the known items, in order


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
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.prepare_data",
            "--synthetic",
            "--users",
            "300",
            "--items",
            "2000",
            "--levels",
            "3",
            "--codes",
            "32",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert (summary["users"], summary["items"], summary["levels"], summary["codes"]) == (300, 2000, 3, 32)
    assert pq.read_metadata(out / "test.parquet").num_rows == 300
    bad = subprocess.run(
        [sys.executable, "-m", "jobs.prepare_data", "--synthetic", "--users", "0", "--items", "5", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--users: expected an integer >= 1, got 0" in bad.stderr


# ---------------------------------------------------------------- the LC-Rec layout


def test_lcrec_format_with_every_problem_reported(tmp_path, capsys):
    """An LC-Rec index JSON and sequential_*.txt files -> the project's parquet contracts; collisions, bad index
    entries, malformed lines and unknown items are counted and listed with line numbers, never silently dropped; an
    unknown item refuses the import (exit 2, named) unless --allow-mismatch."""
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
    assert prepare_data(["--format", "lcrec", "--source", str(src), "--out", str(out), "--history-len", "3"]) == 2
    err = capsys.readouterr().err
    assert f"{src / 'sequential_train.txt'}: line 5 (user 4): item ids [99] are not in the index Toy.index.json" in err
    assert not out.exists()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.prepare_data",
            "--format",
            "lcrec",
            "--source",
            str(src),
            "--out",
            str(out),
            "--history-len",
            "3",
            "--allow-mismatch",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["allow_mismatch"] and summary["mismatches"] == {"train": 1, "valid": 0, "test": 0}
    assert (summary["items"], summary["colliding_semantic_ids"], summary["index_problems"]) == (8, 1, 2)
    assert summary["malformed_lines"] == {"train": 2, "valid": 0, "test": 0}
    assert summary["users_without_items"] == {"train": 1, "valid": 0, "test": 0}  # line 7: "5" alone
    assert summary["dropped_interactions"] == {"train": 1, "valid": 0, "test": 0}
    items = pq.read_table(out / "items.parquet")
    assert items["item_id"].to_pylist() == list(range(8))
    assert _lists(items, "semantic_id")[5] == [2, 5, 10] and _lists(items, "code_tokens")[5] == [
        "<a_2>",
        "<b_5>",
        "<c_10>",
    ]
    report = json.loads((out / "prepare.json").read_text())
    assert [c["item_ids"] for c in report["semantic_id_collisions"]] == [[0, 7]]
    assert sorted(p["item"] for p in report["index_problems"]["entries"]) == ["8", "9"]
    lines = report["lines"]["train"]
    assert [(m["line"], m["reason"]) for m in lines["malformed"]] == [
        (4, "not all fields are integers"),
        (6, "user 2 listed again"),
    ]
    assert lines["users_without_items"] == 1 and report["ids"]["offset"] == 0
    assert lines["unknown"] == [{"line": 5, "user": 4, "items": [99]}]
    train, valid, test = (pq.read_table(out / f"{s}.parquet").to_pylist() for s in ("train", "valid", "test"))
    assert train == [
        {"user_id": 1, "history": [0, 1, 2]},
        {"user_id": 2, "history": [3, 4]},
        {"user_id": 4, "history": [6, 1]},
    ]
    assert [(r["user_id"], r["history"], r["target_items"]) for r in valid] == [
        (1, [0, 1, 2], [3]),
        (2, [3, 4], [5]),
        (4, [6, 1], []),
        (5, [], []),
    ]
    # a test user's history is its train + valid items (the last history_len of them)
    assert [(r["user_id"], r["history"], r["target_items"]) for r in test] == [
        (1, [1, 2, 3], [4]),
        (2, [3, 4, 5], []),
        (4, [6, 1], [2]),
        (5, [], []),
    ]
    bad = subprocess.run(
        [sys.executable, "-m", "jobs.prepare_data", "--format", "lcrec", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--format lcrec needs --source DIR" in bad.stderr
    (src / "sequential_valid.txt").unlink()
    missing = subprocess.run(
        [sys.executable, "-m", "jobs.prepare_data", "--format", "lcrec", "--source", str(src), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "sequential_valid.txt: file not found" in missing.stderr


def _lcrec_release(
    folder: Path, seed: int, users: int = 40, items: int = 30, shift: int = 0, index_name: str = "toy.LCRec-1e-3lr.json"
) -> dict:
    """A small dataset in the AtSpeed authors' layout: the index from 0, the interaction files' ids + `shift` (the
    authors' text files use shift 1); every user on every line of valid / test, most of them without items there.
    -> the 0-based truth {split: {user: items}}."""
    rng = np.random.default_rng(seed)
    folder.mkdir()
    index = {str(i): [f"<a_{i % 7}>", f"<b_{i // 7}>", f"<c_{i % 3}>"] for i in range(items)}
    (folder / index_name).write_text(json.dumps(index))
    (folder / "toy.item.json").write_text(json.dumps({str(i): {"title": f"item {i}"} for i in range(items)}))
    (folder / "toy.inter.json").write_text(json.dumps({"0": [1, 2, 3]}))  # maps ids to integer lists: not an index
    truth = {s: {} for s in ("train", "valid", "test")}
    for u in range(users):
        truth["train"][u] = rng.integers(0, items, size=rng.integers(2, 9)).tolist()
        truth["valid"][u] = rng.integers(0, items, size=1).tolist() if rng.random() < 0.3 else []
        truth["test"][u] = rng.integers(0, items, size=rng.integers(1, 3)).tolist() if rng.random() < 0.4 else []
    truth["train"][0] = [0, items - 1]  # the smallest and largest ids are used
    for split, lists in truth.items():
        (folder / f"sequential_{split}.txt").write_text(
            "".join(" ".join(str(x + shift) for x in [u, *v]) + "\n" for u, v in lists.items())
        )
    return truth


def test_lcrec_published_release_one_based_ids(tmp_path):
    """The AtSpeed release's layout: an index named `<dataset>.LCRec-1e-3lr.json` beside other JSON files, and text
    files counting users and items from 1 where the index counts from 0. Without --id-offset the import is refused
    with the evidence and the option; with --id-offset -1 every user's history, valid and test items equal the
    0-based truth; users listed without items are counted apart from malformed lines."""
    truth = _lcrec_release(tmp_path / "zero", seed=1)
    _lcrec_release(tmp_path / "one", seed=1, shift=1)
    refused = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.prepare_data",
            "--format",
            "lcrec",
            "--source",
            str(tmp_path / "one"),
            "--out",
            str(tmp_path / "out-refused"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and not (tmp_path / "out-refused").exists()
    assert (
        "look shifted against the index toy.LCRec-1e-3lr.json: it holds ids 0..29 (30 items), "
        "the files use ids 1..30" in refused.stderr
    )
    assert "id 0 is never used" in refused.stderr and "Rerun with --id-offset -1" in refused.stderr
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.prepare_data",
            "--format",
            "lcrec",
            "--source",
            str(tmp_path / "one"),
            "--out",
            str(tmp_path / "out-one"),
            "--id-offset",
            "-1",
            "--history-len",
            "5",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    assert summary["id_offset"] == -1 and summary["index"].endswith("toy.LCRec-1e-3lr.json")
    assert summary["malformed_lines"] == {"train": 0, "valid": 0, "test": 0}
    assert summary["users_without_items"] == {s: sum(not v for v in truth[s].values()) for s in truth}
    assert summary["dropped_interactions"] == {"train": 0, "valid": 0, "test": 0}
    out = tmp_path / "out-one"
    train, valid, test = (pq.read_table(out / f"{s}.parquet").to_pylist() for s in ("train", "valid", "test"))
    assert {r["user_id"]: r["history"] for r in train} == truth["train"]
    assert {r["user_id"]: (r["history"], r["target_items"]) for r in valid} == {
        u: (truth["train"][u][-5:], truth["valid"][u]) for u in truth["train"]
    }
    assert {r["user_id"]: (r["history"], r["target_items"]) for r in test} == {
        u: ((truth["train"][u] + truth["valid"][u])[-5:], truth["test"][u]) for u in truth["train"]
    }
    report = json.loads((out / "prepare.json").read_text())
    assert report["ids"] | {"unknown_examples": None} == {
        "index_ids": "0..29",
        "index_items": 30,
        "item_ids_used": "1..30",
        "offset": -1,
        "unknown_after_offset": 0,
        "unknown_examples": None,
        "distinct_items_used": report["ids"]["distinct_items_used"],
    }
    assert report["splits"]["test"].startswith("history = the user's train + valid items")
    # the 0-based copy imports as it is, to the same tables
    prepare_lcrec(tmp_path / "zero", tmp_path / "out-zero", history_len=5)
    for s in ("items", "train", "valid", "test"):
        assert pq.read_table(tmp_path / "out-zero" / f"{s}.parquet").equals(pq.read_table(out / f"{s}.parquet"))


def test_lcrec_index_choice_and_unknown_items_after_offset(tmp_path):
    """Two index files: refused naming both, unless --index names one; an explicit offset is applied as given and
    items still unknown after it are reported with their line numbers, never dropped silently."""
    src = tmp_path / "src"
    truth = _lcrec_release(src, seed=2, shift=1)
    (src / "Toy.index.json").write_text((src / "toy.LCRec-1e-3lr.json").read_text())
    with pytest.raises(
        ValueError,
        match=r"found 2 JSON files \(Toy\.index\.json, toy\.LCRec-1e-3lr\.json\) "
        r".*name it with --index FILE",
    ):
        prepare_lcrec(src, tmp_path / "out")
    summary = prepare_lcrec(src, tmp_path / "out", index=src / "Toy.index.json", id_offset=-1)
    assert summary.index == str(src / "Toy.index.json") and summary.dropped_interactions["train"] == 0
    with pytest.raises(ValueError, match=r"--index .*nope\.json: file not found"):
        prepare_lcrec(src, tmp_path / "out", index=src / "nope.json", id_offset=-1)
    for p in src.glob("*.json"):
        p.unlink()
    with pytest.raises(ValueError, match=r"found no JSON file among \[\]"):
        prepare_lcrec(src, tmp_path / "out")
    # an item beyond the index on line 3 of train (user 2 as written, 1 after the offset)
    _lcrec_release(tmp_path / "src2", seed=2, shift=1)
    lines = (tmp_path / "src2" / "sequential_train.txt").read_text().splitlines()
    lines[2] += " 500"
    (tmp_path / "src2" / "sequential_train.txt").write_text("\n".join(lines) + "\n")
    with pytest.raises(Mismatch, match=r"sequential_train\.txt: line 3 \(user 2\): item ids \[499\] are not in"):
        prepare_lcrec(tmp_path / "src2", tmp_path / "out2", id_offset=-1)
    summary = prepare_lcrec(tmp_path / "src2", tmp_path / "out2", id_offset=-1, allow_mismatch=True)
    assert summary.dropped_interactions == summary.mismatches == {"train": 1, "valid": 0, "test": 0}
    report = json.loads((tmp_path / "out2" / "prepare.json").read_text())
    assert report["lines"]["train"]["unknown"] == [{"line": 3, "user": 2, "items": [499]}]
    assert report["ids"]["unknown_after_offset"] == 1 and report["ids"]["unknown_examples"] == [499]
    train = {r["user_id"]: r["history"] for r in pq.read_table(tmp_path / "out2" / "train.parquet").to_pylist()}
    assert train == truth["train"]  # the unknown item left out, every other item in place
    # without --id-offset, an unknown item on top of the shift is no constant offset: imported as written, reported
    summary = prepare_lcrec(tmp_path / "src2", tmp_path / "out3", allow_mismatch=True)
    shifted_last = sum(v.count(29) for v in truth["train"].values())  # item 29 is written as 30, beyond the index
    assert summary.id_offset == 0 and summary.dropped_interactions["train"] == shifted_last + 1
    assert json.loads((tmp_path / "out3" / "prepare.json").read_text())["ids"]["unknown_examples"] == [30, 500]


def test_lcrec_layout_of_the_release_imports_as_the_parquet_release(beauty, tmp_path):
    """The release in the authors' text layout (an index from 0, interaction files counting users and items from 1,
    every user on every valid / test line) imports with --id-offset -1 to the same four tables and counts as the
    parquet release: both sources' splits are built by one path."""
    _, out = beauty
    src = tmp_path / "lcrec"
    src.mkdir()
    items = pq.read_table(BEAUTY / "items.parquet")
    index = dict(zip(map(str, items["item_id"].to_pylist()), _lists(items, "code_tokens")))
    (src / "beauty.LCRec-1e-3lr.json").write_text(json.dumps(index))
    for split in ("train", "valid", "test"):
        t = pq.read_table(BEAUTY / f"{split}.parquet")
        lines = (" ".join(str(x + 1) for x in [u, *v]) for u, v in zip(_lists(t, "user_id"), _lists(t, "items")))
        (src / f"sequential_{split}.txt").write_text("\n".join(lines) + "\n")
    prepare_lcrec(src, tmp_path / "out", history_len=20, id_offset=-1)
    for name in ("items", "train", "valid", "test"):
        assert pq.read_table(tmp_path / "out" / f"{name}.parquet").equals(pq.read_table(out / f"{name}.parquet")), name
    report, expected = (json.loads((d / "prepare.json").read_text()) for d in (tmp_path / "out", out))
    counts = (
        "distinct_semantic_ids",
        "semantic_id_collisions",
        "users",
        "users_with_targets",
        "interactions",
        "history_length",
        "splits",
    )
    assert {k: report[k] for k in counts} == {k: expected[k] for k in counts}


# ---------------------------------------------------------------- the splits


def _convention(train: dict, valid: dict, test: dict, history_len: int) -> dict:
    """SPLIT_CONVENTION written out on {user: items} dicts (rows in the dicts' order)."""
    return {
        "train": [{"user_id": u, "history": v} for u, v in train.items()],
        "valid": [
            {"user_id": u, "history": train.get(u, [])[-history_len:], "target_items": v} for u, v in valid.items()
        ],
        "test": [
            {"user_id": u, "history": (train.get(u, []) + valid.get(u, []))[-history_len:], "target_items": v}
            for u, v in test.items()
        ],
    }


def _interactions(users: dict) -> Interactions:
    """{user: items} -> Interactions, rows in the dict's order (as a parquet source lists them)."""
    lengths = np.array([len(v) for v in users.values()], np.int64)
    values = np.array([i for v in users.values() for i in v], np.int64)
    return Interactions(np.array(list(users), np.int64), values, np.cumsum(lengths) - lengths, lengths)


@pytest.mark.parametrize("seed", range(4))
def test_split_tables_as_the_convention_says(seed):
    """The one path that builds every source's splits: on random splits (users in any order, missing from train or
    valid, empty rows, histories longer and shorter than history_len; seed 3: no train split at all) the tables
    equal SPLIT_CONVENTION written out on Python lists."""
    rng = np.random.default_rng(seed)

    def split(users) -> dict:
        return {int(u): rng.integers(0, 50, size=rng.integers(0, 7)).tolist() for u in rng.permutation(users)}

    train = split(rng.choice(40, size=0 if seed == 3 else 25, replace=False))
    valid, test = split(np.arange(40)), split(rng.choice(40, size=30, replace=False))
    tables = split_tables(_interactions(train), _interactions(valid), _interactions(test), history_len=4)
    assert {s: t.to_pylist() for s, t in tables.items()} == _convention(train, valid, test, 4)
    lines = Interactions.from_lists({3: [7, 8], 1: [], 2: [5]})  # a text file's lines: rows in user order
    assert lines.user_ids.tolist() == [1, 2, 3] and lines.lists().to_pylist() == [[], [5], [7, 8]]


# ---------------------------------------------------------------- an interrupted import

# jobs.prepare_data, stopped (to be killed by the test) once items.parquet.tmp is written, before its rename
STOP_AFTER_ITEMS = """
import sys
import pyarrow.parquet as pq
from jobs.prepare_data import main

write = pq.write_table


def write_then_wait(table, where, **kw):
    write(table, where, **kw)
    if str(where).endswith("items.parquet.tmp"):
        print("items written", flush=True)
        sys.stdin.read()


pq.write_table = write_then_wait
sys.exit(main(sys.argv[1:]))
"""


def _make_plans_import(out: Path) -> bool:
    """Would `make` (the Makefile's `$(DATA)/items.parquet` target; the venv taken as installed) import again?"""
    run = subprocess.run(
        ["make", "-n", "-o", ".venv/bin/.installed", f"DATA={out}", f"{out}/items.parquet"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return f"jobs.prepare_data --out {out}" in run.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_import_killed_before_its_items_file_is_not_prepared(tmp_path):
    """An import killed (SIGKILL, sent by the test) after its tables, tokenizer, prepare.json and its whole
    items.parquet.tmp are written, before the rename, over a folder an earlier import had completed: the folder is not
    prepared (no items.parquet: the Makefile plans the import again, training refuses the folder), and a rerun
    completes it to what a clean import writes."""
    from pipeline.training.common import load_data

    out = tmp_path / "data"
    write_synthetic(out, 300, 500, levels=3, codes=16, seed=1)  # an earlier import, complete
    assert prepared(out) and not _make_plans_import(out)
    args = ["--synthetic", "--users", "300", "--items", "500", "--levels", "3", "--codes", "16", "--seed", "2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", STOP_AFTER_ITEMS, *args, "--out", str(out)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "items written\n"
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((out / "prepare.json").read_text())["seed"] == 2  # the killed import's tables are written
    assert (out / "items.parquet.tmp").is_file() and not (out / "items.parquet").exists()
    assert not prepared(out) and _make_plans_import(out)
    with pytest.raises(ValueError, match=r"items\.parquet not found: run `python -m jobs\.prepare_data"):
        load_data(out, None, None, 1, "cpu")
    write_synthetic(out, 300, 500, levels=3, codes=16, seed=2)  # the rerun
    write_synthetic(tmp_path / "clean", 300, 500, levels=3, codes=16, seed=2)
    assert prepared(out) and not _make_plans_import(out) and not (out / "items.parquet.tmp").exists()
    for name in ("items", "train", "valid", "test"):
        assert pq.read_table(out / f"{name}.parquet").equals(pq.read_table(tmp_path / "clean" / f"{name}.parquet"))


def _importer(source: str, tmp_path: Path):
    """A small import of `source` -> a function (out_dir, history_len) -> summary."""
    if source == "beauty":
        src = _tiny_source(tmp_path / "src")
        return lambda out, n: prepare_beauty(src, out, history_len=n)
    if source == "lcrec":
        _lcrec_release(tmp_path / "src", seed=3, shift=1)
        return lambda out, n: prepare_lcrec(tmp_path / "src", out, history_len=n, id_offset=-1)
    return lambda out, n: write_synthetic(out, 60, 80, levels=2, codes=16, history_len=n, chunk_users=25)


@pytest.mark.parametrize("source", ["beauty", "lcrec", "synthetic"])
def test_failed_items_write_leaves_the_folder_not_prepared(source, tmp_path):
    """Every source goes through one writer: with the write of items.parquet failing (its temporary name taken by a
    folder, from outside), an import over a completed folder raises after writing its tables and prepare.json and
    leaves the folder not prepared, rather than the earlier items beside the new tables; once the blocker is gone,
    a rerun completes the folder to what a clean import writes."""
    run = _importer(source, tmp_path)
    out = tmp_path / "out"
    run(out, 3)
    assert prepared(out)
    (out / "items.parquet.tmp").mkdir()
    with pytest.raises(IsADirectoryError):
        run(out, 2)
    assert json.loads((out / "prepare.json").read_text())["history_len"] == 2  # the failed import's tables
    assert not prepared(out) and not (out / "items.parquet").exists()
    (out / "items.parquet.tmp").rmdir()
    run(out, 2)
    run(tmp_path / "clean", 2)
    assert prepared(out)
    for name in ("items", "train", "valid", "test"):
        assert pq.read_table(out / f"{name}.parquet").equals(pq.read_table(tmp_path / "clean" / f"{name}.parquet"))
