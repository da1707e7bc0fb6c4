"""A MiniOneRec model as trained (github AkaliKong/MiniOneRec; nothing of theirs is fetched or copied here): their
layout, written by this test -> `prepare_data --format minionerec`; their evaluation prompt (EvalSidDataset, its
instruction and user input tokenized apart) token for token on locally built tokenizers; their ranking (evaluate.py:
codes, then "\\n" and EOS generated and scored, length_penalty 0) equal to `transformers` generate under that
constraint; string keys kept through the nightly, rejects, evaluation and report."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from decoding.beam import Prefix, beam_search
from decoding.catalog import Catalog
from decoding.models import tiny_model
from decoding.reference import generate_beam_search
from decoding.templates import PRESETS, write_template
from jobs.prepare_data import main as prepare_data
from operators.prompts import Renderer, catalog_probes
from pipeline.config import load_config
from pipeline.prepare import build_text_tokenizer, prepare_minionerec
from pipeline.storage import Storage
from tests.helpers import float32_atol

LEVELS, CODES, ITEMS, K = 3, 16, 120, 5
CATEGORY = "Office_Products"
# their data.py, EvalSidDataset.pre and generate_prompt, as published (written out here, not imported)
THEIR_INSTRUCTION = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request. \n\n### Instruction:\nCan you predict the next possible item "
    "that the user may expect?\n\n"
)
THEIR_INPUT = (
    "### User Input: \nCan you predict the next possible item the user may expect, given the following chronological "
    "interaction history: {history}\n\n### Response:\n"
)


def their_encode(tok, text: str, bos: bool) -> list[int]:
    """data.py's Tokenizer.encode: tokenizer.encode(text), leading BOS and trailing EOS stripped, BOS added when asked
    and the tokenizer has one."""
    t = tok.encode(text)
    while t and t[0] == tok.bos_token_id:
        t = t[1:]
    while t and t[-1] == tok.eos_token_id:
        t = t[:-1]
    return ([tok.bos_token_id] if bos and tok.bos_token_id is not None else []) + t


def their_prompt(tok, history_sids: list[str]) -> list[int]:
    """EvalSidDataset's test-time input_ids: the instruction (with BOS), then the user input, tokenized apart."""
    return their_encode(tok, THEIR_INSTRUCTION, True) + their_encode(
        tok, THEIR_INPUT.format(history=", ".join(history_sids)), False
    )


def sid_text(codes) -> str:
    return "".join(f"<{chr(97 + j)}_{c}>" for j, c in enumerate(codes))


