"""Cost/throughput report of published nightly runs: a Markdown file and a self-contained HTML page with PNG plots.

    report_run(uri, ...)     load a published run (and a second to compare), write its report -> (doc, folder)
    summarize(run, price)    the shard metrics aggregated: users, users/s, time split, forwards, accepted steps,
                             KV tokens held vs a batch beam search, accelerator-hours and cost per million users
    compare_outputs(a, b)    whether two runs published the same items for every user and rank
    write_report(...)        report.md + report.html (figures embedded) + figures/*.png + report.json
    build_blocks(...)        the document: each section, figure and summary row only where it applies to one of the
                             runs (FIGURES, SUMMARY: no accepted steps for a beam search), tables through
                             pipeline/markdown.py's renderer; Recall/NDCG above a run's k read `n/a (k = ...)`

Throughput is counted two ways: users per second of the job's decode wall time (read, shard, decode over all actors;
what a nightly window sees) and users per busy actor-second (the sum of the batches' wall times; what one actor
sustains). Cost is accelerator-hours x price: allocated = actors x GPUs per actor x decode wall time (what is billed;
a CPU actor counts as one accelerator), busy = the batches' wall times (the floor at full utilisation).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from decoding.stats import PHASES as DECODER_PHASES
from pipeline import storage as S
from pipeline.markdown import table
from pipeline.runs import Run, load_run, read_recommendations, report_dir
from pipeline.storage import Storage

PHASES = DECODER_PHASES + ("other_s",)  # other: the batch outside the decoder (validation, prompts, output rows)


# ------------------------------------------------------------------ numbers


def accepted_histogram(metrics: pd.DataFrame) -> np.ndarray | None:
    """Sum of the batches' accepted-steps histograms -> [gamma + 1] (user, round) counts, or None (no speculation)."""
    if "accepted_hist" not in metrics:
        return None
    hists = [np.asarray(h, np.int64) for h in metrics["accepted_hist"] if h is not None]
    if not hists:
        return None
    out = np.zeros(max(len(h) for h in hists), np.int64)
    for h in hists:
        out[: len(h)] += h
    return out


def summarize(run: Run, gpu_hour_price: float) -> dict:
    """A published run's shard metrics and manifest -> the report's numbers for it (the module docstring says how
    throughput and cost are counted)."""
    man = run.manifest
    m = decoded_shards(run.metrics)
    users, busy, wall = int(m.users_ok.sum()), float(m.wall_s.sum()), float(man["timings"]["decode_s"])
    return {
        **run_facts(run),
        "incremental": incremental_facts(man),
        **run_counts(m, man, users),
        **run_time(m, man, users, busy, wall),
        **work_per_user(m, users),
        **run_cost(man, users, busy, wall, gpu_hour_price),
        "per_shard": per_shard(m),
        "per_actor": per_actor(m, wall),
        "per_accelerator": busy_accelerators(m, wall),
    }


def decoded_shards(metrics: pd.DataFrame) -> pd.DataFrame:
    """The shards the actors decoded: an incremental run's carried shards (no actor) cost no decode, and their users
    are the report's `incremental` line."""
    if "actor" not in metrics:
        return metrics
    decoded = metrics[metrics.actor.notna()]
    return decoded if len(decoded) else metrics.iloc[:0]


def incremental_facts(man: dict) -> dict | None:
    """An incremental run's users carried and decoded, its base, why a night was full, and its decode seconds against
    a full night's estimate (the manifest's `incremental`); None for a run without it."""
    inc = man.get("incremental")
    if not inc or not inc.get("enabled"):
        return None
    counts = man["counts"]
    return {**inc, **{key: counts.get(key) for key in ("users_decoded", "users_carried", "users_dropped")}}


def incremental_text(s: dict) -> str:
    """The incremental line: carried and decoded users, and the decode's seconds against a full night's estimate (or
    why the night was full)."""
    i = s["incremental"]
    if i["mode"] != "carry":
        return f"full night: {'; '.join(i.get('full_because') or [])}"
    return (
        f"{num(i['users_carried'])} carried from {i['base_run_id']}, {num(i['users_decoded'])} decoded, "
        f"{num(i['users_dropped'])} dropped; decode {num(i['decode_s'], 1)} s against a full night's "
        f"{num(i['full_decode_s_estimate'], 1)} s (estimated from the decoded users' rate)"
    )


def run_facts(run: Run) -> dict:
    """What ran: ids, mode and k, devices, code and models, catalog, template, decoders, settings."""
    m, man = decoded_shards(run.metrics), run.manifest
    decoding = man["config"]["decoding"]
    return {
        "run_id": run.run_id,
        "uri": run.uri,
        "run_date": man["run_date"],
        "mode": run.mode,
        "k": decoding["k"],
        "devices": sorted(set(m.device.dropna())),
        "code_version": man.get("code_version"),
        "models": {role: v["sha256"][:12] for role, v in man.get("models", {}).items()},
        "catalog": man.get("catalog"),
        "template": (man.get("template") or {}).get("name"),
        "max_prompt_tokens": man.get("max_prompt_tokens"),
        "decoders": m.decoder.value_counts().to_dict() if "decoder" in m else {},
        "auto": man.get("auto"),
        "precision_audit": man.get("precision_audit"),
        "exclusions": man.get("exclusions") or {"mode": decoding.get("exclude", "none")},
    }


