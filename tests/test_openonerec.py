"""An OpenOneRec model as they train it (github Kuaishou-OneRec/OpenOneRec; nothing of theirs is fetched or copied
here): their RecIF layout, written by this test -> `prepare_data --format openonerec`; their video recommendation
prompt token for token on a Qwen3-style tokenizer trained here with the code tokens added as they add them (their SID
format and prompts as published, written out here; a soft-switch chat template with thinking off beside the model;
`<|sid_begin|>` after the generation prompt); and a peer test that imports their own prompt-building code and chat
template from a checkout the user gives (GENREC_PEER_OPENONEREC; skipped without it)."""

import importlib.util
import json
import os
import sys
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from decoding.catalog import Catalog
from decoding.models import tiny_model
from decoding.templates import read_template
from jobs.prepare_data import main as prepare_data
from jobs.template import main as template_cli
from operators.prompts import Renderer, catalog_probes
from pipeline.prepare import build_chat_tokenizer
from pipeline.prepare.contract import CHATML
from pipeline.storage import HEAD_FILES, local_files_fingerprint

LEVELS, CODES, PIDS = 3, 12, 90
PEER = os.environ.get("GENREC_PEER_OPENONEREC")  # a checkout of github Kuaishou-OneRec/OpenOneRec
# their data/onerec_data/sft/video_rec.py, as published (written out here, not imported)
THEIR_SID = "<|sid_begin|><s_a_{c0}><s_b_{c1}><s_c_{c2}><|sid_end|>"
THEIR_SYSTEM_0 = "你是一个智能推荐助手，能够根据用户的浏览历史预测用户可能感兴趣的下一个内容。"
THEIR_USER_4 = "{query}\n根据上述浏览记录，推测用户的下一个观看目标。"


