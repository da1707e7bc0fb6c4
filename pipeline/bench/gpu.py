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
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from decoding.beam import beam_search
from decoding.compiled import compile_totals
from decoding.memory import decode_bytes_per_user, fit_batch, free_device_memory
from decoding.metrics import same_within_ties, topk_agreement
from decoding.models import pick_device, tiny_model
from decoding.reference import cpu_trie, generate_beam_search
from decoding.speculative import speculative_beam_search
from pipeline.bench import disc, shapes, speculative
from pipeline.bench.common import (
    Timing,
    environment,
    fmt_ratio,
    fmt_spread,
    footer,
    hardware,
    interleaved,
    progress,
    ratio,
    synchronize,
    versions,
)
from pipeline.bench.decode import synthetic_token_catalog
from pipeline.bench.params import GPU_SECTIONS, DiscParams, GpuParams, SpeculativeParams

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
    t0, half = time.perf_counter(), torch.float32 if p.smoke else torch.bfloat16
    result = {
        "args": asdict(p),
        "environment": environment(p.device, command),
        "hardware": hardware(device, "auto"),
        "versions": versions(),
        "dtype": str(half).removeprefix("torch."),
        "matmul": matmul_rate(device, half, 256 if p.smoke else 8192),
    }
    rate = result["matmul"]["flops_per_s"]
    md = {}
    if "parity" in p.sections:
        result["parity"] = []
        for dtype in ("float32", "bfloat16", "float16"):
            result["parity"].append(parity(p, dtype, device))
            free(device)  # the dtype's models died with parity's frame
    compiled = ("beam_search_compiled",) if "compiled" in p.engines else ()
    if "shapes" in p.sections:
        result["shapes"] = [
            run_cell(c, p, device, half, rate, ("beam_search", "transformers") + compiled)
            for c in progress(shape_cells(p), "gpu: shapes", leave=True)
        ]
    if "anchor" in p.sections:
        result["anchor"] = anchor(p, device, half, rate, ("beam_search",) + compiled)
    if "disc" in p.sections:
        section, md["disc"] = disc.run_disc(
            DiscParams(
                data=p.data,
                device=p.device,
                users=4 if p.smoke else 256,
                batch=2 if p.smoke else 128,
                max_rounds=4,
                repeats=1 if p.smoke else p.repeats,
                dtype=result["dtype"],
                layers=p.layers,
                hidden=p.hidden,
                heads=p.heads,
            ),
            command,
        )
        result["disc"] = section["disc"]
    if "speculative" in p.sections and p.target and p.drafts:
        section, md["speculative"] = speculative.run_speculative(
            SpeculativeParams(
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
                dtype=result["dtype"],
            ),
            command,
        )
        result["speculative"] = section["speculative"]
    result["seconds"] = time.perf_counter() - t0
    return result, markdown_gpu(result, md)


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
    model = dict(
        hidden_size=p.hidden,
        intermediate_size=4 * p.hidden,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.heads,
        max_position_embeddings=2048,
    )
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
    if p.smoke:
        model, vocab, k, prompt, items = (
            dict(
                hidden_size=64,
                intermediate_size=192,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                max_position_embeddings=512,
            ),
            4096,
            8,
            40,
            2000,
        )
    else:
        model, vocab, k, prompt, items = QWEN3_1_7B, 151936, 256, 1000, 1_000_000
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
        rows.append(run_cell(cell, p, device, dtype, rate, methods))
    return rows


