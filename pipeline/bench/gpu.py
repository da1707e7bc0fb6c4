"""gpu: the engine's checks and benchmarks on one CUDA device in one command and one report (about 10 minutes on an
H100; `--device cpu --smoke` runs everything at smoke sizes, which is what the tests check).

parity       bfloat16 and float16: beam_search against transformers beam search in the same dtype, and strict
             speculative decoding against beam_search, on a random Llama at a 32k vocabulary with 300-token prompts,
             K = 20: every user clear of a near-tie at the k-th place (stats["tie_gap"] >= TIE) must get the same
             list (up to swaps within TIE); the largest score difference of the items both lists hold
shapes       beam_search vs transformers at vocabulary 32k / 152k x prompt 300 / 1000 x K 20 / 50, bfloat16
speculative  the AtSpeed Table 1 layout with --target and --drafts (skipped without them)
disc         DISC rounds 1..4 against constrained sampling and beam_search, bfloat16
"""
from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

import torch

from decoding.beam import beam_search
from decoding.metrics import same_within_ties
from decoding.models import pick_device, tiny_model
from decoding.reference import cpu_trie, generate_beam_search
from decoding.speculative import speculative_beam_search
from pipeline.bench import disc, shapes, speculative
from pipeline.bench.common import environment, footer, hardware, versions
from pipeline.bench.params import DiscParams, GpuParams, ShapesParams, SpeculativeParams

TIE = {"bfloat16": 4e-2, "float16": 8e-3}  # as tests/test_engine.py: twice the score bound


def run_gpu(p: GpuParams, command: str) -> tuple[dict, str]:
    device = pick_device(p.device)
    if device.type == "cuda" and not torch.cuda.is_available():  # --device cuda on a machine without one
        raise FileNotFoundError(f"bench gpu: --device {p.device} but torch {torch.__version__} sees no CUDA device "
                                "(or --device cpu --smoke, at smoke sizes)")
    if device.type != "cuda" and not p.smoke:
        raise FileNotFoundError("bench gpu needs a CUDA device (or --device cpu --smoke, at smoke sizes)")
    t0, small, half = time.perf_counter(), p.smoke, "float32" if p.smoke else "bfloat16"
    result = {"args": asdict(p), "environment": environment(p.device, command), "hardware": hardware(device, "auto"),
              "versions": versions(), "parity": [parity(p, dtype, device) for dtype in ("bfloat16", "float16")]}
    runs = {"shapes": lambda: shapes.run_shapes(ShapesParams(
                data=p.data, vocabs=[2048] if small else [32768, 152667], prompts=[40] if small else [300, 1000],
                ks=[5] if small else [20, 50], users=4 if small else 64, batch=2 if small else 32, layers=p.layers,
                hidden=p.hidden, heads=p.heads, repeats=1 if small else 3, dtype=half, device=p.device), command),
            "disc": lambda: disc.run_disc(DiscParams(
                data=p.data, device=p.device, users=4 if small else 256, batch=2 if small else 128, max_rounds=4,
                repeats=1 if small else 3, dtype=half, layers=p.layers, hidden=p.hidden, heads=p.heads), command)}
    if p.target and p.drafts:
        runs["speculative"] = lambda: speculative.run_speculative(SpeculativeParams(
            data=p.data, device=p.device, target=p.target, drafts=list(p.drafts), ks=[1, 10] if small else
            [1, 5, 10, 20], users=2 if small else 20, batch=2 if small else 64, throughput_users=4 if small else 256,
            repeats=1 if small else 3, with_transformers=False, dtype=half), command)
    md = {}
    for name, run in runs.items():
        section, md[name] = run()
        result[name] = section[name]
    result["seconds"] = time.perf_counter() - t0
    return result, markdown_gpu(result, md)


def parity(p: GpuParams, dtype: str, device: torch.device) -> dict:
    """beam_search vs transformers and strict speculative vs beam_search in `dtype`, random Llama target and draft."""
    vocab, prompt, users, k, batch = (2048, 24, 4, 5, 2) if p.smoke else (32768, 300, 128, 20, 32)
    catalog = shapes.catalog_after_text(str(Path(p.data) / "items.parquet"), vocab, device)
    torch_dtype = getattr(torch, dtype)
    target = tiny_model("llama", vocab, seed=p.seed, hidden_size=p.hidden, intermediate_size=4 * p.hidden,
                        num_hidden_layers=p.layers, num_attention_heads=p.heads, num_key_value_heads=p.heads,
                        max_position_embeddings=2048, dtype=torch_dtype).to(device)
    draft = tiny_model("llama", vocab, seed=p.seed + 1, hidden_size=p.hidden // 2, intermediate_size=2 * p.hidden,
                       num_hidden_layers=1, num_attention_heads=p.heads, num_key_value_heads=p.heads,
                       max_position_embeddings=2048, dtype=torch_dtype).to(device)
    g = torch.Generator().manual_seed(p.seed)
    ids = torch.randint(4, vocab - catalog.code_len * 256, (users, prompt), generator=g).to(device)
    mask = torch.ones_like(ids)
    trie = cpu_trie(catalog.to("cpu"))
    out = {"dtype": dtype, "users": users, "k": k, "vocab": vocab, "prompt": prompt, "tie": TIE[dtype]}
    for name, other in (("transformers", lambda i, m: generate_beam_search(target, i, m, catalog, k, trie)),
                        ("speculative", lambda i, m: speculative_beam_search(target, draft, i, m, catalog, k))):
        clear = same = 0
        worst = 0.0
        for a in range(0, users, batch):
            i, m = ids[a:a + batch], mask[a:a + batch]
            ref = beam_search(target, i, m, catalog, k)
            got = other(i, m)
            items, scores = (got[0], got[2]) if name == "transformers" else (got.item_ids, got.scores)
            ok = (ref.stats["tie_gap"] >= TIE[dtype]).cpu()
            clear += int(ok.sum())
            same += int((same_within_ties(ref.item_ids.cpu(), ref.scores.cpu(), items.cpu(), TIE[dtype]) & ok).sum())
            both = ref.item_ids[:, :, None] == items[:, None, :]
            diff = (ref.scores[:, :, None] - scores.float()[:, None, :]).abs()[both]
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        out[name] = {"clear_users": clear, "clear_users_identical": same, "max_abs_score_diff": worst}
    return out


def markdown_gpu(result: dict, md: dict) -> str:
    h = result["hardware"]
    lines = [f"# genrec-batch on {h.get('gpu', h['device'])}: parity and benchmarks", "",
             f"{result['seconds'] / 60:.1f} min; torch {result['versions']['torch']}, transformers "
             f"{result['versions']['transformers']}, commit {result['versions']['git_commit']}", "",
             "## half-precision parity (users clear of a near-tie must get the same list)", "",
             "| dtype | against | users | clear of a near-tie (TIE) | of them identical | max score diff |",
             "|---|---|---:|---:|---:|---:|"]
    for r in result["parity"]:
        for name in ("transformers", "speculative"):
            x = r[name]
            lines.append(f"| {r['dtype']} | beam_search vs {name} | {r['users']} | {x['clear_users']} ({r['tie']:g}) | "
                         f"{x['clear_users_identical']} | {x['max_abs_score_diff']:.2e} |")
    for name, text in md.items():
        lines += ["", text]
    return "\n".join(lines + ["", footer(result["environment"])])
