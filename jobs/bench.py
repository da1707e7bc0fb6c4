"""Benchmarks, side by side in one run: `python -m jobs.bench {all,decode,speculative,disc,disc-bias,nightly} ...`.

all: decode, speculative, disc and disc-bias in one process at sizes that take minutes on a CPU with the demo models
(flags scale them up on a GPU), written as one Markdown report plus JSON with the hardware, versions, seeds, the
command, and a one-line verdict per claim.

disc-bias: DISC's bias reduction on Amazon Beauty. Per user, the exact constrained distribution P_S over the whole
catalog (every item scored); then N draws of constrained sampling, DISC at several rounds and an exact sampler
(draws from P_S itself: the noise floor at this N), compared to P_S by total variation (items and the first code's
marginal), KL, and the mean valid mass x(a) of the drawn items (constrained decoding's exact distribution Q = p / x
is computed too, so its bias is known without sampling noise).

disc: time per user of `disc_sample` (rounds 1..R, exact mask and PPV top-M) against `constrained_sample` and
`beam_search` on the same Amazon Beauty prompts, with proposals per item, acceptance rate and estimated p_b.

speculative: AtSpeed speculative beam search (strict and relaxed) with every trained draft against `beam_search`
of the same target on the same Amazon Beauty prompts, in the layout of the AtSpeed paper's Table 1 (WS@K = walltime
speed-up, AS@K = accepted steps per target verification), at batch size 1 and at a throughput batch size.

decode: `transformers` constrained beam search (generate + prefix_allowed_tokens_fn over a CPU trie) against
genrec-batch's `beam_search` on the same model and the same Amazon Beauty prompts, batch by batch, alternating;
then the per-step cost of the catalog index (CSR `allowed_next`, PPV `verify`) against a CPU trie.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.models import load_model, load_tokenizer, pick_device, pick_dtype, tiny_model
from decoding.reference import cpu_trie, generate_beam_search
from operators.prompts import build_prompts


class PeakMemory:
    """Peak memory above the start of the block: CUDA allocator peak, or sampled process RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
        else:
            self.start, self.done = _rss(), False
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.done:
            self.peak = max(self.peak, _rss() - self.start)
            time.sleep(0.002)

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.start
        else:
            self.done = True
            self.thread.join()


def progress(iterable=None, desc: str = "", total: int | None = None, leave: bool = False):
    """A progress bar on stderr for one benchmark sweep (inner bars clear themselves when done)."""
    return tqdm(iterable, desc=desc, total=total, leave=leave, dynamic_ncols=True, mininterval=0.5)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with PeakMemory(device) as mem:
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, mem.peak


# ------------------------------------------------------------------ data and model


def load_beauty(data: Path, users: int, history_len: int, device, tokenizer_dir: Path | None = None):
    """Prepared data dir -> (tokenizer, catalog, input_ids [U, S], attention_mask [U, S])."""
    for name in ("items.parquet", "test.parquet", "tokenizer"):
        if not (data / name).exists():
            raise SystemExit(f"{data / name} not found: run `python -m jobs.prepare_data --out {data}` first")
    tok = load_tokenizer(tokenizer_dir or data / "tokenizer")
    catalog = Catalog.from_parquet(data / "items.parquet", tok, on_duplicate="first", device=device)
    histories = pq.read_table(data / "test.parquet", columns=["history"]).column("history").to_pylist()
    histories = [h for h in histories if h][:users]
    prompts = build_prompts(histories, catalog.item_tokens, tok.bos_token_id, tok.pad_token_id, history_len)
    return tok, catalog, prompts.input_ids.to(device), prompts.attention_mask.to(device)


def bench_model(args, vocab_size: int, device):
    if args.model:
        return load_model(args.model, device=str(device), dtype=args.dtype, attn_implementation=args.attn)
    model = tiny_model("llama", vocab_size, seed=args.seed, attn_implementation=args.attn,
                       hidden_size=args.hidden, intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                       num_attention_heads=args.heads, num_key_value_heads=args.heads)
    return model.to(device)


# ------------------------------------------------------------------ decode: transformers vs beam_search


def bench_decode(args) -> dict:
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    tok, catalog, ids, mask = load_beauty(Path(args.data), args.users, args.history_len, device)
    model = bench_model(args, len(tok), device)
    trie = cpu_trie(catalog.to("cpu"))
    k, n_users = args.k, ids.shape[0]
    beam_search(model, ids[: args.batch], mask[: args.batch], catalog, k)  # warm-up, both paths
    generate_beam_search(model, ids[:2], mask[:2], catalog, k, trie)

    rows = {"transformers": _zero(), "beam_search": _zero()}
    same_order = same_set = 0
    max_score_diff = 0.0
    bar = progress(range(0, n_users, args.batch), "decode: transformers vs beam_search")
    for start in bar:
        b_ids, b_mask = ids[start:start + args.batch], mask[start:start + args.batch]
        (hf_items, _, hf_scores, hf_kv), t_hf, m_hf = timed(
            lambda: generate_beam_search(model, b_ids, b_mask, catalog, k, trie), device)
        rec, t_bs, m_bs = timed(lambda: beam_search(model, b_ids, b_mask, catalog, k), device)
        _add(rows["transformers"], len(b_ids), t_hf, m_hf, hf_kv)
        _add(rows["beam_search"], len(b_ids), t_bs, m_bs, rec.stats["kv_tokens"])
        same_order += int((rec.item_ids == hf_items).all(1).sum())
        same_set += int((rec.item_ids.sort(1).values == hf_items.sort(1).values).all(1).sum())
        max_score_diff = max(max_score_diff, float((rec.scores - hf_scores).abs().max()))
        bar.set_postfix_str(f"transformers {t_hf:.2f}s, beam_search {t_bs:.3f}s per batch")
    for r in rows.values():
        r["users_per_s"] = r["users"] / r["seconds"]
        r["kv_tokens_per_user"] = r["kv_tokens"] / r["users"]
    return {
        "prompt_tokens_max": ids.shape[1],
        "prompt_tokens_mean": float(mask.sum(1).float().mean()),
        "methods": rows,
        "speedup_users_per_s": rows["beam_search"]["users_per_s"] / rows["transformers"]["users_per_s"],
        "kv_ratio": rows["beam_search"]["kv_tokens"] / rows["transformers"]["kv_tokens"],
        "agreement": {"users": n_users, "same_items_same_order": same_order / n_users,
                      "same_item_set": same_set / n_users, "max_abs_score_diff": max_score_diff},
    }