def run_counts(m: pd.DataFrame, man: dict, users: int) -> dict:
    """Users decoded and rejected, input rows, recommendations, batches, prefill tokens a shared prefix saved."""
    return {
        "users_ok": users,
        "users_rejected": int(man["counts"]["users_rejected"]),
        "users_non_finite": int(m.users_non_finite.sum()) if "users_non_finite" in m else 0,
        "prefix_tokens_saved_per_user": per_user(m.prefix_tokens_saved.sum(), users)
        if "prefix_tokens_saved" in m
        else None,
        "prompt_tokens_per_user": per_user(m.prompt_tokens.sum(), m.users_prompted.sum())
        if "users_prompted" in m
        else None,
        "users_truncated": int(man["counts"].get("users_truncated") or 0),
        "users_too_long": int(man["counts"].get("users_too_long") or 0),
        "input_rows": int(man["counts"]["input_rows"]),
        "recommendations": int(m.recommendations.sum()),
        "batches": len(m),
    }


def run_time(m: pd.DataFrame, man: dict, users: int, busy: float, wall: float) -> dict:
    """Actors and accelerators, wall and busy seconds, users/s both ways, seconds per decoding phase."""
    return {
        "actors": int(m.actor.nunique()),
        "accelerators": accelerators(man),
        "decode_wall_s": wall,
        "total_s": float(man["timings"]["total_s"]),
        "busy_s": busy,
        "users_per_s": users / wall if wall else None,
        "users_per_busy_s": users / busy if busy else None,  # None: every user was carried
        "phase_s": {p: float(m[p].sum()) for p in PHASES},
    }


def work_per_user(m: pd.DataFrame, users: int) -> dict:
    """Forwards, tokens per user, accepted steps (speculative runs), KV tokens per user against a batch beam search,
    peak accelerator memory (None where unmeasured, e.g. on a CPU)."""
    hist = accepted_histogram(m)
    kv, kv_beam = m.kv_tokens.sum(), m.kv_tokens_beam_batch.sum()
    peak = m.peak_memory_bytes.dropna() if "peak_memory_bytes" in m else pd.Series(dtype=float)
    return {
        "target_forwards": int(m.target_forwards.sum()),
        "draft_forwards": int(m.draft_forwards.sum()),
        "target_tokens_per_user": per_user(m.target_tokens.sum(), users),
        "draft_tokens_per_user": per_user(m.draft_tokens.sum(), users),
        "accepted_hist": None if hist is None else hist.tolist(),
        "mean_accepted_steps": None
        if hist is None or hist.sum() == 0
        else float((hist * np.arange(len(hist))).sum() / hist.sum()),
        "kv_tokens_per_user": per_user(kv, users),
        "kv_tokens_beam_batch_per_user": per_user(kv_beam, users),
        "kv_ratio": float(kv / kv_beam) if kv_beam else None,
        "peak_memory_gb": float(peak.max() / 2**30) if len(peak) else None,
        **padding(m, users),
    }


def padding(m: pd.DataFrame, users: int) -> dict:
    """Prompt positions the prefills computed per user, the fraction of them that was left padding, and the KV tokens
    held for padding per user (None for runs whose metrics predate them)."""
    if "prompt_positions" not in m or m.prompt_positions.isna().all():
        return dict.fromkeys(("prompt_positions_per_user", "prompt_padding_fraction", "kv_padding_per_user"))
    positions = m.prompt_positions.sum()
    return {
        "prompt_positions_per_user": per_user(positions, users),
        "prompt_padding_fraction": float(m.prompt_padding.sum() / positions) if positions else None,
        "kv_padding_per_user": per_user(m.kv_padding_tokens.sum(), users),
    }


def per_user(total, users: int) -> float | None:
    return float(total / users) if users else None


def accelerators(man: dict) -> int:
    """Accelerators the run held: actors (compute.num_actors as resolved, e.g. auto) x GPUs per actor (a CPU actor
    counts as one)."""
    compute = man["config"]["compute"]
    actors = man.get("actors", {}).get("count", compute["num_actors"])
    return actors * (compute["gpus_per_actor"] or 1)


def run_cost(man: dict, users: int, busy: float, wall: float, gpu_hour_price: float) -> dict:
    """Accelerator-hours allocated (accelerators x decode wall time) and busy (GPUs per actor x the batches' wall
    times), and the cost per million users of each at `gpu_hour_price`."""
    gpus_per_actor = man["config"]["compute"]["gpus_per_actor"] or 1
    hours = {"allocated": accelerators(man) * wall / 3600, "busy": gpus_per_actor * busy / 3600}
    return {
        "gpu_hour_price": gpu_hour_price,
        "accelerator_hours": hours,
        "cost_per_million_users": {k: gpu_hour_price * h / users * 1e6 if users else None for k, h in hours.items()},
    }


