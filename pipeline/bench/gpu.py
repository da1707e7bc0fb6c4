"""gpu: the engine's checks and benchmarks on one CUDA device, in one process and one report, as a list of cells run
in order of value under a time budget (pipeline/bench/budget.py: `--budget-s`, the report rewritten after every
cell). `infra/gpu/bench.sh` is the one command for a GPU machine; `--device cpu --smoke` runs every cell at smoke
sizes (the compiled engine's code there with torch.compile's stance "force_eager": its compile is the GPU's to time).

1 matmul     the device's dense matrix-product rate in the benchmark dtype: every cell's useful-FLOP fraction is of it
2 anchor     NVIDIA recsys-examples SID-GR's published shape (Qwen3-1.7B, context 1000, beam 256, 3 code tokens) at
             batch 8, the eager engine then (--engines compiled) the compiled one beside it, ms per batch beside
             NVIDIA's 93.2 ms (H100); 3 the same at batch 1 (NVIDIA: 17.6 ms)
4 qwen       Qwen2.5-0.5B's shape (vocabulary 151,936, prompt 300, K 20, Beauty's catalog after the text vocabulary)
             at the largest batch that fits, both engines
5 auto       the nightly's actor with compute.engine auto on the device (the Recommender the nightly's Ray actors run,
             called in this process; no Ray) over 4,096 test users in batches of 256, K 10: its choice, each engine's
             trial users/s, the compile seconds, the parity evidence, then users/s with the engine it kept
6 parity     float32: beam_search against transformers beam search must give every user the same list (up to exact
             float32 ties); bfloat16 and float16: the same against transformers in float32 on the same weights and
             strict speculative decoding (and the compiled engine) against beam_search in that dtype, for every
             user clear of a near-tie at the k-th place (stats["tie_gap"] >= TIE)
7 shapes     beam_search vs transformers at vocabulary 32k / 152k x prompt 300 / 1000 x K 20 / 50 (a random Llama,
             bfloat16): beam_search at the largest batch that fits (decoding/memory.py), transformers at --batch
             halved until it fits; a method that does not fit at batch 1 is recorded as "out of memory"
8 anchor     SID-GR's shape at the largest batch that fits, both engines (users/s)
  disc, speculative (with --sections): DISC rounds 1..4; the AtSpeed Table 1 layout with --target and --drafts

A compiled cell times both engines on the eager cell's model, interleaved (its compile in the warm-up batch, before
the timed runs); it runs only when its expected seconds (its compile estimated from the last compile of this run,
scaled by the layers, else from COLD_COMPILE_S; plus its eager cell's seconds) fit in what is left of the budget.

The shapes, and the useful FLOPs per user each cell's fraction counts, are gpu_shapes.py's; --plan is gpu_plan.py.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from decoding.beam import Recommendations, beam_search
from decoding.catalog import Catalog
from decoding.compiled import compile_totals
from decoding.memory import decode_bytes_per_user, fit_batch, free_device_memory
from decoding.metrics import same_within_ties, topk_agreement
from decoding.models import pick_device, tiny_model
from decoding.reference import cpu_trie, generate_beam_search
from decoding.speculative import speculative_beam_search
from pipeline.bench import disc, shapes, speculative
from pipeline.bench.budget import Cell, run_cells, write_atomic
from pipeline.bench.common import (
    Interleaved,
    Timing,
    aligned,
    fmt_ratio,
    fmt_spread,
    footer,
    hardware,
    interleaved,
    ratio,
    report,
    report_head,
    spread,
    synchronize,
    versions,
    write_result,
)
from pipeline.bench.decode import synthetic_token_catalog
from pipeline.bench.gpu_plan import H100_MATMUL_FRACTION, plan_result, shape_s
from pipeline.bench.gpu_shapes import DTYPES, Shape, grid, prior_compile_s, qwen, sid_gr, useful_flops
from pipeline.bench.inputs import in_batches, llama, random_prompts, ranked
from pipeline.bench.params import GPU_SECTIONS, DiscParams, GpuParams, SpeculativeParams
from pipeline.markdown import table

TIE = {"float32": 1e-4, "bfloat16": 4e-2, "float16": 8e-3}  # two engines in one dtype (tests/test_engine.py SAME_DTYPE)
TIE_EXACT = {"float32": 1e-4, "bfloat16": 0.2, "float16": 0.04}  # half against float32 (tests/test_engine.py BOUNDS)
OOM = "out of memory"
SID_GR_MS = {8: 93.2, 1: 17.6}  # NVIDIA recsys-examples SID-GR on an H100: ms per batch of 8, and at batch 1


@dataclass
class Bench:
    """What the cells of one run share: the parameters, device, dtype and data, the matmul rate once measured, the
    compiles measured so far ((layers, seconds) each), and the model kept for the cells of one shape."""

    p: GpuParams
    device: torch.device
    dtype: torch.dtype
    data: Path
    rate: float | None = None
    compiles: list = field(default_factory=list)
    kept: tuple | None = None  # (shape key, model, catalog)
    eager_s: dict = field(default_factory=dict)  # shape name -> seconds of its eager cell
    memory: int | None = None  # a CUDA device's bytes (eager cells' estimates are a GPU's: none on a CPU)

    def model_for(self, shape: Shape) -> tuple:
        """The shape's random model and catalog on the device: the kept ones when the last shape had the same
        model and catalog (the compiled cell after its eager cell), else built (the kept ones freed first)."""
        key = (shape.arch, shape.vocab, tuple(sorted(shape.model.items())), shape.items, shape.code_len)
        if self.kept and self.kept[0] == key:
            return self.kept[1:]
        self.release()
        with torch.device(self.device):  # initialised where it runs
            model = tiny_model(shape.arch, shape.vocab, seed=self.p.seed, dtype=self.dtype, **shape.model)
        model = model.to(self.device)
        if shape.items:
            catalog = synthetic_token_catalog(shape.items, shape.code_len, 256, self.p.seed, self.device, shape.vocab)
        else:
            catalog = shapes.catalog_after_text(str(self.data / "items.parquet"), shape.vocab, self.device)
        self.kept = (key, model, catalog)
        return model, catalog

    def release(self) -> None:
        self.kept = None
        free(self.device)


def run_gpu(p: GpuParams, command: str, started: float | None = None) -> tuple[dict, str]:
    """Every cell of `p` in order under p.budget_s, counted from `started` (time.monotonic(); the command line passes
    the process's start, so that its imports and the data's preparation count; a call from Python counts from the
    call), the report (p.out/gpu.{json,md}, and the dated page in p.page) rewritten after each -> (result, Markdown)."""
    started = time.monotonic() if started is None else started
    if p.plan:
        return plan_result(p, command)
    device = gpu_device(p)
    b = Bench(p, device, torch.float32 if p.smoke else torch.bfloat16, prepared(Path(p.data)))
    if device.type == "cuda":
        b.memory = torch.cuda.get_device_properties(device).total_memory
    result = {
        **report_head(p, command),
        "hardware": hardware(device, "auto"),
        "versions": versions(),
        "dtype": str(b.dtype).removeprefix("torch."),
        "budget_s": p.budget_s,
    }
    t0 = time.perf_counter()

    def write(rows: list[dict]) -> None:
        result.update(cells=rows, seconds=time.perf_counter() - t0)
        md = markdown_gpu(result)
        write_result(Path(p.out), "gpu", result, md, echo=False)
        if p.page:
            write_page(Path(p.page), result, md)

    cells = gpu_cells(b, command)
    with smoke_stance(p, device):
        run_cells(cells, p.budget_s, write, after=partial(free, device), spent_s=time.monotonic() - started)
    return result, markdown_gpu(result)


def gpu_cells(b: Bench, command: str) -> list[Cell]:
    """The run's cells in order of value (the module's docstring), those of p.sections."""
    p, sections = b.p, set(b.p.sections)
    cells = [Cell("matmul", "matmul", partial(matmul_cell, b))]
    if "anchor" in sections:
        cells += engine_cells(b, sid_gr(p, 8), "anchor") + engine_cells(b, sid_gr(p, 1), "anchor")
    if "qwen" in sections:
        cells += engine_cells(b, qwen(p), "qwen")
    if "auto" in sections:
        cells.append(Cell("engine auto", "auto", partial(engine_auto, b), partial(compile_estimate, b, 2)))
    if "parity" in sections:
        cost = partial(compile_estimate, b, p.layers) if "compiled" in p.engines else None
        cells += [Cell(f"parity {d}", "parity", partial(parity, b, d), cost) for d in DTYPES]
    if "padding" in sections:
        cells.append(Cell("padding", "padding", partial(padding_cell, b)))
    if "shapes" in sections:
        cells += [Cell(s.name, "shapes", partial(measure, b, s, ("beam_search", "transformers"))) for s in grid(p)]
    if "anchor" in sections:
        cells += engine_cells(b, sid_gr(p, None), "anchor")
    if "disc" in sections:
        cells.append(Cell("disc", "disc", partial(disc_cell, b, command)))
    if "speculative" in sections and p.target and p.drafts:
        cells.append(Cell("speculative", "speculative", partial(speculative_cell, b, command)))
    return cells


def padding_cell(b: Bench) -> dict:
    """Beauty's users in input order against ordered by prompt length, at a prefill-heavy prompt (bench padding's
    GPU cell): users/s, target and KV tokens per user, the padding share."""
    from pipeline.bench.padding import gpu_cell

    dtype = str(b.dtype).removeprefix("torch.")
    result, md = gpu_cell(str(b.data), b.p.layers, b.p.hidden, b.p.heads, dtype, b.p.repeats, smoke=b.p.smoke)
    return {"result": result, "markdown": md}


def engine_cells(b: Bench, shape: Shape, kind: str) -> list[Cell]:
    """The eager engine on `shape`; then, with --engines compiled, both engines on the same model, interleaved."""
    eager = Cell(
        f"{shape.name}, eager", kind, partial(measure, b, shape, ("beam_search",)), partial(eager_cost, b, shape)
    )
    if "compiled" not in b.p.engines:
        return [eager]
    both = ("beam_search", "beam_search_compiled")
    return [
        eager,
        Cell(f"{shape.name}, compiled", kind, partial(measure, b, shape, both), partial(compiled_cost, b, shape)),
    ]


def eager_cost(b: Bench, shape: Shape) -> float:
    """An eager cell's expected seconds on a CUDA device: its --plan estimate (gpu_plan.shape_s, an H100's) with its
    FLOP-bound batches at the matmul rate this run measured (the plan's matmul cell expects 0.7 of the H100's peak)
    and its batches sized to this device's memory; 0 (no estimate) before the matmul cell, and on a CPU, where the
    plan's GPU model (launch-bound small batches) does not hold."""
    if not (b.rate and b.memory):
        return 0.0
    return shape_s(shape, ("beam_search",), b.p, b.rate / H100_MATMUL_FRACTION, b.memory)


