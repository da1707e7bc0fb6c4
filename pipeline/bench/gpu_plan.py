"""`bench gpu --plan`: each cell's expected seconds on an H100 before a GPU is lent, from the cell's FLOPs and the
H100's matmul rate, and what a budget's worth of a window is expected to yield.

The model (two constants, both from the eager engine's SID-GR runs on an H100, bfloat16, 2026-11-22): a decode batch
takes max(its useful FLOPs / (FRACTION x H100_BF16), forward passes x layers x LAYER_PASS_S). FRACTION: the batch of 8
(149.6 ms) ran at 0.25 of the dense bfloat16 peak; LAYER_PASS_S: the batch of 1 (97.6 ms for 3 forward passes of 28
layers, at 0.05 of the peak) is bound by kernel launches, not FLOPs. transformers' beam search runs each prompt once
per beam (K x the prompt's FLOPs). A compiled cell adds COLD_COMPILE_S (the 2-core CPU's cold compile: an upper bound
for a 16-core host) and times the eager engine again. Not counted: building the random models and catalogs, the
actor's per-shard work (auto), the copy back.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from functools import partial

import torch

from decoding.memory import decode_bytes_per_user, fit_batch
from decoding.models import tiny_model
from pipeline.bench.budget import Cell, run_cells
from pipeline.bench.gpu_shapes import DTYPES, Shape, grid, prior_compile_s, qwen, sid_gr, useful_flops
from pipeline.bench.inputs import llama
from pipeline.bench.params import GpuParams
from pipeline.markdown import table

H100_BF16 = 989.4e12  # dense bfloat16 FLOP/s, H100 SXM (NVIDIA's datasheet, without sparsity)
H100_FP32 = 66.9e12  # float32 FLOP/s without TF32 (parity's transformers reference runs in float32)
H100_MEMORY = 80 * 2**30
H100_MATMUL_FRACTION = 0.7  # the matmul cell's expected rate, of H100_BF16
EAGER_MS = {8: 149.6, 1: 97.6}  # the eager engine at SID-GR's shape on an H100 (docs/benchmarks.md)
FRACTION = 0.25  # SID-GR batch 8: 8 x 4.58 TFLOP of useful work in 149.6 ms = 0.248 of H100_BF16
LAYER_PASS_S = EAGER_MS[1] / 1e3 / (3 * 28)  # SID-GR batch 1: 3 passes (prefill, 2 tree steps) x 28 layers


def plan_result(p: GpuParams, command: str) -> tuple[dict, str]:
    """The cells `p` would run, each with its expected seconds on an H100, the running total, and what a run within
    p.budget_s would do with it: the run's own loop (budget.run_cells) on a clock each cell moves by its expected
    seconds -> (result, md)."""
    clock, rows, total = [0.0], [], 0.0
    cells = []
    for name, kind, compile_s, run_s in plan_cells(p):
        total += compile_s + run_s
        rows.append({"cell": name, "kind": kind, "compile_s": compile_s, "run_s": run_s, "cumulative_s": total})
        cost = costed(name, compile_s, run_s)
        cells.append(Cell(name, kind, partial(advance, clock, compile_s + run_s), cost))
    ran = run_cells(cells, p.budget_s, lambda rows: None, clock=lambda: clock[0])
    for row, r in zip(rows, ran):
        row["within_budget"] = {"ok": "yes"}.get(r["status"], r["status"])
    result = {"args": asdict(p), "command": command, "device": "NVIDIA H100 (expected)", "cells": rows}
    return result, markdown_plan(result, p.budget_s)


def costed(name: str, compile_s: float, run_s: float):
    """A planned cell's cost estimate as gpu_cells gives it: an engine cell's whole seconds, a compile's (auto,
    parity with the compiled engine) seconds, else none."""
    if name.endswith((", eager", ", compiled")):
        return lambda: compile_s + run_s
    return (lambda: compile_s) if compile_s else None


def advance(clock: list, seconds: float) -> dict:
    clock[0] += seconds
    return {}


def plan_cells(p: GpuParams) -> list[tuple[str, str, float, float]]:
    """(cell, kind, expected compile seconds, expected seconds otherwise) for each cell of a run of `p`, in order."""
    matmul_s = 23 * 2 * 8192**3 / (H100_MATMUL_FRACTION * H100_BF16)
    compiled, out = "compiled" in p.engines, [("matmul", "matmul", 0.0, matmul_s)]
    engines = ("beam_search", "beam_search_compiled") if compiled else ("beam_search",)
    for kind, shape in [("anchor", sid_gr(p, 8)), ("anchor", sid_gr(p, 1)), ("qwen", qwen(p))]:
        out += [engine_plan(shape, kind, engines[: i + 1], p) for i in range(len(engines))]
    auto_s = 16 * 2 * 4 * LAYER_PASS_S  # 16 shards of 256 users, 2 layers, 4 passes: launch-bound
    out.append(("engine auto", "auto", prior_compile_s(2), auto_s * (1 + 2 / 16)))  # + 2 trial shards, both engines
    for dtype in DTYPES:
        out.append((f"parity {dtype}", "parity", prior_compile_s(p.layers) if compiled else 0.0, parity_s(p, dtype)))
    out.append(("padding", "padding", 0.0, padding_s(p)))
    for shape in grid(p):
        out.append((shape.name, "shapes", 0.0, shape_s(shape, ("beam_search", "transformers"), p)))
    shape = sid_gr(p, None)
    out += [engine_plan(shape, "anchor", engines[: i + 1], p) for i in range(len(engines))]
    return [c for c in out if c[1] == "matmul" or c[1] in p.sections]


def engine_plan(shape: Shape, kind: str, methods: tuple, p: GpuParams) -> tuple:
    """An engine cell of `shape`: the eager one, or (both methods) the compiled one with its compile."""
    compile_s = prior_compile_s(shape.layers) if "beam_search_compiled" in methods else 0.0
    engine = "compiled" if compile_s else "eager"
    return (f"{shape.name}, {engine}", kind, compile_s, shape_s(shape, methods, p))


def shape_s(shape: Shape, methods: tuple, p: GpuParams, rate: float = H100_BF16, memory: int = H100_MEMORY) -> float:
    """Expected seconds of a cell of `shape`: per method, a warm-up batch and p.repeats runs over its users (its
    FLOP-bound batches at FRACTION of `rate`, its largest batch what fits in `memory`: an H100's unless given)."""
    with torch.device("meta"):  # parameter counts and sizes, nothing allocated
        model = tiny_model(shape.arch, shape.vocab, dtype=torch.bfloat16, **shape.model)
    flops = useful_flops(model, shape.prompt, shape.k, shape.code_len)
    per_user = decode_bytes_per_user(model, shape.prompt, shape.k, shape.code_len, torch.bfloat16)
    weights = sum(x.numel() for x in model.parameters()) * 2
    best = fit_batch(per_user, memory - weights)
    users = shape.users or 2 * best
    total = 0.0
    for method in methods:
        n = min(users, shape.reference_users or users) if method == "transformers" else users
        batch = min(shape.batches.get(method.removesuffix("_compiled")) or best, n)
        work = flops if method != "transformers" else flops_transformers(model, shape)
        one = batch_s(batch * work, shape.code_len, shape.layers, rate)
        total += one * (1 + p.repeats * math.ceil(n / batch))
    return total


def flops_transformers(model, shape: Shape) -> float:
    """transformers' beam search per user: every one of the K beams runs the prompt, then the same tree tokens."""
    return useful_flops(model, shape.prompt * shape.k, shape.k, shape.code_len)


def batch_s(flops: float, passes: int, layers: int, rate: float) -> float:
    """One decode batch: its FLOPs at FRACTION of `rate`, or the launch floor of its passes x layers if longer."""
    return max(flops / (FRACTION * rate), passes * layers * LAYER_PASS_S)


def padding_s(p: GpuParams) -> float:
    """padding: 2,048 users in batches of 256 at prompts up to 300 tokens, K 20, in input order (about the longest
    prompt for every user) and ordered (about half of it), each a warm-up and p.repeats rounds."""
    model = dict(llama(p.hidden, p.layers, p.heads), max_position_embeddings=2048)
    order = Shape("padding", 32768, 300, 20, 2048, model, batches={"beam_search": 256})
    ordered = Shape("padding", 32768, 150, 20, 2048, model, batches={"beam_search": 256})
    return shape_s(order, ("beam_search",), p) + shape_s(ordered, ("beam_search",), p)


def parity_s(p: GpuParams, dtype: str) -> float:
    """parity in `dtype`: beam_search (twice: the reference and, with --engines compiled, the compiled engine),
    speculative (about one beam_search) and transformers in float32, over 128 users in batches of 32."""
    model = dict(llama(p.hidden, p.layers, p.heads), max_position_embeddings=2048)
    shape = Shape("parity", 32768, 300, 20, 128, model)
    with torch.device("meta"):
        m = tiny_model("llama", shape.vocab, dtype=torch.bfloat16, **model)
    ours = batch_s(32 * useful_flops(m, 300, 20, 4), 4, p.layers, H100_BF16)
    ref = batch_s(32 * flops_transformers(m, shape), 4, p.layers, H100_FP32)
    return 4 * (3 * ours + ref)


def markdown_plan(result: dict, budget_s: float) -> str:
    """The plan as a table: each cell's expected compile and other seconds, and the running total against the budget."""
    header = ["cell", "expected compile s", "expected s otherwise", "cumulative s", f"within {budget_s:.0f} s"]
    rows = [
        [
            r["cell"],
            f"{r['compile_s']:.0f}",
            f"{r['run_s']:.1f}",
            f"{r['cumulative_s']:.0f}",
            r["within_budget"],
        ]
        for r in result["cells"]
    ]
    return "\n".join(
        [
            "## Expected seconds per cell on an H100 (bench gpu --plan)",
            "",
            f"A decode batch: its useful FLOPs at {FRACTION:.0%} of {H100_BF16 / 1e12:.0f} TFLOP/s (bfloat16 dense), "
            f"or {LAYER_PASS_S * 1e3:.2f} ms per layer per forward pass where that is longer; compiles: "
            "COLD_COMPILE_S (2-core CPU, compiled by region). Models' and catalogs' building not counted.",
            "",
            table(header, rows, ["left", "right", "right", "right", "left"]),
        ]
    )
