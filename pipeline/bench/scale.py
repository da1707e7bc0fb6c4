"""nightly-scale: the nightly job on synthetic users at scale on one machine, a tiny model, each size in its own
driver process: every user exactly once, the driver's peak RSS and the object store's peak (polled), the job's users/s
per actor against the same recommender called directly on a sample of the same batches."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline import runs
from pipeline.bench.common import fmt_ratio, fmt_spread, spread, torch_threads
from pipeline.bench.params import ScaleParams
from pipeline.markdown import table
from pipeline.storage import Storage

ROOT = Path(__file__).resolve().parents[2]


def run_scale(p: ScaleParams) -> dict:
    """Each size a whole nightly run on a local Ray of p.cpus CPUs -> the sizes' rows."""
    import ray

    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        rows = [bench_size(p, n) for n in p.users]
    finally:
        ray.shutdown()
    return {"sizes": rows}


def world(p: ScaleParams, n: int) -> Path:
    """Synthetic histories of n users (row groups of 100k) and a tiny random model with the data's tokenizer."""
    from decoding.models import build_model
    from decoding.templates import PRESETS, write_template
    from pipeline.prepare import prepared, write_synthetic

    root = Path(p.out) / "nightly-scale" / f"world-{n}"
    if not prepared(root / "data"):  # items.parquet is written last: a world cut off part-way is written again
        write_synthetic(
            root / "data",
            n_users=n,
            n_items=p.items,
            levels=3,
            codes=16,
            seed=0,
            history_len=p.history_len,
            chunk_users=100_000,
        )
    if not (root / "target" / "config.json").is_file():
        build_model(4 + 3 * 16, 1, 32, 2, 1, seed=0).save_pretrained(root / "target")
        for f in (root / "data" / "tokenizer").iterdir():
            shutil.copy(f, root / "target" / f.name)
        write_template(root / "target", PRESETS["codes"].with_max_items(p.history_len))
    return root


def overrides(p: ScaleParams, root: Path) -> list[str]:
    return [
        f"input={root / 'data' / 'test.parquet'}",
        f"catalog={root / 'data' / 'items.parquet'}",
        f"output={root / 'out'}",
        f"models.target={root / 'target'}",
        f"decoding.k={p.k}",
        f"compute.batch_size={p.batch}",
        f"compute.num_actors={p.actors}",
        "runs.grace_s=0",
        "runs.progress_s=10",
        "run_date=2026-01-01",
    ]


def bench_size(p: ScaleParams, n: int) -> dict:
    """One size: the recommender called directly, the nightly job in its own driver process, the recommender again;
    the job's outputs read back through its manifest."""
    import ray

    root = world(p, n)
    direct = direct_users_per_s(p, root)
    shutil.rmtree(root / "out", ignore_errors=True)
    cmd = [sys.executable, "-m", "jobs.nightly", *(x for o in overrides(p, root) for x in ("--set", o))]
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    stdout, wall, usage, samples = run_driver(cmd, env, f"nightly-scale {n} users")
    manifest = json.loads(stdout[stdout.index("{") :])
    direct += direct_users_per_s(p, root)
    row = size_row(p, n, manifest, spread(direct))
    return {
        **row,
        "wall_s": wall,
        "driver_peak_rss_mib": usage.ru_maxrss / 1024,
        "driver_peak_anon_mib": max((x["anon_mib"] for x in samples), default=0.0),
        "object_store_peak_mib": max((x["object_store_mib"] for x in samples), default=0.0),
        "samples": samples,
    }


def run_driver(cmd: list[str], env: dict, what: str) -> tuple:
    """`cmd` in its own process from the repository root, its memory and the object store polled every second ->
    (its stdout, wall seconds, its own rusage, the samples); RuntimeError with its stderr's tail when it fails."""
    samples: list[dict] = []
    done = threading.Event()
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        threading.Thread(target=poll, args=(proc.pid, samples, done), daemon=True).start()
        _, status, usage = os.wait4(proc.pid, 0)  # this driver's own rusage: its peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        done.set()
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{stderr[-3000:]}")
    return stdout, wall, usage, samples


def size_row(p: ScaleParams, n: int, manifest: dict, direct: dict) -> dict:
    """A job of n users from its manifest and the files it lists: every user exactly once, the phase seconds, users/s
    per actor (all, and after the first shard) against the direct calls' users/s (`direct`: median, min, max)."""
    t, ok = manifest["timings"], manifest["counts"]["users_ok"]
    run = Path(manifest["outputs"]["recommendations"]).parent
    recs = runs.read_table(str(run), "recommendations", Storage(), ["user_id"])  # the manifest's files
    metrics = runs.read_table(str(run), "metrics", Storage(), ["users_ok", "wall_s", "actor"]).to_pandas()
    job_per_actor = ok / t["decode_s"] / p.actors
    steady = (ok - min(p.batch, ok)) / (t["decode_s"] - t["first_shard_s"]) / p.actors  # after the first shard
    return {
        "users": n,
        "exactly_once": pc.count_distinct(recs["user_id"]).as_py() == n and recs.num_rows == n * p.k,
        "recommendations": recs.num_rows,
        "decode_s": t["decode_s"],
        "duplicates_s": t["duplicates_s"],
        "first_shard_s": t["first_shard_s"],
        "job_users_per_s": ok / t["decode_s"],
        "job_users_per_s_per_actor": job_per_actor,
        "steady_users_per_s_per_actor": steady,
        "direct_users_per_s": direct,
        "job_vs_direct": over(job_per_actor, direct),
        "steady_vs_direct": over(steady, direct),
        "actor_busy_users_per_s": float(metrics.users_ok.sum() / metrics.wall_s.sum()),
        "shards": len(metrics),
    }