def per_shard(m: pd.DataFrame) -> list[dict]:
    """One entry per shard (batch): its actor, batch number, users and users/s."""
    rows = zip(m.shard, m.actor, m.batch, m.users_ok, m.users_per_s.fillna(0.0))
    return [
        {"shard": s, "actor": a, "batch": int(b), "users": int(u), "users_per_s": float(r)} for s, a, b, u, r in rows
    ]


def per_actor(m: pd.DataFrame, wall: float) -> list[dict]:
    """One entry per actor: users, batches, busy seconds and their share of the decode wall time, users per busy
    second."""
    actors = m.groupby("actor").agg(users=("users_ok", "sum"), busy_s=("wall_s", "sum"), batches=("shard", "size"))
    return [
        {
            "actor": a,
            "users": int(r.users),
            "batches": int(r.batches),
            "busy_s": float(r.busy_s),
            "busy_fraction": float(r.busy_s / wall) if wall else None,
            "users_per_s": float(r.users / r.busy_s) if r.busy_s else None,
        }
        for a, r in actors.iterrows()
    ]


def busy_accelerators(m: pd.DataFrame, wall: float) -> list[dict]:
    """Per accelerator (a GPU, or a node's CPUs): its actors and the fraction of the decode's wall time in which at
    least one of them was decoding (the union of their shards' [commit - wall_s, commit] intervals; actors that share
    a GPU overlap). Empty for runs whose metrics predate these columns."""
    if not {"accelerator", "committed_at"} <= set(m.columns) or m.committed_at.isna().all() or not wall:
        return []
    out = []
    for name, g in m.dropna(subset=["accelerator", "committed_at"]).groupby("accelerator"):
        busy, end = 0.0, -np.inf
        for a, b in sorted(zip(g.committed_at - g.wall_s, g.committed_at)):
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        out.append({"accelerator": name, "actors": int(g.actor.nunique()), "busy_fraction": busy / wall})
    return out


def compare_outputs(a: Run, b: Run, storage: Storage) -> dict:
    """Outputs of two runs, (user, rank) by (user, rank): identical when both hold the same rows and items."""
    ta, tb = read_recommendations(a, storage), read_recommendations(b, storage)
    if ta.schema.field("user_id").type != tb.schema.field("user_id").type:
        ta = ta.set_column(0, "user_id", pc.cast(ta["user_id"], pa.string()))
        tb = tb.set_column(0, "user_id", pc.cast(tb["user_id"], pa.string()))
    j = ta.join(tb, keys=["user_id", "rank"], join_type="full outer", left_suffix="_a", right_suffix="_b")
    same = pc.fill_null(pc.equal(j["item_id_a"], j["item_id_b"]), False)
    differ = j.filter(pc.invert(same))
    both = j.filter(same)
    diff = pc.max(pc.abs(pc.subtract(both["score_a"], both["score_b"]))).as_py() if both.num_rows else None
    users = pc.count_distinct(j["user_id"]).as_py()
    users_differ = pc.count_distinct(differ["user_id"]).as_py() if differ.num_rows else 0
    return {
        "users": users,
        "users_differ": users_differ,
        "rows_a": ta.num_rows,
        "rows_b": tb.num_rows,
        "identical": users_differ == 0,
        "max_abs_score_diff": diff,
    }


# ------------------------------------------------------------------ what applies to a run


def speculative(s: dict) -> bool:
    """Verified drafted steps (atspeed modes; auto when it tried atspeed-strict)."""
    return s["mean_accepted_steps"] is not None


def drafts(s: dict) -> bool:
    return s["draft_forwards"] > 0


def excludes(s: dict) -> bool:
    """decoding.exclude set, or an exclusion column in the input."""
    return s["exclusions"]["mode"] != "none" or bool(s["exclusions"].get("column"))


def chose_decoders(s: dict) -> bool:
    """Batches decoded by another decoder than the run's mode names (auto)."""
    return bool(set(s["decoders"]) - {s["mode"]})


def padded(s: dict) -> bool:
    """Metrics that count the prompt positions and their padding."""
    return s["prompt_positions_per_user"] is not None


def measured_memory(s: dict) -> bool:
    """Peak accelerator memory measured (CUDA)."""
    return s["peak_memory_gb"] is not None


def spent(phase: str):
    """-> whether a run spent time in `phase` (a beam search has no draft or verify phase)."""
    return lambda s: s["phase_s"][phase] > 0


def applies(when, runs: list[dict]) -> bool:
    """Whether a part of the report (its `when`: one of the above, None for every run) applies to at least one run."""
    return when is None or any(when(s) for s in runs)


# ------------------------------------------------------------------ figures


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def _label(s: dict) -> str:
    return f"{s['mode']} ({s['run_id'][-6:]})"


