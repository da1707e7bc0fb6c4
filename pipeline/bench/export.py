"""export: a published run served from Redis. For each K, a nightly of synthetic users (`nightly-scale`'s world, a
tiny model), then `genrec-batch export`'s path (pipeline/stores/redis.py) into a local redis-server started for the
bench (append-only file, fsync every second, noeviction), `repeats` times, each into a namespace of its own: wall
seconds, users/s and MB/s of list values (medians, min-max), and Redis's memory per user (used_memory after the first
export less before, over its users)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import replace

from pipeline.bench.common import fmt_spread, spread
from pipeline.bench.params import ExportParams, ScaleParams
from pipeline.bench.scale import overrides, world
from pipeline.markdown import table


def run_export(p: ExportParams) -> dict:
    import ray

    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    folder = tempfile.mkdtemp(prefix="genrec-bench-redis-")
    server = start_redis(folder)
    try:
        rows = []
        for i, k in enumerate(p.ks):
            for n in p.users if i == 0 else [p.k_users]:
                rows.append(bench_one(p, n, k, server[1]))
        return {"rows": rows, "redis": redis_version(server[1])}
    finally:
        server[0].terminate()
        server[0].wait(30)
        shutil.rmtree(folder, ignore_errors=True)
        ray.shutdown()


def start_redis(folder: str) -> tuple[subprocess.Popen, str]:
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", folder, "--save", ""]
    cmd += ["--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def redis_version(url: str) -> str:
    import redis

    return redis.Redis.from_url(url).info("server")["redis_version"]


def bench_one(p: ExportParams, n: int, k: int, url: str) -> dict:
    """A nightly of n users at K k, exported `repeats` times -> the row."""
    import redis

    from pipeline.config import Serving, load_config
    from pipeline.nightly import run_nightly
    from pipeline.output import open_run
    from pipeline.stores import redis as serving

    scale = ScaleParams(users=[n], k=k, batch=p.batch, cpus=p.cpus, out=p.out)
    root = world(scale, n)
    out = root / f"out-export-k{k}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(None, [*overrides(replace(scale, actors=1), root), f"output={out}", "compute.num_actors=1"])
    run = open_run(str(runs_dir(out, run_nightly(cfg))))
    client = redis.Redis.from_url(url)
    walls, sizes, memory = [], [], None
    for r in range(p.repeats):
        before = client.info("memory")["used_memory"]
        t0 = time.perf_counter()
        done = serving.export(run, Serving(url, namespace=f"bench-k{k}-{n}-{r}", writers=p.writers))
        walls.append(time.perf_counter() - t0)
        sizes.append(done.bytes)
        if memory is None:
            memory = (client.info("memory")["used_memory"] - before) / done.users
    users = int(run.manifest["counts"]["users_ok"])
    client.flushall()
    rate = [users / w for w in walls]
    mbps = [s / w / 1e6 for s, w in zip(sizes, walls, strict=True)]
    return {
        "users": users,
        "k": k,
        "shards": len(run.manifest["files"]["recommendations"]),
        "wall_s": spread(walls),
        "users_per_s": spread(rate),
        "mb_per_s": spread(mbps),
        "value_bytes_per_user": sizes[0] / users,
        "redis_bytes_per_user": memory,
    }


def runs_dir(out, manifest: dict):
    from pipeline import runs

    return runs.run_dir(str(out), manifest["run_date"], manifest["run_id"])


def markdown_export(result: dict) -> str:
    head = ["users", "K", "shards", "export s", "users/s", "MB/s of values", "value bytes / user", "Redis bytes / user"]
    rows = [
        [
            f"{r['users']:,}",
            r["k"],
            f"{r['shards']:,}",
            fmt_spread(r["wall_s"], 1),
            fmt_spread(r["users_per_s"], 0),
            fmt_spread(r["mb_per_s"], 2),
            f"{r['value_bytes_per_user']:.0f}",
            f"{r['redis_bytes_per_user']:.0f}",
        ]
        for r in result["rows"]
    ]
    return f"## Export to Redis\n\nRedis {result['redis']}.\n\n" + table(head, rows) + "\n"
