"""Prompt templates rendered by operators/prompts.py (the `codes` format exactly as before; the LC-Rec instruction
prompt equal to the tokenizer's own ids for a real BPE tokenizer), operators/validate.py (row rules) and the
catalog's item-to-tokens map."""

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest
import torch

from decoding.catalog import Catalog, ItemTokens
from decoding.codes import ragged_ranges
from decoding.templates import PRESETS, PromptTemplate, get_template, read_template, write_template
from operators.prompts import Renderer, catalog_probes
from operators.validate import validate
from pipeline.prepare import build_tokenizer
from tests.helpers import bpe_tokenizer


def build_prompts(histories, items, bos, pad, history_len):
    """The `codes` template (<bos> + the code tokens of the last history_len items) with the project tokenizer."""
    tok = build_tokenizer(2, 8)
    assert (tok.bos_token_id, tok.pad_token_id) == (bos, pad)
    renderer = Renderer.compile(PRESETS["codes"].with_max_items(history_len), tok, catalog_probes(items))
    return renderer.render(histories, items)


# L = 2 levels, 8 codes: token id of (level j, code c) = 4 + 8 j + c
CATALOG = pa.table({"item_id": [30, 10, 20], "semantic_id": [[5, 0], [1, 2], [3, 4]]})
T10, T20, T30 = [4 + 1, 12 + 2], [4 + 3, 12 + 4], [4 + 5, 12 + 0]
BOS, PAD = 1, 0


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(2, 8)


@pytest.fixture(scope="module")
def items(tok):
    return Catalog.from_table(CATALOG, tok).item_tokens


def test_item_tokens(items, tok):
    assert items.item_ids.tolist() == [10, 20, 30] and items.levels == 2
    tokens, known = items.lookup(np.array([20, 99, 10, 5, 31]))
    assert known.tolist() == [True, False, True, False, False]
    assert tokens.tolist() == [T20, [-1, -1], T10, [-1, -1], [-1, -1]]
    with pytest.raises(ValueError, match=r"duplicate item ids: \[7\]"):
        ItemTokens.from_arrays(np.array([7, 8, 7]), np.zeros((3, 2)))
    # items sharing a semantic ID: one keeps it in the index, every one of them renders in prompts
    shared = pa.table({"item_id": [30, 10, 20, 40], "semantic_id": [[5, 0], [1, 2], [3, 4], [1, 2]]})
    cat = Catalog.from_table(shared, tok, on_duplicate="first")
    assert cat.duplicates == [(40, 10)] and len(cat) == 3
    assert cat.item_tokens.lookup(np.array([40, 10]))[0].tolist() == [T10, T10]


def test_exact_ids_left_padded(items):
    p = build_prompts([[10, 20], [30], [20, 10, 30]], items, BOS, PAD, history_len=5)
    assert p.input_ids.dtype == torch.int64 and p.attention_mask.dtype == torch.int64
    assert p.input_ids.tolist() == [
        [PAD, PAD, BOS, *T10, *T20],
        [PAD, PAD, PAD, PAD, BOS, *T30],
        [BOS, *T20, *T10, *T30],
    ]
    assert p.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1], [1] * 7]


def test_same_as_tokenizer_text(items, tok):
    history = [30, 10, 20, 10]
    p = build_prompts([history], items, tok.bos_token_id, tok.pad_token_id, history_len=20)
    sid = dict(zip(CATALOG.column("item_id").to_pylist(), CATALOG.column("semantic_id").to_pylist()))
    text = "<bos>" + "".join(f"<a_{sid[i][0]}><b_{sid[i][1]}>" for i in history)
    assert p.input_ids[0].tolist() == tok(text)["input_ids"]