def run_cell(
    cell: Cell,
    p: GpuParams,
    device: torch.device,
    dtype: torch.dtype,
    rate: float,
    methods: tuple = ("beam_search", "transformers"),
) -> dict:
    """`measure_cell`, then everything it built freed (its model, catalog and outputs die with its frame)."""
    row = measure_cell(cell, p, device, dtype, rate, methods)
    free(device)
    return row


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
    if not cell.users:  # the best batch: as many users as two such batches
        cell.users = 2 * best
    g = torch.Generator().manual_seed(p.seed + 1)
    ids = torch.randint(4, cell.vocab - catalog.code_len * 256, (cell.users, cell.prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    trie = cpu_trie(catalog.to("cpu")) if "transformers" in methods else None
    decoders = {
        "beam_search": lambda i, m: beam_search(model, i, m, catalog, cell.k),
        "beam_search_compiled": lambda i, m: beam_search(model, i, m, catalog, cell.k, engine="compiled"),
        "transformers": lambda i, m: generate_beam_search(model, i, m, catalog, cell.k, trie),
    }
    row = {
        "cell": cell.name,
        "arch": cell.arch,
        "vocab": cell.vocab,
        "prompt": cell.prompt,
        "k": cell.k,
        "code_len": catalog.code_len,
        "items": len(catalog),
        "dtype": str(dtype).removeprefix("torch."),
        "parameters": sum(x.numel() for x in model.parameters()),
        "useful_flops_per_user": flops,
        "fit_batch": best,
        "methods": {},
    }
    runs = {}
    for method in methods:
        users = min(cell.users, cell.reference_users or cell.users) if method == "transformers" else cell.users
        batch = min(cell.batches.get(method.removesuffix("_compiled")) or best, users)  # both engines alike
        batch = fitting_batch(decoders[method], method, ids[:users], mask[:users], batch, p.simulate_oom)
        if batch is None:
            row["methods"][method] = {"status": OOM}
            continue
        row["methods"][method] = {"status": "ok", "batch": batch, "users": users}
        if method == "beam_search_compiled":  # the warm-up batch compiled its bucket
            seconds, graphs = compile_totals(model)
            row["methods"][method].update(compile_s=seconds, graphs_compiled=graphs)
        runs[method] = (lambda f, u, b: lambda: decode_all(f, ids[:u], mask[:u], b))(decoders[method], users, batch)
    if runs:
        timed = interleaved(runs, 1 if p.smoke else p.repeats, device, warmup={m: lambda: None for m in runs})
        for method, t in timed.timings.items():
            x = row["methods"][method]
            ups, batches = t.per(lambda s, u=x["users"]: u / s), -(-x["users"] // x["batch"])
            x.update(
                seconds=t.to_dict(),
                users_per_s=ups,
                ms_per_batch=t.per(lambda s, n=batches: 1e3 * s / n),
                flop_fraction=flops * ups["median"] / rate,
            )
        if {"beam_search", "transformers"} <= set(runs):
            row["speedup"] = ratio(
                per_user(timed.timings["transformers"], row, "transformers"),
                per_user(timed.timings["beam_search"], row, "beam_search"),
            )
            row.update(agreement(timed.outputs, row["methods"]["transformers"]["users"]))
        if {"beam_search", "beam_search_compiled"} <= set(runs):
            row["compiled_speedup"] = ratio(
                per_user(timed.timings["beam_search"], row, "beam_search"),
                per_user(timed.timings["beam_search_compiled"], row, "beam_search_compiled"),
            )
            row["compiled_agreement"] = agreement(timed.outputs, cell.users, "beam_search_compiled", "beam_search")
    return row


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


def decode_all(decode, ids, mask, batch: int) -> list:
    return [decode(ids[a : a + batch], mask[a : a + batch]) for a in range(0, ids.shape[0], batch)]


def per_user(t: Timing, row: dict, method: str) -> Timing:
    """A Timing in seconds per user (methods that decoded different numbers of users compare per user)."""
    return Timing([s / row["methods"][method]["users"] for s in t.seconds])


def agreement(outputs: dict, users: int, ours: str = "beam_search", ref: str = "transformers") -> dict:
    """One method against another (beam_search vs transformers; the compiled engine vs the eager one) on the first
    `users` users, which both decoded: same items in the same order, largest score gap."""

    def lists(name: str):  # -> item ids, scores [U, K]
        out = outputs[name]
        items, scores = (
            ([r[0] for r in out], [r[2] for r in out])
            if name == "transformers"
            else ([r.item_ids for r in out], [r.scores for r in out])
        )
        return torch.cat(items)[:users].cpu(), torch.cat(scores)[:users].float().cpu()

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
    torch_dtype = getattr(torch, dtype)
    target = tiny_model(
        "llama",
        vocab,
        seed=p.seed,
        hidden_size=p.hidden,
        intermediate_size=4 * p.hidden,
        num_hidden_layers=p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.heads,
        max_position_embeddings=2048,
        dtype=torch_dtype,
    ).to(device)
    draft = tiny_model(
        "llama",
        vocab,
        seed=p.seed + 1,
        hidden_size=p.hidden // 2,
        intermediate_size=2 * p.hidden,
        num_hidden_layers=1,
        num_attention_heads=p.heads,
        num_key_value_heads=p.heads,
        max_position_embeddings=2048,
        dtype=torch_dtype,
    ).to(device)
    g = torch.Generator().manual_seed(p.seed)
    ids = torch.randint(4, vocab - catalog.code_len * 256, (users, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1::2, : prompt // 4] = 0  # every other user left-padded
    trie = cpu_trie(catalog.to("cpu"))
    exact = copy.deepcopy(target).float() if dtype != "float32" else target  # the same weights, in float32
    out = {"dtype": dtype, "users": users, "k": k, "vocab": vocab, "prompt": prompt}
    others = {
        "transformers": lambda i, m: generate_beam_search(exact, i, m, catalog, k, trie),
        "speculative": lambda i, m: speculative_beam_search(target, draft, i, m, catalog, k),
    }
    if "compiled" in p.engines:
        others["compiled"] = lambda i, m: beam_search(target, i, m, catalog, k, engine="compiled")
    for name, other in others.items():
        tie = TIE_EXACT[dtype] if name == "transformers" else TIE[dtype]
        clear = same = identical = 0
        worst = 0.0
        for a in range(0, users, batch):
            i, m = ids[a : a + batch], mask[a : a + batch]
            ref = beam_search(target, i, m, catalog, k)
            got = other(i, m)
            items, scores = (got[0], got[2]) if name == "transformers" else (got.item_ids, got.scores)
            ok = (ref.stats["tie_gap"] >= tie).cpu()
            clear += int(ok.sum())
            same += int((same_within_ties(ref.item_ids.cpu(), ref.scores.cpu(), items.cpu(), tie) & ok).sum())
            agree = topk_agreement(ref.item_ids, ref.scores, items, scores)
            identical += int(agree["identical"].sum())
            worst = max(worst, float(agree["score_diff"].max()))
        out[name] = {
            "clear_users": clear,
            "clear_users_identical": same,
            "identical": identical,
            "max_abs_score_diff": worst,
            "tie": tie,
        }
    return out


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
        lines += [
            "",
            "## parity: float32 identical to transformers; half precision on users clear of a near-tie",
            "",
            "| dtype | against | users (every other left-padded) | identical lists | clear of a near-tie (TIE) | "
            "of them identical | max score diff |",
            "|---|---|---:|---:|---:|---:|---:|",
        ]
        for r in result["parity"]:
            for name in [n for n in ("transformers", "speculative", "compiled") if n in r]:
                x = r[name]
                against = "transformers float32" if name == "transformers" else name
                lines.append(
                    f"| {r['dtype']} | beam_search vs {against} | {r['users']} | {x['identical']} | "
                    f"{x['clear_users']} ({x['tie']:g}) | {x['clear_users_identical']} | "
                    f"{x['max_abs_score_diff']:.2e} |"
                )
    if "shapes" in result:
        lines += [
            "",
            f"## shapes: beam_search vs transformers beam search ({result['dtype']}, random Llama), users/s "
            "median (min-max); batch: beam_search's largest that fits, transformers' halved until it fits",
            "",
            "| vocabulary | prompt | K | beam_search users/s (batch) | transformers users/s (batch) | speed-up "
            "| useful-FLOP fraction beam_search / transformers | same items, same order |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for c in result["shapes"]:
            ours, ref = c["methods"]["beam_search"], c["methods"].get("transformers", {"status": OOM})
            lines.append(
                f"| {c['vocab']:,} | {c['prompt']} | {c['k']} | {method_cell(ours)} | {method_cell(ref)} | "
                f"{fmt_ratio(c['speedup'], 1) if 'speedup' in c else '-'} | {fraction(ours)} / "
                f"{fraction(ref)} | "
                + (
                    f"{c['same_items_same_order']:.0%} (max score diff {c['max_abs_score_diff']:.1e})"
                    if "same_items_same_order" in c
                    else "-"
                )
                + " |"
            )
    if "anchor" in result:
        a0 = result["anchor"][0]
        lines += [
            "",
            f"## anchor: NVIDIA SID-GR's shape ({a0['arch']}, {a0['parameters'] / 1e9:.2f}B parameters, "
            f"vocabulary {a0['vocab']:,}, context {a0['prompt']}, beam {a0['k']}, {a0['code_len']} code "
            f"tokens, {a0['items']:,} items, {a0['dtype']})",
            "",
            "| engine | batch | ms per batch | NVIDIA recsys-examples (H100) | genrec-batch / NVIDIA rate | "
            "users/s | useful-FLOP fraction |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in result["anchor"]:
            for method, x in r["methods"].items():
                engine = "compiled" if method == "beam_search_compiled" else "eager"
                if x["status"] != "ok":
                    lines.append(f"| {engine} | - | {OOM} | - | - | - | - |")
                    continue
                ref, ms = SID_GR_MS.get(x["batch"]), x["ms_per_batch"]
                theirs = f"{ref} ms | {ref / ms['median']:.2f}x" if ref else "- | -"
                lines.append(
                    f"| {engine} | {x['batch']} | {fmt_spread(ms, 1)} | {theirs} | "
                    f"{fmt_spread(x['users_per_s'], 1)} | {fraction(x)} |"
                )
    cells = [c for c in result.get("shapes", []) + result.get("anchor", []) if "compiled_speedup" in c]
    if cells:
        lines += [
            "",
            f"## engines: beam_search eager vs compiled ({result['dtype']}), users/s median (min-max); "
            "compile: seconds and graphs of the warm-up batch (before the timed runs)",
            "",
            "| cell | eager users/s (batch) | compiled users/s (batch) | compiled / eager | compile s (graphs) | "
            "useful-FLOP fraction eager / compiled | same items, same order |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c in cells:
            eager, comp, ag = c["methods"]["beam_search"], c["methods"]["beam_search_compiled"], c["compiled_agreement"]
            lines.append(
                f"| {c['cell']} | {method_cell(eager)} | {method_cell(comp)} | "
                f"{fmt_ratio(c['compiled_speedup'])} | {comp['compile_s']:.1f} ({comp['graphs_compiled']}) | "
                f"{fraction(eager)} / {fraction(comp)} | {ag['same_items_same_order']:.0%} (max score diff "
                f"{ag['max_abs_score_diff']:.1e}) |"
            )
    for text in md.values():
        lines += ["", text]
    return "\n".join(lines + ["", footer(result["environment"])])


def method_cell(x: dict) -> str:
    return OOM if x["status"] != "ok" else f"{fmt_spread(x['users_per_s'], 1)} ({x['batch']})"


def fraction(x: dict) -> str:
    return f"{x['flop_fraction']:.1%}" if x.get("status") == "ok" else "-"
