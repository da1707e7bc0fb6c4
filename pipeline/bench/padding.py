"""padding: what ordering users by prompt length saves. The same Amazon Beauty users are decoded by `beam_search` in
batches cut in input order and in the order the actor decodes them (`length_order`: prompt length, then user id),
each batch without the left padding none of its users needs (`trim_padding`), the template's fixed prefix prefilled
once (as the actor does), interleaved. `--prompt-tokens N` stretches every prompt to N x its share of the longest
(its own tokens repeated): Beauty's length distribution at a prefill-heavy length. Reported per order: users/s,
target tokens, KV tokens and their padding per user, the share of prompt positions that were padding, and the
compiled engine's buckets its batches fall into (`decoding.compiled.Bucket.of`: users and prompt rounded up); the
lists of the two orders are compared user by user.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from decoding.beam import Prefix, beam_search
from decoding.catalog import Catalog
from decoding.compiled import Bucket
from decoding.models import load_tokenizer, pick_device, pick_dtype
from decoding.templates import PRESETS
from operators.batcher import length_order, trim_padding
from operators.prompts import Renderer, catalog_probes
from pipeline.bench.common import compare, fmt_ratio, fmt_spread, footer, interleaved, ratio, report
from pipeline.bench.inputs import bench_model
from pipeline.bench.params import PaddingParams
from pipeline.markdown import table


def run_padding(p: PaddingParams) -> dict:
    """The padding section's figures."""
    device = pick_device(p.device)
    torch.manual_seed(p.seed)
    tok, catalog, prefix, ids, mask = beauty_prompts(Path(p.data), p.users, p.history_len, device)
    if p.prompt_tokens:
        ids, mask = stretched(ids, mask, p.prompt_tokens)
    model = bench_model(p, len(tok), device)
    model = model if p.model else model.to(pick_dtype(p.dtype, device))  # a random model in the run's dtype
    return {"padding": bench_padding(p, model, catalog, Prefix(prefix.to(device)), ids, mask)}


def gpu_cell(data: str, layers: int, hidden: int, heads: int, dtype: str, repeats: int, smoke: bool = False):
    """The padding cell of a GPU page (`bench gpu`): 2,048 Beauty users (64 with smoke), batch 256, K 20, every
    prompt stretched to 300 tokens x its share of the longest (Beauty's lengths at a prefill-heavy length), a random
    Llama of layers x hidden in `dtype` on CUDA (cpu with smoke), input order against ordered -> (result, Markdown)."""
    p = PaddingParams(
        data=data,
        layers=layers,
        hidden=hidden,
        heads=heads,
        dtype=dtype,
        repeats=repeats,
        device="cpu" if smoke else "cuda",
        users=64 if smoke else 2048,
        batch=16 if smoke else 256,
        k=20,
        prompt_tokens=300,
    )
    return report(p, "bench gpu: padding cell", run_padding, markdown_padding)


def beauty_prompts(data: Path, users: int, history_len: int, device):
    """The first `users` Beauty test users with a history, in file order, in the `codes` template -> (tokenizer,
    catalog, the template's fixed prefix [P], prompts after it: input_ids, attention_mask [U, S] left-padded)."""
    tok = load_tokenizer(data / "tokenizer")
    catalog = Catalog.from_parquet(data / "items.parquet", tok, on_duplicate="first", device=device)
    histories = [h for h in pq.read_table(data / "test.parquet", columns=["history"])["history"].to_pylist() if h]
    renderer = Renderer.compile(PRESETS["codes"].with_max_items(history_len), tok, catalog_probes(catalog.item_tokens))
    prompts = renderer.render(pa.array(histories[:users]), catalog.item_tokens, len(renderer.prefix_ids))
    prefix = torch.from_numpy(np.asarray(renderer.prefix_ids, np.int64))
    return tok, catalog, prefix, prompts.input_ids.to(device), prompts.attention_mask.to(device)