def compiled_cost(b: Bench, shape: Shape) -> float:
    """A compiled cell's expected seconds: its compile, and its eager cell's seconds (both engines are timed again)."""
    return compile_estimate(b, shape.layers) + b.eager_s.get(shape.name, 0.0)


def compile_estimate(b: Bench, layers: int) -> float:
    """Expected seconds of one bucket's cold compile at `layers`: the last compile of this run scaled by
    COLD_COMPILE_S's growth with layers, else COLD_COMPILE_S itself."""
    if not b.compiles:
        return prior_compile_s(layers)
    measured_layers, seconds = b.compiles[-1]
    return seconds * prior_compile_s(layers) / prior_compile_s(measured_layers)


@contextlib.contextmanager
def smoke_stance(p: GpuParams, device: torch.device):
    """--smoke on a CPU: torch.compile's stance "force_eager" in the block (the compiled engine's code runs, nothing
    compiles: a cold compile costs tens of seconds per bucket on a CPU); elsewhere nothing changes."""
    if not (p.smoke and device.type == "cpu"):
        yield
        return
    with torch.compiler.set_stance("force_eager"):
        yield


def prepared(data: Path) -> Path:
    """`data` when it holds a prepared catalog; else Amazon Beauty as the package ships it, prepared there."""
    if not (data / "items.parquet").is_file():
        from pipeline.prepare import BEAUTY_SOURCE, prepare_beauty

        prepare_beauty(BEAUTY_SOURCE, data)
    return data