def over(x: float, s: dict) -> dict:
    """x over a spread s (median, min, max) -> the ratio to the median, with the range x / max .. x / min."""
    return {"median": x / s["median"], "low": x / s["max"], "high": x / s["min"]}


def direct_users_per_s(p: ScaleParams, root: Path) -> list[float]:
    """The recommender called in this process on the first `direct_batches` batches of the input, one thread as Ray
    gives an actor of one CPU (after one warm-up batch), `direct_repeats` times -> users/s of each."""
    from operators.recommender import Recommender
    from pipeline.config import load_config
    from pipeline.plan import direct_spec

    cfg = load_config(None, overrides(p, root))
    actor = Recommender(direct_spec(cfg))
    table = pq.ParquetFile(root / "data" / "test.parquet").read_row_group(0, columns=["user_id", "history"])
    batches = [table.slice(a * p.batch, p.batch) for a in range(p.direct_batches + 1)]
    with torch_threads(1):
        actor(batches[0])
        rates = []
        for _ in range(p.direct_repeats):
            t0 = time.perf_counter()
            for b in batches[1:]:
                actor(b)
            rates.append(p.direct_batches * p.batch / (time.perf_counter() - t0))
        return rates


def poll(pid: int, samples: list[dict], done: threading.Event) -> None:
    """Every second: the driver's resident memory (anonymous: its own heap; shared: object-store pages it mapped) and
    the object store's use (this process's cluster's: other Ray instances may run on the machine)."""
    import ray
    from ray._private.internal_api import memory_summary

    address = ray.get_runtime_context().gcs_address
    t0 = time.perf_counter()
    while not done.wait(1.0):
        try:
            status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
            used = re.search(r"Plasma memory usage (\d+) MiB", memory_summary(address, stats_only=True))
        except Exception:  # the driver has exited, or the cluster is busy: try again
            continue
        kib = {key: int(status.get(key, "0 kB").split()[0]) for key in ("VmRSS", "RssAnon", "RssShmem")}
        samples.append(
            {
                "t": round(time.perf_counter() - t0, 1),
                "rss_mib": kib["VmRSS"] / 1024,
                "anon_mib": kib["RssAnon"] / 1024,
                "shmem_mib": kib["RssShmem"] / 1024,
                "object_store_mib": float(used.group(1)) if used else 0.0,
            }
        )


def markdown_scale(result: dict) -> str:
    a, env = result["args"], result["environment"]
    header = (
        "users | every user once | shards | decode s (duplicates s, first shard s) | "
        "job users/s per actor (after the first shard) | direct users/s | job / direct (after the first shard) | "
        "actor busy users/s | driver peak RSS (anonymous) | object store peak"
    ).split(" | ")
    lines = [
        f"## nightly job at scale: synthetic users, tiny Llama (1 layer x 32), k {a['k']}, batch {a['batch']}, "
        f"{a['actors']} CPU actor(s), local Ray with {a['cpus']} CPUs",
        "",
        table(header, [size_cells(r) for r in result["sizes"]], ["right", "center"] + ["right"] * 8),
        "",
        "decode s: the driver's time from the start of the execution to the last shard written (duplicate "
        "user ids pass, actor start and model load included); job users/s per actor: users / decode s / actors; "
        "after the first shard: the rate once the pipeline is full. Direct: the same recommender called in "
        "one process on the input's first batches, one thread, median (min-max) of the runs before and "
        "after the job; the ratios' ranges divide by direct's max and min. Actor busy: users / the actors' "
        "summed batch wall time. Driver peak RSS: each size's `jobs.nightly` driver process (wait4); "
        "anonymous: the peak of its own heap (RssAnon, polled every second; the rest is shared libraries "
        "and object-store pages it mapped). Object store: polled every second; the JSON keeps both series.",
        "",
        f"`{env['command']}`",
    ]
    return "\n".join(lines)


def size_cells(r: dict) -> list[str]:
    """One size's row of the table."""
    return [
        f"{r['users']:,}",
        "yes" if r["exactly_once"] else "**NO**",
        f"{r['shards']:,}",
        f"{r['decode_s']:.1f} ({r['duplicates_s']:.1f}, {r['first_shard_s']:.1f})",
        f"{r['job_users_per_s_per_actor']:.0f} ({r['steady_users_per_s_per_actor']:.0f})",
        fmt_spread(r["direct_users_per_s"], 0),
        f"{fmt_ratio(r['job_vs_direct'])} ({fmt_ratio(r['steady_vs_direct'])})",
        f"{r['actor_busy_users_per_s']:.0f}",
        f"{r['driver_peak_rss_mib']:.0f} MiB ({r['driver_peak_anon_mib']:.0f})",
        f"{r['object_store_peak_mib']:.0f} MiB",
    ]
