"""templates: what a prompt template costs. (1) Rendering users/s per CPU core at three prompt shapes, 300 and 2,000
tokens (pipeline/bench/prompt_shapes.py). (2) Rendering: ms per 1,000 Amazon Beauty users of every template with the
renderer (numpy over compiled spans) against the tokenizer called on each user's text (what rendering would cost
without the renderer). (3) The nightly job: users/s of the same model (a random Llama of layers x hidden over a
byte-level BPE vocabulary plus the Beauty code tokens) with each template, interleaved runs on one local Ray. `beauty`
false: (1) alone.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from decoding.catalog import Catalog
from decoding.codes import semantic_id_matrix
from decoding.models import build_model
from decoding.templates import PRESETS, write_template
from operators.prompts import Renderer, catalog_probes
from pipeline.bench.common import (
    Timing,
    aligned,
    compare,
    fmt_ratio,
    fmt_spread,
    footer,
    interleaved,
    ratio,
)
from pipeline.bench.params import TemplatesParams
from pipeline.bench.prompt_shapes import CODES, markdown_shapes, run_shapes
from pipeline.markdown import table
from pipeline.prepare import build_chat_tokenizer, build_text_tokenizer


def run_templates(p: TemplatesParams) -> dict:
    out = {"shapes": run_shapes(p, build_chat_tokenizer(3, CODES, vocab_size=p.text_vocab))} if p.shapes else {}
    return {"templates": out | (bench_templates(p) if p.beauty else {})}


def bench_templates(p: TemplatesParams) -> dict:
    data = Path(p.data)
    for name in ("items.parquet", "test.parquet"):
        if not (data / name).is_file():
            raise FileNotFoundError(f"{data / name} not found: run `python -m jobs.prepare_data --out {data}` first")
    items = pq.read_table(data / "items.parquet")
    levels, codes = semantic_id_matrix(items).shape[1], int(semantic_id_matrix(items).max()) + 1
    tok = build_text_tokenizer(levels, codes, vocab_size=p.text_vocab)
    catalog = Catalog.from_table(items, tok, on_duplicate="first")
    test = pq.read_table(data / "test.parquet", columns=["user_id", "history"])
    test = test.filter(np.asarray([bool(h) for h in test["history"].to_pylist()]))
    return {
        "text_vocab": len(tok),
        "render": bench_render(p, tok, catalog, items, test),
        "nightly": bench_jobs(p, tok, catalog, items, test),
    }


def bench_render(p: TemplatesParams, tok, catalog: Catalog, items, test) -> dict:
    """Every Beauty test user with a history (the first p.render_users), in blocks of 1,000, per template: renderer
    vs tokenizer."""
    histories = test["history"].to_pylist()[: p.render_users]
    codes_of = dict(zip(items["item_id"].to_pylist(), items["semantic_id"].to_pylist()))
    blocks = [histories[a : a + 1000] for a in range(0, len(histories), 1000)]
    methods, out = {}, {}
    for name in p.templates:
        t0 = time.perf_counter()
        renderer = Renderer.compile(
            PRESETS[name].with_max_items(p.history_len), tok, catalog_probes(catalog.item_tokens)
        )
        out[name] = {"compile_s": time.perf_counter() - t0, "max_prompt_tokens": renderer.max_len}
        methods[f"{name} renderer"] = lambda r=renderer: [r.render(b, catalog.item_tokens) for b in blocks]
        template = renderer.template
        methods[f"{name} tokenizer"] = lambda t=template: [
            tok([t.text([codes_of[i] for i in h]) for h in b], padding=True) for b in blocks
        ]
    run = interleaved(methods, p.repeats, desc="templates: rendering")
    per_1000 = lambda s: 1e3 * s / len(histories) * 1000  # noqa: E731  ms per 1,000 users
    for name in p.templates:
        renderer, tokenizer = run.timings[f"{name} renderer"], run.timings[f"{name} tokenizer"]
        prompts = run.outputs[f"{name} renderer"]
        out[name].update(
            renderer_ms_per_1000=renderer.per(per_1000),
            tokenizer_ms_per_1000=tokenizer.per(per_1000),
            speedup=ratio(tokenizer, renderer),
            renderer=renderer.to_dict(),
            tokenizer=tokenizer.to_dict(),
            prompt_tokens_mean=sum(float(x.attention_mask.sum()) for x in prompts) / len(histories),
        )
    return {"users": len(histories), "order": run.order, "templates": out}


def bench_jobs(p: TemplatesParams, tok, catalog: Catalog, items, test) -> dict:
    """The nightly job on the first p.users test users, once per template per repeat, interleaved; one model."""
    import ray

    from pipeline.nightly import run_nightly

    configs = template_configs(p, tok, items, test, Path(p.out) / "templates-bench")
    ray.init(num_cpus=p.cpus + 1, include_dashboard=False, ignore_reinit_error=True)
    try:
        run = interleaved(
            {name: lambda c=c: run_nightly(c) for name, c in configs.items()}, p.repeats, desc="templates: nightly jobs"
        )
    finally:
        ray.shutdown()
    first, second = p.templates[0], p.templates[-1]
    return {
        "order": run.order,
        "model": {"layers": p.layers, "hidden": p.hidden, "vocab": len(tok)},
        "templates": {name: job_row(run.outputs[name], run.timings[name]) for name in p.templates},
        "ratio": ratio(run.timings[second], run.timings[first]),
    }


def template_configs(p: TemplatesParams, tok, items, test, root: Path) -> dict:
    """Under `root` (made anew): the users, the catalog and, per template, one random Llama (the same weights) saved
    with the tokenizer and that template -> template name -> its nightly config (one actor of p.cpus CPUs)."""
    from pipeline.config import load_config

    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    pq.write_table(test.slice(0, p.users), root / "users.parquet")
    pq.write_table(items, root / "items.parquet")
    model = build_model(len(tok), p.layers, p.hidden, p.heads, p.heads, seed=p.seed, max_positions=1024)
    configs = {}
    for name in p.templates:
        model_dir = root / f"model-{name}"
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        write_template(model_dir, PRESETS[name].with_max_items(p.history_len))
        configs[name] = load_config(
            None,
            [
                f"input={root / 'users.parquet'}",
                f"catalog={root / 'items.parquet'}",
                f"output={root / f'out-{name}'}",
                f"models.target={model_dir}",
                f"decoding.k={p.k}",
                f"compute.batch_size={p.batch}",
                "compute.num_actors=1",
                f"compute.cpus_per_actor={p.cpus}",
            ],
        )
    return configs


def job_row(manifest: dict, t: Timing) -> dict:
    """One template's job: users, its timing and users/s, prompt tokens per user and the longest (from the last run's
    manifest and shard metrics), users per busy actor-second."""
    users = manifest["counts"]["users_ok"]
    metrics = pq.read_table(manifest["outputs"]["metrics"]).to_pandas()
    return {
        "users": users,
        "job": t.to_dict(),
        "job_users_per_s": t.per(lambda s: users / s),
        "prompt_tokens_per_user": float(metrics.prompt_tokens.sum() / users),
        "max_prompt_tokens": manifest["max_prompt_tokens"],
        "decode_users_per_busy_s": float(users / metrics.wall_s.sum()),
    }


def markdown_templates(result: dict) -> str:
    t, env = result["templates"], result["environment"]
    shapes = markdown_shapes(t["shapes"]) if "shapes" in t else []
    if "render" not in t:
        return "\n".join(shapes + ["", footer(env)])
    r, n = t["render"], t["nightly"]
    header = (
        "template | longest prompt (tokens) | mean prompt (tokens) | renderer | tokenizer on the text | "
        "renderer speed-up | compile (s)"
    ).split(" | ")
    rows = [
        [
            name,
            x["max_prompt_tokens"],
            f"{x['prompt_tokens_mean']:.1f}",
            fmt_spread(x["renderer_ms_per_1000"], 1),
            fmt_spread(x["tokenizer_ms_per_1000"], 1),
            fmt_ratio(x["speedup"]),
            f"{x['compile_s']:.2f}",
        ]
        for name, x in r["templates"].items()
    ]
    lines = (
        shapes
        + [""] * bool(shapes)
        + [
            f"## prompt templates: rendering {r['users']:,} Amazon Beauty users (ms per 1,000 users), byte-level BPE "
            f"of {t['text_vocab']:,} tokens with the code tokens added, {env['device']}; median (min-max) of "
            f"{result['args']['repeats']} interleaved repeats",
            "",
            table(header, rows, aligned(1, 6)),
        ]
    )
    return "\n".join(lines + markdown_jobs(n) + ["", footer(env)])


def markdown_jobs(n: dict) -> list[str]:
    """The nightly job with each template: prompt tokens, users/s; the first template's users/s over the last's."""
    first, second = list(n["templates"])[0], list(n["templates"])[-1]
    header = ["template", "prompt tokens / user", "users/s (job)", "users/s per busy actor-second (last run)"]
    rows = [
        [
            name,
            f"{x['prompt_tokens_per_user']:.1f}",
            fmt_spread(x["job_users_per_s"], 1),
            f"{x['decode_users_per_busy_s']:.1f}",
        ]
        for name, x in n["templates"].items()
    ]
    return [
        "",
        f"## the nightly job with each template: {n['templates'][first]['users']:,} users, one CPU actor, "
        f"a random Llama {n['model']['layers']} x {n['model']['hidden']} over {n['model']['vocab']:,} tokens; "
        "median (min-max) of interleaved runs",
        "",
        table(header, rows, aligned(1, 3)),
        "",
        f"{first} over {second}, users/s of the job: **{fmt_ratio(n['ratio'])}** "
        f"({compare(first, second, n['ratio'])})",
    ]