def write_page(folder: Path, result: dict, md: str) -> Path:
    """The report as a page to keep (docs/benchmarks/gpu-<device>-<date>.md): when, where, which code and which
    command measured every figure on it, then the report itself."""
    env, hw, ver = result["environment"], result["hardware"], result["versions"]
    device = hw.get("gpu") or env["device"]
    date = time.strftime("%Y-%m-%d", time.gmtime())
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    head = (
        f"# GPU benchmark: {device}, {date}\n\n"
        f"Measured on {date} (UTC) on {device} ({hw.get('gpu_memory_gib', '?')} GiB, CUDA {hw.get('cuda', 'none')}; "
        f"host CPU {hw['cpu']}), torch {ver['torch']}, transformers {ver['transformers']}, commit "
        f"`{ver['git_commit']}`, in {result['seconds'] / 60:.1f} minutes by\n\n```bash\n{env['command']}\n```\n\n"
        "Random weights: the figures are speed and parity, not recommendation quality.\n\n"
    )
    path = folder / f"gpu-{slug}-{date}.md"
    write_atomic(path, head + md + "\n")
    return path


def gpu_device(p: GpuParams) -> torch.device:
    """The CUDA device to run on (the CPU with --smoke); FileNotFoundError, saying how to run it, without one;
    ValueError on an unknown section."""
    device = pick_device(p.device)
    if device.type == "cuda" and not torch.cuda.is_available():  # --device cuda on a machine without one
        raise FileNotFoundError(
            f"bench gpu: --device {p.device} but torch {torch.__version__} sees no CUDA device "
            "(or --device cpu --smoke, at smoke sizes)"
        )
    if device.type != "cuda" and not p.smoke:
        raise FileNotFoundError("bench gpu needs a CUDA device (or --device cpu --smoke, at smoke sizes)")
    unknown = sorted(set(p.sections) - set(GPU_SECTIONS))
    if unknown:
        raise ValueError(f"bench gpu: unknown sections {unknown}; choose from {list(GPU_SECTIONS)}")
    return device


# ------------------------------------------------------------------ the cells