def write_release(root: Path, seed: int = 0) -> dict:
    """Their RecIF files: onerec_bench_release.parquet (30 users, split 0 train else test; histories of pids with
    some pid2sid lacks; a product history and a profile for other tasks) and video_ad_pid2sid.parquet (pids with 3
    codes, two sharing one)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    pids = rng.choice(10**9, PIDS, replace=False).astype(np.int64)
    sids = np.unique(rng.integers(0, CODES, (3 * PIDS, LEVELS)), axis=0)[rng.permutation(PIDS)]
    sids[1] = sids[0]  # a semantic ID two videos share
    pq.write_table(pa.table({"pid": pids, "sid": sids.tolist()}), root / "video_ad_pid2sid.parquet")
    unknown = [7, 11]  # pids pid2sid lacks
    rows = []
    for u in range(30):
        hist = rng.choice(pids, rng.integers(1, 14)).tolist() + ([unknown[u % 2]] if u % 4 == 0 else [])
        rng.shuffle(hist)
        rows.append(
            {
                "uid": 1000 + u,
                "split": 0 if u < 6 else 1,
                "hist_video_pid": hist,
                "target_video_pid": rng.choice(pids, 3).tolist(),
                "hist_goods_pid": rng.choice(pids, 2).tolist(),
                "inter_user_profile_with_sid": f"喜欢 {THEIR_SID.format(c0=1, c1=2, c2=3)} 这样的视频",
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), root / "onerec_bench_release.parquet")
    return {"pid2sid": dict(zip(pids.tolist(), sids.tolist())), "rows": rows}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("openonerec")
    release = write_release(root / "release")
    assert prepare_data(["--format", "openonerec", "--source", str(root / "release"), "--out", str(root / "data")]) == 0
    return root, release


def their_query(hist: list, pid2sid: dict, last: int = 512) -> str:
    """Their pids_to_sids(hist[-512:]): the SIDs of the pids pid2sid holds, back to back."""
    return "".join(THEIR_SID.format(c0=s[0], c1=s[1], c2=s[2]) for p in hist[-last:] if (s := pid2sid.get(p)))


def test_their_release_imports_as_their_video_prompt_reads_it(imported):
    """Test users keep the pids their prompt writes (pid2sid's, of the last 512) and every other column; train users
    are one sequence; the items carry their popularity (occurrences in histories and targets) and the shared SID."""
    root, release = imported
    test = pq.read_table(root / "data" / "test.parquet")
    rows = [r for r in release["rows"] if r["split"] != 0]
    known = release["pid2sid"]
    assert test["user_id"].to_pylist() == [r["uid"] for r in rows]
    assert test["history"].to_pylist() == [[p for p in r["hist_video_pid"] if p in known] for r in rows]
    assert test["inter_user_profile_with_sid"].to_pylist() == [r["inter_user_profile_with_sid"] for r in rows]
    assert test["hist_goods_pid"].to_pylist() == [r["hist_goods_pid"] for r in rows]
    items = pq.read_table(root / "data" / "items.parquet")
    seen = [p for r in release["rows"] for p in r["hist_video_pid"] + r["target_video_pid"]]
    assert dict(zip(items["item_id"].to_pylist(), items["popularity"].to_pylist())) == {p: seen.count(p) for p in known}
    report = json.loads((root / "data" / "prepare.json").read_text())
    lost = sum(p not in known for r in rows for p in r["hist_video_pid"])
    assert report["unknown_pids_left_out"]["test"]["history"] == lost > 0
    assert len(report["semantic_id_collisions"]) == 1
    train = pq.read_table(root / "data" / "train.parquet")
    first = release["rows"][0]
    assert train["history"][0].as_py() == [p for p in first["hist_video_pid"] + first["target_video_pid"] if p in known]


@pytest.fixture(scope="module")
def model_dir(imported):
    """A OneRec-style model folder: a tiny Qwen3 over the tokenizer (code tokens and SID marks added with
    add_tokens, as their expand_qwen3_vocab.py adds them), its template written by `genrec-batch template --preset
    openonerec:0:4 --chat-template` from a stand-in for their soft-switch template."""
    root, _ = imported
    tok = build_chat_tokenizer(LEVELS, CODES)
    model = root / "onerec"
    tiny_model("qwen3", len(tok), seed=0).save_pretrained(model)
    tok.save_pretrained(model)
    (root / "qwen3_soft_switch.jinja2").write_text(CHATML)
    args = ["--model", str(model), "--preset", "openonerec:0:4", "--catalog", str(root / "data" / "items.parquet")]
    assert template_cli([*args, "--chat-template", str(root / "qwen3_soft_switch.jinja2")]) == 0
    return model, tok


def rendered(root: Path, model: Path, tok, template=None):
    """The test users' prompts rendered with the model folder's template -> (prompts, rows)."""
    template = template or read_template(model)
    items = pq.read_table(root / "data" / "items.parquet")
    cat = Catalog.from_table(items, tok, on_duplicate="first", code_token=template.code)
    renderer = Renderer.compile(template, tok, catalog_probes(cat.item_tokens), items, model)
    test = pq.read_table(root / "data" / "test.parquet")
    return renderer.render(test, cat.item_tokens), test


def ids_of(prompts, row: int) -> list[int]:
    return prompts.input_ids[row][prompts.attention_mask[row].bool()].tolist()


def test_the_prompt_is_their_video_prompt_token_for_token(imported, model_dir):
    """Every test user's ids equal their prompt: the soft-switch chat template applied to their system and user
    prompt (variant 0 and 4) around the history's SIDs, thinking off, `<|sid_begin|>` appended, the text tokenized
    by the model's tokenizer as vLLM does; the template names their chat template file, found beside the model by the
    actor's own checks (default prompt bound: the model's context less an item)."""
    from operators.recommender import prepare
    from operators.spec import ActorSpec

    root, release = imported
    model, tok = model_dir
    prompts, test = rendered(root, model, tok)
    template = read_template(model)
    assert template.messages[0]["content"] == THEIR_SYSTEM_0
    assert template.messages[1]["content"] == THEIR_USER_4.replace("{query}", "{history}")
    assert template.chat_template == "qwen3_soft_switch.jinja2" and (model / template.chat_template).is_file()
    for row, r in enumerate([r for r in release["rows"] if r["split"] != 0]):
        messages = [
            {"role": "system", "content": THEIR_SYSTEM_0},
            {
                "role": "user",
                "content": THEIR_USER_4.format(query=their_query(r["hist_video_pid"], release["pid2sid"])),
            },
        ]
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert ids_of(prompts, row) == tok(text + "<|sid_begin|>")["input_ids"], row
    spec = ActorSpec(run_id="t", target=str(model), catalog=pq.read_table(root / "data" / "items.parquet"),
                     catalog_name="items", template=template)  # fmt: skip
    inputs = prepare(spec)
    assert inputs.renderer.max_prompt_tokens == 512 - LEVELS and inputs.renderer.chat == CHATML
    # the chat template is part of the model: its files' sha256, and what a driver reads of an s3:// model
    before = local_files_fingerprint(model)
    (model / template.chat_template).write_text(CHATML.replace("/no_think", "/nothink"))
    assert local_files_fingerprint(model) != before and any(fnmatch(template.chat_template, f) for f in HEAD_FILES)
    (model / template.chat_template).write_text(CHATML)


@pytest.mark.skipif(not PEER, reason="GENREC_PEER_OPENONEREC names no checkout of github Kuaishou-OneRec/OpenOneRec")
@pytest.mark.parametrize("system, user", [(0, 0), (3, 2)])
def test_the_prompt_is_what_their_own_code_builds(imported, model_dir, system, user):
    """Their video_rec.py (build_messages, pids_to_sids; its random choice of prompts pinned to one variant) and
    their benchmark's qwen3_soft_switch.jinja2, imported from the checkout: every test user's ids equal ours."""
    from decoding.templates import get_template

    root, release = imported
    model, tok = model_dir
    peer = Path(PEER)
    jinja = peer / "benchmarks" / "benchmark" / "tasks" / "v1_0" / "qwen3_soft_switch.jinja2"
    theirs = load_module(peer / "data" / "onerec_data" / "sft" / "video_rec.py")
    (model / "qwen3_soft_switch.jinja2").write_text(jinja.read_text(encoding="utf-8"))
    picks = {id(theirs.SYSTEM_PROMPTS): system, id(theirs.USER_PROMPTS): user}
    theirs.random = SimpleNamespace(choice=lambda seq: seq[picks[id(seq)]])
    prompts, _ = rendered(root, model, tok, get_template(f"openonerec:{system}:{user}"))
    for row, r in enumerate([r for r in release["rows"] if r["split"] != 0]):
        query = theirs.pids_to_sids(r["hist_video_pid"][-theirs.HIST_MAX_LEN :], release["pid2sid"])
        messages = [
            {"role": m["role"], "content": "".join(c["text"] for c in m["content"])}
            for m in json.loads(theirs.build_messages(query, ""))
            if m["role"] != "assistant"
        ]  # their loader's _convert_messages_format, the answer left out
        text = tok.apply_chat_template(
            messages, chat_template=jinja.read_text(), tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        assert ids_of(prompts, row) == tok(text + "<|sid_begin|>")["input_ids"], row
    (model / "qwen3_soft_switch.jinja2").write_text(CHATML)


def load_module(path: Path):
    """A module of theirs, imported from its file."""
    if not path.is_file():
        pytest.fail(f"GENREC_PEER_OPENONEREC: {path} not found; give a checkout of github Kuaishou-OneRec/OpenOneRec")
    spec = importlib.util.spec_from_file_location(f"openonerec_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