def fig_throughput(runs: list[dict]) -> bytes:
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(runs)
    for i, s in enumerate(runs):
        actors = sorted({r["actor"] for r in s["per_shard"]})
        shards = sorted(s["per_shard"], key=lambda r: (actors.index(r["actor"]), r["batch"]))
        left.plot(range(1, len(shards) + 1), [r["users_per_s"] for r in shards], marker="o", ms=3, label=_label(s))
        rate = {a["actor"]: a["users_per_s"] for a in s["per_actor"]}
        right.bar(np.arange(len(actors)) + i * width, [rate[x] for x in actors], width, label=_label(s))
    left.set(title="users/s per shard (batch), by actor then batch", xlabel="shard", ylabel="users/s")
    right.set(title="users/s per actor (busy seconds)", xlabel="actor", ylabel="users/s")
    right.set_xticks(
        np.arange(max(s["actors"] for s in runs)) + 0.4 - width / 2,
        [str(i + 1) for i in range(max(s["actors"] for s in runs))],
    )
    left.legend(fontsize=8)
    left.set_ylim(bottom=0)
    return _png(fig)


def fig_time_split(runs: list[dict]) -> bytes:
    """Seconds per phase, stacked per run: the phases some run spent time in (a beam search has no draft or verify),
    each in its own colour whatever the runs."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.7 * len(runs)))
    left = np.zeros(len(runs))
    for p in [p for p in PHASES if applies(spent(p), runs)]:
        values = np.array([s["phase_s"][p] for s in runs])
        ax.barh([_label(s) for s in runs], values, left=left, label=p.removesuffix("_s"), color=f"C{PHASES.index(p)}")
        for y, (v, x0, s) in enumerate(zip(values, left, runs)):
            share = v / max(sum(s["phase_s"].values()), 1e-12)
            if share > 0.06:
                ax.text(x0 + v / 2, y, f"{share:.0%}", ha="center", va="center", fontsize=8, color="white")
        left += values
    ax.set(title="time split: seconds summed over batches", xlabel="seconds")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35 / len(runs) - 0.25))
    return _png(fig)


def fig_accepted_steps(runs: list[dict]) -> bytes:
    """The speculative runs' accepted steps per verification, as shares of their user-rounds (drawn only for a
    report with a speculative run: FIGURES)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    spec = [s for s in runs if speculative(s)]
    width = 0.8 / len(spec)
    n = max(int(np.nonzero(s["accepted_hist"])[0].max()) + 1 for s in spec)  # up to the largest bin in use
    for i, s in enumerate(spec):
        h = np.asarray(s["accepted_hist"][:n], float)
        ax.bar(
            np.arange(len(h)) + i * width, h / h.sum(), width, label=f"{_label(s)}: mean {s['mean_accepted_steps']:.2f}"
        )
    ax.set_xticks(np.arange(n) + 0.4 - width / 2, [str(i) for i in range(n)])
    ax.set(
        title="accepted steps per verification (user-rounds)",
        xlabel="drafted steps accepted",
        ylabel="share of user-rounds",
    )
    _legend_above_bars(ax)
    return _png(fig)


def _paired_bars(runs: list[dict], bars: list[tuple[str, list[float], list[str]]], title: str, ylabel: str) -> bytes:
    """Two bars per run: bars = [(legend label, value per run, text above each bar)] x 2."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    x = np.arange(len(runs))
    for off, (label, values, texts) in zip((-0.2, 0.2), bars):
        ax.bar_label(ax.bar(x + off, values, 0.4, label=label), texts, fontsize=8)
    ax.set_xticks(x, [_label(s) for s in runs])
    ax.set(title=title, ylabel=ylabel)
    _legend_above_bars(ax)
    return _png(fig)


def fig_kv_memory(runs: list[dict]) -> bytes:
    held = [s["kv_tokens_per_user"] or 0 for s in runs]
    beam = [s["kv_tokens_beam_batch_per_user"] or 0 for s in runs]
    ratio = [f"{h / b:.2f}x" if b else "" for h, b in zip(held, beam)]
    return _paired_bars(
        runs,
        [("held (shared-prefix tree)", held, ratio), ("batch beam search (K prompt copies)", beam, [""] * len(runs))],
        "KV cache tokens per user",
        "tokens",
    )


def fig_cost(runs: list[dict]) -> bytes:
    bars = []
    for kind in ("allocated", "busy"):
        values = [s["cost_per_million_users"][kind] or 0 for s in runs]
        bars.append((f"{kind} accelerator-hours", values, [f"\\${v:,.2f}" for v in values]))
    return _paired_bars(
        runs, bars, f"cost per million users at \\${runs[0]['gpu_hour_price']:g} per accelerator-hour", "USD"
    )


def _legend_above_bars(ax) -> None:
    """Headroom above the tallest bar for the legend, so that it never hides a bar."""
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.legend(fontsize=8, loc="upper left")


FIGURES = {  # name: (draw, heading, the runs it applies to: None for every run)
    "throughput": (fig_throughput, "Throughput", None),
    "time_split": (fig_time_split, "Time split", None),
    "accepted_steps": (fig_accepted_steps, "Accepted steps", speculative),
    "kv_memory": (fig_kv_memory, "KV memory", None),
    "cost": (fig_cost, "Cost", None),
}


def figures_for(runs: list[dict]) -> dict[str, tuple]:
    """The figures of a report of these runs, name -> (draw, heading): those that apply to at least one of them."""
    return {name: (draw, heading) for name, (draw, heading, when) in FIGURES.items() if applies(when, runs)}


# ------------------------------------------------------------------ document: blocks rendered as Markdown and HTML


def num(x, digits: int = 3) -> str:
    """The report's number format: integers with thousands separators, floats with `digits` decimals."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, (int, np.integer)):
        return f"{int(x):,}"
    return f"{x:,.{digits}f}"


def pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"


def pct1(x) -> str:
    return "-" if x is None else f"{x:.1%}"


SUMMARY = [  # the summary table's rows: (metric, its cell for one run, the runs it applies to: None for every run)
    ("mode / k", lambda s: f"{s['mode']} / {s['k']}", None),
    ("device", lambda s: ", ".join(s["devices"]), None),
    ("dtype / precision audit (float32 re-decode)", lambda s: audit_text(s["precision_audit"]), None),
    ("exclusions (decoding.exclude; items excluded per user)", lambda s: exclusions_text(s["exclusions"]), excludes),
    ("incremental (users carried from the base run)", incremental_text, lambda s: bool(s.get("incremental"))),
    ("users ok", lambda s: num(s["users_ok"]), None),
    ("users rejected", lambda s: num(s["users_rejected"]), None),
    ("of them: non-finite log-probs", lambda s: num(s["users_non_finite"]), None),
    (
        "prompt template / longest prompt (tokens)",
        lambda s: f"{s['template'] or '-'} / {num(s['max_prompt_tokens'])}",
        None,
    ),
    (
        "prompt tokens per user (mean) / cut to fit / too long",
        lambda s: f"{num(s['prompt_tokens_per_user'], 1)} / {num(s['users_truncated'])} / {num(s['users_too_long'])}",
        None,
    ),
    ("prefill tokens saved per user (shared prefix)", lambda s: num(s["prefix_tokens_saved_per_user"], 1), None),
    (
        "decoder (batches)",
        lambda s: ", ".join(f"{d} {n}" for d, n in sorted(s["decoders"].items())) or "-",
        chose_decoders,
    ),
    ("recommendations", lambda s: num(s["recommendations"]), None),
    ("batches / actors", lambda s: f"{num(s['batches'])} / {num(s['actors'])}", None),
    ("decode wall time (s)", lambda s: num(s["decode_wall_s"]), None),
    ("users/s (decode wall time)", lambda s: num(s["users_per_s"]), None),
    ("users/s per busy actor-second", lambda s: num(s["users_per_busy_s"]), None),
    *[
        (f"{p.removesuffix('_s')} (s, summed over batches)", lambda s, p=p: num(s["phase_s"][p]), spent(p))
        for p in PHASES
    ],
    ("target forwards", lambda s: num(s["target_forwards"]), None),
    ("draft forwards", lambda s: num(s["draft_forwards"]), drafts),
    ("target tokens per user (prompt + tree)", lambda s: num(s["target_tokens_per_user"], 1), None),
    (
        "prompt positions per user (prefill) / of them left padding",
        lambda s: f"{num(s['prompt_positions_per_user'], 1)} / {pct1(s['prompt_padding_fraction'])}",
        padded,
    ),
    ("draft tokens per user (prompt + tree)", lambda s: num(s["draft_tokens_per_user"], 1), drafts),
    ("mean accepted steps per verification", lambda s: num(s["mean_accepted_steps"]), speculative),
    ("KV tokens held per user", lambda s: num(s["kv_tokens_per_user"], 1), None),
    ("of them for left padding", lambda s: num(s["kv_padding_per_user"], 1), padded),
    ("KV tokens per user, batch beam search", lambda s: num(s["kv_tokens_beam_batch_per_user"], 1), None),
    ("peak accelerator memory (GiB)", lambda s: num(s["peak_memory_gb"]), measured_memory),
    (
        "accelerator-hours (allocated / busy)",
        lambda s: f"{num(s['accelerator_hours']['allocated'], 6)} / {num(s['accelerator_hours']['busy'], 6)}",
        None,
    ),
    ("cost per million users, allocated (USD)", lambda s: num(s["cost_per_million_users"]["allocated"], 2), None),
    ("cost per million users, busy (USD)", lambda s: num(s["cost_per_million_users"]["busy"], 2), None),
]


def summary_rows(runs: list[dict]) -> list[list[str]]:
    """(metric, value per run) rows of the summary table: those of SUMMARY that apply to at least one of the runs."""
    return [[name] + [cell(s) for s in runs] for name, cell, when in SUMMARY if applies(when, runs)]


