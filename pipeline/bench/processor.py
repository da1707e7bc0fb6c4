"""processor: the processor in a Ray Data pipeline (read_parquet -> processor -> write_parquet) against the nightly
job on the same users (`nightly-scale`'s synthetic world, a tiny Llama, the same config), each run in its own driver
process on one local Ray, the two interleaved `repeats` times: the processor's users/s against the nightly's decode
rate, every user once, and each driver's peak memory.

Both rates run from the start of the execution to its last row written, the actors' start and model load included:
the nightly's `timings.decode_s` (its manifest), the processor's execution as its driver times it (`drive`, this
module run as a script). The plan and the processor's build (the same driver checks) are outside both.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.bench.common import Timing, compare, fmt_ratio, fmt_spread, ratio, run_order, spread
from pipeline.bench.params import ProcessorParams, ScaleParams
from pipeline.bench.scale import overrides, run_driver, world
from pipeline.markdown import table


def run_processor(p: ProcessorParams) -> dict:
    """Each size's interleaved runs on a local Ray of p.cpus CPUs -> the sizes' rows."""
    import ray

    ray.init(num_cpus=p.cpus, include_dashboard=False, ignore_reinit_error=True)
    try:
        return {"sizes": [bench_size(p, n) for n in p.users]}
    finally:
        ray.shutdown()


def bench_size(p: ProcessorParams, n: int) -> dict:
    """n users: the nightly and the processor, each in its own driver process, interleaved `repeats` times."""
    import ray

    scale = ScaleParams(users=[n], k=p.k, batch=p.batch, cpus=p.cpus, out=p.out)  # its world: one CPU actor
    root = world(scale, n)
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address}
    runs: dict[str, list[dict]] = {"nightly": [], "processor": []}
    for names in run_order(["nightly", "processor"], p.repeats):
        for name in names:
            run = nightly_run if name == "nightly" else processor_run
            runs[name].append(run(scale, root, env))
    return size_row(n, runs)


def nightly_run(p: ScaleParams, root: Path, env: dict) -> dict:
    """One nightly job of the world: its decode seconds, users, and its driver's peak memory."""
    shutil.rmtree(root / "out", ignore_errors=True)
    cmd = [sys.executable, "-m", "jobs.nightly", *(x for o in overrides(p, root) for x in ("--set", o))]
    stdout, _, usage, samples = run_driver(cmd, env, f"processor bench: nightly of {root.name}")
    manifest = json.loads(stdout[stdout.index("{") :])
    counts = manifest["counts"]
    return {
        "seconds": manifest["timings"]["decode_s"],
        "users": counts["users_ok"],
        "rows": counts["users_ok"] + counts["users_rejected"],
        **memory(usage, samples),
    }


def processor_run(p: ScaleParams, root: Path, env: dict) -> dict:
    """One pipeline through the processor (`drive`, in its own driver process): its seconds, rows, users listed,
    and its driver's peak memory."""
    out = root / "processor-out"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "pipeline.bench.processor", str(root), str(out), *overrides(p, root)]
    stdout, _, usage, samples = run_driver(cmd, env, f"processor bench: processor of {root.name}")
    return {**json.loads(stdout.strip().splitlines()[-1]), **memory(usage, samples)}


def memory(usage, samples: list[dict]) -> dict:
    """A driver's peak RSS (wait4) and the peak of its own heap (RssAnon, polled)."""
    anon = max((x["anon_mib"] for x in samples), default=0.0)
    return {"driver_peak_rss_mib": usage.ru_maxrss / 1024, "driver_peak_anon_mib": anon}