def matmul_cell(b: Bench) -> dict:
    """The device's matmul rate (every later cell's FLOP fractions are of it)."""
    out = matmul_rate(b.device, b.dtype, 256 if b.p.smoke else 8192)
    b.rate = out["flops_per_s"]
    return out


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int = 20) -> dict:
    """The dense [n, n] x [n, n] product rate in `dtype` on `device`: median FLOP/s of `repeats` timed products."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device, dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        seconds.append(time.perf_counter() - t0)
    s = float(np.median(seconds))
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "median_s": s, "flops_per_s": 2 * n**3 / s}


def measure(b: Bench, shape: Shape, methods: tuple) -> dict:
    """The shape's model and catalog (kept from its last cell, or built), each method's batch (halving on out of
    memory), the methods that fit timed interleaved (p.repeats rounds, 1 with --smoke) -> the cell's row."""
    t0, p = time.perf_counter(), b.p
    model, catalog = b.model_for(shape)
    flops = useful_flops(model, shape.prompt, shape.k, catalog.code_len)
    need = decode_bytes_per_user(model, shape.prompt, shape.k, catalog.code_len, b.dtype)
    best = fit_batch(need, free_device_memory(b.device) or 8 << 30, most=4 if p.smoke else 4096)
    users = shape.users or 2 * best
    ids = random_prompts(users, shape.prompt, shape.vocab - catalog.code_len * 256, p.seed + 1, b.device)
    mask = torch.ones_like(ids)
    row = shape_row(shape, model, catalog, flops, best)
    before = compile_totals(model)
    decoders = cell_decoders(model, catalog, shape.k, methods)
    row["methods"], runs = fit_methods(shape, users, p, decoders, ids, mask, best)
    if "beam_search_compiled" in runs:  # its warm-up batch compiled its bucket
        seconds, graphs = (a - z for a, z in zip(compile_totals(model), before))
        row["methods"]["beam_search_compiled"].update(compile_s=seconds, graphs_compiled=graphs)
        b.compiles.append((shape.layers, seconds))
    if runs:
        timed = interleaved(runs, 1 if p.smoke else p.repeats, b.device, warmup={m: lambda: None for m in runs})
        for method, t in timed.timings.items():
            row["methods"][method].update(method_timing(t, row["methods"][method], flops, b.rate))
        row.update(comparisons(row, timed, users))
    if methods == ("beam_search",):
        b.eager_s[shape.name] = time.perf_counter() - t0
    return row


def shape_row(shape: Shape, model, catalog: Catalog, flops: float, best: int) -> dict:
    """What a cell is: its shape, model size, useful FLOPs per user, the largest batch that fits; methods to come."""
    return {
        "shape": shape.name,
        "arch": shape.arch,
        "layers": shape.layers,
        "vocab": shape.vocab,
        "prompt": shape.prompt,
        "k": shape.k,
        "code_len": catalog.code_len,
        "items": len(catalog),
        "dtype": str(model.dtype).removeprefix("torch."),
        "parameters": sum(x.numel() for x in model.parameters()),
        "useful_flops_per_user": flops,
        "fit_batch": best,
        "methods": {},
    }


def cell_decoders(model, catalog: Catalog, k: int, methods: tuple) -> dict:
    """method -> fn(ids, mask) for each of `methods` (beam_search, beam_search_compiled, transformers)."""
    trie = cpu_trie(catalog.to("cpu")) if "transformers" in methods else None
    decoders = {
        "beam_search": lambda i, m: beam_search(model, i, m, catalog, k),
        "beam_search_compiled": lambda i, m: beam_search(model, i, m, catalog, k, engine="compiled"),
        "transformers": lambda i, m: generate_beam_search(model, i, m, catalog, k, trie),
    }
    return {method: decoders[method] for method in methods}


def fit_methods(shape: Shape, users: int, p: GpuParams, decoders: dict, ids, mask, best: int) -> tuple:
    """Each method's batch: the shape's (beam_search's largest that fits, `best`, where None), at most its users,
    halved until it runs -> (method -> its status, batch and users; method -> the call that decodes its users)."""
    status, runs = {}, {}
    for method, decode in decoders.items():
        n = min(users, shape.reference_users or users) if method == "transformers" else users
        batch = min(shape.batches.get(method.removesuffix("_compiled")) or best, n)  # both engines alike
        batch = fitting_batch(decode, method, ids[:n], mask[:n], batch, p.simulate_oom)
        if batch is None:
            status[method] = {"status": OOM}
            continue
        status[method] = {"status": "ok", "batch": batch, "users": n}
        runs[method] = partial(in_batches, decode, ids[:n], mask[:n], batch)
    return status, runs


def fitting_batch(decode, method: str, ids, mask, batch: int, simulate_oom: list[str]) -> int | None:
    """Warms `decode` up on one batch, halving the batch while it runs out of memory -> the batch that ran, or None
    when even one user does not fit. simulate_oom: methods made to run out of memory at every batch (tests)."""
    while batch >= 1:
        try:
            if method in simulate_oom:
                raise torch.OutOfMemoryError(f"simulated out of memory ({method}, batch {batch})")
            decode(ids[:batch], mask[:batch])
            return batch
        except torch.OutOfMemoryError:
            free(ids.device)
            batch //= 2
    return None