def _zero():
    return {"users": 0, "seconds": 0.0, "peak_memory_mb": 0.0, "kv_tokens": 0}


def _add(row, users, seconds, peak, kv_tokens):
    row["users"] += users
    row["seconds"] += seconds
    row["peak_memory_mb"] = max(row["peak_memory_mb"], peak / 2 ** 20)
    row["kv_tokens"] += kv_tokens


# ------------------------------------------------------------------ catalog index: CSR, PPV, CPU trie


def synthetic_token_catalog(n_items: int, levels: int, codes: int, seed: int, device) -> Catalog:
    from pipeline.prepare import synthetic_catalog  # distinct random semantic IDs, any size

    table = synthetic_catalog(n_items, levels, codes, seed)
    sid = table.column("semantic_id").combine_chunks().flatten().to_numpy().reshape(-1, levels)
    tokens = 4 + np.arange(levels) * codes + sid.astype(np.int64)  # the project tokenizer's id layout
    item_ids = table.column("item_id").to_numpy().copy()
    return Catalog.from_token_ids(torch.from_numpy(item_ids), torch.from_numpy(tokens), 4 + levels * codes,
                                  device=device)


def bench_index(catalog: Catalog, rows: int, top_m: int, repeats: int, with_trie: bool, seed: int) -> dict:
    """Mean seconds per decoding step (rows = users x beams prefixes, averaged over the L levels)."""
    g = torch.Generator().manual_seed(seed)
    dev = catalog.device
    out = {"items": len(catalog), "rows": rows, "top_m": top_m}
    t0 = time.perf_counter()
    trie = cpu_trie(catalog.to("cpu")) if with_trie else None
    out["trie_build_s"] = time.perf_counter() - t0 if with_trie else None
    times = {"allowed_next": [], "verify": [], "cpu_trie": []}
    for level in range(catalog.code_len):
        pick = torch.randint(len(catalog), (rows,), generator=g)
        prefix = catalog.tokens[pick.to(dev), :level]  # [R, t] real prefixes, as beams have
        cands = torch.randint(catalog.vocab_size, (rows, top_m), generator=g).to(dev)
        cands[:, 0] = catalog.tokens[pick.to(dev), level]
        for name, fn in (("allowed_next", lambda: catalog.allowed_next(prefix)),
                         ("verify", lambda: catalog.verify(prefix, cands)),
                         ("cpu_trie", lambda: _trie_mask(trie, prefix, catalog.vocab_size) if trie else None)):
            if name == "cpu_trie" and trie is None:
                continue
            fn()
            times[name].append(_best_of(fn, repeats, dev))
    for name, ts in times.items():
        out[f"{name}_ms"] = 1e3 * float(np.mean(ts)) if ts else None
    return out


def _trie_mask(trie: dict, prefix: torch.Tensor, vocab: int) -> torch.Tensor:
    """What `PrefixConstrainedLogitsProcessor` does per step: one dict lookup per row, then fill a mask."""
    mask = torch.zeros(prefix.shape[0], vocab, dtype=torch.bool)
    for i, p in enumerate(prefix.tolist()):
        mask[i, trie.get(tuple(p), [])] = True
    return mask


def _best_of(fn, repeats: int, dev) -> float:
    best = float("inf")
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run_index(args, beauty_catalog: Catalog | None) -> list[dict]:
    device = pick_device(args.device)
    rows = args.batch * args.k
    out = []
    if beauty_catalog is not None:
        out.append({"catalog": "amazon-beauty", **bench_index(beauty_catalog, rows, args.top_m, args.repeats,
                                                                True, args.seed)})
    for n in progress(args.index_items, "index: synthetic catalogs"):
        cat = synthetic_token_catalog(n, 4, 256, args.seed, device)
        out.append({"catalog": f"synthetic-{n}", **bench_index(cat, rows, args.top_m, args.repeats,
                                                               n <= args.trie_max_items, args.seed)})
    return out


# ------------------------------------------------------------------ speculative: Table 1 of the AtSpeed paper


def in_batches(fn, ids, mask, batch: int, device):
    """Runs fn(ids, mask) over consecutive batches -> (results, seconds)."""
    out = []
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for a in range(0, ids.shape[0], batch):
        out.append(fn(ids[a:a + batch], mask[a:a + batch]))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def require_models(target, drafts=None) -> None:
    """Fails with how to train them when the target (or every draft) is missing."""
    how = ("train the demo models with `make models` (python -m jobs.train_target --preset demo, then "
           "python -m jobs.train_draft --preset demo; about 15 minutes on a CPU), or pass your own")
    if not target or not (Path(target) / "config.json").is_file():
        raise SystemExit(f"no target model at {target}: {how} with --target / --model DIR")
    if drafts is not None and not drafts:
        raise SystemExit(f"no draft models (models/demo-draft*): {how} with --drafts DIR [DIR ...]")
    for d in drafts or []:
        if not (Path(d) / "config.json").is_file():
            raise SystemExit(f"no draft model at {d}: {how} with --drafts DIR [DIR ...]")


def load_drafts(paths, device) -> dict:
    drafts = {}
    for path in paths:
        report = json.loads((Path(path) / "training.json").read_text()) if (Path(path) / "training.json").is_file() else {}
        name = report.get("objective", Path(path).name)
        beta = report.get("config", {}).get("beta", 1.0)
        name += "" if name != "atspeed-s" or beta == 1.0 else f" (beta={beta:g})"
        drafts[name] = load_model(path, device=str(device), dtype="float32")
    return drafts