def audit_text(a: dict | None) -> str:
    """The manifest's precision_audit in one cell: the dtype and what the float32 re-decode found."""
    if not a:
        return "-"
    skipped = f"; skipped: {'; '.join(a['skipped'])}" if a.get("skipped") else ""
    if not a.get("users"):
        return f"{a['dtype']}: {a.get('note', 'no audit')}{skipped}"
    return (
        f"{a['dtype']}: {a['identical_lists']} of {a['users']} users' top-K identical to float32 "
        f"({a['identical_lists'] / a['users']:.0%}), top-K overlap {a['topk_overlap']:.1%}, largest score "
        f"difference {a['max_abs_score_diff']:.3g}, audit {num(a['seconds'])} s"
        f"{' on ' + ', '.join(a['device']) if a.get('device') else ''}{skipped}"
    )


def exclusions_text(e: dict) -> str:
    """The manifest's exclusions in one cell: the mode, the exclusion column, excluded items per user (mean, max)."""
    column = f", column `{e['column']}`" if e.get("column") else ""
    if "users" not in e:  # a run from before exclusions were counted
        return f"{e['mode']}{column}"
    unknown = f", {num(e['unknown_ids_ignored'])} unknown ids ignored" if e["unknown_ids_ignored"] else ""
    return (
        f"{e['mode']}{column}: mean {num(e['excluded_per_user_mean'], 1)}, max "
        f"{num(e['excluded_per_user_max'])}{unknown}"
    )


def auto_text(s: dict) -> str:
    """decoding.mode = auto and compute.engine = auto: what each actor chose and the trials behind it (users/s; for
    the engine, the compile seconds, the parity evidence and the device)."""

    def trials(a: dict) -> str:
        return ", ".join(f"{d} {num(v, 1)}" for d, v in a["trial_users_per_s"].items() if v is not None)

    parts = []
    for actor, a in sorted(s["auto"].items()):
        said = [f"mode **{a['choice'] or 'undecided'}** (trials, users/s: {trials(a)})"] if "choice" in a else []
        if a.get("engine"):
            e = a["engine"]
            ok = sum(p["identical_clear"] for p in e["parity"])
            clear = sum(p["clear"] for p in e["parity"])
            said.append(
                f"engine **{e['choice'] or 'undecided'}** on {e['device']} (trials, users/s: {trials(e)}; compile "
                f"{num(e['compile_s'], 1)} s; parity: {ok} of {clear} users clear of a near-tie identical; "
                f"{e['reason']})"
            )
        parts.append(f"{actor[-8:]}: " + ", ".join(said))
    return f"Auto choices of {_label(s)}, per actor: " + "; ".join(parts) + "."


def catalog_text(s: dict) -> str:
    """The catalog a run decoded against, the semantic IDs its recommendable items share and what its
    duplicate-semantic-ID policy dropped."""
    c, d = s["catalog"], s["catalog"]["duplicates"]
    text = (
        f"Catalog of {_label(s)}: {num(c['items'])} items, {num(c['indexed'])} distinct semantic IDs in the index; "
        f"duplicate policy `{d['policy']}`: "
    )
    if d.get("shared_semantic_ids"):  # absent from manifests written before the counts
        text += f"{num(d['shared_semantic_ids'])} semantic IDs name {num(d['items_sharing'])} recommendable items; "
    elif not d["dropped"]:
        return text + "no item shares a semantic ID."
    if not d["dropped"]:
        return text + "none dropped."
    shown = ", ".join(f"{x['item_id']} (kept {x['kept']})" for x in d["items"][:30])
    more = f" and {num(d['dropped'] - 30)} more (manifest.json lists all)" if d["dropped"] > 30 else ""
    return text + f"**{num(d['dropped'])} items dropped** for sharing a semantic ID with a kept item: {shown}{more}."


def comparison_text(run: dict, base: dict, outputs: dict) -> str:
    speed = run["users_per_s"] / base["users_per_s"]
    busy = run["users_per_busy_s"] / base["users_per_busy_s"]
    same = (
        "identical"
        if outputs["identical"]
        else f"NOT identical: {num(outputs['users_differ'])} of {num(outputs['users'])} users differ"
    )
    diff = outputs["max_abs_score_diff"]
    return (
        f"Speed-up of {_label(run)} over {_label(base)}: **{speed:.2f}x** users/s (decode wall time), "
        f"**{busy:.2f}x** per busy actor-second. Outputs: **{same}** ({num(outputs['users'])} users compared by "
        f"user and rank; max |score difference| {'-' if diff is None else f'{diff:.2e}'})."
    )


def build_blocks(runs: list[dict], outputs: dict | None, evaluations: list[dict | None]) -> list[tuple]:
    """The report as blocks: ("h1" | "h2" | "p", text), ("img", figure name), ("table", header, rows). The title,
    the summary, the comparison (two runs), a section per figure and the quality (evaluated runs), each only where it
    applies to the runs (figures_for, summary_rows)."""
    blocks = title_blocks(runs) + summary_blocks(runs)
    if outputs is not None:
        blocks += [("h2", "Comparison"), ("p", comparison_text(runs[0], runs[1], outputs))]
    for name, (_, heading) in figures_for(runs).items():
        blocks += [("h2", heading), ("img", name)] + (actor_tables(runs) if name == "throughput" else [])
    return blocks + quality_blocks(runs, evaluations)


