"""decode: `transformers` constrained beam search (generate + prefix_allowed_tokens_fn over a CPU trie) against
genrec-batch's `beam_search` on the same model, the same Amazon Beauty prompts and the same batches, interleaved;
with `--engines eager compiled`, beam_search's two engines (decoding/compiled.py) side by side the same way; then the
per-step cost of the catalog index (CSR `allowed_next`, PPV `verify`) against a CPU trie, interleaved too.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch

from decoding.beam import Recommendations, beam_search
from decoding.catalog import Catalog
from decoding.compiled import compile_totals, warm_up
from decoding.metrics import same_within_ties, topk_agreement
from decoding.models import pick_device
from decoding.reference import cpu_trie, generate_beam_search
from pipeline.bench.common import (
    Timing,
    aligned,
    compare,
    fmt_ratio,
    fmt_spread,
    footer,
    interleaved,
    progress,
    ratio,
)
from pipeline.bench.inputs import beauty_section, bench_model, in_batches, ranked
from pipeline.bench.params import DecodeParams
from pipeline.markdown import table


def run_decode(p: DecodeParams) -> dict:
    """The decode section's figures: transformers against beam_search, the engines, the catalog index."""
    device, tok, catalog, ids, mask = beauty_section(p)
    model = bench_model(p, len(tok), device)
    result = {}
    if p.transformers:
        result["decode"] = bench_decode(p, model, catalog, ids, mask)
    if "compiled" in p.engines:
        result["engines"] = bench_engines(p, model, catalog, ids, mask)
    result["index"] = run_index(p, catalog)
    return result