def write_layout(root: Path, seed: int = 0) -> dict:
    """Their data/Amazon layout for one category: index, info, valid and test CSVs (string user ids, several rows a
    user, Python-literal lists), the train CSV a Git LFS pointer as in the published snapshot. Test row 3's first
    history item carries a semantic id the index does not give it; test row 5's history holds an item the index
    lacks. -> {"sids": [N, L], "test": frame, "valid": frame}."""
    rng = np.random.default_rng(seed)
    sids = np.unique(rng.integers(0, CODES, (3 * ITEMS, LEVELS)), axis=0)[rng.permutation(ITEMS)]  # [N, L] distinct
    for d in ("index", "info", "train", "valid", "test"):
        (root / d).mkdir(parents=True)
    index = {str(i): [f"<{chr(97 + j)}_{c}>" for j, c in enumerate(s)] for i, s in enumerate(sids)}
    (root / "index" / f"{CATEGORY}.index.json").write_text(json.dumps(index))
    info = "".join(f"{sid_text(s)}\tItem {i}, a title\t{i}\n" for i, s in enumerate(sids))
    (root / "info" / f"{CATEGORY}_5_2016-10-2018-11.txt").write_text(info)
    (root / "train" / f"{CATEGORY}_5_2016-10-2018-11.csv").write_text(
        "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n"
    )
    frames = {}
    for split, users in (("valid", 40), ("test", 60)):
        rows = []
        for u in range(users):
            seq = rng.integers(0, ITEMS, rng.integers(3, 12)).tolist()
            for cut in range(max(1, len(seq) - rng.integers(1, 4)), len(seq)):  # 1-3 rows a user
                history, item = seq[:cut], seq[cut]
                rows.append(
                    {
                        "user_id": f"A{u * 7 + 1000}",
                        "history_item_title": str([f"Item {i}, a title" for i in history]),
                        "item_title": f"Item {item}, a title",
                        "history_item_id": str(history),
                        "item_id": item,
                        "history_item_sid": str([sid_text(sids[i]) for i in history]),
                        "item_sid": sid_text(sids[item]),
                    }
                )
        frames[split] = pd.DataFrame(rows)
    test = frames["test"]
    first = eval(test.at[3, "history_item_id"])[0]
    wrong = sids[first] + np.eye(LEVELS, dtype=sids.dtype)[0]  # its first code off by one
    test.at[3, "history_item_sid"] = str([sid_text(wrong), *eval(test.at[3, "history_item_sid"])[1:]])
    test.at[5, "history_item_id"] = str([*eval(test.at[5, "history_item_id"]), 9999])
    test.at[5, "history_item_sid"] = str([*eval(test.at[5, "history_item_sid"]), "<a_1><b_1><c_1>"])
    for split, frame in frames.items():
        frame.to_csv(root / split / f"{CATEGORY}_5_2016-10-2018-11.csv", index=False)
    return {"sids": sids, **frames}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("minionerec")
    layout = write_layout(root / "repo" / "data" / "Amazon")
    args = ["--format", "minionerec", "--source", str(root / "repo"), "--out", str(root / "data")]
    assert prepare_data([*args, "--allow-mismatch"]) == 0  # test rows 3 and 5 disagree with the index
    return root, layout