def test_bad_rows_rejected_with_reasons(items):
    batch = pa.table(
        {
            "user_id": pa.array([1, 2, 3, None, 5, 6, 7], pa.int64()),
            "history": pa.array([[], [10, 99, 20, 98], None, [10], [20], [5], [99, 10, 20]], pa.list_(pa.int64())),
        }
    )
    good, rejects = validate(batch, items, history_len=2)
    assert good["user_id"].to_pylist() == [5, 7]  # user 7's unknown item is older than the window: not used
    assert good["history"].to_pylist() == [[20], [99, 10, 20]]
    assert rejects.to_pylist() == [
        {"user_id": 1, "reason": "empty_history", "detail": "history has no items"},
        {"user_id": 2, "reason": "unknown_item", "detail": "item ids not in catalog: 98"},
        {"user_id": 3, "reason": "empty_history", "detail": "history is null"},
        {"user_id": None, "reason": "missing_user_id", "detail": "user_id is null"},
        {"user_id": 6, "reason": "unknown_item", "detail": "item ids not in catalog: 5"},
    ]
    wide, _ = validate(batch, items, history_len=5)  # the window now reaches user 2's 98 and user 7's 99
    assert wide["user_id"].to_pylist() == [5]
    assert validate(batch, items, 5)[1].to_pylist()[1] == {
        "user_id": 2,
        "reason": "unknown_item",
        "detail": "item ids not in catalog: 98, 99",
    }
    strings = pa.table(
        {"user_id": ["a", "b", "c"], "history": pa.array([["10", "20"], ["x"], None], pa.list_(pa.string()))}
    )
    good, rejects = validate(strings, items, history_len=5)
    assert good["user_id"].to_pylist() == ["a"] and good["history"].to_pylist() == [[10, 20]]
    assert [r["reason"] for r in rejects.to_pylist()] == ["bad_type", "empty_history"]
    with pytest.raises(ValueError, match=r"rows \[1\] have an empty history or items missing"):
        build_prompts([[10], [99]], items, BOS, PAD, history_len=5)  # prompts are rendered from validated rows


def test_history_len_keeps_most_recent(items):
    p = build_prompts([[10, 20, 30], [30, 20]], items, BOS, PAD, history_len=2)
    assert p.input_ids.tolist() == [[BOS, *T20, *T30], [BOS, *T30, *T20]]
    # an unknown item older than the window is not used, so the row is fine
    p = build_prompts([[99, 10, 20]], items, BOS, PAD, history_len=2)
    assert p.input_ids.tolist() == [[BOS, *T10, *T20]]
    with pytest.raises(ValueError, match="max_items must be an integer >= 1"):
        build_prompts([[10]], items, BOS, PAD, history_len=0)


def test_arrow_input_same_as_lists(items):
    rows = [[10, 20], [30, 20, 10, 30], [20], [99, 30]]
    arrow = pa.array([[1]] + rows, pa.list_(pa.int64())).slice(1)  # sliced: offsets do not start at 0
    a = build_prompts(arrow, items, BOS, PAD, history_len=1)
    b = build_prompts(rows, items, BOS, PAD, history_len=1)
    c = build_prompts(pa.chunked_array([arrow.slice(0, 2), arrow.slice(2)]), items, BOS, PAD, history_len=1)
    for other in (b, c):
        assert torch.equal(a.input_ids, other.input_ids) and torch.equal(a.attention_mask, other.attention_mask)
    assert a.input_ids.tolist() == [[BOS, *T20], [BOS, *T30], [BOS, *T20], [BOS, *T30]]


def test_ragged_ranges():
    assert ragged_ranges(np.array([5, 0, 2]), np.array([2, 0, 3])).tolist() == [5, 6, 2, 3, 4]


# ---------------------------------------------------------------- templates with a real BPE tokenizer

