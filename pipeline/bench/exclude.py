"""exclude: what per-user exclusions cost beam_search (issue 32). The same Amazon Beauty users and batches are
decoded without exclusions and with each count of excluded items per user (the user's whole history first, topped up
with distinct random catalog items), interleaved; the timed call builds each batch's `Exclusions` from its (user,
item) pairs, as the actor does. Reported: users/s per method, median (min-max), and each count's cost over no
exclusions as the ratio of medians with its range, against the issue's bounds (1.1x at 50 items, 1.5x at 1,000).
"""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog, Exclusions
from pipeline.bench.common import Interleaved, compare, fmt_ratio, fmt_spread, footer, interleaved, ratio
from pipeline.bench.inputs import beauty_section, bench_model, ranked
from pipeline.bench.params import ExcludeParams
from pipeline.markdown import table

BOUNDS = {50: 1.1, 1000: 1.5}  # the cost bounds: excluded items per user -> the most beam_search may cost


def run_exclude(p: ExcludeParams) -> dict:
    """The exclude section's figures."""
    device, tok, catalog, ids, mask = beauty_section(p, p.model)
    model = bench_model(p, len(tok), device)
    histories = pq.read_table(Path(p.data) / "test.parquet", columns=["history"]).column("history").to_pylist()
    histories = [h for h in histories if h][: ids.shape[0]]  # the users load_beauty rendered, in order
    return {"exclude": bench_exclude(p, model, catalog, ids, mask, histories)}


def exclusion_pairs(catalog: Catalog, histories: list[list[int]], count: int, seed: int):
    """Each user's `count` excluded items: its whole history first, then distinct random catalog items -> (user [M],
    item id [M]) on the catalog's device."""
    rng = np.random.default_rng(seed)
    ids = catalog.item_ids.cpu().numpy()
    users, items = [], []
    for u, history in enumerate(histories):  # building the benchmark's input, outside the timed calls
        own = np.unique(np.asarray(history, dtype=np.int64))[:count]
        more = rng.choice(np.setdiff1d(ids, own), count - len(own), replace=False)
        users.append(np.full(count, u))
        items.append(np.concatenate([own, more]))
    to = lambda x: torch.from_numpy(np.concatenate(x)).to(catalog.device)  # noqa: E731
    return to(users), to(items)


def bench_exclude(
    p: ExcludeParams, model, catalog: Catalog, ids: torch.Tensor, mask: torch.Tensor, histories: list[list[int]]
) -> dict:
    """beam_search over the users [U, S] in batches of p.batch, with no exclusions and with each of p.counts
    excluded items per user, interleaved; whether any user got an excluded item."""
    pairs = {n: exclusion_pairs(catalog, histories, n, p.seed) for n in p.counts}

    def decode(n: int | None, a: int):  # users a .. a + B - 1 with n excluded items each (None: no exclusions)
        return excluded_beam_search(model, catalog, p.k, ids[a : a + p.batch], mask[a : a + p.batch], pairs.get(n), a)

    names = {"none": None, **{f"exclude {n}": n for n in p.counts}}
    run = interleaved(
        {name: lambda n=n: [decode(n, a) for a in range(0, ids.shape[0], p.batch)] for name, n in names.items()},
        p.repeats,
        ids.device,
        warmup={name: partial(decode, n, 0) for name, n in names.items()},
        desc="exclude: beam_search with and without exclusions",
    )
    return {
        "users": ids.shape[0],
        "batch": p.batch,
        "k": p.k,
        "repeats": p.repeats,
        "order": run.order,
        "methods": {name: exclusion_row(run, name, n, ids.shape[0], pairs.get(n)) for name, n in names.items()},
        "prompt_tokens_max": ids.shape[1],
        "own_work": own_work(p, model, catalog, ids, mask, pairs),
    }


def excluded_beam_search(
    model, catalog: Catalog, k: int, ids: torch.Tensor, mask: torch.Tensor, pairs: tuple | None, a: int
):
    """beam_search on a batch [B, S] of users a .. a + B - 1, excluding their items among `pairs` (user [M], item id
    [M] over all the users; None: no exclusions), with `Exclusions` built in the call, as the actor does."""
    if pairs is None:
        return beam_search(model, ids, mask, catalog, k)
    user, item = pairs
    pick = (user >= a) & (user < a + ids.shape[0])
    exclude = Exclusions.from_items(catalog, user[pick] - a, item[pick], ids.shape[0])
    return beam_search(model, ids, mask, catalog, k, exclude=exclude)


def exclusion_row(run: Interleaved, name: str, n: int | None, users: int, pairs: tuple | None) -> dict:
    """One count of excluded items per user: users/s; with exclusions, the cost over none, the bound, the excluded
    items returned (over all `pairs`, user [M] and item id [M]) and the share of users with a full list."""
    t = run.timings[name]
    row = {"excluded_per_user": n or 0, "timing": t.to_dict(), "users_per_s": t.per(lambda s: users / s)}
    if pairs is None:
        return row
    items = ranked(run.outputs[name])[0]  # [U, k]
    user, item = pairs
    hit = (items[user] == item[:, None]).any(1)  # [M] an excluded item among its user's recommendations
    row.update(
        cost=ratio(t, run.timings["none"]),
        bound=BOUNDS.get(n),
        excluded_returned=int(hit.sum()),
        full_lists=float((items >= 0).all(1).float().mean()),
    )
    return row


