"""`bench compile`: what the compiled engine's cold compile costs against the model's depth.

Each depth runs in a fresh process with an empty inductor cache (TORCHINDUCTOR_CACHE_DIR a new temporary folder): a
random Qwen3 of `layers` decoder layers (hidden `hidden`), one batch of `users` prompts of `prompt` tokens, K beams,
through `beam_search(engine="compiled")`. The first decode compiles the bucket's graphs: its compile seconds
(stats["compile_s"]: the wall seconds of the calls that compiled), the CPU seconds that decode cost (this process
and the compilers it ran, inductor compiling in-process: TORCHINDUCTOR_COMPILE_THREADS=1), and graphs; then
`decodes` warm decodes of the same batch give the decode time once compiled (median, min-max). CPU seconds depend
far less than wall seconds on what else shares the machine (contention still inflates them somewhat). Depths run in
rotated order per repeat (2 8 28, 8 28 2, ...); the verdict is the deepest model's median over the shallowest's.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time

from pipeline.bench.common import footer, in_fresh_process, run_order, spread
from pipeline.bench.params import CompileParams
from pipeline.markdown import table


def run_compile(p: CompileParams) -> dict:
    """Each depth's cold compile, each in a fresh process, the depths interleaved -> the rows."""
    runs = {n: [] for n in p.layers}
    for order in run_order(list(p.layers), p.repeats):
        for n in order:
            runs[n].append(worker_process({**vars(p), "layers": n}))
    rows = [
        {
            "layers": n,
            "compile_s": spread([r["compile_s"] for r in runs[n]]),
            "compile_cpu_s": spread([r["compile_cpu_s"] for r in runs[n]]),
            "graphs": runs[n][0]["graphs"],
            "decode_s": spread([r["decode_s"] for r in runs[n]]),
            "runs": runs[n],
        }
        for n in p.layers
    ]
    return {"rows": rows}


def worker_process(spec: dict) -> dict:
    """One depth in a fresh process with an empty inductor cache -> its JSON line."""
    with tempfile.TemporaryDirectory(prefix="genrec-cold-compile-") as cache:
        env = {
            "TORCHINDUCTOR_CACHE_DIR": cache,
            "TRITON_CACHE_DIR": os.path.join(cache, "triton"),
            "TORCHINDUCTOR_COMPILE_THREADS": "1",  # compilers run as this process's children: their CPU time counts
        }
        return in_fresh_process("pipeline.bench.compile", spec, f"compile worker ({spec['layers']} layers)", env)


def worker(spec: dict) -> dict:
    """In this (fresh) process: the cold decode's compile seconds and graphs, then the warm decodes' seconds."""
    import torch

    from decoding.beam import beam_search
    from decoding.models import pick_device, tiny_model
    from pipeline.bench.decode import synthetic_token_catalog
    from pipeline.bench.inputs import random_prompts

    device = pick_device(spec["device"])
    vocab, levels, codes = spec["vocab"], 4, 256
    catalog = synthetic_token_catalog(spec["items"], levels, codes, spec["seed"], device, vocab=vocab)
    h = spec["hidden"]
    model = tiny_model(
        "qwen3", vocab, seed=spec["seed"], hidden_size=h, intermediate_size=2 * h, num_hidden_layers=spec["layers"]
    ).to(device)
    ids = random_prompts(spec["users"], spec["prompt"], vocab - levels * codes, spec["seed"] + 1, device)
    mask = torch.ones_like(ids)
    decode = lambda: beam_search(model, ids, mask, catalog, spec["k"], engine="compiled")  # noqa: E731
    cpu = cpu_seconds()
    first = decode()
    cpu = cpu_seconds() - cpu
    seconds = []
    for _ in range(spec["decodes"]):
        t0 = time.perf_counter()
        decode()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
    return {
        "compile_s": first.stats["compile_s"],
        "compile_cpu_s": cpu,
        "graphs": first.stats["graphs_compiled"],
        "decode_s": float(sorted(seconds)[len(seconds) // 2]),
    }


def cpu_seconds() -> float:
    """CPU seconds (user and system) of this process and of the children it has waited for (the C++ compilers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def markdown_compile(result: dict) -> str:
    a, rows = result["args"], result["rows"]
    f = lambda s: f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"  # noqa: E731
    ms = lambda s: f"{1000 * s['median']:.0f} ({1000 * s['min']:.0f}-{1000 * s['max']:.0f})"  # noqa: E731
    body = table(
        ["decoder layers", "cold compile, CPU s", "cold compile, wall s", "graphs compiled", "warm decode ms"],
        [[r["layers"], f(r["compile_cpu_s"]), f(r["compile_s"]), r["graphs"], ms(r["decode_s"])] for r in rows],
    )
    ratio = rows[-1]["compile_cpu_s"]["median"] / rows[0]["compile_cpu_s"]["median"]
    return (
        "## The compiled engine's cold compile against depth\n\n"
        f"Random Qwen3, hidden {a['hidden']}, vocabulary {a['vocab']}, {a['users']} users x prompt {a['prompt']}, "
        f"K {a['k']}, an empty inductor cache per run, {a['repeats']} run(s) per depth; warm decode: the median of "
        f"{a['decodes']} decodes of the batch once compiled.\n\n{body}\n\n"
        f"{rows[-1]['layers']} layers compile in {ratio:.2f}x the CPU time of {rows[0]['layers']}.\n\n"
        f"{footer(result['environment'])}\n"
    )


if __name__ == "__main__":  # the worker: one depth, its spec as JSON -> one JSON line
    print(json.dumps(worker(json.loads(sys.argv[1]))))
