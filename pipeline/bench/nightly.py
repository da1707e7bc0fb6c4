"""nightly: the nightly job on a local Ray (one actor) against the same recommender called directly in this process
on the same users and batches; the two interleaved, `repeats` times each after a warm-up run of each."""

from __future__ import annotations

import pyarrow.parquet as pq
import torch

from pipeline.bench.common import (
    Interleaved,
    aligned,
    compare,
    fmt_ratio,
    fmt_spread,
    interleaved,
    ratio,
    torch_threads,
)
from pipeline.bench.params import NightlyParams
from pipeline.markdown import table


def run_nightly_bench(p: NightlyParams) -> dict:
    """The nightly section's figures."""
    return {"nightly": bench_nightly(p)}


def bench_nightly(p: NightlyParams) -> dict:
    """Ray stays up across the repeats; each job run is a whole run (read, validate, actor pool, write, manifest,
    publish) of the same run date under OUT/nightly-bench. The direct path loads the recommender once (not timed, as
    the actor does) and calls it on the job's batches with the threads Ray gives an actor."""
    import ray

    from pipeline.config import load_config
    from pipeline.nightly import run_nightly

    cfg = load_config(
        p.config, list(p.overrides) + [f"output={p.out}/nightly-bench", "compute.num_actors=1", "runs.grace_s=0"]
    )
    actor, batches = direct_recommender(cfg)
    threads = max(int(cfg.compute.cpus_per_actor), 1) if cfg.compute.threads_per_actor is None else None
    with torch_threads(threads):  # what Ray gives an actor
        ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
        try:
            run = interleaved(
                {"job": lambda: run_nightly(cfg), "direct": lambda: [actor(b) for b in batches]},
                p.repeats,
                actor.device,
                desc="nightly: job vs direct",
            )
        finally:
            ray.shutdown()
        direct_threads = torch.get_num_threads()
    return nightly_result(p, cfg, run, sum(b.num_rows for b in batches), direct_threads)


def direct_recommender(cfg) -> tuple:
    """The recommender the config's actor would be, built in this process, and the input's batches
    (compute.batch_size rows each) -> (recommender, [pyarrow.Table])."""
    from operators.recommender import Recommender
    from pipeline.plan import direct_spec, open_input

    data = open_input(cfg)[0].data
    table = data.to_table(columns=["user_id", "history"])
    size = cfg.compute.batch_size
    batches = [table.slice(a, size) for a in range(0, table.num_rows, size)]
    actor = Recommender(direct_spec(cfg))
    return actor, batches


def nightly_result(p: NightlyParams, cfg, run: Interleaved, input_rows: int, direct_threads: int) -> dict:
    """The section's result: both paths' seconds and users/s, their ratio, the last job's shard metrics."""
    import pyarrow as pa

    manifest = run.outputs["job"]
    users = manifest["counts"]["users_ok"]
    metrics = pq.read_table(manifest["outputs"]["metrics"]).to_pandas()
    job, direct = run.timings["job"], run.timings["direct"]
    return {
        "users": users,
        "input_rows": input_rows,
        "repeats": p.repeats,
        "order": run.order,
        "job": job.to_dict(),
        "job_users_per_s": job.per(lambda s: users / s),
        "direct": direct.to_dict(),
        "direct_users_per_s": direct.per(lambda s: users / s),
        "job_vs_direct_users_per_s": ratio(direct, job),
        "actor_wall_s": float(metrics.wall_s.sum()),
        "torch_threads": direct_threads,
        "metrics_summary": metrics_summary(metrics),
        "config": {"mode": cfg.decoding.mode, "k": cfg.decoding.k, "batch_size": cfg.compute.batch_size},
        "arrow": pa.__version__,
    }


def metrics_summary(metrics) -> dict:
    """A job's shard metrics (a pandas frame, a row per batch) -> batches, users, phase seconds, target forwards."""
    return {
        "batches": len(metrics),
        "users_ok": int(metrics.users_ok.sum()),
        "users_rejected": int(metrics.users_rejected.sum()),
        "mean_batch_users_per_s": float(metrics.users_per_s.mean()),
        "prefill_s": float(metrics.prefill_s.sum()),
        "decode_s": float(metrics.decode_s.sum()),
        "target_forwards": int(metrics.target_forwards.sum()),
    }


def markdown_nightly(result: dict) -> str:
    n, env = result["nightly"], result["environment"]
    m, r = n["metrics_summary"], n["job_vs_direct_users_per_s"]
    rows = [
        [
            "`ray` nightly job (read, validate, actor pool, write, manifest, publish)",
            _seconds(n["job"]),
            fmt_spread(n["job_users_per_s"], 1),
        ],
        [
            "recommender called directly in one process (same batches)",
            _seconds(n["direct"]),
            fmt_spread(n["direct_users_per_s"], 1),
        ],
    ]
    return "\n".join(
        [
            f"## nightly job (one actor) vs direct calls: {n['users']} users, mode {n['config']['mode']}, k "
            f"{n['config']['k']}, batch {n['config']['batch_size']}, {env['device']}; median (min-max) of "
            f"{n['repeats']} interleaved repeats",
            "",
            table(["path", "seconds", "users/s"], rows, aligned(1, 2)),
            "",
            f"job / direct users/s: **{fmt_ratio(r)}** ({compare('job', 'direct', r)}; torch threads "
            f"{n['torch_threads']}); shard metrics of the last job: {m['batches']} batches, {m['users_ok']} users ok, "
            f"{m['users_rejected']} rejected, prefill {m['prefill_s']:.1f}s, decode {m['decode_s']:.1f}s, "
            f"{m['target_forwards']} target forwards, mean {m['mean_batch_users_per_s']:.0f} users/s per batch",
            "",
            f"`{env['command']}`",
        ]
    )


def _seconds(t: dict) -> str:
    return fmt_spread({"median": t["median_s"], "min": t["min_s"], "max": t["max_s"]}, 1)