def test_disagreements_with_the_index_exit_2_naming_file_row_and_values(imported, tmp_path, capsys):
    """Test row 3's semantic id and row 5's unknown item: exit 2 naming both (file, row, values), nothing written;
    --allow-mismatch imports them as written, and prepare.json and the printed summary say so."""
    root, layout = imported
    args = ["--format", "minionerec", "--source", str(root / "repo"), "--out", str(tmp_path / "out")]
    assert prepare_data(args) == 2
    err = capsys.readouterr().err
    first = eval(layout["test"].at[3, "history_item_id"])[0]
    wrong = eval(layout["test"].at[3, "history_item_sid"])[0]
    csv = f"test/{CATEGORY}_5_2016-10-2018-11.csv"
    assert "2 ids or semantic ids disagree with the index" in err and "--allow-mismatch" in err
    assert f"{csv}: row 3: item {first} has semantic id {wrong} here, {sid_text(layout['sids'][first])} in the " in err
    assert f"{csv}: row 5: item 9999 is not in the index" in err
    assert not (tmp_path / "out").exists()
    assert prepare_data([*args, "--allow-mismatch"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["allow_mismatch"] and summary["mismatches"] == {"train": 0, "valid": 0, "test": 2, "info": 0}
    report = json.loads((tmp_path / "out" / "prepare.json").read_text())
    assert report["allow_mismatch"] and report["mismatches"] == summary["mismatches"]
    info = root / "repo" / "data" / "Amazon" / "info" / f"{CATEGORY}_5_2016-10-2018-11.txt"
    shutil.copytree(root / "repo", tmp_path / "repo")
    lines = info.read_text().splitlines()
    lines[4] = lines[4].replace("<a_", "<a_1", 1)  # item 4's semantic id, another in the info file
    (tmp_path / "repo" / "data" / "Amazon" / "info" / info.name).write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"3 ids or .* info/.*\.txt: line 5: item 4 has semantic id <a_1"):
        prepare_minionerec(tmp_path / "repo", tmp_path / "out2")


@pytest.mark.parametrize(
    "column, value, says",
    [
        ("user_id", "  ", "is blank, expected a user id"),
        ("item_id", "", "is not an item id (a non-negative integer)"),
        ("item_id", "12.0", "is not an item id (a non-negative integer)"),
        ("history_item_id", "5", "is not a Python-literal list of item ids"),
        ("history_item_id", "['12']", "is not a Python-literal list of item ids"),
        ("history_item_id", "[1, 2", "is not a Python-literal list of item ids"),
        ("history_item_sid", "[1, 2]", "is not a Python-literal list of semantic ids"),
        ("item_sid", "", "is blank, expected a semantic id"),
    ],
)
def test_a_malformed_cell_is_named_by_file_row_column_and_value(imported, tmp_path, column, value, says):
    root, layout = imported
    shutil.copytree(root / "repo", tmp_path / "repo")
    frame = layout["test"].copy()
    frame[column] = frame[column].astype(object)
    frame.at[2, column] = value
    csv = tmp_path / "repo" / "data" / "Amazon" / "test" / f"{CATEGORY}_5_2016-10-2018-11.csv"
    frame.to_csv(csv, index=False)
    with pytest.raises(ValueError) as e:
        prepare_minionerec(tmp_path / "repo", tmp_path / "out", allow_mismatch=True)
    assert str(e.value) == f"{csv}: row 2, column {column}: {value!r} {says}" + (
        ", e.g. [12, 7]" if "item ids" in says else ", e.g. ['<a_1><b_2>']" if "semantic ids" in says else ""
    ) + (" such as <a_1><b_2><c_3>" if column == "item_sid" else "")


def test_a_history_column_of_bare_numbers_is_refused_not_emptied(imported, tmp_path, capsys):
    """A history_item_id column of bare numbers (pandas would read it as integers) is no column of lists: exit 2 at
    its first row, never a table of empty histories."""
    root, layout = imported
    shutil.copytree(root / "repo", tmp_path / "repo")
    frame = layout["valid"].copy()
    frame["history_item_id"] = [eval(h)[-1] if eval(h) else 0 for h in frame.history_item_id]
    csv = tmp_path / "repo" / "data" / "Amazon" / "valid" / f"{CATEGORY}_5_2016-10-2018-11.csv"
    frame.to_csv(csv, index=False)
    args = ["--format", "minionerec", "--source", str(tmp_path / "repo"), "--out", str(tmp_path / "out")]
    assert prepare_data([*args, "--allow-mismatch"]) == 2
    err = capsys.readouterr().err
    value = str(frame.history_item_id[0])
    assert f"{csv}: row 0, column history_item_id: {value!r} is not a Python-literal list of item ids" in err
    assert not (tmp_path / "out").exists()


def test_every_csv_row_is_a_unit_keyed_by_its_user_and_row(imported):
    root, layout = imported
    report = json.loads((root / "data" / "prepare.json").read_text())
    assert report["format"] == "minionerec" and report["category"] == CATEGORY and report["items"] == ITEMS
    for split in ("valid", "test"):
        frame, table = layout[split], pq.read_table(root / "data" / f"{split}.parquet")
        assert table.num_rows == len(frame) == report["rows"][split]["rows"]  # no row dropped as a duplicate user
        assert table.schema.field("user_id").type == pa.string()
        assert table["user_id"].to_pylist() == [f"{u}#{r}" for r, u in enumerate(frame.user_id)]
        assert table["source_user_id"].to_pylist() == frame.user_id.tolist()
        assert table["history"].to_pylist() == [eval(h) for h in frame.history_item_id]
        assert table["target_items"].to_pylist() == [[i] for i in frame.item_id]
        assert report["rows"][split]["users"] == frame.user_id.nunique() < len(frame)
    test = report["rows"]["test"]
    assert test["sid_differs"] == 1 and test["sid_differences"][0]["row"] == 3
    assert test["unknown_items"] == 1 and test["unknown"] == [{"row": 5, "item": 9999}]
    assert report["rows"]["valid"]["sid_differs"] == report["rows"]["valid"]["unknown_items"] == 0
    assert "Git LFS pointer" in report["rows"]["train"]["missing"] and report["users"]["train"] == 0
    assert report["info"]["lines"] == ITEMS and report["info"]["differ_from_index"] == 0
    assert set(report["sha256"]) == {
        f"{CATEGORY}.index.json",
        *(f"{CATEGORY}_5_2016-10-2018-11.{e}" for e in "txt csv".split()),
    }


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_the_prompt_is_their_eval_prompt_token_for_token(imported, style):
    """Qwen-style (no BOS; ":\\n" one piece) and Llama-style (adds <s>) tokenizers: the rendered ids equal
    EvalSidDataset's two-part tokenization for every test row; the forced answer tokens are what their evaluate.py's
    constraint puts after the codes (the tokens of "### Response:\\n" + codes + "\\n" after the codes, then EOS)."""
    root, layout = imported
    tok = build_text_tokenizer(LEVELS, CODES, 800, style=style)
    items = pq.read_table(root / "data" / "items.parquet")
    cat = Catalog.from_table(items, tok)
    renderer = Renderer.compile(PRESETS["minionerec"], tok, catalog_probes(cat.item_tokens))
    frame = layout["test"].drop(index=[3, 5])  # rows whose sids or items the index does not back
    prompts = renderer.render(pa.array([eval(h) for h in frame.history_item_id]), cat.item_tokens)
    for row, sids in enumerate(frame.history_item_sid):
        ids = prompts.input_ids[row][prompts.attention_mask[row].bool()].tolist()
        assert ids == their_prompt(tok, eval(sids)), row
    # the two parts are tokenized apart: with an instruction that ends in "### Res" and a prefix that starts with
    # "ponse", the whole text would make " Response" one token; the renderer keeps them apart, as EvalSidDataset does
    minionerec = PRESETS["minionerec"]
    glued = replace(minionerec, instruction=THEIR_INSTRUCTION + "### Res", prefix="ponse:\n" + minionerec.prefix)
    row = Renderer.compile(glued, tok, catalog_probes(cat.item_tokens)).render(
        pa.array([eval(frame.history_item_id.iloc[0])]), cat.item_tokens
    )
    user_input = "ponse:\n" + THEIR_INPUT.format(history=", ".join(eval(frame.history_item_sid.iloc[0])))
    apart = their_encode(tok, glued.instruction, True) + their_encode(tok, user_input, False)
    assert row.input_ids[0].tolist() == apart != their_encode(tok, glued.instruction + user_input, True)
    for codes in layout["sids"][:10]:  # their prefixID: "### Response:\n" + codes + "\n", its tokens after the codes
        hashed = tok("### Response:\n" + sid_text(codes) + "\n", add_special_tokens=False).input_ids
        after = hashed[hashed.index(tok.convert_tokens_to_ids(f"<c_{codes[-1]}>")) + 1 :]
        assert renderer.answer.tolist() == [*after, tok.eos_token_id] and len(after) >= 1


def prompts_of(tok, items: pa.Table, layout, rows: range):
    cat = Catalog.from_table(items, tok)
    renderer = Renderer.compile(PRESETS["minionerec"], tok, catalog_probes(cat.item_tokens))
    frame = layout["valid"].iloc[list(rows)]
    prefix = Prefix(renderer.prefix_ids)
    histories = pa.array([eval(h) for h in frame.history_item_id])
    return (
        cat,
        renderer,
        renderer.render(histories, cat.item_tokens),
        prefix,
        renderer.render(histories, cat.item_tokens, len(prefix)),
    )


def test_their_ranking_includes_the_answer_tokens_and_equals_generate(imported):
    """A tiny Qwen2 in float32: beam_search with the template's answer tokens returns what `model.generate` returns
    when the constraint allows codes, then "\\n", then EOS (their evaluate.py's search, length_penalty 0): the same
    lists for every user clear of a float32 near-tie (tie_gap above twice the scores' float32 bound), the same scores
    within that bound. Users are drawn 16 at a time until 8 are clear (at most 4 groups); the answer tokens change
    some user's list (else the test would not tell the two rankings apart); without them, beam search stays what it
    was; the compiled engine hands the answer to the eager one, saying so."""
    root, layout = imported
    tok = build_text_tokenizer(LEVELS, CODES, 800, style="qwen")
    items = pq.read_table(root / "data" / "items.parquet")
    model = tiny_model("qwen2", len(tok), seed=1)
    clear = changed = 0
    for group in range(4):
        cat, renderer, full, prefix, rest = prompts_of(tok, items, layout, range(16 * group, 16 * group + 16))
        answer = torch.from_numpy(renderer.answer)
        ours = beam_search(model, rest.input_ids, rest.attention_mask, cat, K, prefix=prefix, answer=answer)
        want_items, _, want_scores, _ = generate_beam_search(
            model,
            full.input_ids,
            full.attention_mask,
            cat,
            K,
            answer=renderer.answer.tolist(),
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        atol = float32_atol(want_scores)
        torch.testing.assert_close(ours.scores, want_scores, atol=atol, rtol=0)
        ok = ours.stats["tie_gap"] > 2 * atol  # [16]
        assert torch.equal(ours.item_ids[ok], want_items[ok])
        clear += int(ok.sum())
        plain = beam_search(model, rest.input_ids, rest.attention_mask, cat, K, prefix=prefix)
        changed += int((plain.item_ids != ours.item_ids).any(1).sum())
        if clear >= 8:
            break
    assert clear >= 8, f"{clear} users clear of a float32 near-tie in {16 * (group + 1)}"
    assert changed >= 1
    compiled = beam_search(
        model, rest.input_ids, rest.attention_mask, cat, K, prefix=prefix, answer=answer, engine="compiled"
    )
    assert "eager" in compiled.stats["engine_note"] and torch.equal(compiled.item_ids, ours.item_ids)


@pytest.fixture(scope="module")
def nightly(imported):
    """The imported test rows decoded by the nightly job with a MiniOneRec-style model directory (a tiny Qwen2, the
    Qwen-style tokenizer with the code tokens, the minionerec template)."""
    import ray

    from pipeline.nightly import run_nightly

    root, layout = imported
    tok = build_text_tokenizer(LEVELS, CODES, 800, style="qwen")
    target = root / "target"
    tiny_model("qwen2", len(tok), seed=1).save_pretrained(target)
    tok.save_pretrained(target)
    write_template(target, PRESETS["minionerec"])
    cfg = load_config(
        None,
        [
            f"input={root / 'data' / 'test.parquet'}",
            f"catalog={root / 'data' / 'items.parquet'}",
            f"output={root / 'out'}",
            f"models.target={target}",
            f"decoding.k={K}",
            "compute.batch_size=32",
            "run_date=2026-11-25",
        ],
    )
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        manifest = run_nightly(cfg)
    finally:
        ray.shutdown()
    return root, layout, cfg, manifest


def test_string_keys_through_the_nightly_rejects_evaluation_and_report(nightly):
    from pipeline.evaluate import evaluate
    from pipeline.report import report_run

    root, layout, cfg, manifest = nightly
    run = Path(manifest["outputs"]["recommendations"]).parent
    recs = pq.read_table(run / "recommendations")
    rejects = pq.read_table(run / "rejects")
    assert recs.schema.field("user_id").type == rejects.schema.field("user_id").type == pa.string()
    keys = [f"{u}#{r}" for r, u in enumerate(layout["test"].user_id)]
    assert rejects["user_id"].to_pylist() == [keys[5]] and rejects["reason"].to_pylist() == ["unknown_item"]
    assert sorted(set(recs["user_id"].to_pylist())) == sorted(set(keys) - {keys[5]})
    assert recs.num_rows == K * (len(keys) - 1)  # every row its own unit, several per CSV user
    result = evaluate(cfg.output, Storage())
    assert result["users"] == len(keys) and result["users_without_recommendations"] == 1  # the rejected row
    _, out = report_run(cfg.output, Storage())
    assert (Path(out) / "report.md").is_file()


# A stand-in for their evaluate.py with its interface (main's arguments, the module-level AutoModelForCausalLM /
# AutoTokenizer it loads with, the JSON it writes), written by this test: `transformers` generate under their
# constraint (codes, "\n", EOS; length_penalty 0) on EvalSidDataset's prompt. The real one is theirs, never fetched
# here; `python -m jobs.bench minionerec --peer` runs it the same way.
PEER_EVALUATE = """
import json

import pandas as pd
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

device = "cpu"
INSTRUCTION = {instruction!r}
USER_INPUT = {user_input!r}


def encode(tok, text, bos):
    t = tok.encode(text)
    while t and t[0] == tok.bos_token_id:
        t = t[1:]
    return ([tok.bos_token_id] if bos and tok.bos_token_id is not None else []) + t


def main(base_model, info_file, category, test_data_path, result_json_data, batch_size=4, num_beams=50,
         length_penalty=0.0, max_new_tokens=256):
    model = AutoModelForCausalLM.from_pretrained(base_model, torch_dtype=torch.bfloat16, device_map="auto")
    tok = AutoTokenizer.from_pretrained(base_model)
    allowed = {{}}
    for line in open(info_file):
        ids = tok(line.split("\\t")[0].strip() + "\\n", add_special_tokens=False).input_ids + [tok.eos_token_id]
        for i in range(len(ids)):
            allowed.setdefault(tuple(ids[:i]), set()).add(ids[i])
    rows = pd.read_csv(test_data_path)
    prompts = [encode(tok, INSTRUCTION, True) + encode(tok, USER_INPUT.format(history=", ".join(eval(h))), False)
               for h in rows.history_item_sid]
    out = []
    for a in range(0, len(prompts), batch_size):
        batch = prompts[a : a + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[tok.eos_token_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        fn = lambda b, sent: sorted(allowed.get(tuple(sent[width:].tolist()), [tok.eos_token_id]))
        gen = model.generate(ids, attention_mask=mask, num_beams=num_beams, num_return_sequences=num_beams,
                             length_penalty=length_penalty, max_new_tokens=max_new_tokens, do_sample=False,
                             prefix_allowed_tokens_fn=fn, pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
        texts = tok.batch_decode(gen[:, width:], skip_special_tokens=True)
        out += [[t.strip() for t in texts[i : i + num_beams]] for i in range(0, len(texts), num_beams)]
    json.dump([{{"predict": p}} for p in out], open(result_json_data, "w"))
"""


def test_the_peer_run_imports_their_evaluate_from_a_path_and_compares(imported, tmp_path):
    """`bench minionerec` on a peer folder in their layout whose evaluate.py has their interface: it imports it from
    the path, redirects its model loading (their bfloat16 -> float32, local files), runs both, and finds every list
    identical by semantic ID, none invalid, the same items' scores within float32 noise."""
    from pipeline.bench.params import MiniOneRecParams
    from pipeline.bench.sections import run_section

    root, layout = imported
    peer = tmp_path / "peer"
    shutil.copytree(root / "repo", peer)
    (peer / "evaluate.py").write_text(PEER_EVALUATE.format(instruction=THEIR_INSTRUCTION, user_input=THEIR_INPUT))
    (peer / "data.py").write_text("")
    (peer / "LogitProcessor.py").write_text("")
    csv = peer / "data" / "Amazon" / "test" / f"{CATEGORY}_5_2016-10-2018-11.csv"
    pd.read_csv(csv, dtype={"user_id": str}).drop(index=[3, 5]).to_csv(csv, index=False)  # rows the index backs
    params = MiniOneRecParams(
        peer=str(peer), category=CATEGORY, users=12, beams=K, batch=8, repeats=1, out=str(tmp_path)
    )
    result, md = run_section("minionerec", params, "test")
    a = result["agreement"]
    assert a["users"] == 12 and a["identical"] == 12 and a["invalid_theirs"] == a["invalid_ours"] == 0
    # a score sums L + 2 log-probs over a vocabulary of about 500 tokens: |score| < 50
    assert a["max_abs_score_diff_same_item"] <= float32_atol(torch.tensor([50.0]))
    assert set(result["users_per_s"]) == {"theirs", "ours_theirs", "ours"} and "their evaluate.py" in md