def stretched(ids: torch.Tensor, mask: torch.Tensor, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [U, S] -> each ceil(longest x its length / the longest length) tokens, its own tokens repeated, left-
    padded [U, longest]: the same length distribution, scaled (building the input, outside the timed calls)."""
    lengths = mask.sum(1).tolist()
    out_ids = torch.zeros(ids.shape[0], longest, dtype=ids.dtype, device=ids.device)
    out_mask = torch.zeros_like(out_ids)
    for u, n in enumerate(lengths):
        m = math.ceil(longest * n / max(lengths))
        own = ids[u, ids.shape[1] - n :]
        out_ids[u, longest - m :] = own.repeat(-(-m // n))[:m]
        out_mask[u, longest - m :] = 1
    return out_ids, out_mask


def bench_padding(p: PaddingParams, model, catalog: Catalog, prefix: Prefix, ids, mask) -> dict:
    """beam_search over the users [U, S] in batches of p.batch, in input order and ordered by length, interleaved."""
    n = ids.shape[0]
    orders = {"input order": np.arange(n), "ordered": length_order(mask, pa.array(np.arange(n)))}

    def decode(order: np.ndarray, users: int | None = None) -> list:
        out = []
        for a in range(0, users or n, p.batch):
            rows = torch.from_numpy(order[a : a + p.batch]).to(ids.device)
            out.append(beam_search(model, *trim_padding(ids[rows], mask[rows]), catalog, p.k, prefix=prefix))
        return out

    run = interleaved(
        {name: partial(decode, o) for name, o in orders.items()},
        p.repeats,
        ids.device,
        warmup={name: partial(decode, o, p.batch) for name, o in orders.items()},
        desc="padding: input order vs ordered by length",
    )
    rows = {name: order_row(run, name, o, mask, p.batch, catalog.code_len, p.k) for name, o in orders.items()}
    items = {name: torch.cat([r.item_ids for r in run.outputs[name]])[np.argsort(o)] for name, o in orders.items()}
    return {
        "users": n,
        "batch": p.batch,
        "k": p.k,
        "repeats": p.repeats,
        "order": run.order,
        "prompt_tokens_max": int(mask.sum(1).max()),
        "prompt_tokens_mean": float(mask.sum(1).float().mean()),
        "methods": rows,
        "speedup": ratio(run.timings["input order"], run.timings["ordered"]),
        "identical_lists": int((items["input order"] == items["ordered"]).all(1).sum()),
    }


def order_row(run, name: str, order: np.ndarray, mask: torch.Tensor, batch: int, code_len: int, k: int) -> dict:
    """One order's figures: users/s, and per user the target tokens, prompt positions, KV tokens and KV tokens of
    padding; the padding share of prompt positions; the compiled engine's distinct buckets."""
    t, parts, n = run.timings[name], run.outputs[name], len(order)
    lengths = mask.sum(1).cpu().numpy()[order]
    cut = [lengths[a : a + batch] for a in range(0, n, batch)]
    positions = sum(len(c) * int(c.max()) for c in cut)
    return {
        "timing": t.to_dict(),
        "users_per_s": t.per(lambda s: n / s),
        "target_tokens_per_user": sum(r.stats["target_tokens"] for r in parts) / n,
        "kv_tokens_per_user": sum(r.stats["kv_tokens"] for r in parts) / n,
        "prompt_positions_per_user": positions / n,
        "prompt_padding_fraction": 1 - float(lengths.sum()) / positions,
        "kv_padding_per_user": sum(len(c) * int(c.max()) - int(c.sum()) for c in cut) / n,
        "buckets": len({Bucket.of(len(c), int(c.max()), k, code_len) for c in cut}),
    }


def markdown_padding(result: dict) -> str:
    r, env, a = result["padding"], result["environment"], result["args"]
    model = a["model"] or f"a random Llama {a['layers']} x {a['hidden']}"
    header = (
        "order | users/s | target tokens per user | prompt positions per user | padding | KV tokens per user "
        "| of them padding | compiled buckets"
    ).split(" | ")
    rows = [
        [
            name,
            fmt_spread(m["users_per_s"], 1),
            f"{m['target_tokens_per_user']:.1f}",
            f"{m['prompt_positions_per_user']:.1f}",
            f"{m['prompt_padding_fraction']:.1%}",
            f"{m['kv_tokens_per_user']:.1f}",
            f"{m['kv_padding_per_user']:.1f}",
            m["buckets"],
        ]
        for name, m in r["methods"].items()
    ]
    return "\n".join(
        [
            f"## padding: beam_search, K={r['k']}, batch {r['batch']}, {r['users']} Amazon Beauty users (prompt "
            f"after the shared prefix: mean {r['prompt_tokens_mean']:.1f}, longest {r['prompt_tokens_max']} tokens), "
            f"{model}, {env['device']}; median (min-max) of {r['repeats']} interleaved repeats",
            "",
            table(header, rows),
            "",
            f"Ordered by length: {fmt_ratio(r['speedup'])} the users/s of input order "
            f"({compare('ordered', 'input order', r['speedup'])}); identical lists for {r['identical_lists']} of "
            f"{r['users']} users.",
            "",
            footer(env),
        ]
    )
