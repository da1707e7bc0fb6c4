"""gpu: the engine's checks and benchmarks on one CUDA device, in one process and one report (at most about 10 minutes
on an H100 for the default sections; `--device cpu --smoke` runs every section at smoke sizes, which the tests check).

matmul       the device's dense matrix-product rate in the benchmark dtype, measured first: every cell's useful-FLOP
             fraction is of this rate
parity       float32: beam_search against transformers beam search must give every user the same list (up to exact
             float32 ties); bfloat16 and float16: the same against transformers in float32 on the same weights (the
             exact ranking) and strict speculative decoding (and, with --engines compiled, the compiled engine)
             against beam_search in that dtype, for every user clear of a near-tie at the k-th place
             (stats["tie_gap"] >= TIE), with the largest score difference of the items both lists hold
shapes       beam_search vs transformers at vocabulary 32k / 152k x prompt 300 / 1000 x K 20 / 50, a random Llama,
             bfloat16; beam_search at the largest batch that fits (decoding/memory.py), transformers at --batch halved
             until it fits; a method that does not fit at batch 1 is recorded as "out of memory"
anchor       NVIDIA recsys-examples SID-GR's published shape (Qwen3-1.7B, context 1000, beam 256, 3 code tokens): ms per
             batch of 8 and per user at batch 1 beside NVIDIA's 93.2 ms and 17.6 ms (H100), and users/s at the
             largest batch that fits
auto         the nightly's actor with compute.engine auto on the device (the Recommender the nightly's Ray actors
             run, called in this process) over 4,096 test users of --data in batches of 256, K 10: a random model
             of the demo architecture (or --target): its choice, each engine's trial users/s, the compile seconds,
             the parity evidence, then users/s with the engine it kept
disc, speculative (with --sections): DISC rounds 1..4 against constrained sampling and beam_search; the AtSpeed
             Table 1 layout with --target and --drafts
--engines eager compiled: the shapes and the anchor run beam_search's compiled engine (decoding/compiled.py: CUDA
             graphs for the tree step) beside the eager one: users/s, FLOP fractions, its compile seconds and graphs
             (compiled during the warm-up batch, before the timed runs), and its agreement with the eager engine

Models are built once per cell and freed before the next. Useful FLOPs per user (the roofline): 2 x the body's
parameters x (prompt + K(L-1)) tokens, plus 2 x hidden x vocabulary x (1 + K(L-1)) head rows (exact scores need each
row's full normaliser); attention's own products are not counted.
"""

from __future__ import annotations

import copy
import gc
import json
import re
import time
from dataclasses import asdict, dataclass, field, replace
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
from pipeline.bench.common import (
    Interleaved,
    Timing,
    aligned,
    environment,
    fmt_ratio,
    fmt_spread,
    footer,
    hardware,
    interleaved,
    progress,
    ratio,
    spread,
    synchronize,
    versions,
)
from pipeline.bench.decode import synthetic_token_catalog
from pipeline.bench.inputs import in_batches, llama, random_prompts, ranked
from pipeline.bench.params import GPU_SECTIONS, DiscParams, GpuParams, SpeculativeParams
from pipeline.markdown import table

TIE = {"float32": 1e-4, "bfloat16": 4e-2, "float16": 8e-3}  # two engines in one dtype (tests/test_engine.py SAME_DTYPE)
TIE_EXACT = {"float32": 1e-4, "bfloat16": 0.2, "float16": 0.04}  # half against float32 (tests/test_engine.py BOUNDS)
OOM = "out of memory"
SID_GR_MS = {8: 93.2, 1: 17.6}  # NVIDIA recsys-examples SID-GR on an H100: ms per batch of 8, and at batch 1
QWEN3_1_7B = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
)

