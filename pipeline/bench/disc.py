"""disc: time per user of `disc_sample` (rounds 1..R, exact mask and PPV top-M) against `constrained_sample` and
`beam_search` on the same Amazon Beauty prompts, every method interleaved, with proposals per item, acceptance rate
and estimated p_b.

disc-bias: DISC's bias reduction on Amazon Beauty. Per user, the exact constrained distribution P_S over the whole
catalog (every item scored); then N draws of constrained sampling, DISC at several rounds and an exact sampler
(draws from P_S itself: the noise floor at this N), compared to P_S by total variation (items and the first code's
marginal), KL, and the mean valid mass x(a) of the drawn items (constrained decoding's exact distribution Q = p / x
is computed too, so its bias is known without sampling noise). A distance measurement, not a timing comparison.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from decoding.beam import beam_search
from decoding.catalog import Catalog
from decoding.disc import constrained_sample, disc_sample
from decoding.metrics import distances, draw_stats, mean_over_users
from decoding.models import load_model
from decoding.reference import catalog_logprob
from pipeline.bench.common import Timing, aligned, fmt_ratio, fmt_spread, footer, progress, ratio, timed
from pipeline.bench.inputs import (
    beauty_section,
    bench_model,
    in_batches,
    interleaved_in_batches,
    require_models,
)
from pipeline.bench.params import DiscBiasParams, DiscParams
from pipeline.markdown import table


def run_disc(p: DiscParams) -> dict:
    """The disc section's figures."""
    return {"disc": bench_disc(p)}


def bench_disc(p: DiscParams) -> dict:
    """Every method over the same users in batches of p.batch, interleaved, p.repeats times; each call re-seeds the
    sampling generator, so every repeat draws the same."""
    device, _, catalog, ids, mask = beauty_section(p, p.model)
    model = bench_model(p, catalog.vocab_size, device)
    g = torch.Generator(device=device)
    run = interleaved_in_batches(
        disc_decoders(p, model, catalog, g), ids, mask, p.batch, p.repeats, g, p.seed, "disc: methods"
    )
    users, beam = ids.shape[0], run.timings["beam_search"]
    rows = {
        name: sampler_row(t, run.outputs[name], users, p.k, None if name == "beam_search" else beam)
        for name, t in run.timings.items()
    }
    disc, base = run.timings[f"disc rounds={p.max_rounds} exact"], run.timings["constrained_sample"]
    return {
        "k": p.k,
        "users": users,
        "batch": p.batch,
        "temperature": p.temperature,
        "repeats": p.repeats,
        "model": str(Path(p.model)) if p.model else "random",
        "order": run.order,
        "methods": rows,
        "disc_vs_constrained": ratio(disc, base),
        "disc_vs_beam_search": ratio(disc, beam),
    }


def disc_decoders(p: DiscParams, model, catalog: Catalog, g: torch.Generator) -> dict:
    """name -> fn(ids, mask): beam_search, constrained sampling, and DISC at rounds 1..p.max_rounds with the exact
    mask and with PPV top-M, the samplers drawing from `g`."""
    k, t = p.k, p.temperature
    fns = {
        "beam_search": lambda i, m: beam_search(model, i, m, catalog, k),
        "constrained_sample": lambda i, m: constrained_sample(model, i, m, catalog, k, temperature=t, generator=g),
    }
    for top_m in (None, p.top_m):
        for rounds in range(1, p.max_rounds + 1):
            fns[f"disc rounds={rounds} {'exact' if top_m is None else f'PPV top-{top_m}'}"] = (
                lambda i, m, r=rounds, tm=top_m: disc_sample(
                    model, i, m, catalog, k, rounds=r, top_m=tm, temperature=t, generator=g
                )
            )
    return fns


def sampler_row(t: Timing, recs: list, users: int, k: int, beam: Timing | None) -> dict:
    """One method's timing, ms per user and users/s; its time over beam_search's (`beam`, None for beam_search
    itself); a sampler's proposals per item, acceptance rate and estimated invalid mass."""
    row = {
        "timing": t.to_dict(),
        "ms_per_user": t.per(lambda s: 1e3 * s / users),
        "users_per_s": t.per(lambda s: users / s),
    }
    if beam is not None:
        row["vs_beam_search"] = ratio(t, beam)
    if "proposals" in recs[0].stats:
        cat = lambda key: torch.cat([r.stats[key] for r in recs]).double()  # noqa: E731 [U]
        row.update(
            proposals_per_item=float(cat("proposals").mean()) / k,
            acceptance_rate=float(cat("acceptance_rate").mean()),
            invalid_mass=float(cat("invalid_mass").mean()),
        )
    return row