def method_timing(t: Timing, x: dict, flops: float, rate: float | None) -> dict:
    """A method's timed runs over its x["users"] users in batches of x["batch"]: seconds, users/s, ms per batch
    (median, min, max) and the useful-FLOP fraction of the matmul `rate` at the median (None without a rate)."""
    ups, batches = t.per(lambda s: x["users"] / s), -(-x["users"] // x["batch"])
    return {
        "seconds": t.to_dict(),
        "users_per_s": ups,
        "ms_per_batch": t.per(lambda s: 1e3 * s / batches),
        "flop_fraction": flops * ups["median"] / rate if rate else None,
    }


def comparisons(row: dict, timed: Interleaved, users: int) -> dict:
    """beam_search's speed-up over transformers and their agreement; the compiled engine's over the eager one and
    theirs (per user: the methods may have decoded different numbers of users)."""
    out, t = {}, {method: per_user(x, row, method) for method, x in timed.timings.items()}
    if {"beam_search", "transformers"} <= set(t):
        out["speedup"] = ratio(t["transformers"], t["beam_search"])
        out.update(agreement(timed.outputs, row["methods"]["transformers"]["users"]))
    if {"beam_search", "beam_search_compiled"} <= set(t):
        out["compiled_speedup"] = ratio(t["beam_search"], t["beam_search_compiled"])
        out["compiled_agreement"] = agreement(timed.outputs, users, "beam_search_compiled", "beam_search")
    return out


def per_user(t: Timing, row: dict, method: str) -> Timing:
    """A Timing in seconds per user (methods that decoded different numbers of users compare per user)."""
    return Timing([s / row["methods"][method]["users"] for s in t.seconds])


def agreement(outputs: dict, users: int, ours: str = "beam_search", ref: str = "transformers") -> dict:
    """One method against another (beam_search vs transformers; the compiled engine vs the eager one) on the first
    `users` users, which both decoded: same items in the same order, largest score gap."""

    def lists(name: str):  # -> item ids, scores [U, K]
        items, scores = ranked(outputs[name])
        return items[:users].cpu(), scores[:users].float().cpu()

    (ours, ours_s), (ref, ref_s) = lists(ours), lists(ref)
    finite = torch.isfinite(ours_s) & torch.isfinite(ref_s)
    return {
        "same_items_same_order": float((ours == ref).all(1).float().mean()),
        "max_abs_score_diff": float((ours_s - ref_s).abs()[finite].max()) if finite.any() else 0.0,
    }


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ the nightly's actor, engine auto


def engine_auto(b: Bench) -> dict:
    """The nightly's actor (operators.recommender.Recommender, compute.engine auto, the trials' short-run rule off)
    decoding the first test users of the data shard by shard on the device, in this process (no Ray) -> its engine
    state, the users/s of the shards after its choice, and the seconds of the whole."""
    import tempfile

    import pyarrow.parquet as pq

    from operators.recommender import Recommender
    from pipeline.config import load_config
    from pipeline.plan import plan_run

    b.release()
    n, batch, k = (48, 16, 5) if b.p.smoke else (4096, 256, 10)
    users = pq.read_table(b.data / "test.parquet", columns=["user_id", "history"])
    users = users.filter(pa_lengths(users) > 0).slice(0, n)
    with tempfile.TemporaryDirectory() as tmp, kept_env("TORCHINDUCTOR_CACHE_DIR"):  # the actor points it at its cache
        settings = auto_settings(b, tmp, k, batch)
        actor = Recommender(replace(plan_run(load_config(None, settings)).spec, trial_users=users))
        t0, after = time.perf_counter(), []
        for a in range(0, users.num_rows, batch):
            t = actor(users.slice(a, batch)).to_pandas()
            metric = json.loads(t[t.kind == "metric"].metrics.iloc[0])
            if actor.engine_auto.choice and metric["engine"] == actor.engine_auto.choice:
                after.append(metric["users_ok"] / metric["wall_s"])
        seconds = time.perf_counter() - t0
    state = actor.engine_auto.state()
    if state["compile_s"]:
        b.compiles.append((2, state["compile_s"]))
    return {
        "users": users.num_rows,
        "batch": batch,
        "dtype": actor.dtype,
        "seconds": seconds,
        "state": state,
        "users_per_s_after": spread(after) if after else None,
    }


@contextlib.contextmanager
def kept_env(name: str):
    """The environment variable `name` as it was before the block, after it."""
    before = os.environ.get(name)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def auto_settings(b: Bench, tmp: str, k: int, batch: int) -> list[str]:
    """The nightly config's settings for the auto cell: the data's test users and catalog, --target or the demo
    target's architecture with random weights (the data's code-token tokenizer), engine auto, the device."""
    import shutil

    from decoding.models import build_model, load_tokenizer
    from decoding.templates import PRESETS, write_template

    target = b.p.target
    if target is None:
        target = str(Path(tmp) / "target")
        tok = load_tokenizer(b.data / "tokenizer")
        build_model(len(tok), 2, 128, 4, 2, seed=b.p.seed).save_pretrained(target)
        for f in (b.data / "tokenizer").iterdir():
            shutil.copy(f, Path(target) / f.name)
        write_template(target, PRESETS["codes"])
    return [
        f"input={b.data / 'test.parquet'}",
        f"catalog={b.data / 'items.parquet'}",
        f"output={tmp}/out",
        f"models.target={target}",
        "models.draft=null",
        f"decoding.k={k}",
        f"compute.batch_size={batch}",
        "compute.engine=auto",
        "compute.engine_short_run_s=0",
        f"compute.gpus_per_actor={1 if b.device.type == 'cuda' else 0}",
        f"compute.compile_cache={tmp}/compile",
    ]


def pa_lengths(table):
    import pyarrow.compute as pc

    return pc.fill_null(pc.list_value_length(table["history"]), 0).to_numpy()


# ------------------------------------------------------------------ parity, DISC, speculative


def parity(b: Bench, dtype: str) -> dict:
    """beam_search vs transformers and strict speculative vs beam_search in `dtype`, random Llama target and draft."""
    p, device = b.p, b.device
    b.release()
    vocab, prompt, users, k, batch = (2048, 16, 2, 5, 2) if p.smoke else (32768, 300, 128, 20, 32)
    catalog = shapes.catalog_after_text(str(b.data / "items.parquet"), vocab, device)
    target, draft = parity_models(p, vocab, getattr(torch, dtype), device)
    ids = random_prompts(users, prompt, vocab - catalog.code_len * 256, p.seed, device)
    mask = torch.ones_like(ids)
    mask[1::2, : prompt // 4] = 0  # every other user left-padded
    trie = cpu_trie(catalog.to("cpu"))
    exact = copy.deepcopy(target).float() if dtype != "float32" else target  # the same weights, in float32
    others = {
        "transformers": lambda i, m: generate_beam_search(exact, i, m, catalog, k, trie),
        "speculative": lambda i, m: speculative_beam_search(target, draft, i, m, catalog, k),
    }
    if "compiled" in p.engines:
        others["compiled"] = lambda i, m: beam_search(target, i, m, catalog, k, engine="compiled")
    reference = partial(in_batches, lambda i, m: beam_search(target, i, m, catalog, k), ids, mask, batch)
    out = {"dtype": dtype, "users": users, "k": k, "vocab": vocab, "prompt": prompt}
    for name, other in others.items():
        tie = TIE_EXACT[dtype] if name == "transformers" else TIE[dtype]
        out[name] = parity_counts(Recommendations.concat(reference()), in_batches(other, ids, mask, batch), tie)
    if "compiled" in others:
        b.compiles.append((p.layers, compile_totals(target)[0]))
    return out


def parity_models(p: GpuParams, vocab: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """A random Llama target of p.layers x p.hidden and a one-layer draft of half its width, in `dtype`."""
    target = llama(p.hidden, p.layers, p.heads)
    draft = llama(p.hidden // 2, 1, p.heads, mlp=2 * p.hidden)
    return tuple(
        tiny_model("llama", vocab, seed=seed, max_position_embeddings=2048, dtype=dtype, **shape).to(device)
        for seed, shape in ((p.seed, target), (p.seed + 1, draft))
    )


def parity_counts(ref: Recommendations, outputs: list, tie: float) -> dict:
    """Another decoder's outputs (over batches) against beam_search's `ref` in the same dtype: users with identical
    lists, users clear of a near-tie (ref's tie_gap >= tie) and of them those with the same list up to exact ties,
    the largest score difference of an item both lists hold."""
    items, scores = ranked(outputs)  # [U, K]
    clear = (ref.stats["tie_gap"] >= tie).cpu()  # [U]
    same = same_within_ties(ref.item_ids.cpu(), ref.scores.cpu(), items.cpu(), tie) & clear  # [U]
    agree = topk_agreement(ref.item_ids, ref.scores, items, scores)
    return {
        "clear_users": int(clear.sum()),
        "clear_users_identical": int(same.sum()),
        "identical": int(agree["identical"].sum()),
        "max_abs_score_diff": float(agree["score_diff"].max()),
        "tie": tie,
    }


def disc_cell(b: Bench, command: str) -> dict:
    """DISC rounds 1..4 against constrained sampling and beam_search on the run's random Llama: 256 users in batches
    of 128 (4 in 2 with --smoke) -> its section and Markdown."""
    b.release()
    p = b.p
    params = DiscParams(
        data=str(b.data),
        device=p.device,
        users=4 if p.smoke else 256,
        batch=2 if p.smoke else 128,
        max_rounds=4,
        repeats=1 if p.smoke else p.repeats,
        dtype=str(b.dtype).removeprefix("torch."),
        layers=p.layers,
        hidden=p.hidden,
        heads=p.heads,
    )
    section, md = report(params, command, disc.run_disc, disc.markdown_disc)
    return {"disc": section["disc"], "markdown": md}


def speculative_cell(b: Bench, command: str) -> dict:
    """The AtSpeed Table 1 layout on --target and --drafts, K in 1 5 10 20, without transformers."""
    b.release()
    p = b.p
    params = SpeculativeParams(
        data=str(b.data),
        device=p.device,
        target=p.target,
        drafts=list(p.drafts),
        ks=[1, 10] if p.smoke else [1, 5, 10, 20],
        users=2 if p.smoke else 20,
        batch=2 if p.smoke else 64,
        throughput_users=4 if p.smoke else 256,
        repeats=1 if p.smoke else p.repeats,
        with_transformers=False,
        dtype=str(b.dtype).removeprefix("torch."),
    )
    section, md = report(params, command, speculative.run_speculative, speculative.markdown_speculative)
    return {"speculative": section["speculative"], "markdown": md}


# ------------------------------------------------------------------ the report


def ok_rows(result: dict, kind: str) -> list[dict]:
    """The rows of `kind` cells that ran to the end."""
    return [r for r in result.get("cells", []) if r["kind"] == kind and r["status"] == "ok"]


def markdown_gpu(result: dict) -> str:
    h, rows = result["hardware"], result.get("cells", [])
    lines = [
        f"# genrec-batch on {h.get('gpu', h['device'])}: parity and benchmarks",
        "",
        f"{result.get('seconds', 0) / 60:.1f} min of a {result['budget_s']:.0f} s budget; torch "
        f"{result['versions']['torch']}, transformers {result['versions']['transformers']}, commit "
        f"{result['versions']['git_commit']}",
        "",
        table(["cell", "status", "seconds"], [status_row(r) for r in rows], aligned(2, 1)),
    ]
    for mm in ok_rows(result, "matmul"):
        lines += [
            "",
            f"Matrix-product rate measured in this run ({mm['dtype']}, [{mm['n']}, {mm['n']}] x [{mm['n']}, "
            f"{mm['n']}]): **{mm['flops_per_s'] / 1e12:.1f} TFLOP/s**; every cell's useful-FLOP fraction is of it.",
        ]
    if ok_rows(result, "anchor"):
        lines += markdown_anchor(ok_rows(result, "anchor"))
    if ok_rows(result, "qwen"):
        lines += markdown_qwen(ok_rows(result, "qwen"))
    both = [r for r in ok_rows(result, "anchor") + ok_rows(result, "qwen") if "compiled_speedup" in r]
    if both:
        lines += markdown_engines(both, result["dtype"])
    for a in ok_rows(result, "auto"):
        lines += markdown_auto(a)
    if ok_rows(result, "parity"):
        lines += markdown_parity(ok_rows(result, "parity"))
    if ok_rows(result, "shapes"):
        lines += markdown_grid(ok_rows(result, "shapes"), result["dtype"])
    lines += [f"\n{r['markdown']}" for r in ok_rows(result, "padding") + ok_rows(result, "disc")]
    lines += [f"\n{r['markdown']}" for r in ok_rows(result, "speculative")]
    return "\n".join(lines + ["", footer(result["environment"])])


def status_row(r: dict) -> list:
    """A cell, its status (an error with its message), and its seconds."""
    status = f"error: {r['error']}" if r["status"] == "error" else r["status"]
    return [r["cell"], status[:300].replace("\n", " "), f"{r['seconds']:.1f}" if "seconds" in r else "-"]


def markdown_auto(a: dict) -> list[str]:
    """The auto cell: the actor's choice and the evidence behind it."""
    s = a["state"]
    trials = ", ".join(f"{m} {v:.1f}" for m, v in s["trial_users_per_s"].items() if v)
    ok = sum(x["identical_clear"] for x in s["parity"])
    clear = sum(x["clear"] for x in s["parity"])
    after = a["users_per_s_after"]
    return [
        "",
        f"## The nightly's actor with `compute.engine: auto` ({a['users']} users, batches of {a['batch']}, "
        f"{a['dtype']})",
        "",
        f"- choice: **{s['choice']}** on {s['device']}: {s['reason']}",
        f"- trials ({s['trial_batches']} batches, users/s): {trials}; compile {s['compile_s']:.1f} s",
        f"- parity: {ok} of {clear} users clear of a near-tie identical; largest score difference "
        f"{max((x['max_score_diff'] for x in s['parity']), default=0):.2e} (bound "
        f"{max((x['bound'] for x in s['parity']), default=0):.2e})",
        f"- after the choice: {fmt_spread(after, 1)} users/s per shard; {a['seconds']:.1f} s in all"
        if after
        else f"- {a['seconds']:.1f} s in all",
    ]


def markdown_parity(parity: list[dict]) -> list[str]:
    """A row per dtype x decoder compared: identical lists, users clear of a near-tie and of them identical."""
    header = (
        "dtype | against | users (every other left-padded) | identical lists | clear of a near-tie (TIE) | "
        "of them identical | max score diff"
    ).split(" | ")
    rows = [
        [
            r["dtype"],
            f"beam_search vs {'transformers float32' if name == 'transformers' else name}",
            r["users"],
            r[name]["identical"],
            f"{r[name]['clear_users']} ({r[name]['tie']:g})",
            r[name]["clear_users_identical"],
            f"{r[name]['max_abs_score_diff']:.2e}",
        ]
        for r in parity
        for name in ("transformers", "speculative", "compiled")
        if name in r
    ]
    title = "## parity: float32 identical to transformers; half precision on users clear of a near-tie"
    return ["", title, "", table(header, rows, aligned(2, 5))]


def markdown_grid(cells: list[dict], dtype: str) -> list[str]:
    """The shapes grid: users/s (batch) of beam_search and transformers, the speed-up, FLOP fractions, agreement."""
    header = (
        "vocabulary | prompt | K | beam_search users/s (batch) | transformers users/s (batch) | speed-up | "
        "useful-FLOP fraction beam_search / transformers | same items, same order"
    ).split(" | ")
    return [
        "",
        f"## shapes: beam_search vs transformers beam search ({dtype}, random Llama), users/s "
        "median (min-max); batch: beam_search's largest that fits, transformers' halved until it fits",
        "",
        table(header, [grid_row(c) for c in cells]),
    ]


def grid_row(c: dict) -> list:
    """One shape: each method's users/s (batch) or out of memory, the speed-up, FLOP fractions, agreement."""
    ours, ref = c["methods"]["beam_search"], c["methods"].get("transformers", {"status": OOM})
    return [
        f"{c['vocab']:,}",
        c["prompt"],
        c["k"],
        method_cell(ours),
        method_cell(ref),
        fmt_ratio(c["speedup"], 1) if "speedup" in c else "-",
        f"{fraction(ours)} / {fraction(ref)}",
        same_cell(c),
    ]


ENGINE_HEADER = "cell | engine | batch | ms per batch | users/s | useful-FLOP fraction".split(" | ")


def markdown_anchor(rows: list[dict]) -> list[str]:
    """SID-GR's shape: ms per batch beside NVIDIA's at the same batch, users/s, FLOP fraction, per cell and engine."""
    a0 = rows[0]
    header = ENGINE_HEADER[:4] + ["NVIDIA recsys-examples (H100)", "genrec-batch / NVIDIA rate"] + ENGINE_HEADER[4:]
    body = []
    for r in rows:
        for method, x in r["methods"].items():
            line = engine_row(r, method, x)
            ref = SID_GR_MS.get(x.get("batch"))
            theirs = (
                [f"{ref} ms", f"{ref / x['ms_per_batch']['median']:.2f}x"] if ref and "ms_per_batch" in x else ["-"] * 2
            )
            body.append(line[:4] + theirs + line[4:])
    return [
        "",
        f"## anchor: NVIDIA SID-GR's shape ({a0['arch']}, {a0['parameters'] / 1e9:.2f}B parameters, "
        f"vocabulary {a0['vocab']:,}, context {a0['prompt']}, beam {a0['k']}, {a0['code_len']} code "
        f"tokens, {a0['items']:,} items, {a0['dtype']})",
        "",
        table(header, body, aligned(2, 6)),
    ]


def markdown_qwen(rows: list[dict]) -> list[str]:
    """Qwen2.5-0.5B's shape: ms per batch, users/s and FLOP fraction per engine, at the largest batch that fits."""
    r0 = rows[0]
    body = [engine_row(r, method, x) for r in rows for method, x in r["methods"].items()]
    return [
        "",
        f"## Qwen2.5-0.5B's shape ({r0['arch']}, {r0['parameters'] / 1e9:.2f}B parameters, vocabulary "
        f"{r0['vocab']:,}, prompt {r0['prompt']}, K {r0['k']}, Beauty's {r0['items']:,} items, {r0['dtype']}; "
        f"largest batch that fits: {r0['fit_batch']})",
        "",
        table(ENGINE_HEADER, body, aligned(2, 4)),
    ]


def engine_row(r: dict, method: str, x: dict) -> list:
    """One engine in one cell: batch, ms per batch, users/s, FLOP fraction (out of memory where it did not fit)."""
    engine = "compiled" if method == "beam_search_compiled" else "eager"
    if x["status"] != "ok":
        return [r["cell"], engine, "-", OOM, "-", "-"]
    return [
        r["cell"],
        engine,
        x["batch"],
        fmt_spread(x["ms_per_batch"], 1),
        fmt_spread(x["users_per_s"], 1),
        fraction(x),
    ]


def markdown_engines(cells: list[dict], dtype: str) -> list[str]:
    """beam_search's eager vs compiled engine in every cell that ran both."""
    rows = [engines_row(c) for c in cells]
    header = (
        "cell | eager users/s (batch) | compiled users/s (batch) | compiled / eager | compile s (graphs) | "
        "useful-FLOP fraction eager / compiled | same items, same order"
    ).split(" | ")
    title = (
        f"## engines: beam_search eager vs compiled ({dtype}), users/s median (min-max); "
        "compile: seconds and graphs of the warm-up batch (before the timed runs)"
    )
    return ["", title, "", table(header, rows, aligned(1, 6))]


def engines_row(c: dict) -> list:
    """One cell's eager and compiled engines: users/s (batch), the speed-up, compile time, FLOP fractions, agreement."""
    eager, comp = c["methods"]["beam_search"], c["methods"]["beam_search_compiled"]
    return [
        c["cell"],
        method_cell(eager),
        method_cell(comp),
        fmt_ratio(c["compiled_speedup"]),
        f"{comp['compile_s']:.1f} ({comp['graphs_compiled']})",
        f"{fraction(eager)} / {fraction(comp)}",
        same_cell(c["compiled_agreement"]),
    ]


def method_cell(x: dict) -> str:
    return OOM if x["status"] != "ok" else f"{fmt_spread(x['users_per_s'], 1)} ({x['batch']})"


def fraction(x: dict) -> str:
    return f"{x['flop_fraction']:.1%}" if x.get("status") == "ok" and x.get("flop_fraction") is not None else "-"


def same_cell(ag: dict) -> str:
    """'100% (max score diff 1.2e-06)': an agreement's share of identical lists and its largest score difference."""
    if "same_items_same_order" not in ag:
        return "-"
    return f"{ag['same_items_same_order']:.0%} (max score diff {ag['max_abs_score_diff']:.1e})"