QWEN3_SMOKE = dict(  # the anchor at smoke sizes
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
DTYPES = ("float32", "bfloat16", "float16")  # parity's


@dataclass
class Cell:
    """One shape: a random `arch` model of `model` (tiny_model overrides) over `vocab` tokens, `users` prompts of
    `prompt` tokens, top-`k` over a catalog of `code_len`-token semantic IDs (Beauty's 4-level catalog after the text
    vocabulary, or `items` random ones of 256 codes per level)."""

    name: str
    vocab: int
    prompt: int
    k: int
    users: int
    model: dict
    arch: str = "llama"
    code_len: int = 4
    items: int | None = None
    batches: dict = field(default_factory=dict)  # method -> batch (None: beam_search's largest that fits)
    reference_users: int | None = None  # users given to transformers (its users/s is per user all the same)


def run_gpu(p: GpuParams, command: str) -> tuple[dict, str]:
    device = gpu_device(p)
    t0, half = time.perf_counter(), torch.float32 if p.smoke else torch.bfloat16
    result = {
        "args": asdict(p),
        "environment": environment(p.device, command),
        "hardware": hardware(device, "auto"),
        "versions": versions(),
        "dtype": str(half).removeprefix("torch."),
        "matmul": matmul_rate(device, half, 256 if p.smoke else 8192),
    }
    rate, md = result["matmul"]["flops_per_s"], {}
    compiled = ("beam_search_compiled",) if "compiled" in p.engines else ()
    if "parity" in p.sections:
        result["parity"] = [freed(device, parity(p, dtype, device)) for dtype in DTYPES]
    if "shapes" in p.sections:
        result["shapes"] = [
            freed(device, measure_cell(c, p, device, half, rate, ("beam_search", "transformers") + compiled))
            for c in progress(shape_cells(p), "gpu: shapes", leave=True)
        ]
    if "anchor" in p.sections:
        result["anchor"] = anchor(p, device, half, rate, ("beam_search",) + compiled)
    if "auto" in p.sections:
        result["auto"] = freed(device, engine_auto(p, device))
    if "disc" in p.sections:
        section, md["disc"] = disc.run_disc(disc_params(p, result["dtype"]), command)
        result["disc"] = section["disc"]
    if "speculative" in p.sections and p.target and p.drafts:
        section, md["speculative"] = speculative.run_speculative(speculative_params(p, result["dtype"]), command)
        result["speculative"] = section["speculative"]
    result["seconds"] = time.perf_counter() - t0
    return result, markdown_gpu(result, md)


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
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"gpu-{slug}-{date}.md"
    path.write_text(head + md + "\n")
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


def engine_auto(p: GpuParams, device: torch.device) -> dict:
    """The auto section: the nightly's actor (operators.recommender.Recommender, compute.engine auto, the trials'
    short-run rule off) decoding the first test users of p.data shard by shard on `device` -> its engine state, the
    users/s of the shards after its choice, and the seconds of the whole."""
    import shutil
    import tempfile

    import pyarrow.parquet as pq

    from decoding.models import build_model, load_tokenizer
    from decoding.templates import PRESETS, write_template
    from operators.recommender import Recommender
    from pipeline.config import load_config
    from pipeline.nightly import plan_run

    data, (n, batch, k) = Path(p.data), ((48, 16, 5) if p.smoke else (4096, 256, 10))
    users = pq.read_table(data / "test.parquet", columns=["user_id", "history"])
    users = users.filter(pa_lengths(users) > 0).slice(0, n)
    with tempfile.TemporaryDirectory() as tmp:
        target = p.target
        if target is None:  # the demo target's architecture, random weights, the data's code-token tokenizer
            target = str(Path(tmp) / "target")
            tok = load_tokenizer(data / "tokenizer")
            build_model(len(tok), 2, 128, 4, 2, seed=p.seed).save_pretrained(target)
            for f in (data / "tokenizer").iterdir():
                shutil.copy(f, Path(target) / f.name)
            write_template(target, PRESETS["codes"])
        settings = [
            f"input={data / 'test.parquet'}",
            f"catalog={data / 'items.parquet'}",
            f"output={tmp}/out",
            f"models.target={target}",
            "models.draft=null",
            f"decoding.k={k}",
            f"compute.batch_size={batch}",
            "compute.engine=auto",
            "compute.engine_short_run_s=0",
            f"compute.gpus_per_actor={1 if device.type == 'cuda' else 0}",
            f"compute.compile_cache={tmp}/compile",
        ]
        actor = Recommender(replace(plan_run(load_config(None, settings)).spec, trial_users=users))
        t0, after = time.perf_counter(), []
        for a in range(0, users.num_rows, batch):
            t = actor(users.slice(a, batch)).to_pandas()
            metric = json.loads(t[t.kind == "metric"].metrics.iloc[0])
            if actor.engine_auto.choice and metric["engine"] == actor.engine_auto.choice:
                after.append(metric["users_ok"] / metric["wall_s"])
        seconds = time.perf_counter() - t0
    return {
        "users": users.num_rows,
        "batch": batch,
        "dtype": actor.dtype,
        "seconds": seconds,
        "state": actor.engine_auto.state(),
        "users_per_s_after": spread(after) if after else None,
    }


def pa_lengths(table):
    import pyarrow.compute as pc

    return pc.fill_null(pc.list_value_length(table["history"]), 0).to_numpy()


def markdown_auto(a: dict) -> list[str]:
    """The auto section: the actor's choice and the evidence behind it."""
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


def disc_params(p: GpuParams, dtype: str) -> DiscParams:
    """The disc section on the gpu run's random Llama: 256 users in batches of 128 (4 in 2 with --smoke)."""
    return DiscParams(
        data=p.data,
        device=p.device,
        users=4 if p.smoke else 256,
        batch=2 if p.smoke else 128,
        max_rounds=4,
        repeats=1 if p.smoke else p.repeats,
        dtype=dtype,
        layers=p.layers,
        hidden=p.hidden,
        heads=p.heads,
    )


def speculative_params(p: GpuParams, dtype: str) -> SpeculativeParams:
    """The speculative section on --target and --drafts, K in 1 5 10 20, without transformers."""
    return SpeculativeParams(
        data=p.data,
        device=p.device,
        target=p.target,
        drafts=list(p.drafts),
        ks=[1, 10] if p.smoke else [1, 5, 10, 20],
        users=2 if p.smoke else 20,
        batch=2 if p.smoke else 64,
        throughput_users=4 if p.smoke else 256,
        repeats=1 if p.smoke else p.repeats,
        with_transformers=False,
        dtype=dtype,
    )


# ------------------------------------------------------------------ the roofline


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


def useful_flops(model, prompt: int, k: int, code_len: int) -> float:
    """Per user: the prompt and the K(L-1) tree tokens through the body (2 x its parameters each), plus 1 + K(L-1)
    full-vocabulary head rows."""
    body = sum(p.numel() for name, p in model.base_model.named_parameters() if "embed_tokens" not in name)
    vocab, hidden = model.get_output_embeddings().weight.shape
    tree = k * (code_len - 1)
    return 2.0 * body * (prompt + tree) + 2.0 * hidden * vocab * (1 + tree)


# ------------------------------------------------------------------ one cell: build, fit, time, free


def shape_cells(p: GpuParams) -> list[Cell]:
    """The grid: vocabulary x prompt x K on a random Llama of layers x hidden."""
    model = dict(llama(p.hidden, p.layers, p.heads), max_position_embeddings=2048)
    grid = [(2048, 40, 5)] if p.smoke else [(v, s, k) for v in (32768, 152667) for s in (300, 1000) for k in (20, 50)]
    return [
        Cell(
            f"V={v} S={s} K={k}",
            v,
            s,
            k,
            4 if p.smoke else 64,
            model,
            batches={"beam_search": 2 if p.smoke else None, "transformers": 2 if p.smoke else p.batch},
            reference_users=None if p.smoke else 16,
        )
        for v, s, k in grid
    ]


def anchor(p: GpuParams, device: torch.device, dtype: torch.dtype, rate: float, methods: tuple) -> list[dict]:
    """SID-GR's shape at batch 8, batch 1 and the largest batch that fits (beam_search only: transformers fits one
    user at this shape and takes seconds for it)."""
    model, vocab, k, prompt, items = (
        (QWEN3_SMOKE, 4096, 8, 40, 2000) if p.smoke else (QWEN3_1_7B, 151936, 256, 1000, 1_000_000)
    )
    rows = []
    for batch in (8, 1, None):
        cell = Cell(
            f"SID-GR batch {batch or 'best'}",
            vocab,
            prompt,
            k,
            0,
            model,
            arch="qwen3",
            code_len=3,
            items=items,
            batches={"beam_search": batch},
        )
        cell.users = 2 * (batch or 0) if p.smoke else {8: 32, 1: 8}.get(batch, 0)
        rows.append(freed(device, measure_cell(cell, p, device, dtype, rate, methods)))
    return rows


def freed(device: torch.device, value):
    """`value`, once what its call built is collected (its models, catalog and outputs died with the call's frame)."""
    free(device)
    return value


def measure_cell(
    cell: Cell, p: GpuParams, device: torch.device, dtype: torch.dtype, rate: float, methods: tuple
) -> dict:
    """Builds the cell's model and catalog, finds each method's batch (halving on out-of-memory), times the methods
    that fit interleaved (p.repeats rounds, 1 with --smoke) -> the cell's row."""
    model = tiny_model(cell.arch, cell.vocab, seed=p.seed, dtype=dtype, **cell.model).to(device)
    if cell.items:
        catalog = synthetic_token_catalog(cell.items, cell.code_len, 256, p.seed, device, vocab=cell.vocab)
    else:
        catalog = shapes.catalog_after_text(str(Path(p.data) / "items.parquet"), cell.vocab, device)
    flops = useful_flops(model, cell.prompt, cell.k, catalog.code_len)
    need = decode_bytes_per_user(model, cell.prompt, cell.k, catalog.code_len, dtype)
    best = fit_batch(need, free_device_memory(device) or 8 << 30, most=4 if p.smoke else 4096)
    cell.users = cell.users or 2 * best  # the best batch: as many users as two such batches
    ids = random_prompts(cell.users, cell.prompt, cell.vocab - catalog.code_len * 256, p.seed + 1, device)
    mask = torch.ones_like(ids)
    row = cell_row(cell, model, catalog, flops, best)
    row["methods"], runs = fit_methods(cell, p, cell_decoders(model, catalog, cell.k, methods), ids, mask, best)
    if "beam_search_compiled" in runs:  # its warm-up batch compiled its bucket
        seconds, graphs = compile_totals(model)
        row["methods"]["beam_search_compiled"].update(compile_s=seconds, graphs_compiled=graphs)
    if runs:
        timed = interleaved(runs, 1 if p.smoke else p.repeats, device, warmup={m: lambda: None for m in runs})
        for method, t in timed.timings.items():
            row["methods"][method].update(method_timing(t, row["methods"][method], flops, rate))
        row.update(comparisons(row, timed, cell.users))
    return row


def cell_row(cell: Cell, model, catalog: Catalog, flops: float, best: int) -> dict:
    """What a cell is: its shape, model size, useful FLOPs per user, the largest batch that fits; methods to come."""
    return {
        "cell": cell.name,
        "arch": cell.arch,
        "vocab": cell.vocab,
        "prompt": cell.prompt,
        "k": cell.k,
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


def fit_methods(cell: Cell, p: GpuParams, decoders: dict, ids: torch.Tensor, mask: torch.Tensor, best: int) -> tuple:
    """Each method's batch: the cell's (beam_search's largest that fits, `best`, where None), at most its users,
    halved until it runs -> (method -> its status, batch and users; method -> the call that decodes its users)."""
    status, runs = {}, {}
    for method, decode in decoders.items():
        users = min(cell.users, cell.reference_users or cell.users) if method == "transformers" else cell.users
        batch = min(cell.batches.get(method.removesuffix("_compiled")) or best, users)  # both engines alike
        batch = fitting_batch(decode, method, ids[:users], mask[:users], batch, p.simulate_oom)
        if batch is None:
            status[method] = {"status": OOM}
            continue
        status[method] = {"status": "ok", "batch": batch, "users": users}
        runs[method] = partial(in_batches, decode, ids[:users], mask[:users], batch)
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


def method_timing(t: Timing, x: dict, flops: float, rate: float) -> dict:
    """A method's timed runs over its x["users"] users in batches of x["batch"]: seconds, users/s, ms per batch
    (median, min, max) and the useful-FLOP fraction of the matmul `rate` at the median."""
    ups, batches = t.per(lambda s: x["users"] / s), -(-x["users"] // x["batch"])
    return {
        "seconds": t.to_dict(),
        "users_per_s": ups,
        "ms_per_batch": t.per(lambda s: 1e3 * s / batches),
        "flop_fraction": flops * ups["median"] / rate,
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


# ------------------------------------------------------------------ parity


def parity(p: GpuParams, dtype: str, device: torch.device) -> dict:
    """beam_search vs transformers and strict speculative vs beam_search in `dtype`, random Llama target and draft."""
    vocab, prompt, users, k, batch = (2048, 24, 4, 5, 2) if p.smoke else (32768, 300, 128, 20, 32)
    catalog = shapes.catalog_after_text(str(Path(p.data) / "items.parquet"), vocab, device)
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


# ------------------------------------------------------------------ the report


def markdown_gpu(result: dict, md: dict) -> str:
    h, mm = result["hardware"], result["matmul"]
    lines = [
        f"# genrec-batch on {h.get('gpu', h['device'])}: parity and benchmarks",
        "",
        f"{result['seconds'] / 60:.1f} min; torch {result['versions']['torch']}, transformers "
        f"{result['versions']['transformers']}, commit {result['versions']['git_commit']}",
        "",
        f"Matrix-product rate measured in this run ({mm['dtype']}, [{mm['n']}, {mm['n']}] x [{mm['n']}, "
        f"{mm['n']}]): **{mm['flops_per_s'] / 1e12:.1f} TFLOP/s**; every cell's useful-FLOP fraction is of it.",
    ]
    if "parity" in result:
        lines += markdown_parity(result["parity"])
    if "shapes" in result:
        lines += markdown_grid(result["shapes"], result["dtype"])
    if "anchor" in result:
        lines += markdown_anchor(result["anchor"])
    cells = [c for c in result.get("shapes", []) + result.get("anchor", []) if "compiled_speedup" in c]
    if cells:
        lines += markdown_engines(cells, result["dtype"])
    if "auto" in result:
        lines += markdown_auto(result["auto"])
    for text in md.values():
        lines += ["", text]
    return "\n".join(lines + ["", footer(result["environment"])])


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


def markdown_anchor(anchor: list[dict]) -> list[str]:
    """SID-GR's shape: ms per batch beside NVIDIA's at the same batch, users/s, FLOP fraction, per engine."""
    a0 = anchor[0]
    header = (
        "engine | batch | ms per batch | NVIDIA recsys-examples (H100) | genrec-batch / NVIDIA rate | users/s | "
        "useful-FLOP fraction"
    ).split(" | ")
    rows = [anchor_row(method, x) for r in anchor for method, x in r["methods"].items()]
    return [
        "",
        f"## anchor: NVIDIA SID-GR's shape ({a0['arch']}, {a0['parameters'] / 1e9:.2f}B parameters, "
        f"vocabulary {a0['vocab']:,}, context {a0['prompt']}, beam {a0['k']}, {a0['code_len']} code "
        f"tokens, {a0['items']:,} items, {a0['dtype']})",
        "",
        table(header, rows, aligned(1, 6)),
    ]


def anchor_row(method: str, x: dict) -> list:
    """One engine at one batch of the anchor; NVIDIA's figure where it published one for that batch."""
    engine = "compiled" if method == "beam_search_compiled" else "eager"
    if x["status"] != "ok":
        return [engine, "-", OOM, "-", "-", "-", "-"]
    ref, ms = SID_GR_MS.get(x["batch"]), x["ms_per_batch"]
    theirs = [f"{ref} ms", f"{ref / ms['median']:.2f}x"] if ref else ["-", "-"]
    return [engine, x["batch"], fmt_spread(ms, 1), *theirs, fmt_spread(x["users_per_s"], 1), fraction(x)]


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
    return f"{x['flop_fraction']:.1%}" if x.get("status") == "ok" else "-"


def same_cell(ag: dict) -> str:
    """'100% (max score diff 1.2e-06)': an agreement's share of identical lists and its largest score difference."""
    if "same_items_same_order" not in ag:
        return "-"
    return f"{ag['same_items_same_order']:.0%} (max score diff {ag['max_abs_score_diff']:.1e})"
