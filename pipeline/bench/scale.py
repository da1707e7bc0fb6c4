"""nightly-scale: the nightly job on synthetic users at scale on one machine, a tiny model, each size in its own
driver process: every user exactly once, the driver's peak RSS and the object store's peak (polled), the job's users/s
per actor against the same recommender called directly on a sample of the same batches."""
from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import torch

from pipeline.bench.common import environment
from pipeline.bench.params import ScaleParams

ROOT = Path(__file__).resolve().parents[2]


def run_scale(p: ScaleParams, command: str) -> tuple[dict, str]:
    import ray

    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        rows = [bench_size(p, n) for n in p.users]
    finally:
        ray.shutdown()
    result = {"args": asdict(p), "environment": environment("cpu", command), "sizes": rows}
    return result, markdown_scale(result)


def world(p: ScaleParams, n: int) -> Path:
    """Synthetic histories of n users (row groups of 100k) and a tiny random model with the data's tokenizer."""
    from decoding.models import build_model
    from decoding.templates import PRESETS, write_template
    from pipeline.prepare import write_synthetic

    root = Path(p.out) / "nightly-scale" / f"world-{n}"
    if not (root / "data" / "test.parquet").is_file():
        write_synthetic(root / "data", n_users=n, n_items=p.items, levels=3, codes=16, seed=0,
                        history_len=p.history_len, chunk_users=100_000)
    if not (root / "target" / "config.json").is_file():
        build_model(4 + 3 * 16, 1, 32, 2, 1, seed=0).save_pretrained(root / "target")
        for f in (root / "data" / "tokenizer").iterdir():
            shutil.copy(f, root / "target" / f.name)
        write_template(root / "target", PRESETS["codes"].with_max_items(p.history_len))
    return root


def overrides(p: ScaleParams, root: Path) -> list[str]:
    return [f"input={root / 'data' / 'test.parquet'}", f"catalog={root / 'data' / 'items.parquet'}",
            f"output={root / 'out'}", f"models.target={root / 'target'}", f"decoding.k={p.k}",
            f"compute.batch_size={p.batch}", f"compute.num_actors={p.actors}", "runs.grace_s=0",
            "runs.progress_s=10", "run_date=2026-01-01"]


def bench_size(p: ScaleParams, n: int) -> dict:
    import ray

    root = world(p, n)
    shutil.rmtree(root / "out", ignore_errors=True)
    cmd = [sys.executable, "-m", "jobs.nightly", *(x for o in overrides(p, root) for x in ("--set", o))]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    peak = {"object_store_mib": 0.0}
    done = threading.Event()
    threading.Thread(target=poll_object_store, args=(peak, done), daemon=True).start()
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    done.set()
    if proc.returncode != 0:
        raise RuntimeError(f"nightly-scale {n} users failed:\n{proc.stderr[-3000:]}")
    driver_rss_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # the largest child so far
    manifest = json.loads(proc.stdout[proc.stdout.index("{"):])
    run = Path(manifest["outputs"]["recommendations"]).parent
    recs = pads.dataset(run / "recommendations").to_table(columns=["user_id"])
    users = pc.count_distinct(recs["user_id"]).as_py()
    metrics = pq.read_table(run / "metrics", columns=["users_ok", "wall_s", "actor"]).to_pandas()
    exactly_once = users == n and recs.num_rows == n * p.k
    job_per_actor = manifest["counts"]["users_ok"] / manifest["timings"]["decode_s"] / p.actors
    direct = direct_users_per_s(p, root)
    return {"users": n, "exactly_once": exactly_once, "recommendations": recs.num_rows, "wall_s": wall,
            "decode_s": manifest["timings"]["decode_s"], "job_users_per_s": manifest["counts"]["users_ok"] /
            manifest["timings"]["decode_s"], "job_users_per_s_per_actor": job_per_actor,
            "direct_users_per_s": direct, "job_vs_direct": job_per_actor / direct,
            "actor_busy_users_per_s": float(metrics.users_ok.sum() / metrics.wall_s.sum()),
            "driver_peak_rss_mib": driver_rss_mib, "object_store_peak_mib": peak["object_store_mib"],
            "shards": len(metrics)}


def direct_users_per_s(p: ScaleParams, root: Path) -> float:
    """The recommender called in this process on the first `direct_batches` batches of the input, one thread per
    actor CPU as Ray gives it (after one warm-up batch)."""
    from operators.recommender import Recommender
    from pipeline.config import load_config
    from pipeline.nightly import actor_spec, read_catalog, resolve_models, resolve_template

    cfg = load_config(None, overrides(p, root))
    actor = Recommender(actor_spec(cfg, "direct", read_catalog(cfg), resolve_template(cfg, resolve_models(cfg))))
    table = pq.ParquetFile(root / "data" / "test.parquet").read_row_group(0, columns=["user_id", "history"])
    batches = [table.slice(a * p.batch, p.batch) for a in range(p.direct_batches + 1)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        actor(batches[0])
        t0 = time.perf_counter()
        for b in batches[1:]:
            actor(b)
        return p.direct_batches * p.batch / (time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)


def poll_object_store(peak: dict, done: threading.Event) -> None:
    from ray._private.internal_api import memory_summary

    while not done.wait(0.5):
        try:
            used = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(stats_only=True))
        except Exception:  # the cluster is busy: try again
            continue
        if used:
            peak["object_store_mib"] = max(peak["object_store_mib"], float(used.group(1)))


def markdown_scale(result: dict) -> str:
    a, env = result["args"], result["environment"]
    lines = [f"## nightly job at scale: synthetic users, tiny Llama (1 layer x 32), k {a['k']}, batch {a['batch']}, "
             f"{a['actors']} CPU actor(s), local Ray with {a['cpus']} CPUs", "",
             "| users | every user once | shards | job users/s | job users/s per actor | direct users/s | job / "
             "direct | driver peak RSS | object store peak |", "|---:|:-:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["sizes"]:
        lines.append(f"| {r['users']:,} | {'yes' if r['exactly_once'] else '**NO**'} | {r['shards']:,} | "
                     f"{r['job_users_per_s']:.0f} | {r['job_users_per_s_per_actor']:.0f} | "
                     f"{r['direct_users_per_s']:.0f} | {r['job_vs_direct']:.2f}x | {r['driver_peak_rss_mib']:.0f} MiB"
                     f" | {r['object_store_peak_mib']:.0f} MiB |")
    lines += ["", "Driver peak RSS: the largest child process of the benchmark (each size's `jobs.nightly` driver; "
              "sizes run in increasing order, so a row is at least the previous one). Object store: polled every "
              "0.5 s.", "", f"`{env['command']}`"]
    return "\n".join(lines)