def bench_speculative(args) -> dict:
    from decoding.speculative import speculative_beam_search

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    require_models(args.target, args.drafts)
    target = load_model(args.target, device=str(device), dtype=args.dtype)
    drafts = load_drafts(args.drafts, device)
    _, catalog, ids, mask = load_beauty(Path(args.data), max(args.users, args.throughput_users), args.history_len,
                                        device, Path(args.target))
    out = {"target_parameters": sum(p.numel() for p in target.parameters()),
           "draft_parameters": {n: sum(p.numel() for p in d.parameters()) for n, d in drafts.items()}, "batches": []}
    for batch, users in ((1, args.users), (args.batch, args.throughput_users)):
        b_ids, b_mask = ids[:users], mask[:users]
        table = {"batch": batch, "users": users, "k": {}}
        bar = progress(desc=f"speculative: batch {batch}, K x draft x mode", total=len(args.ks) * len(drafts) * 2)
        for k in args.ks:
            run_beam = lambda i, m: beam_search(target, i, m, catalog, k)  # noqa: E731
            in_batches(run_beam, b_ids[:batch], b_mask[:batch], batch, device)  # warm-up
            ref, t_beam = in_batches(run_beam, b_ids, b_mask, batch, device)
            ref_items = torch.cat([r.item_ids for r in ref])
            row = {"beam_search_s": t_beam, "beam_search_users_per_s": users / t_beam, "drafts": {}}
            if batch == 1 and args.with_transformers:
                trie = cpu_trie(catalog.to("cpu"))
                _, t_hf = in_batches(lambda i, m: generate_beam_search(target, i, m, catalog, k, trie), b_ids, b_mask,
                                     batch, device)
                row["transformers_s"] = t_hf
            for name, draft in drafts.items():
                for mode in ("strict", "relaxed"):
                    bar.set_postfix_str(f"K={k} {name} {mode}")
                    g = torch.Generator(device=device).manual_seed(args.seed)
                    run = lambda i, m: speculative_beam_search(  # noqa: E731
                        target, draft, i, m, catalog, k, draft_beams=max(args.draft_beams, k), gamma=args.gamma,
                        verification=mode, temperature=args.temperature, generator=g)
                    in_batches(run, b_ids[:batch], b_mask[:batch], batch, device)  # warm-up
                    recs, t = in_batches(run, b_ids, b_mask, batch, device)
                    accepted = torch.cat([r.stats["accepted_steps"] for r in recs]).float()
                    rounds = torch.cat([r.stats["rounds"] for r in recs]).float().clamp(min=1)
                    cell = {"seconds": t, "ws": t_beam / t, "as": float((accepted / rounds).mean()),
                            "target_forwards": sum(r.stats["target_forwards"] for r in recs),
                            "draft_forwards": sum(r.stats["draft_forwards"] for r in recs)}
                    if "transformers_s" in row:
                        cell["ws_vs_transformers"] = row["transformers_s"] / t
                    if mode == "strict":
                        cell["same_as_beam_search"] = float((torch.cat([r.item_ids for r in recs]) == ref_items)
                                                            .all(1).float().mean())
                    row["drafts"][f"{name}|{mode}"] = cell
                    bar.update()
            row["beam_search_target_forwards"] = sum(r.stats["target_forwards"] for r in ref)
            table["k"][k] = row
        bar.close()
        out["batches"].append(table)
    return out


def markdown_speculative(result: dict) -> str:
    env = result["environment"]
    s = result["speculative"]
    lines = [f"## speculative beam search vs beam_search ({env['device']}; target {s['target_parameters']:,} "
             f"parameters; WS@K = walltime speed-up over beam_search, AS@K = accepted steps per target verification)"]
    for table in s["batches"]:
        ks = list(table["k"])
        lines += ["", f"### batch size {table['batch']}, {table['users']} Amazon Beauty users", "",
                  "| draft | verification | " + " | ".join(f"WS@{k} | AS@{k}" for k in ks) + " |",
                  "|---|---|" + "---:|---:|" * len(ks)]
        names = list(next(iter(table["k"].values()))["drafts"])
        for key in names:
            name, mode = key.split("|")
            cells = " | ".join(f"{table['k'][k]['drafts'][key]['ws']:.2f} | {table['k'][k]['drafts'][key]['as']:.2f}"
                               for k in ks)
            lines.append(f"| {name} | {mode} | {cells} |")
        lines.append("| beam_search users/s | | " + " | ".join(
            f"{table['k'][k]['beam_search_users_per_s']:.1f} | " for k in ks) + " |")
        if "transformers_s" in next(iter(table["k"].values())):
            best = {k: max((c for c in table["k"][k]["drafts"].values()), key=lambda c: c["ws"]) for k in ks}
            lines.append("| WS vs transformers (beam_search / best draft) | | " + " | ".join(
                f"{table['k'][k]['transformers_s'] / table['k'][k]['beam_search_s']:.1f} / "
                f"{best[k]['ws_vs_transformers']:.1f} | " for k in ks) + " |")
        strict_same = [c["same_as_beam_search"] for k in ks for c in table["k"][k]["drafts"].values()
                       if "same_as_beam_search" in c]
        lines.append(f"\nstrict results identical to beam_search for {min(strict_same):.0%} of users or more "
                     "(every draft, every K).")
    lines += ["", f"`{env['command']}` (torch {env['torch']}, transformers {env['transformers']}, "
              f"{env['cpu_threads']} threads)"]
    return "\n".join(lines)


# ------------------------------------------------------------------ disc: sampling modes against beam search


def bench_disc(args) -> dict:
    from decoding.disc import constrained_sample, disc_sample

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    model_dir = Path(args.model) if args.model else None
    _, catalog, ids, mask = load_beauty(Path(args.data), args.users, args.history_len, device, model_dir)
    model = load_model(model_dir, device=str(device), dtype=args.dtype) if model_dir else bench_model(
        args, catalog.vocab_size, device)
    k, g = args.k, torch.Generator(device=device)
    methods = {"beam_search": lambda i, m: beam_search(model, i, m, catalog, k),
               "constrained_sample": lambda i, m: constrained_sample(model, i, m, catalog, k,
                                                                     temperature=args.temperature, generator=g)}
    for top_m in (None, args.top_m):
        for rounds in range(1, args.max_rounds + 1):
            methods[f"disc rounds={rounds} {'exact' if top_m is None else f'PPV top-{top_m}'}"] = (
                lambda i, m, r=rounds, t=top_m: disc_sample(model, i, m, catalog, k, rounds=r, top_m=t,
                                                            temperature=args.temperature, generator=g))
    rows = {}
    bar = progress(methods.items(), "disc: methods", total=len(methods))
    for name, fn in bar:
        bar.set_postfix_str(name)
        g.manual_seed(args.seed)
        in_batches(fn, ids[:args.batch], mask[:args.batch], args.batch, device)  # warm-up
        recs, seconds = in_batches(fn, ids, mask, args.batch, device)
        row = {"seconds": seconds, "ms_per_user": 1e3 * seconds / ids.shape[0], "users_per_s": ids.shape[0] / seconds}
        if "proposals" in recs[0].stats:
            cat = lambda key: torch.cat([r.stats[key] for r in recs]).double()  # noqa: E731
            row.update(proposals_per_item=float(cat("proposals").mean()) / k,
                       acceptance_rate=float(cat("acceptance_rate").mean()), invalid_mass=float(cat("invalid_mass").mean()))
        rows[name] = row
    return {"k": k, "users": ids.shape[0], "batch": args.batch, "temperature": args.temperature,
            "model": str(model_dir) if model_dir else "random", "methods": rows}