class Recording(Exclusions):
    """Exclusions that keep the nodes each mask was asked about (`asked`), to time the masks alone afterwards."""

    def open(self, node: torch.Tensor) -> torch.Tensor:
        self.asked.append(node)
        return super().open(node)


def own_work(p: ExcludeParams, model, catalog: Catalog, ids: torch.Tensor, mask: torch.Tensor, pairs: dict) -> dict:
    """The exclusions' own work on the first batch, each part timed alone: building them from the batch's (user,
    item) pairs, and every decoding step's mask replayed on the children beam_search asked about; interleaved with the
    batch's decode without exclusions, p.repeats times. The parts' sum over the decode: from the medians, and from
    the minima (each part's fastest run, nearest a quiet machine's cost when others share the CPU)."""
    b = min(p.batch, ids.shape[0])
    methods = {"decode": lambda: beam_search(model, ids[:b], mask[:b], catalog, p.k)}
    for n, (user, item) in pairs.items():
        pick = user < b
        build = lambda user=user[pick], item=item[pick]: Exclusions.from_items(catalog, user, item, b)  # noqa: E731
        ex = build()
        rec = Recording(*(getattr(ex, f.name) for f in fields(ex)))
        rec.asked = []
        beam_search(model, ids[:b], mask[:b], catalog, p.k, exclude=rec)
        methods[f"build {n}"] = build
        methods[f"masks {n}"] = lambda ex=ex, asked=rec.asked: [ex.open(node) for node in asked]
    run = interleaved(methods, p.repeats, ids.device, desc="exclude: the exclusions' own work")
    t = run.timings
    return {
        "users": b,
        "timings": {name: x.to_dict() for name, x in t.items()},
        "parts": {
            n: {
                "build_ms": t[f"build {n}"].per(lambda s: 1e3 * s),
                "masks_ms": t[f"masks {n}"].per(lambda s: 1e3 * s),
                "of_decode_median": (t[f"build {n}"].median + t[f"masks {n}"].median) / t["decode"].median,
                "of_decode_min": (t[f"build {n}"].min + t[f"masks {n}"].min) / t["decode"].min,
            }
            for n in pairs
        },
    }


def markdown_exclude(result: dict) -> str:
    e, env, a = result["exclude"], result["environment"], result["args"]
    model = a["model"] or f"a random Llama {a['layers']} x {a['hidden']}"
    header = (
        "excluded items per user | users/s | cost over none (ratio of medians, range) | bound | excluded items returned"
    ).split(" | ")
    rows = [
        [
            f"{r['excluded_per_user']:,}",
            fmt_spread(r["users_per_s"]),
            fmt_ratio(r["cost"]) if "cost" in r else "1",
            f"{r['bound']:.1f}x" if r.get("bound") else "-",
            r.get("excluded_returned", "-"),
        ]
        for r in e["methods"].values()
    ]
    lines = [
        f"## exclude: beam_search with per-user exclusions, K={e['k']}, batch {e['batch']}, {e['users']} Amazon "
        f"Beauty users (prompt up to {e['prompt_tokens_max']} tokens), {model}, {env['device']}; median (min-max) "
        f"of {e['repeats']} interleaved repeats",
        "",
        table(header, rows),
        "",
        verdict_exclude(result),
        "",
    ]
    return "\n".join(lines + own_work_lines(e["own_work"], e["repeats"]) + ["", footer(env)])


def own_work_lines(w: dict, repeats: int) -> list[str]:
    """The exclusions' own work on one batch: build and masks per count, and both over the decode."""
    d = {key: 1e3 * w["timings"]["decode"][f"{key}_s"] for key in ("median", "min", "max")}
    header = (
        "excluded items per user | build | masks, every step | both / decode (medians) | both / decode (minima)"
    ).split(" | ")
    rows = [
        [
            f"{int(n):,}",
            fmt_spread(r["build_ms"], 1),
            fmt_spread(r["masks_ms"], 1),
            f"{r['of_decode_median']:.1%}",
            f"{r['of_decode_min']:.1%}",
        ]
        for n, r in w["parts"].items()
    ]
    return [
        f"The exclusions' own work on one batch of {w['users']} users, each part timed alone (ms, median "
        f"(min-max) of {repeats} interleaved repeats with the batch's decode without exclusions, "
        f"{fmt_spread(d, 0)} ms):",
        "",
        table(header, rows),
    ]


def verdict_exclude(result: dict) -> str:
    """Each count's cost against its bound, from the medians (the range says how sure)."""
    parts = []
    for name, r in result["exclude"]["methods"].items():
        if "cost" not in r:
            continue
        c = r["cost"]
        within = (
            ""
            if r["bound"] is None
            else (f", {'within' if c['median'] <= r['bound'] else 'ABOVE'} the {r['bound']:.1f}x bound")
        )
        parts.append(
            f"{r['excluded_per_user']:,} excluded items per user cost {fmt_ratio(c)} of beam_search without"
            f"{within} ({compare('none', name, c)})"
        )
    return "; ".join(parts) + "."