def title_blocks(runs: list[dict]) -> list[tuple]:
    """The title and where each run is: its URI, run date, code version and models."""
    title = "genrec-batch run report: " + " vs ".join(s["run_id"] for s in runs)
    sources = "; ".join(
        f"`{s['uri']}` (run date {s['run_date']}, code {str(s['code_version'])[:12]}, models "
        + ", ".join(f"{r} {h}" for r, h in s["models"].items())
        + ")"
        for s in runs
    )
    return [("h1", title), ("p", sources)]


def summary_blocks(runs: list[dict]) -> list[tuple]:
    """The summary table, then each run's catalog and (auto mode) what its actors chose."""
    blocks = [("h2", "Summary"), ("table", ["metric"] + [_label(s) for s in runs], summary_rows(runs))]
    blocks += [("p", catalog_text(s)) for s in runs if s["catalog"]]
    return blocks + [("p", auto_text(s)) for s in runs if s["auto"]]


def actor_tables(runs: list[dict]) -> list[tuple]:
    """Per actor (batches, users, users/s, busy share) and, where recorded, per accelerator (how busy any of its
    actors kept it)."""
    actors = [
        [
            _label(s),
            str(i + 1),
            a["actor"],
            num(a["batches"]),
            num(a["users"]),
            num(a["users_per_s"]),
            pct(a.get("busy_fraction")),
        ]
        for s in runs
        for i, a in enumerate(sorted(s["per_actor"], key=lambda a: a["actor"]))
    ]
    blocks = [("table", ["run", "actor", "actor id", "batches", "users", "users/s", "busy"], actors)]
    accelerators = [
        [_label(s), x["accelerator"], num(x["actors"]), pct(x["busy_fraction"])]
        for s in runs
        for x in s.get("per_accelerator", [])
    ]
    if accelerators:
        blocks.append(("table", ["run", "accelerator", "actors", "busy (any of its actors decoding)"], accelerators))
    return blocks


def quality_blocks(runs: list[dict], evaluations: list[dict | None]) -> list[tuple]:
    """The offline evaluation of the runs that have one (none: no section): who was scored and how, then Recall and
    NDCG at every cut-off of any of them."""
    evaluated = [(s, e) for s, e in zip(runs, evaluations) if e is not None]
    if not evaluated:
        return []
    ks = sorted({k for _, e in evaluated for k in e["ks"]})
    rows = [[f"{m}@{k}"] + [quality_cell(e, m, k) for _, e in evaluated] for m in ("Recall", "NDCG") for k in ks]
    header = ["metric"] + [_label(s) for s, _ in evaluated]
    return [("h2", "Quality (offline evaluation)"), ("p", quality_text(evaluated)), ("table", header, rows)]


def quality_cell(e: dict, metric: str, k: int) -> str:
    """A metric at cut-off k, or n/a above the run's own k: its lists hold k items, so Recall@20 of a k = 10 run
    would only repeat Recall@10."""
    if e.get("k") is not None and k > e["k"]:
        return f"n/a (k = {e['k']})"
    return num(e.get(f"{metric.lower()}@{k}"), 4)


def quality_text(evaluated: list[tuple[dict, dict]]) -> str:
    """Per run: users with targets, misses, k and the targets' protocol; then the splits' conventions."""
    runs = "; ".join(
        f"{_label(s)}: {num(e['users'])} users with target items, "
        f"{num(e['users_without_recommendations'])} of them without recommendations "
        f"(misses), k = {e['k']}" + (f", targets {e['targets']['meaning']}" if "targets" in e else "")
        for s, e in evaluated
    )
    splits = {e["protocol"]["split"]: e["protocol"] for _, e in evaluated if "protocol" in e}
    conventions = "".join(f" Split `{p['split']}`: {p['convention']}." for p in splits.values())
    return runs + ". Users without targets are skipped (`python -m jobs.evaluate`)." + conventions


def to_markdown(blocks, figure_dir: str = "figures") -> str:
    out = []
    for b in blocks:
        if b[0] == "h1":
            out.append(f"# {b[1]}")
        elif b[0] == "h2":
            out.append(f"## {b[1]}")
        elif b[0] == "p":
            out.append(b[1])
        elif b[0] == "img":
            out.append(f"![{b[1]}]({figure_dir}/{b[1]}.png)")
        elif b[0] == "table":  # the first column names the row, the others hold values (as the HTML aligns them)
            out.append(table(b[1], b[2], align=["left"] + ["right"] * (len(b[1]) - 1)))
    return "\n\n".join(out) + "\n"