def markdown_disc(result: dict) -> str:
    d, env = result["disc"], result["environment"]
    lines = [f"## DISC vs constrained sampling vs beam search: k={d['k']}, {d['users']} Amazon Beauty users, batch "
             f"{d['batch']}, temperature {d['temperature']}, model {d['model']} ({env['device']})", "",
             "| method | ms / user | users/s | proposals / item | acceptance | est. invalid mass p_b |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in d["methods"].items():
        extra = (f"{r['proposals_per_item']:.2f} | {r['acceptance_rate']:.3f} | {r['invalid_mass']:.3f}"
                 if "proposals_per_item" in r else "- | - | -")
        lines.append(f"| {name} | {r['ms_per_user']:.1f} | {r['users_per_s']:.1f} | {extra} |")
    lines += ["", f"`{env['command']}` (torch {env['torch']}, transformers {env['transformers']}, "
              f"{env['cpu_threads']} threads)"]
    return "\n".join(lines)


# ------------------------------------------------------------------ disc-bias: distance to the exact P_S


def bench_disc_bias(args) -> dict:
    """Per user: P_S and constrained decoding's own distribution Q over the whole catalog (`catalog_logprob`), then
    `draws` single-item draws (k=1, the prompt repeated) of constrained sampling, DISC at each of `rounds` and an
    exact sampler, compared to P_S. Besides TV and KL, the mean valid mass x(a) of the drawn items measures the bias
    along its direction with little noise: constrained decoding over-draws items whose prefixes are mostly invalid
    (small x), Q(a) = P_S(a) (1 - p_b) / x(a)."""
    from decoding.disc import constrained_sample, disc_sample
    from decoding.reference import catalog_logprob

    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    require_models(args.model)
    _, catalog, ids, mask = load_beauty(Path(args.data), args.users, args.history_len, device, Path(args.model))
    model = load_model(args.model, device=str(device), dtype=args.dtype)
    t, g = args.temperature, torch.Generator(device=device)
    samplers = {"constrained_sample": lambda i, m: constrained_sample(model, i, m, catalog, 1, temperature=t,
                                                                      generator=g)}
    for rounds in args.rounds:
        samplers[f"disc rounds={rounds}"] = lambda i, m, r=rounds: disc_sample(model, i, m, catalog, 1, rounds=r,
                                                                              temperature=t, generator=g)
    users = []
    for u in progress(range(ids.shape[0]), "disc bias: users"):
        t0 = time.perf_counter()
        log_p, log_x = catalog_logprob(model, ids[u:u + 1], mask[u:u + 1], catalog, t, args.chunk,
                                       valid_mass=True)  # [N], [N]
        p_s = (log_p - log_p.logsumexp(0)).exp()  # [N] P_S over the catalog rows
        q, x = (log_p - log_x).exp(), log_x.exp()  # [N] constrained decoding's distribution, valid masses
        row = {"p_b": float(1 - log_p.exp().sum()), "exact_scoring_s": time.perf_counter() - t0,
               "exact": {"P_S": {"mean_x": float((p_s * x).sum())},
                         "constrained decoding Q": {**distances(p_s, q, catalog), "mean_x": float((q * x).sum())}},
               "methods": {}}
        g.manual_seed(args.seed)
        drawn = torch.multinomial(p_s, args.draws, replacement=True, generator=g)  # [D] catalog rows
        row["methods"]["exact sampler"] = draw_stats(p_s, x, drawn, catalog)
        u_ids, u_mask = ids[u:u + 1].repeat(args.draws, 1), mask[u:u + 1].repeat(args.draws, 1)  # [D, S]
        for name, fn in samplers.items():
            g.manual_seed(args.seed)
            recs, seconds = in_batches(fn, u_ids, u_mask, args.batch, device)
            tokens = torch.cat([r.token_ids[:, 0] for r in recs])  # [D, L]
            drawn = catalog.node_of(tokens) - catalog.level_start[catalog.code_len]  # [D] catalog rows
            p_b = torch.cat([r.stats["invalid_mass"] for r in recs]).double().mean()  # 1 - E_q[x] over proposals
            row["methods"][name] = {**draw_stats(p_s, x, drawn, catalog), "est_invalid_mass": float(p_b),
                                    "seconds": seconds}
        users.append(row)
    return {"users": len(users), "draws": args.draws, "items": len(catalog), "temperature": t,
            "model": str(args.model), "p_b": [u["p_b"] for u in users],
            "exact": {name: mean_over_users([u["exact"][name] for u in users]) for name in users[0]["exact"]},
            "methods": {name: mean_over_users([u["methods"][name] for u in users]) for name in users[0]["methods"]},
            "per_user": users}


def distances(p_s: torch.Tensor, q: torch.Tensor, catalog: Catalog) -> dict:
    """Two distributions over the catalog rows [N] -> total variation distance over the items and over the first
    code's (level a) marginal, and KL(P_S || q)."""
    level_a = lambda p: p.new_zeros(catalog.vocab_size).index_add_(0, catalog.tokens[:, 0], p)  # noqa: E731 [V]
    return {"tv_items": 0.5 * float((p_s - q).abs().sum()),
            "tv_level_a": 0.5 * float((level_a(p_s) - level_a(q)).abs().sum()),
            "kl": float((torch.special.xlogy(p_s, p_s) - p_s * q.log()).sum())}


def draw_stats(p_s: torch.Tensor, x: torch.Tensor, drawn: torch.Tensor, catalog: Catalog) -> dict:
    """P_S [N], valid masses x [N], drawn [D] catalog rows -> TV of the empirical distribution to P_S (items, level a),
    KL(P_S || empirical smoothed by +0.5 per item), and the mean x of the drawn items with its standard error."""
    if (drawn < 0).any():
        raise RuntimeError(f"{int((drawn < 0).sum())} draws are not catalog items")
    counts = torch.bincount(drawn, minlength=p_s.numel()).to(p_s.dtype)  # [N]
    smoothed = (counts + 0.5) / (counts.sum() + 0.5 * counts.numel())
    return {**distances(p_s, counts / counts.sum(), catalog), "kl": distances(p_s, smoothed, catalog)["kl"],
            "mean_x": float(x[drawn].mean()), "mean_x_se": float(x[drawn].std() / drawn.numel() ** 0.5)}


def mean_over_users(cells: list[dict]) -> dict:
    """Per-user dicts of numbers -> their mean; standard errors (`*_se`) combine as those of a mean."""
    return {key: float(np.sqrt(np.sum(np.square([c[key] for c in cells]))) / len(cells)) if key.endswith("_se")
            else float(np.mean([c[key] for c in cells])) for key in cells[0]}


def markdown_disc_bias(result: dict) -> str:
    b, env = result["disc_bias"], result["environment"]
    p_b = ", ".join(f"{x:.3f}" for x in b["p_b"])
    lines = [f"## DISC bias: distance to the exact constrained distribution P_S, {b['users']} Amazon Beauty users x "
             f"{b['draws']:,} draws (k=1), temperature {b['temperature']}, model {b['model']} ({env['device']})", "",
             f"P_S and constrained decoding's own distribution Q computed exactly over all {b['items']:,} catalog "
             f"items per user; invalid mass p_b per user: {p_b}. Means over the users. The exact sampler draws "
             "from P_S itself: its distances are the noise floor at this number of draws. x(a) = the valid mass "
             "along item a's prefix; constrained decoding over-draws items with small x.", "",
             "| method | TV items | TV level a | KL(P_S ‖ ·) | mean x(a) of the draws | est. p_b | "
             f"s / {b['draws']:,} draws |", "|---|---:|---:|---:|---:|---:|---:|",
             f"| P_S, exact (DISC's target) | - | - | - | {b['exact']['P_S']['mean_x']:.4f} | - | - |"]
    q = b["exact"]["constrained decoding Q"]
    lines.append(f"| constrained decoding, exact Q (no sampling) | {q['tv_items']:.3f} | {q['tv_level_a']:.3f} | "
                 f"{q['kl']:.3f} | {q['mean_x']:.4f} | - | - |")
    for name, r in b["methods"].items():
        extra = f"{r['est_invalid_mass']:.3f} | {r['seconds']:.1f}" if "seconds" in r else "- | -"
        label = f"{name} (draws from P_S)" if name == "exact sampler" else name
        lines.append(f"| {label} | {r['tv_items']:.3f} | {r['tv_level_a']:.3f} | {r['kl']:.3f} | "
                     f"{r['mean_x']:.4f} ± {r['mean_x_se']:.4f} | {extra} |")
    lines += ["", "KL of the draws: to the empirical distribution smoothed by +0.5 per item; ± one standard error.",
              "", f"`{env['command']}` (torch {env['torch']}, transformers {env['transformers']}, "
              f"{env['cpu_threads']} threads)"]
    return "\n".join(lines)


# ------------------------------------------------------------------ nightly: the Ray job vs direct calls


def bench_nightly(args) -> dict:
    """The nightly job on a local Ray (one actor) against the same recommender called directly in this process on
    the same users and batches, and against bare `beam_search` on the same prompts."""
    import pyarrow as pa

    import ray
    from operators.recommender import Recommender
    from pipeline.config import load_config
    from pipeline.nightly import open_input, run_nightly

    cfg = load_config(args.config, args.set + [f"output={args.out}/nightly-bench", "compute.num_actors=1"])
    data, _, _ = open_input(cfg)
    table = data.to_table(columns=["user_id", "history"])
    ray.init(num_cpus=args.cpus, include_dashboard=False, ignore_reinit_error=True)
    t0 = time.perf_counter()
    manifest = run_nightly(cfg)
    t_job = time.perf_counter() - t0
    ray.shutdown()
    actor = Recommender(cfg, "direct")  # load once, as the actor does; not timed
    if cfg.compute.threads_per_actor is None:
        torch.set_num_threads(int(cfg.compute.cpus_per_actor))  # what Ray gives an actor
    batches = [table.slice(a, cfg.compute.batch_size) for a in range(0, table.num_rows, cfg.compute.batch_size)]
    t0 = time.perf_counter()
    for b in batches:
        actor(b)
    t_direct = time.perf_counter() - t0
    users = manifest["counts"]["users_ok"]
    metrics = pq.read_table(manifest["outputs"]["metrics"]).to_pandas()
    return {"users": users, "input_rows": table.num_rows, "job_s": t_job, "job_users_per_s": users / t_job,
            "actor_wall_s": float(metrics.wall_s.sum()), "direct_s": t_direct, "direct_users_per_s": users / t_direct,
            "ratio_job_vs_direct": t_direct / t_job, "torch_threads": torch.get_num_threads(),
            "metrics_summary": {"batches": len(metrics), "users_ok": int(metrics.users_ok.sum()),
                                "users_rejected": int(metrics.users_rejected.sum()),
                                "mean_batch_users_per_s": float(metrics.users_per_s.mean()),
                                "prefill_s": float(metrics.prefill_s.sum()), "decode_s": float(metrics.decode_s.sum()),
                                "target_forwards": int(metrics.target_forwards.sum())},
            "config": {"mode": cfg.decoding.mode, "k": cfg.decoding.k, "batch_size": cfg.compute.batch_size},
            "arrow": pa.__version__}


def markdown_nightly(result: dict) -> str:
    n, env = result["nightly"], result["environment"]
    m = n["metrics_summary"]
    return "\n".join([
        f"## nightly job (one actor) vs direct calls: {n['users']} users, mode {n['config']['mode']}, k "
        f"{n['config']['k']}, batch {n['config']['batch_size']}, {env['device']}", "",
        "| path | seconds | users/s |", "|---|---:|---:|",
        f"| `ray` nightly job (read, validate, actor pool, write, manifest, publish) | {n['job_s']:.1f} | "
        f"{n['job_users_per_s']:.1f} |",
        f"| recommender called directly in one process (same batches) | {n['direct_s']:.1f} | "
        f"{n['direct_users_per_s']:.1f} |", "",
        f"job / direct users/s: **{n['ratio_job_vs_direct']:.2f}** (torch threads {n['torch_threads']}); shard metrics: "
        f"{m['batches']} batches, {m['users_ok']} users ok, {m['users_rejected']} rejected, prefill {m['prefill_s']:.1f}s, "
        f"decode {m['decode_s']:.1f}s, {m['target_forwards']} target forwards, mean {m['mean_batch_users_per_s']:.0f} "
        "users/s per batch", "", f"`{env['command']}`"])


# ------------------------------------------------------------------ all: every claim, one process, one report

SECTIONS = ("decode", "speculative", "disc", "disc-bias")


def section_argvs(a) -> dict[str, list[str]]:
    """The `all` flags -> each section's own command line; a flag not named keeps that section's default."""
    shared = ["--data", a.data, "--history-len", str(a.history_len), "--dtype", a.dtype, "--seed", str(a.seed),
              "--out", a.out, *(["--device", a.device] if a.device else [])]
    users, batch, temperature = str(a.users), str(a.batch), str(a.temperature)
    argvs = {
        "decode": ["decode", *shared, "--model", a.target, "--users", users, "--batch", batch, "--k", str(a.k),
                   "--index-items", *map(str, a.index_items), "--repeats", str(a.repeats)],
        "speculative": ["speculative", *shared, "--target", a.target, "--drafts", *a.drafts, "--ks", *map(str, a.ks),
                        "--users", str(a.batch1_users), "--batch", batch, "--throughput-users", users,
                        "--temperature", temperature],
        "disc": ["disc", *shared, "--model", a.target, "--users", users, "--batch", batch, "--k", str(a.disc_k),
                 "--max-rounds", str(max(a.rounds)), "--temperature", temperature],
        "disc-bias": ["disc-bias", *shared, "--model", a.target, "--users", str(a.bias_users), "--draws",
                      str(a.draws), "--rounds", *map(str, a.rounds), "--temperature", temperature,
                      "--chunk", str(a.chunk)],
    }
    return {name: argvs[name] for name in a.sections}


def bench_all(args, argv: list[str]) -> tuple[dict, str]:
    """Every section in this process, in order -> (all.json content, all.md)."""
    require_models(args.target, args.drafts if "speculative" in args.sections else None)
    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    result = {"command": command_line(argv), "started": started, "hardware": hardware(pick_device(args.device), args.dtype),
              "versions": versions(), "seeds": {"seed": args.seed, "where": SEED_USES}, "args": vars(args),
              "sections": {}}
    md = {}
    bar = progress(section_argvs(args).items(), "bench all: sections", total=len(args.sections), leave=True)
    for name, section_argv in bar:
        bar.set_postfix_str(name)
        t_section = time.perf_counter()
        _, section, md[name] = run(parse_args(section_argv), section_argv)
        section.update(seconds=time.perf_counter() - t_section, verdict=VERDICTS[name](section))
        result["sections"][name] = section
    result["seconds"] = time.perf_counter() - t0
    return result, markdown_all(result, md)


SEED_USES = ("torch.manual_seed at the start of every section; every sampling torch.Generator (relaxed speculative, "
             "DISC, constrained sampling, the exact sampler) re-seeded with it for each method; the synthetic index "
             "catalogs")


def verdict_decode(r: dict) -> str:
    d, a = r["decode"], r["decode"]["agreement"]
    m = d["methods"]
    line = (f"beam_search = transformers on {a['same_items_same_order']:.0%} of users (same items, same order; max "
            f"|score diff| {a['max_abs_score_diff']:.1e}), {d['speedup_users_per_s']:.1f}x users/s, "
            f"{1 / d['kv_ratio']:.1f}x fewer KV tokens, peak memory {m['beam_search']['peak_memory_mb']:.0f} vs "
            f"{m['transformers']['peak_memory_mb']:.0f} MB")
    with_trie = [i for i in r["index"] if i["cpu_trie_ms"] is not None]
    if with_trie:
        i = max(with_trie, key=lambda i: i["items"])
        line += (f"; catalog index on {i['items']:,} items: CSR allowed_next {i['allowed_next_ms']:.2f} ms per step "
                 f"vs CPU trie {i['cpu_trie_ms']:.2f} ms ({i['cpu_trie_ms'] / i['allowed_next_ms']:.0f}x), "
                 f"PPV verify {i['verify_ms']:.2f} ms")
    return line


def verdict_speculative(r: dict) -> str:
    s = r["speculative"]
    strict = [c["same_as_beam_search"] for t in s["batches"] for row in t["k"].values()
              for c in row["drafts"].values() if "same_as_beam_search" in c]
    best = []
    for t in s["batches"]:
        ws, k, key = max((c["ws"], k, key) for k, row in t["k"].items() for key, c in row["drafts"].items())
        best.append(f"batch {t['batch']} {ws:.2f} ({key.replace('|', ' ')}, K={k})")
    return (f"strict speculative identical to beam_search on {min(strict):.0%} of users (every draft, every K); "
            f"best WS@K over beam_search: {', '.join(best)}")


def verdict_disc(r: dict) -> str:
    d, rounds = r["disc"], r["args"]["max_rounds"]
    m = d["methods"]
    disc, base, beam = m[f"disc rounds={rounds} exact"], m["constrained_sample"], m["beam_search"]
    return (f"DISC rounds={rounds} (exact mask) {disc['ms_per_user']:.1f} ms/user for k={d['k']}: "
            f"{disc['ms_per_user'] / base['ms_per_user']:.1f}x constrained sampling, "
            f"{disc['ms_per_user'] / beam['ms_per_user']:.1f}x beam_search; {disc['proposals_per_item']:.2f} proposals "
            f"per item, acceptance {disc['acceptance_rate']:.2f}")


def verdict_disc_bias(r: dict) -> str:
    b, rounds = r["disc_bias"], max(r["args"]["rounds"])
    m, q, target = b["methods"], b["exact"]["constrained decoding Q"], b["exact"]["P_S"]["mean_x"]
    floor, base, disc = m["exact sampler"], m["constrained_sample"], m[f"disc rounds={rounds}"]
    return (f"mean x(a) of the draws: DISC rounds={rounds} {disc['mean_x']:.3f} ± {disc['mean_x_se']:.3f}, "
            f"constrained {base['mean_x']:.3f} ± {base['mean_x_se']:.3f}, exact P_S {target:.3f}; "
            f"DISC rounds={rounds} TV (level a) {disc['tv_level_a']:.3f} vs constrained {base['tv_level_a']:.3f}, "
            f"exact-sampler floor {floor['tv_level_a']:.3f} (constrained decoding's exact bias: TV "
            f"{q['tv_level_a']:.3f} level a, {q['tv_items']:.3f} items); p_b {np.mean(b['p_b']):.2f}")


VERDICTS = {"decode": verdict_decode, "speculative": verdict_speculative, "disc": verdict_disc,
            "disc-bias": verdict_disc_bias}


def markdown_all(result: dict, sections_md: dict[str, str]) -> str:
    h, v, a = result["hardware"], result["versions"], result["args"]
    gpu = f"{h['gpu']} ({h['gpu_memory_gib']} GiB) x {h['gpus']}, CUDA {h['cuda']}" if "gpu" in h else "none"
    lines = ["# genrec-batch: the project's claims on Amazon Beauty", "",
             f"`{result['command']}`: {result['seconds'] / 60:.1f} min, started {result['started']}", "",
             "| | |", "|---|---|",
             f"| hardware | {h['cpu']}, {h['cpu_cores']} cores ({h['cpu_cores_usable']} usable), {h['ram_gib']} GiB "
             f"RAM; GPU: {gpu} |",
             f"| run on | {h['device']}, dtype {a['dtype']} ({h['dtype']}), {h['torch_threads']} torch threads |",
             f"| versions | python {v['python']}, torch {v['torch']}, transformers {v['transformers']}, "
             f"ray {v['ray']}, pyarrow {v['pyarrow']}, numpy {v['numpy']}, tqdm {v['tqdm']} |",
             f"| genrec-batch | {v['genrec-batch']}, commit {v['git_commit']} |",
             f"| seeds | {result['seeds']['seed']}: {result['seeds']['where']} |",
             f"| models | target {a['target']}; drafts {', '.join(a['drafts'])} |", "", "## verdicts", ""]
    lines += [f"- **{name}** ({s['seconds']:.0f} s): {s['verdict']}" for name, s in result["sections"].items()]
    for name, s in result["sections"].items():
        heading, rest = sections_md[name].split("\n", 1)
        lines += ["", heading, "", f"**verdict**: {s['verdict']}", rest]
    return "\n".join(lines)


def hardware(device: torch.device, dtype: str) -> dict:
    """CPU model, cores, memory, the GPU if there is one, and the precision `dtype` resolves to on `device`."""
    out = {"cpu": cpu_model(), "cpu_cores": os.cpu_count(),
           "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
           "device": str(device), "dtype": str(pick_dtype(dtype, device)).removeprefix("torch."),
           "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device.type == "cuda" else 0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2 ** 30, 1),
                   gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "ray", "pyarrow", "numpy", "tqdm", "genrec-batch"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["git_commit"] = git_commit(Path(__file__).resolve().parents[1])
    return out


def git_commit(root: Path) -> str:
    """HEAD of the checkout, `+dirty` when tracked files differ from it."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


# ------------------------------------------------------------------ report


def environment(args, argv: list[str]) -> dict:
    import transformers

    device = pick_device(args.device)
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "cpu_threads": torch.get_num_threads(), "command": command_line(argv)}


def command_line(argv: list[str]) -> str:
    return "python -m jobs.bench " + shlex.join(argv)


def markdown(result: dict) -> str:
    d, env = result["decode"], result["environment"]
    lines = [f"## decode: K={result['args']['k']}, batch {result['args']['batch']}, {d['agreement']['users']} "
             f"Amazon Beauty users (prompt up to {d['prompt_tokens_max']} tokens), {env['device']}",
             "", "| method | users/s | peak memory (MB) | KV tokens / user |", "|---|---:|---:|---:|"]
    for name, r in d["methods"].items():
        lines.append(f"| {name} | {r['users_per_s']:.2f} | {r['peak_memory_mb']:.1f} | {r['kv_tokens_per_user']:.0f} |")
    a = d["agreement"]
    lines += ["", f"speed-up: **{d['speedup_users_per_s']:.1f}x** users/s; KV held: {d['kv_ratio']:.3f}x; "
              f"same items in the same order: {a['same_items_same_order']:.1%}, same item set: {a['same_item_set']:.1%}, "
              f"max |score diff| {a['max_abs_score_diff']:.2e}", ""]
    if result.get("index"):
        lines += [f"## catalog index: ms per decoding step ({result['index'][0]['rows']} prefixes, PPV top-M = "
                  f"{result['index'][0]['top_m']}), mean over levels", "",
                  "| catalog | items | allowed_next (CSR) | verify (PPV) | CPU trie | trie build (s) |",
                  "|---|---:|---:|---:|---:|---:|"]
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        for r in result["index"]:
            lines.append(f"| {r['catalog']} | {r['items']:,} | {fmt(r['allowed_next_ms'], '.3f')} | "
                         f"{fmt(r['verify_ms'], '.3f')} | {fmt(r['cpu_trie_ms'], '.3f')} | {fmt(r['trie_build_s'], '.1f')} |")
    lines += ["", f"`{env['command']}` (torch {env['torch']}, transformers {env['transformers']}, "
              f"{env['cpu_threads']} threads)"]
    return "\n".join(lines)


def parse_args(argv=None):
    root = Path(__file__).resolve().parents[1]
    p = argparse.ArgumentParser(prog="python -m jobs.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="bench", required=True)

    def common(sp):  # every benchmark: data, precision, device, seed, output folder
        sp.add_argument("--data", default=str(root / "data" / "beauty"), help="prepared data dir (jobs.prepare_data)")
        sp.add_argument("--history-len", type=_positive, default=20)
        sp.add_argument("--dtype", default="auto")
        sp.add_argument("--device", help="cpu or cuda (default: cuda if available)")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--out", default=str(root / "bench-out"), help="folder for NAME.json and NAME.md")

    def random_model(sp):  # the model when none is given: a random Llama of --layers x --hidden
        sp.add_argument("--layers", type=_positive, default=4)
        sp.add_argument("--hidden", type=_positive, default=256)
        sp.add_argument("--heads", type=_positive, default=4)
        sp.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")

    d = sub.add_parser("decode", help="transformers beam search vs beam_search, and the catalog index")
    common(d)
    random_model(d)
    d.add_argument("--model", help="local model dir; default: a random Llama of --layers x --hidden")
    d.add_argument("--users", type=_positive, default=128)
    d.add_argument("--batch", type=_positive, default=32)
    d.add_argument("--k", type=_positive, default=20)
    d.add_argument("--index-items", type=_positive, nargs="*", default=[10_000_000],
                   help="synthetic catalog sizes for the index benchmark")
    d.add_argument("--trie-max-items", type=int, default=10_000_000, help="skip the CPU trie above this size")
    d.add_argument("--top-m", type=_positive, default=50, help="PPV candidates per row")
    d.add_argument("--repeats", type=_positive, default=5)
    sp = sub.add_parser("speculative", help="AtSpeed Table 1: speculative vs beam_search, every draft, strict/relaxed")
    common(sp)
    sp.add_argument("--target", default=str(root / "models" / "demo-target"))
    sp.add_argument("--drafts", nargs="*", default=None, help="draft model dirs (default: models/demo-draft-*)")
    sp.add_argument("--ks", type=_positive, nargs="+", default=[1, 3, 5, 10, 20])
    sp.add_argument("--users", type=_positive, default=20, help="users at batch size 1")
    sp.add_argument("--batch", type=_positive, default=64, help="the throughput batch size")
    sp.add_argument("--throughput-users", type=_positive, default=128)
    sp.add_argument("--draft-beams", type=_positive, default=40)
    sp.add_argument("--gamma", type=_positive, default=None)
    sp.add_argument("--temperature", type=float, default=1.0)
    sp.add_argument("--with-transformers", action=argparse.BooleanOptionalAction, default=True)
    dc = sub.add_parser("disc", help="DISC (rounds 1..R, exact and PPV) vs constrained sampling vs beam_search")
    common(dc)
    random_model(dc)
    demo = root / "models" / "demo-target"
    dc.add_argument("--model", default=str(demo) if (demo / "config.json").is_file() else None,
                    help="local model dir (default: models/demo-target if trained, else a random Llama)")
    dc.add_argument("--k", type=_positive, default=10)
    dc.add_argument("--users", type=_positive, default=128)
    dc.add_argument("--batch", type=_positive, default=32)
    dc.add_argument("--max-rounds", type=_positive, default=4)
    dc.add_argument("--top-m", type=_positive, default=50)
    dc.add_argument("--temperature", type=float, default=1.0)
    db = sub.add_parser("disc-bias", help="DISC's bias: TV / KL of each sampler to the exact constrained P_S")
    common(db)
    db.add_argument("--model", default=str(demo), help="trained model dir (default: models/demo-target)")
    db.add_argument("--users", type=_positive, default=4)
    db.add_argument("--draws", type=_positive, default=2000, help="items drawn per user and method (k=1 each)")
    db.add_argument("--batch", type=_positive, default=500, help="draws per batch")
    db.add_argument("--rounds", type=_positive, nargs="+", default=[1, 2, 4], help="DISC rounds to compare")
    db.add_argument("--temperature", type=float, default=1.0)
    db.add_argument("--chunk", type=_positive, default=1024, help="catalog items per forward when scoring P_S "
                    "(lower it for large vocabularies: the chunk holds [chunk, L, vocab] float64)")
    al = sub.add_parser("all", help="every claim in one run (decode, speculative, disc, disc-bias) -> all.{md,json}")
    common(al)
    al.add_argument("--target", default=str(demo), help="the target model of every section")
    al.add_argument("--drafts", nargs="*", default=None, help="draft model dirs (default: models/demo-draft*)")
    al.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    al.add_argument("--users", type=_positive, default=64, help="users of decode, disc and the speculative "
                    "throughput batch")
    al.add_argument("--batch", type=_positive, default=32, help="batch size of decode, disc and speculative")
    al.add_argument("--k", type=_positive, default=20, help="K of decode")
    al.add_argument("--index-items", type=_positive, nargs="*", default=[1_000_000],
                    help="synthetic catalog sizes for the index benchmark")
    al.add_argument("--repeats", type=_positive, default=3, help="index timings: best of")
    al.add_argument("--ks", type=_positive, nargs="+", default=[1, 3, 5, 10, 20],
                    help="speculative K (the Table 1 columns)")
    al.add_argument("--batch1-users", type=_positive, default=10, help="speculative users at batch size 1")
    al.add_argument("--disc-k", type=_positive, default=10, help="items per user of the disc timing")
    al.add_argument("--rounds", type=_positive, nargs="+", default=[1, 2, 4],
                    help="DISC rounds of disc-bias (the disc timing runs 1..max)")
    al.add_argument("--bias-users", type=_positive, default=4)
    al.add_argument("--draws", type=_positive, default=2000, help="disc-bias draws per user and method")
    al.add_argument("--temperature", type=float, default=1.0)
    al.add_argument("--chunk", type=_positive, default=1024, help="disc-bias: catalog items per forward when "
                    "scoring P_S (lower it for large vocabularies: the chunk holds [chunk, L, vocab] float64)")
    nb = sub.add_parser("nightly", help="the nightly job on one actor vs direct calls on the same users")
    nb.add_argument("--config", default=str(root / "infra" / "configs" / "demo.yaml"))
    nb.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    nb.add_argument("--cpus", type=_positive, default=2, help="CPUs of the local Ray")
    nb.add_argument("--device")
    nb.add_argument("--out", default=str(root / "bench-out"))
    args = p.parse_args(argv)
    if args.bench in ("speculative", "all") and args.drafts is None:
        args.drafts = sorted(str(d) for d in (root / "models").glob("demo-draft*") if (d / "config.json").is_file())
    return args


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def write_result(out: Path, name: str, result: dict, md: str) -> None:
    """bench-out/NAME.json and NAME.md, and the table on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    (out / f"{name}.md").write_text(md + "\n")
    print(md)


def run(args, argv: list[str]) -> tuple[str, dict, str]:
    """One benchmark -> (name, result, Markdown)."""
    result = {"args": vars(args), "environment": environment(args, argv)}
    if args.bench == "decode":
        result["decode"] = bench_decode(args)
        tok = load_tokenizer(Path(args.data) / "tokenizer")
        beauty = Catalog.from_parquet(Path(args.data) / "items.parquet", tok, on_duplicate="first",
                                      device=pick_device(args.device))
        result["index"] = run_index(args, beauty)
        return "decode", result, markdown(result)
    bench, md = {"speculative": (bench_speculative, markdown_speculative), "disc": (bench_disc, markdown_disc),
                 "disc-bias": (bench_disc_bias, markdown_disc_bias), "nightly": (bench_nightly, markdown_nightly)
                 }[args.bench]
    result[args.bench.replace("-", "_")] = bench(args)
    return args.bench, result, md(result)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.bench == "all":
        result, md = bench_all(args, argv)
        write_result(Path(args.out), "all", result, md)
    else:
        name, result, md = run(args, argv)
        write_result(Path(args.out), name, result, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