def bench_decode(p: DecodeParams, model, catalog: Catalog, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """transformers vs beam_search over the users [U, S] in batches of p.batch: `p.repeats` interleaved runs of
    both over the same batches; agreement of the last run's outputs."""
    trie = cpu_trie(catalog.to("cpu"))
    run_hf = lambda i, m: generate_beam_search(model, i, m, catalog, p.k, trie)  # noqa: E731
    run_bs = lambda i, m: beam_search(model, i, m, catalog, p.k)  # noqa: E731
    run = interleaved(
        {
            "transformers": lambda: in_batches(run_hf, ids, mask, p.batch),
            "beam_search": lambda: in_batches(run_bs, ids, mask, p.batch),
        },
        p.repeats,
        ids.device,
        warmup={
            "transformers": lambda: run_hf(ids[:2], mask[:2]),
            "beam_search": lambda: run_bs(ids[: p.batch], mask[: p.batch]),
        },
        peak_memory=True,
        desc="decode: transformers vs beam_search",
    )
    hf, bs, n_users = run.outputs["transformers"], run.outputs["beam_search"], ids.shape[0]
    rows = {
        "transformers": method_row(run.timings["transformers"], n_users, sum(o[3] for o in hf)),
        "beam_search": method_row(run.timings["beam_search"], n_users, sum(r.stats["kv_tokens"] for r in bs)),
    }
    return {
        "prompt_tokens_max": ids.shape[1],
        "prompt_tokens_mean": float(mask.sum(1).float().mean()),
        "repeats": p.repeats,
        "order": run.order,
        "methods": rows,
        "speedup": ratio(run.timings["transformers"], run.timings["beam_search"]),
        "kv_ratio": rows["beam_search"]["kv_tokens"] / rows["transformers"]["kv_tokens"],
        "agreement": agreement(*ranked(bs), *ranked(hf)),
    }


def agreement(items: torch.Tensor, scores: torch.Tensor, hf_items: torch.Tensor, hf_scores: torch.Tensor) -> dict:
    """beam_search's items and scores [U, k] against transformers': the share of users with the same items in the
    same order, with the same item set, and the largest score difference."""
    n_users = items.shape[0]
    same_order = int((items == hf_items).all(1).sum())
    same_set = int((items.sort(1).values == hf_items.sort(1).values).all(1).sum())
    return {
        "users": n_users,
        "same_items_same_order": same_order / n_users,
        "same_item_set": same_set / n_users,
        "max_abs_score_diff": float((scores - hf_scores).abs().max()),
    }


def bench_engines(p: DecodeParams, model, catalog: Catalog, ids: torch.Tensor, mask: torch.Tensor) -> dict:
    """beam_search's eager and compiled engines over the users [U, S] in batches of p.batch, `p.repeats` interleaved
    runs. The compiled engine first compiles its bucket (p.batch users x the longest prompt: every batch snaps to
    it, as in the nightly actor), timed as compile_s."""
    t0 = time.perf_counter()
    warm_up(model, catalog, min(p.batch, ids.shape[0]), ids.shape[1], p.k)
    compile_s, graphs = time.perf_counter() - t0, compile_totals(model)[1]
    decode = {e: partial(_beam_search, model, catalog, p.k, e) for e in ("eager", "compiled")}
    run = interleaved(
        {e: partial(in_batches, f, ids, mask, p.batch) for e, f in decode.items()},
        p.repeats,
        ids.device,
        peak_memory=True,
        warmup={"eager": lambda: decode["eager"](ids[: p.batch], mask[: p.batch]), "compiled": lambda: None},
        desc="decode: beam_search eager vs compiled",
    )
    eager, compiled = (Recommendations.concat(run.outputs[e]) for e in decode)
    n = ids.shape[0]
    return {
        "users": n,
        "batch": p.batch,
        "repeats": p.repeats,
        "order": run.order,
        "compile_s": compile_s,
        "graphs_compiled": graphs,
        "bucket": [compiled.stats["bucket_users"], compiled.stats["bucket_prompt"]],
        "methods": {
            e: method_row(run.timings[e], n, r.stats["kv_tokens"])
            for e, r in (("eager", eager), ("compiled", compiled))
        },
        "speedup": ratio(run.timings["eager"], run.timings["compiled"]),
        "agreement": engines_agreement(eager, compiled),
    }


def _beam_search(model, catalog: Catalog, k: int, engine: str, ids: torch.Tensor, mask: torch.Tensor):
    return beam_search(model, ids, mask, catalog, k, engine=engine)


def engines_agreement(eager: Recommendations, compiled: Recommendations) -> dict:
    """The compiled engine's lists against the eager one's: same items in the same order, the largest score
    difference, and the users clear of a near-tie (eager tie_gap above twice that difference) whose lists are
    identical."""
    agree = topk_agreement(eager.item_ids, eager.scores, compiled.item_ids, compiled.scores)
    diff = float(agree["score_diff"].max())
    clear = eager.stats["tie_gap"].cpu() > 2 * diff
    same = same_within_ties(eager.item_ids.cpu(), eager.scores.cpu(), compiled.item_ids.cpu(), 2 * diff)
    return {
        "users": eager.item_ids.shape[0],
        "same_items_same_order": float(agree["identical"].float().mean()),
        "max_abs_score_diff": diff,
        "clear_users": int(clear.sum()),
        "clear_users_identical": int((agree["identical"] & clear).sum()),
        "same_within_ties": float(same.float().mean()),
    }


def method_row(t: Timing, users: int, kv_tokens: int) -> dict:
    """One method over all users: every repeat's seconds, users/s (median, min, max), peak memory, KV tokens."""
    return {
        "users": users,
        "timing": t.to_dict(),
        "users_per_s": t.per(lambda s: users / s),
        "peak_memory_mb": t.peak_memory_mb,
        "kv_tokens": int(kv_tokens),
        "kv_tokens_per_user": kv_tokens / users,
    }


# ------------------------------------------------------------------ catalog index: CSR, PPV, CPU trie


def run_index(p: DecodeParams, beauty: Catalog | None) -> list[dict]:
    """The index timings on the Beauty catalog (when given) and on synthetic catalogs of p.index_items items."""
    device, rows = pick_device(p.device), p.batch * p.k
    out = []
    if beauty is not None:
        out.append({"catalog": "amazon-beauty", **bench_index(beauty, rows, p.top_m, p.repeats, True, p.seed)})
    for n in progress(p.index_items, "index: synthetic catalogs"):
        cat = synthetic_token_catalog(n, 4, 256, p.seed, device)
        out.append(
            {"catalog": f"synthetic-{n}", **bench_index(cat, rows, p.top_m, p.repeats, n <= p.trie_max_items, p.seed)}
        )
    return out


def synthetic_token_catalog(
    n_items: int, levels: int, codes: int, seed: int, device, vocab: int | None = None
) -> Catalog:
    """n_items distinct random semantic IDs, as token ids in the project tokenizer's layout (after its 4 special
    tokens), or, given `vocab`, as the last levels x codes tokens of a `vocab`-token vocabulary (an LLM's added code
    tokens after its text vocabulary)."""
    from pipeline.prepare import synthetic_catalog

    table = synthetic_catalog(n_items, levels, codes, seed)
    sid = table.column("semantic_id").combine_chunks().flatten().to_numpy().reshape(-1, levels)
    start = 4 if vocab is None else vocab - levels * codes
    tokens = start + np.arange(levels) * codes + sid.astype(np.int64)  # [N, L]
    item_ids = table.column("item_id").to_numpy().copy()
    return Catalog.from_token_ids(
        torch.from_numpy(item_ids), torch.from_numpy(tokens), start + levels * codes, device=device
    )


def bench_index(catalog: Catalog, rows: int, top_m: int, repeats: int, with_trie: bool, seed: int) -> dict:
    """Milliseconds per decoding step (rows = users x beams real prefixes at each of the L levels; one timed run of a
    backend covers the L levels): CSR allowed_next, PPV verify of top_m candidates and (with_trie) a CPU trie,
    interleaved; the median with min and max over the repeats."""
    g = torch.Generator().manual_seed(seed)
    dev, levels = catalog.device, catalog.code_len
    out = {"items": len(catalog), "rows": rows, "top_m": top_m}
    trie, t_build = None, None
    if with_trie:
        trie, t_build = _timed_build(catalog)
    prefixes, cands = [], []
    for level in range(levels):
        pick = torch.randint(len(catalog), (rows,), generator=g).to(dev)
        prefixes.append(catalog.tokens[pick, :level])  # [R, t] real prefixes, as beams have
        c = torch.randint(catalog.vocab_size, (rows, top_m), generator=g).to(dev)  # [R, M]
        c[:, 0] = catalog.tokens[pick, level]
        cands.append(c)
    methods = {
        "allowed_next": lambda: [catalog.allowed_next(x) for x in prefixes],
        "verify": lambda: [catalog.verify(x, c) for x, c in zip(prefixes, cands)],
    }
    if trie is not None:
        methods["cpu_trie"] = lambda: [trie_mask(trie, x, catalog.vocab_size) for x in prefixes]
    run = interleaved(methods, repeats, dev)
    out.update(
        trie_build_s=t_build,
        repeats=repeats,
        timings={n: t.to_dict() for n, t in run.timings.items()},
        cpu_trie_ms=None,
        trie_over_csr=None,
    )
    for name, t in run.timings.items():
        out[f"{name}_ms"] = t.per(lambda s: 1e3 * s / levels)
    if trie is not None:
        out["trie_over_csr"] = ratio(run.timings["cpu_trie"], run.timings["allowed_next"])
    return out


def _timed_build(catalog: Catalog) -> tuple[dict, float]:
    t0 = time.perf_counter()
    trie = cpu_trie(catalog.to("cpu"))
    return trie, time.perf_counter() - t0


def trie_mask(trie: dict, prefix: torch.Tensor, vocab: int) -> torch.Tensor:
    """What `PrefixConstrainedLogitsProcessor` does per step: one dict lookup per row, then fill a mask [R, V]."""
    mask = torch.zeros(prefix.shape[0], vocab, dtype=torch.bool)
    for i, row in enumerate(prefix.tolist()):
        mask[i, trie.get(tuple(row), [])] = True
    return mask


# ------------------------------------------------------------------ report


def markdown_decode(result: dict) -> str:
    env, a, lines = result["environment"], result["args"], []
    if "decode" in result:
        lines += markdown_transformers(result["decode"], a, env)
    if "engines" in result:
        lines += markdown_engines(result["engines"], a, env)
    if result.get("index"):
        lines += markdown_index(result["index"])
    lines += ["", footer(env)]
    return "\n".join(lines)


def markdown_transformers(d: dict, a: dict, env: dict) -> list[str]:
    """transformers vs beam_search: users/s, peak memory and KV tokens per method; the speed-up and agreement."""
    ag = d["agreement"]
    rows = [
        [name, fmt_spread(r["users_per_s"]), f"{r['peak_memory_mb']:.1f}", f"{r['kv_tokens_per_user']:.0f}"]
        for name, r in d["methods"].items()
    ]
    return [
        f"## decode: K={a['k']}, batch {a['batch']}, {ag['users']} Amazon Beauty users (prompt "
        f"up to {d['prompt_tokens_max']} tokens), {env['device']}; median (min-max) of {d['repeats']} "
        "interleaved repeats",
        "",
        table(["method", "users/s", "peak memory (MB)", "KV tokens / user"], rows, aligned(1, 3)),
        "",
        f"speed-up (users/s of beam_search over transformers, ratio of medians, range): "
        f"**{fmt_ratio(d['speedup'], 1)}**{' within noise' if d['speedup']['within_noise'] else ''}; KV "
        f"held: {d['kv_ratio']:.3f}x; same items in the same order: {ag['same_items_same_order']:.1%}, same "
        f"item set: {ag['same_item_set']:.1%}, max |score diff| {ag['max_abs_score_diff']:.2e}",
        "",
    ]


def markdown_engines(e: dict, a: dict, env: dict) -> list[str]:
    """beam_search eager vs compiled: users/s and peak memory per engine; the speed-up, compile time, agreement."""
    ag = e["agreement"]
    rows = [[name, fmt_spread(r["users_per_s"]), f"{r['peak_memory_mb']:.1f}"] for name, r in e["methods"].items()]
    return [
        f"## beam_search engines: eager vs compiled, K={a['k']}, {e['users']} users in batches of "
        f"{e['batch']} (bucket {e['bucket'][0]} x {e['bucket'][1]}), {env['device']}; median (min-max) of "
        f"{e['repeats']} interleaved repeats",
        "",
        table(["engine", "users/s", "peak memory (MB)"], rows, aligned(1, 2)),
        "",
        f"compiled over eager (ratio of medians, range): **{fmt_ratio(e['speedup'])}**"
        f"{' within noise' if e['speedup']['within_noise'] else ''}; compile {e['compile_s']:.1f} s "
        f"({e['graphs_compiled']} graphs, before the timed runs); same items in the same order: "
        f"{ag['same_items_same_order']:.1%} (up to near-tie swaps: {ag['same_within_ties']:.1%}); users "
        f"clear of a near-tie: {ag['clear_users_identical']} of {ag['clear_users']} identical; max |score "
        f"diff| {ag['max_abs_score_diff']:.2e}",
        "",
    ]


def markdown_index(index: list[dict]) -> list[str]:
    """The catalog index: ms per decoding step of CSR, PPV and the CPU trie per catalog, the trie's build time."""
    i0 = index[0]
    fmt = lambda x: "-" if x is None else fmt_spread(x, 3)  # noqa: E731
    rows = [
        [
            r["catalog"],
            f"{r['items']:,}",
            fmt(r["allowed_next_ms"]),
            fmt(r["verify_ms"]),
            fmt(r["cpu_trie_ms"]),
            "-" if r["trie_build_s"] is None else f"{r['trie_build_s']:.1f}",
        ]
        for r in index
    ]
    header = ["catalog", "items", "allowed_next (CSR)", "verify (PPV)", "CPU trie", "trie build (s)"]
    return [
        f"## catalog index: ms per decoding step ({i0['rows']} prefixes, PPV top-M = {i0['top_m']}), "
        f"median (min-max) of {i0['repeats']} interleaved repeats",
        "",
        table(header, rows, aligned(1, 5)),
    ]


def verdict_decode(r: dict) -> str:
    """From the medians; 'within noise' where the ranges overlap."""
    d, ag = r["decode"], r["decode"]["agreement"]
    m = d["methods"]
    speed = compare("beam_search", "transformers", d["speedup"])
    line = (
        f"beam_search = transformers on {ag['same_items_same_order']:.0%} of users (same items, same order; max "
        f"|score diff| {ag['max_abs_score_diff']:.1e}); users/s: {speed}"
        f"; {1 / d['kv_ratio']:.1f}x fewer KV tokens, peak memory {m['beam_search']['peak_memory_mb']:.0f} vs "
        f"{m['transformers']['peak_memory_mb']:.0f} MB"
    )
    with_trie = [i for i in r["index"] if i["trie_over_csr"] is not None]
    if with_trie:
        i = max(with_trie, key=lambda i: i["items"])
        line += (
            f"; catalog index on {i['items']:,} items, ms per step: CSR allowed_next "
            f"{fmt_spread(i['allowed_next_ms'])}, CPU trie {fmt_spread(i['cpu_trie_ms'])}, PPV verify "
            f"{fmt_spread(i['verify_ms'])}: {compare('CSR allowed_next', 'CPU trie', i['trie_over_csr'])}"
        )
    return line
