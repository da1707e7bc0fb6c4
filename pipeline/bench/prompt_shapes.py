"""templates, rendering at three prompt shapes: users/s per CPU core of the renderer (operators/prompts.py) against
the tokenizer on each user's whole text (written beforehand, untimed: the least a renderer without spans would pay),
on synthetic users over a Qwen3-style byte-level BPE (pipeline.prepare.build_chat_tokenizer) with OpenOneRec's code
tokens. Per core: users over the process's CPU seconds (every thread counted), so other jobs on the machine slow the
wall clock, not the figure; interleaved repeats, medians with ranges.

    300         a chat template around one history of 50 semantic IDs: about 300 tokens
    openonerec  OpenOneRec-like: a chat template, a 200-token profile ({user:profile}) and two histories of semantic
                IDs (256 and 100 items): about 2,000 tokens
    titles      a chat template around 100 items, each its semantic ID and a title of about 15 tokens
                ({item:title}): about 2,000 tokens
"""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa

from decoding.catalog import Catalog
from decoding.templates import PromptTemplate
from operators.prompts import Renderer, as_text, catalog_probes
from operators.text import chat_template_text, prompt_pieces
from pipeline.bench.common import Timing, aligned, fmt_ratio, fmt_spread, ratio, run_order
from pipeline.bench.params import TemplatesParams
from pipeline.markdown import table

LEVELS, CODES, ITEMS = 3, 256, 50_000
SYSTEM = "你是一个智能推荐助手，能够根据用户的浏览历史预测用户可能感兴趣的下一个内容。"
CHAT = dict(bos=False, code_token="<s_{level}_{code}>", chat_template_kwargs={"enable_thinking": False})
CHAT |= dict(item="<|sid_begin|>{codes}<|sid_end|>", generation_prefix="<|sid_begin|>")
HISTORY_ONLY = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "浏览历史：\n{history}\n请推荐。"}]
PROFILE = "用户画像：\n{user:profile}\n\n视频：{history}\n商品：{history:goods}\n请预测。"
SHAPES = {
    "300": PromptTemplate(name="300", messages=HISTORY_ONLY, max_items=50, **CHAT),
    "openonerec": PromptTemplate(
        name="openonerec-like",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": PROFILE}],
        max_items=256,
        windows={"goods": 100},
        **CHAT,
    ),
    "titles": PromptTemplate(
        name="titles",
        messages=HISTORY_ONLY,
        max_items=100,
        **{**CHAT, "item": "<|sid_begin|>{codes}<|sid_end|> {item:title}\n"},
    ),
}
WORDS = [
    "喜欢",
    "美食",
    "旅行",
    "猫咪",
    "🐱",
    "🍜",
    "视频",
    "sale",
    "the",
    "video",
    "cats",
    "summer",
    "2024",
    "，",
    "。",
]
WORDS += [" ", "\n", "用户", "推荐", "内容", "Hello", "world", "50%", "✈️", "周末"]


def run_shapes(p: TemplatesParams, tok) -> dict:
    """Every shape of `p.shapes`: renderer and tokenizer, interleaved `p.repeats` times after a warm-up (the
    renderer's per-item caches filled by it, as a night fills them on its first batches)."""
    rng = np.random.default_rng(p.seed)
    catalog = synthetic_catalog(tok, rng)
    timings, methods, rendered = {}, {}, {}
    for name in p.shapes:
        template = SHAPES[name]
        cat = Catalog.from_table(catalog, tok, on_duplicate="first", code_token=template.code)
        renderer = Renderer.compile(template, tok, catalog_probes(cat.item_tokens), catalog)
        rows = shape_rows(template, tok, rng, p.shape_users)
        texts = whole_texts(template, tok, rows, catalog)
        methods[f"{name} renderer"] = lambda r=renderer, x=rows, c=cat: r.render(x, c.item_tokens)
        methods[f"{name} tokenizer"] = lambda t=texts: tok(t, add_special_tokens=False)["input_ids"]
        rendered[name] = (renderer, rows, cat)
    for name, method in methods.items():
        method()  # warm-up
        timings[name] = []
    for names in run_order(list(methods), p.repeats):
        for name in names:
            cpu = time.process_time()
            methods[name]()
            timings[name].append(time.process_time() - cpu)
    out = {name: shape_result(name, *rendered[name], timings) for name in p.shapes}
    return {"text_vocab": len(tok), "items": ITEMS, "shapes": out}