def markdown_disc(result: dict) -> str:
    d, env = result["disc"], result["environment"]
    header = (
        "method | ms / user | users/s | x beam_search time | proposals / item | acceptance | est. invalid mass p_b"
    ).split(" | ")
    rows = [
        [
            name,
            fmt_spread(r["ms_per_user"], 1),
            fmt_spread(r["users_per_s"], 1),
            fmt_ratio(r["vs_beam_search"]) if "vs_beam_search" in r else "1",
            *(
                (f"{r['proposals_per_item']:.2f}", f"{r['acceptance_rate']:.3f}", f"{r['invalid_mass']:.3f}")
                if "proposals_per_item" in r
                else ("-", "-", "-")
            ),
        ]
        for name, r in d["methods"].items()
    ]
    return "\n".join(
        [
            f"## DISC vs constrained sampling vs beam search: k={d['k']}, {d['users']} Amazon Beauty users, batch "
            f"{d['batch']}, temperature {d['temperature']}, model {d['model']} ({env['device']}); median (min-max) "
            f"of {d['repeats']} interleaved repeats",
            "",
            table(header, rows, aligned(1, 6)),
            "",
            footer(env),
        ]
    )


def verdict_disc(r: dict) -> str:
    """DISC at the most rounds (exact mask) against constrained sampling and beam_search: time ratios of medians with
    their ranges, 'within noise' where the ranges overlap."""
    d, rounds = r["disc"], r["args"]["max_rounds"]
    disc = d["methods"][f"disc rounds={rounds} exact"]
    return (
        f"DISC rounds={rounds} (exact mask) {fmt_spread(disc['ms_per_user'], 1)} ms/user for k={d['k']}: "
        f"{_times(d['disc_vs_constrained'])} the time of constrained sampling, "
        f"{_times(d['disc_vs_beam_search'])} that of beam_search; {disc['proposals_per_item']:.2f} proposals "
        f"per item, acceptance {disc['acceptance_rate']:.2f}"
    )


def _times(r: dict) -> str:
    """A time ratio: '3.1x (2.8-3.4)', with ', within noise' when its range holds 1."""
    return f"{fmt_ratio(r, 1)}{' (within noise)' if r['within_noise'] else ''}"


# ------------------------------------------------------------------ disc-bias: distance to the exact P_S


def run_disc_bias(p: DiscBiasParams) -> dict:
    """The disc-bias section's figures."""
    return {"disc_bias": bench_disc_bias(p)}


def bench_disc_bias(p: DiscBiasParams) -> dict:
    """Per user: P_S and constrained decoding's own distribution Q over the whole catalog (`catalog_logprob`), then
    `draws` single-item draws (k=1, the prompt repeated) of constrained sampling, DISC at each of `rounds` and an
    exact sampler, compared to P_S. Besides TV and KL, the mean valid mass x(a) of the drawn items measures the bias
    along its direction with little noise: constrained decoding over-draws items whose prefixes are mostly invalid
    (small x), Q(a) = P_S(a) (1 - p_b) / x(a)."""
    require_models(p.model)
    device, _, catalog, ids, mask = beauty_section(p, p.model)
    model = load_model(p.model, device=str(device), dtype=p.dtype)
    g = torch.Generator(device=device)
    samplers = bias_samplers(p, model, catalog, g)
    users = [
        user_bias(p, model, catalog, samplers, g, ids[u : u + 1], mask[u : u + 1])
        for u in progress(range(ids.shape[0]), "disc bias: users")
    ]
    return {
        "users": len(users),
        "draws": p.draws,
        "items": len(catalog),
        "temperature": p.temperature,
        "model": str(p.model),
        "p_b": [u["p_b"] for u in users],
        "exact": {name: mean_over_users([u["exact"][name] for u in users]) for name in users[0]["exact"]},
        "methods": {name: mean_over_users([u["methods"][name] for u in users]) for name in users[0]["methods"]},
        "per_user": users,
    }


def bias_samplers(p: DiscBiasParams, model, catalog: Catalog, g: torch.Generator) -> dict:
    """name -> fn(ids, mask) drawing one item per row from `g`: constrained sampling, and DISC at each of p.rounds."""
    t = p.temperature
    samplers = {
        "constrained_sample": lambda i, m: constrained_sample(model, i, m, catalog, 1, temperature=t, generator=g)
    }
    for rounds in p.rounds:
        samplers[f"disc rounds={rounds}"] = lambda i, m, r=rounds: disc_sample(
            model, i, m, catalog, 1, rounds=r, temperature=t, generator=g
        )
    return samplers


def user_bias(
    p: DiscBiasParams,
    model,
    catalog: Catalog,
    samplers: dict,
    g: torch.Generator,
    ids: torch.Tensor,
    mask: torch.Tensor,
) -> dict:
    """One user's prompt [1, S]: P_S, Q and the valid masses x over the catalog, exactly; then p.draws draws of the
    exact sampler and of every sampler (each from `g` re-seeded with p.seed), compared to P_S."""
    (log_p, log_x), t_exact, _ = timed(
        lambda: catalog_logprob(model, ids, mask, catalog, p.temperature, p.chunk, valid_mass=True), ids.device
    )  # [N], [N]
    p_s = (log_p - log_p.logsumexp(0)).exp()  # [N] P_S over the catalog rows
    q, x = (log_p - log_x).exp(), log_x.exp()  # [N] constrained decoding's distribution, valid masses
    row = {
        "p_b": float(1 - log_p.exp().sum()),
        "exact_scoring_s": t_exact,
        "exact": {
            "P_S": {"mean_x": float((p_s * x).sum())},
            "constrained decoding Q": {**distances(p_s, q, catalog), "mean_x": float((q * x).sum())},
        },
        "methods": {},
    }
    g.manual_seed(p.seed)
    drawn = torch.multinomial(p_s, p.draws, replacement=True, generator=g)  # [D] catalog rows
    row["methods"]["exact sampler"] = draw_stats(p_s, x, drawn, catalog)
    u_ids, u_mask = ids.repeat(p.draws, 1), mask.repeat(p.draws, 1)  # [D, S]
    for name, fn in samplers.items():
        g.manual_seed(p.seed)
        row["methods"][name] = sampler_draws(fn, u_ids, u_mask, p.batch, p_s, x, catalog)
    return row