LEVELS, CODES = 3, 6


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE trained here on instruction text, the code tokens added as tokens of their own, <s> added
    by the tokenizer itself (as Llama's does); a catalog of 120 random items over 3 levels x 6 codes."""
    tok = bpe_tokenizer(LEVELS, CODES)
    rng = np.random.default_rng(0)
    sid = np.unique(rng.integers(0, CODES, size=(200, LEVELS)), axis=0)[:120]
    table = pa.table({"item_id": np.arange(len(sid)) * 7 + 3, "semantic_id": sid.tolist()})
    return tok, Catalog.from_table(table, tok), dict(zip(table["item_id"].to_pylist(), sid.tolist()))


@pytest.mark.parametrize("preset", ["lcrec", "codes"])
def test_rendered_ids_equal_the_tokenizer_on_the_rendered_text(bpe, preset):
    """Every history length 1 .. max_items (and longer histories, cut to the last max_items), 400 histories in
    batches: the ids are exactly tokenizer(text), the text being what the template writes."""
    tok, cat, codes_of = bpe
    template = PRESETS[preset]
    renderer = Renderer.compile(template, tok, catalog_probes(cat.item_tokens))
    rng = np.random.default_rng(1)
    item_ids = np.array(sorted(codes_of))
    lengths = np.concatenate([np.arange(1, 26), rng.integers(1, 30, size=375)])  # 1..25 and 375 random lengths
    histories = [rng.choice(item_ids, size=n).tolist() for n in lengths]
    for a in range(0, len(histories), 64):
        batch = histories[a : a + 64]
        p = renderer.render(batch, cat.item_tokens)
        for row, history in enumerate(batch):
            text = template.text([codes_of[i] for i in history])
            want = tok(text)["input_ids"]  # the way a user of the model calls it (the tokenizer adds <s>)
            real = p.input_ids[row][p.attention_mask[row].bool()].tolist()
            assert real == want, (preset, len(history), text)
            assert p.attention_mask[row, : p.input_ids.shape[1] - len(want)].sum() == 0  # left padding only
    assert renderer.max_len == len(tok(template.text([codes_of[3]] * 20))["input_ids"])
    if preset == "lcrec":  # the AtSpeed paper's prompt, history numbered and joined with ", "
        (a1, b1, c1), (a2, b2, c2) = codes_of[3], codes_of[10]
        assert template.text([codes_of[3], codes_of[10]]) == (
            "Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\nThe user has interacted with items "
            f"1. <a_{a1}><b_{b1}><c_{c1}>, 2. <a_{a2}><b_{b2}><c_{c2}> in chronological order. Can you predict the "
            "next possible item that the user may expect?\n\n### Response:"
        )


def test_a_sentencepiece_style_tokenizer_renders_its_own_ids(bpe):
    """A SentencePiece-style BPE as Llama-2 and Mistral tokenizers are converted today (`Metaspace`, prepend_scheme
    "first": "▁" before the very first word only, none after an added token; byte fallback), the code tokens added:
    LC-Rec's prompt and a template that writes a title and a query right after code tokens equal tokenizer(text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.prepare.contract import INSTRUCTION_TEXT

    _, _, codes_of = bpe
    raw = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    raw.decoder = decoders.Metaspace(prepend_scheme="first", split=False)
    raw.train_from_iterator(INSTRUCTION_TEXT * 5, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>"]))
    spec = json.loads(raw.to_str())  # the 256 byte pieces in the vocabulary, as Llama's: "猫" becomes 3 of them
    spec["model"]["vocab"] |= {f"<0x{b:02X}>": len(spec["model"]["vocab"]) + b for b in range(256)}
    raw = Tokenizer.from_str(json.dumps(spec))
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", unk_token="<unk>", pad_token="<unk>")
    tok.add_tokens([f"<{chr(97 + j)}_{c}>" for j in range(LEVELS) for c in range(CODES)])
    ids = sorted(codes_of)
    catalog = pa.table({"item_id": ids, "semantic_id": [codes_of[i] for i in ids], "title": ["x y", "\n猫", ""] * 40})
    cat = Catalog.from_table(catalog, tok)
    titled = PromptTemplate(name="titled", prefix="{user:q}", item="{codes}{item:title}", suffix="{user:q}", bos=True)
    rng = np.random.default_rng(2)
    rows = pa.table({"history": [rng.choice(ids, int(n)).tolist() for n in rng.integers(1, 6, 24)],
                     "q": [["", "ok", " Item", "\nnext", "猫 ok"][i % 5] for i in range(24)]})  # fmt: skip
    title = dict(zip(ids, catalog["title"].to_pylist()))
    sid = lambda i: "".join(f"<{chr(97 + j)}_{c}>" for j, c in enumerate(codes_of[i]))  # noqa: E731
    for template in (PRESETS["lcrec"], titled):
        p = Renderer.compile(template, tok, catalog_probes(cat.item_tokens), catalog).render(rows, cat.item_tokens)
        for row, (history, q) in enumerate(zip(rows["history"].to_pylist(), rows["q"].to_pylist())):
            text = template.text([codes_of[i] for i in history])
            if template is titled:
                text = q + "".join(sid(i) + title[i] for i in history) + q
            assert p.input_ids[row][p.attention_mask[row].bool()].tolist() == tok(text)["input_ids"], (row, text)


def test_a_tokenizer_that_merges_text_into_code_tokens_is_refused(bpe):
    """A tokenizer whose vocabulary holds every code token but that does not split them out of the text around them
    (words split at whitespace only, the way a tokenizer without added tokens treats `<a_0><b_1><c_2>,`): the
    template is refused at compile time, never rendered differently."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    _, _, codes_of = bpe
    words = ["<unk>", "<s>", "<pad>"] + [f"<{chr(97 + j)}_{c}>" for j in range(LEVELS) for c in range(CODES)]
    words += sorted(set(PRESETS["lcrec"].text([]).split()))
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    merging = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", pad_token="<pad>", unk_token="<unk>")
    catalog = Catalog.from_table(
        pa.table({"item_id": list(codes_of), "semantic_id": list(codes_of.values())}), merging
    )  # every code token is in the vocabulary ...
    with pytest.raises(ValueError, match="code tokens must be tokens of their own"):  # ... but not kept apart
        Renderer.compile(PRESETS["lcrec"], merging, catalog_probes(catalog.item_tokens))
    with pytest.raises(ValueError, match=r"1-item probe: rendered .*, the tokenizer \[1, 0\]"):  # one word <unk>
        Renderer.compile(PRESETS["codes"], merging, catalog_probes(catalog.item_tokens))


def test_text_from_data_cannot_write_a_code_token_the_vocabulary_holds_as_a_word(tok, items):
    """The project tokenizer holds the code tokens as words of its vocabulary, not as added tokens: a profile
    holding `<a_5><b_0>` would be read as item 30's codes, so a template that writes untrusted text is refused; the
    same column trusted is parsed as the tokenizer parses it, by the template's choice."""
    profile = PromptTemplate(name="profile", prefix="{user:profile}", bos=True)
    with pytest.raises(ValueError, match=r"writes text from data \(profile\), but the tokenizer reads <a_"):
        Renderer.compile(profile, tok, catalog_probes(items))
    trusted = Renderer.compile(replace(profile, trusted=["profile"]), tok, catalog_probes(items))
    rows = pa.table({"history": pa.array([[10]], pa.list_(pa.int64())), "profile": ["<a_5><b_0>"]})
    assert trusted.render(rows, items).input_ids[0].tolist() == [BOS, *T30, *T10]


def test_template_files_and_refusals(tmp_path, bpe):
    tok, cat, _ = bpe
    custom = PromptTemplate(
        name="mine",
        prefix="History: ",
        item="[{index}] {codes}",
        separator="; ",
        suffix="\nNext:",
        max_items=5,
        bos=False,
        code_token="<{level}_{code}>",
    )
    write_template(tmp_path, custom)
    assert read_template(tmp_path) == custom == get_template(str(tmp_path / "genrec_template.json"))
    assert get_template("lcrec") is PRESETS["lcrec"]
    r = Renderer.compile(custom, tok, catalog_probes(cat.item_tokens))
    (a1, b1, c1), (a2, b2, c2) = bpe[2][3], bpe[2][10]
    ids = r.render([[3, 10]], cat.item_tokens).input_ids[0].tolist()
    text = f"History: [1] <a_{a1}><b_{b1}><c_{c1}>; [2] <a_{a2}><b_{b2}><c_{c2}>\nNext:"
    assert ids == tok(text, add_special_tokens=False)["input_ids"]  # bos: false
    with pytest.raises(ValueError, match=r"no genrec_template.json.*python -m jobs.template --model"):
        read_template(tmp_path / "elsewhere")
    with pytest.raises(ValueError, match=r"must contain \{codes\} exactly once"):
        PromptTemplate(item="{index}")
    with pytest.raises(ValueError, match="unknown prompt template field"):
        PromptTemplate.from_dict({"prefix": "x", "colour": "red"})
    with pytest.raises(ValueError, match="neither a preset"):
        get_template("no-such-preset")
    no_bos = bpe_tokenizer(LEVELS, CODES)
    no_bos.bos_token = None
    with pytest.raises(ValueError, match="the tokenizer has no BOS token"):
        Renderer.compile(PRESETS["lcrec"], no_bos, catalog_probes(cat.item_tokens))
    # code tokens named differently: every one the catalog needs must exist, named in the error
    other = replace(PRESETS["lcrec"], code_token="<|{level_index}_{code}|>")
    every = pa.table(
        {"item_id": list(range(216)), "semantic_id": [[a, b, c] for a in range(6) for b in range(6) for c in range(6)]}
    )
    with pytest.raises(ValueError, match=r"18 code tokens the catalog needs are missing from the tokenizer: <\|0_0\|>"):
        Catalog.from_table(every, tok, code_token=other.code)