def shape_result(name: str, renderer: Renderer, rows: pa.Table, cat: Catalog, timings: dict) -> dict:
    """One shape's figures: its prompts' mean tokens, users (and tokens) per CPU second of each method, speed-up."""
    tokens = float(renderer.render(rows, cat.item_tokens).attention_mask.sum(1).float().mean())
    mine, theirs = Timing(timings[f"{name} renderer"]), Timing(timings[f"{name} tokenizer"])
    users = rows.num_rows
    return {
        "template": SHAPES[name].to_dict(),
        "users": users,
        "prompt_tokens_mean": tokens,
        "renderer_users_per_core_s": mine.per(lambda s: users / s),
        "tokenizer_users_per_core_s": theirs.per(lambda s: users / s),
        "tokenizer_tokens_per_core_s": theirs.per(lambda s: tokens * users / s),
        "speedup": ratio(theirs, mine),
        "renderer_cpu_s": mine.to_dict(),
        "tokenizer_cpu_s": theirs.to_dict(),
    }


def synthetic_catalog(tok, rng) -> pa.Table:
    """ITEMS items with distinct 3-level semantic IDs and a title of about 15 tokens each."""
    sids = np.unique(rng.integers(0, CODES, (2 * ITEMS, LEVELS)), axis=0)[:ITEMS]
    titles = sized_texts(tok, rng, ITEMS, 15)
    return pa.table({"item_id": np.arange(ITEMS), "semantic_id": sids.tolist(), "title": titles})


def sized_texts(tok, rng, n: int, tokens: int) -> list[str]:
    """n random texts of CJK, emoji and English words, each about `tokens` tokens long."""
    per_word = np.mean([len(tok(w, add_special_tokens=False)["input_ids"]) for w in WORDS])
    words = max(1, int(round(tokens / per_word)))
    return ["".join(rng.choice(WORDS, words)) for _ in range(n)]


def shape_rows(template: PromptTemplate, tok, rng, users: int) -> pa.Table:
    """`users` rows for a template: full histories (1.2x each window) of random catalog items, 200-token profiles."""
    rows = {}
    for column, window in template.histories.items():
        rows[column] = pa.array([rng.integers(0, ITEMS, window * 6 // 5) for _ in range(users)], pa.list_(pa.int64()))
    for column in template.user_columns:
        rows[column] = sized_texts(tok, rng, users, 200)
    return pa.table(rows)


def whole_texts(template: PromptTemplate, tok, rows: pa.Table, catalog: pa.Table) -> list[str]:
    """Each row's whole prompt text (operators/text.py prompt_pieces), for the tokenizer's side."""
    codes = catalog["semantic_id"].to_pylist()  # row i: item i's
    titles = as_text(catalog["title"])
    chat = chat_template_text(template, tok, None)
    out = []
    for r in range(rows.num_rows):
        histories = {}
        for c, w in template.histories.items():
            items = rows[c][r].values.to_numpy()[-w:]
            histories[c] = [
                template.item_text(
                    q + 1, "".join(template.code(j, x) for j, x in enumerate(codes[i])), {"title": titles[i]}
                )
                for q, i in enumerate(items)
            ]
        users = {c: rows[c][r].as_py() for c in template.user_columns}
        out.append("".join(t for t, _ in prompt_pieces(template, tok, chat, histories, users)))
    return out


def markdown_shapes(r: dict) -> list[str]:
    header = ["shape", "tokens / user", "renderer users/s per core", "tokenizer on the text", "speed-up"]
    rows = [
        [
            name,
            f"{x['prompt_tokens_mean']:,.0f}",
            fmt_spread(x["renderer_users_per_core_s"], 0),
            fmt_spread(x["tokenizer_users_per_core_s"], 0),
            fmt_ratio(x["speedup"]),
        ]
        for name, x in r["shapes"].items()
    ]
    return [
        f"## rendering users/s per CPU core, {next(iter(r['shapes'].values()))['users']:,} synthetic users per "
        f"shape, a Qwen3-style byte-level BPE of {r['text_vocab']:,} tokens with OpenOneRec's code tokens, "
        f"{r['items']:,} catalog items; median (min-max) of interleaved repeats, users per process CPU second",
        "",
        table(header, rows, aligned(1, 4)),
    ]