def sampler_draws(
    fn, ids: torch.Tensor, mask: torch.Tensor, batch: int, p_s: torch.Tensor, x: torch.Tensor, catalog: Catalog
) -> dict:
    """A sampler's draws, one per row of the repeated prompt [D, S], against P_S [N] (x [N]: the valid masses): the
    distances, its estimated invalid mass, its seconds."""
    recs, seconds, _ = timed(lambda: in_batches(fn, ids, mask, batch), ids.device)
    tokens = torch.cat([r.token_ids[:, 0] for r in recs])  # [D, L]
    drawn = catalog.node_of(tokens) - catalog.level_start[catalog.code_len]  # [D] catalog rows
    p_b = torch.cat([r.stats["invalid_mass"] for r in recs]).double().mean()  # 1 - E_q[x] over proposals
    return {**draw_stats(p_s, x, drawn, catalog), "est_invalid_mass": float(p_b), "seconds": seconds}


def markdown_disc_bias(result: dict) -> str:
    b, env = result["disc_bias"], result["environment"]
    p_b = ", ".join(f"{x:.3f}" for x in b["p_b"])
    header = (
        f"method | TV items | TV level a | KL(P_S ‖ ·) | mean x(a) of the draws | est. p_b | s / {b['draws']:,} draws"
    ).split(" | ")
    return "\n".join(
        [
            f"## DISC bias: distance to the exact constrained distribution P_S, {b['users']} Amazon Beauty users x "
            f"{b['draws']:,} draws (k=1), temperature {b['temperature']}, model {b['model']} ({env['device']})",
            "",
            f"P_S and constrained decoding's own distribution Q computed exactly over all {b['items']:,} catalog "
            f"items per user; invalid mass p_b per user: {p_b}. Means over the users. The exact sampler draws "
            "from P_S itself: its distances are the noise floor at this number of draws. x(a) = the valid mass "
            "along item a's prefix; constrained decoding over-draws items with small x.",
            "",
            table(header, bias_rows(b), aligned(1, 6)),
            "",
            "KL of the draws: to the empirical distribution smoothed by +0.5 per item; ± one standard error.",
            "",
            footer(env),
        ]
    )


def bias_rows(b: dict) -> list[list]:
    """P_S itself, constrained decoding's exact Q, then every sampler's draws (the exact sampler's from P_S)."""
    q = b["exact"]["constrained decoding Q"]
    rows = [
        ["P_S, exact (DISC's target)", "-", "-", "-", f"{b['exact']['P_S']['mean_x']:.4f}", "-", "-"],
        [
            "constrained decoding, exact Q (no sampling)",
            *(f"{q[key]:.3f}" for key in ("tv_items", "tv_level_a", "kl")),
            f"{q['mean_x']:.4f}",
            "-",
            "-",
        ],
    ]
    for name, r in b["methods"].items():
        rows.append(
            [
                f"{name} (draws from P_S)" if name == "exact sampler" else name,
                *(f"{r[key]:.3f}" for key in ("tv_items", "tv_level_a", "kl")),
                f"{r['mean_x']:.4f} ± {r['mean_x_se']:.4f}",
                *((f"{r['est_invalid_mass']:.3f}", f"{r['seconds']:.1f}") if "seconds" in r else ("-", "-")),
            ]
        )
    return rows


def verdict_disc_bias(r: dict) -> str:
    b, rounds = r["disc_bias"], max(r["args"]["rounds"])
    m, q, target = b["methods"], b["exact"]["constrained decoding Q"], b["exact"]["P_S"]["mean_x"]
    floor, base, disc = m["exact sampler"], m["constrained_sample"], m[f"disc rounds={rounds}"]
    return (
        f"mean x(a) of the draws: DISC rounds={rounds} {disc['mean_x']:.3f} ± {disc['mean_x_se']:.3f}, "
        f"constrained {base['mean_x']:.3f} ± {base['mean_x_se']:.3f}, exact P_S {target:.3f}; "
        f"DISC rounds={rounds} TV (level a) {disc['tv_level_a']:.3f} vs constrained {base['tv_level_a']:.3f}, "
        f"exact-sampler floor {floor['tv_level_a']:.3f} (constrained decoding's exact bias: TV "
        f"{q['tv_level_a']:.3f} level a, {q['tv_items']:.3f} items); p_b {np.mean(b['p_b']):.2f}"
    )