def drive(root: Path, out: Path, settings: list[str]) -> dict:
    """The processor's driver: the world's histories read by Ray Data, the processor built from the nightly's config
    (`settings`: its overrides), written as parquet -> {"seconds" of the execution, "rows" written, "users" listed}.
    Nothing per user passes through this process: the rows are counted from the files' footers."""
    import ray

    import genrec_batch as gb

    ray.init()  # RAY_ADDRESS: the bench's cluster
    cfg = gb.load_config(None, settings)
    processor = gb.build_processor(cfg)  # the driver's checks, as the nightly's plan: outside the timing
    histories = ray.data.read_parquet(cfg.input, columns=[cfg.columns.user_id, cfg.columns.history])
    t0 = time.perf_counter()
    processor(histories).write_parquet(str(out))
    seconds = time.perf_counter() - t0
    footers = [pq.read_metadata(f) for f in sorted(out.glob("*.parquet"))]
    return {"seconds": seconds, "rows": sum(m.num_rows for m in footers), "users": sum(map(listed, footers))}


def listed(footer) -> int:
    """A parquet file's rows with a list: those whose reject_reason is null (its row groups' statistics)."""
    return sum(
        c.statistics.null_count
        for g in range(footer.num_row_groups)
        for c in (footer.row_group(g).column(j) for j in range(footer.num_columns))
        if c.path_in_schema == "reject_reason"
    )


def size_row(n: int, runs: dict[str, list[dict]]) -> dict:
    """One size's runs -> users/s of each (median, min, max), the processor's over the nightly's, every user once,
    the drivers' peak memory."""
    timing = {name: Timing([r["seconds"] for r in rs]) for name, rs in runs.items()}
    return {
        "users": n,
        "every_user_once": all(r["rows"] == n and r["users"] == n for rs in runs.values() for r in rs),
        "users_per_s": {name: t.per(lambda s: n / s) for name, t in timing.items()},
        "processor_vs_nightly": ratio(timing["nightly"], timing["processor"]),
        "driver_peak_rss_mib": {name: spread([r["driver_peak_rss_mib"] for r in rs]) for name, rs in runs.items()},
        "driver_peak_anon_mib": {name: spread([r["driver_peak_anon_mib"] for r in rs]) for name, rs in runs.items()},
        "runs": runs,
    }


def markdown_processor(result: dict) -> str:
    a, env = result["args"], result["environment"]
    header = (
        "users | every user once | nightly users/s | processor users/s | processor / nightly | "
        "driver peak RSS: nightly (heap) | processor (heap)"
    ).split(" | ")
    rows = []
    for r in result["sizes"]:
        rss, anon = r["driver_peak_rss_mib"], r["driver_peak_anon_mib"]
        rows.append(
            [
                f"{r['users']:,}",
                "yes" if r["every_user_once"] else "**NO**",
                fmt_spread(r["users_per_s"]["nightly"], 0),
                fmt_spread(r["users_per_s"]["processor"], 0),
                f"{fmt_ratio(r['processor_vs_nightly'])}: {compare('processor', 'nightly', r['processor_vs_nightly'])}",
                f"{fmt_spread(rss['nightly'], 0)} MiB ({fmt_spread(anon['nightly'], 0)})",
                f"{fmt_spread(rss['processor'], 0)} MiB ({fmt_spread(anon['processor'], 0)})",
            ]
        )
    return "\n".join(
        [
            f"## the processor against the nightly: synthetic users, tiny Llama (1 layer x 32), k {a['k']}, batch "
            f"{a['batch']}, one CPU actor, local Ray with {a['cpus']} CPUs; median (min-max) of "
            f"{a['repeats']} interleaved runs of each",
            "",
            table(header, rows, ["right", "center"] + ["right"] * 5),
            "",
            "users/s: users over the seconds from the start of the execution to its last row written, actor start "
            "and model load included (the nightly's `timings.decode_s`; the processor's `read_parquet -> processor "
            "-> write_parquet` as its driver times it). Driver peak RSS: each run's driver process (wait4); heap: "
            "the peak of its own heap (RssAnon, polled every second).",
            "",
            f"`{env['command']}`",
        ]
    )


if __name__ == "__main__":  # the processor's driver process (`processor_run`)
    print(json.dumps(drive(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:])))