def to_html(blocks, figures: dict[str, bytes]) -> str:
    def inline(text: str) -> str:  # `code` and **bold**, the only Markdown the blocks use
        parts = html.escape(text).split("`")
        text = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
        parts = text.split("**")
        return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))

    body = []
    for b in blocks:
        if b[0] in ("h1", "h2", "p"):
            body.append(f"<{b[0]}>{inline(b[1])}</{b[0]}>")
        elif b[0] == "img":
            data = base64.b64encode(figures[b[1]]).decode()
            body.append(f'<img alt="{b[1]}" src="data:image/png;base64,{data}">')
        elif b[0] == "table":
            head = "".join(f"<th>{inline(h)}</th>" for h in b[1])
            rows = "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in b[2])
            body.append(f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>")
    style = (
        "body{font-family:sans-serif;max-width:1150px;margin:24px auto;color:#222}"
        "table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ccc;padding:3px 8px;"
        "text-align:right}td:first-child,th:first-child{text-align:left}img{max-width:100%;display:block}"
        "code{background:#f3f3f3;padding:0 3px}"
    )
    title = html.escape(blocks[0][1])
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{title}</title><style>{style}</style>'
        f"</head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def read_evaluation(run: Run, storage: Storage) -> dict | None:
    """The run's offline evaluation (`python -m jobs.evaluate` writes it into `<run>/report`), if any."""
    raw = S.read_bytes(S.join(report_dir(run.uri), "evaluation.json"), storage)
    return json.loads(raw) if raw else None


def write_report(runs: list[Run], out: str, storage: Storage, gpu_hour_price: float = 2.5) -> dict:
    """Writes out/report.md, report.html, report.json and figures/*.png -> the report's JSON."""
    summaries = [summarize(r, gpu_hour_price) for r in runs]
    evaluations = [read_evaluation(r, storage) for r in runs]
    outputs = compare_outputs(runs[0], runs[1], storage) if len(runs) == 2 else None
    figures = {name: draw(summaries) for name, (draw, _) in figures_for(summaries).items()}
    blocks = build_blocks(summaries, outputs, evaluations)
    doc = {
        "runs": summaries,
        "outputs": outputs,
        "evaluations": evaluations,
        "speedup": None
        if outputs is None
        else {
            "users_per_s": summaries[0]["users_per_s"] / summaries[1]["users_per_s"],
            "users_per_busy_s": summaries[0]["users_per_busy_s"] / summaries[1]["users_per_busy_s"],
        },
    }
    for name, png in figures.items():
        S.write_bytes(S.join(out, "figures", f"{name}.png"), png, storage)
    S.write_bytes(S.join(out, "report.md"), to_markdown(blocks).encode(), storage)
    S.write_bytes(S.join(out, "report.html"), to_html(blocks, figures).encode(), storage)
    S.write_bytes(S.join(out, "report.json"), json.dumps(doc, indent=2, default=str).encode(), storage)
    return doc


def report_run(
    uri: str, storage: Storage, compare: str | None = None, out: str | None = None, gpu_hour_price: float = 2.5
) -> tuple[dict, str]:
    """The report of a published run (a run folder, a `run_date=D` folder or an output root), beside a second run
    when `compare` is given -> (the report's JSON, the folder it was written to: default `<run>/report` or
    `<run>/report-vs-<compare run id>`)."""
    if gpu_hour_price < 0:
        raise ValueError(f"the GPU-hour price must be >= 0, got {gpu_hour_price}")
    run = load_run(uri, storage)
    base = load_run(compare, storage) if compare else None
    out = out or report_dir(run.uri, base.run_id if base else None)
    return write_report([run] + ([base] if base else []), out, storage, gpu_hour_price), out


def screenshot_report(out: str, png: Path, storage: Storage) -> Path:
    """Renders the report.html in folder `out` (local or s3://) in headless Chromium -> png."""
    html = Path(out) / "report.html"
    if S.is_s3(out):
        html = Path(tempfile.mkdtemp()) / "report.html"
        html.write_bytes(S.read_bytes(S.join(out, "report.html"), storage))
    return screenshot(html, png)


# ------------------------------------------------------------------ looking at it as a person would


def chromium() -> str:
    """The browser to render with: $CHROMIUM, else the first of Chromium's or Chrome's names on PATH."""
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "chrome"):
        path = name and shutil.which(name)
        if path:
            return path
    raise FileNotFoundError("no chromium on PATH (set CHROMIUM=/path/to/chrome, or `make browser`: Debian's chromium)")


def screenshot(html_file: Path, png_file: Path, width: int = 1200, height: int = 4000) -> Path:
    """Renders a local HTML file in headless Chromium -> a PNG of the page, cropped below the last content."""
    from PIL import Image

    with tempfile.TemporaryDirectory() as profile:
        cmd = [
            chromium(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={png_file.resolve()}",
            html_file.resolve().as_uri(),
        ]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if run.returncode != 0 or not png_file.is_file():
        raise RuntimeError(f"chromium screenshot of {html_file} failed: {run.stderr[-2000:]}")
    image = Image.open(png_file).convert("RGB")
    pixels = np.asarray(image)
    content = np.nonzero((pixels != pixels[-1:, :, :]).any(axis=(1, 2)))[0]  # rows unlike the bottom background
    if len(content):
        image.crop((0, 0, image.width, min(image.height, int(content[-1]) + 24))).save(png_file)
    return png_file
