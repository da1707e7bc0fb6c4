"""The timing harness every comparison uses, and what every report carries (hardware, versions, environment).

`interleaved(methods, repeats)` runs each method once to warm up, then `repeats` rounds in which every method runs
once, the order rotated each round (A B, B A, A B, ... for two methods), and records every round's seconds. A
method's `Timing` reports the median with min and max; `ratio(a, b)` is the ratio of medians with the range
[min a / max b, max a / min b]; two methods whose ranges overlap (the ratio's range holds 1) are `within noise`, and a
verdict then names no winner.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from decoding.models import pick_device, pick_dtype
from pipeline.bench.budget import write_atomic

# ------------------------------------------------------------------ the harness


@dataclass
class Timing:
    """One method's seconds, one per timed repeat (in repeat order), and its peak memory when measured."""

    seconds: list[float]
    peak_memory_mb: float | None = None

    @property
    def median(self) -> float:
        return float(np.median(self.seconds))

    @property
    def min(self) -> float:
        return float(np.min(self.seconds))

    @property
    def max(self) -> float:
        return float(np.max(self.seconds))

    def per(self, fn: Callable[[float], float]) -> dict:
        """A quantity derived from each repeat's seconds (users/s, ms per user) -> its median, min and max."""
        return spread([fn(s) for s in self.seconds])

    def to_dict(self) -> dict:
        out = {"seconds": list(self.seconds), "median_s": self.median, "min_s": self.min, "max_s": self.max}
        return out if self.peak_memory_mb is None else {**out, "peak_memory_mb": self.peak_memory_mb}


@dataclass
class Interleaved:
    """What `interleaved` returns: every method's Timing, its output of the last timed repeat, and the call order
    of the timed runs."""

    timings: dict[str, Timing]
    outputs: dict[str, Any]
    order: list[str] = field(default_factory=list)


def run_order(names: list[str], repeats: int) -> list[list[str]]:
    """Repeat r runs the methods rotated by r: [A B C], [B C A], [C A B], ... (two methods alternate who goes first)."""
    n = len(names)
    return [names[r % n :] + names[: r % n] for r in range(repeats)]


def interleaved(
    methods: dict[str, Callable[[], Any]],
    repeats: int,
    device: torch.device | str = "cpu",
    warmup: dict[str, Callable[[], Any]] | None = None,
    peak_memory: bool = False,
    desc: str | None = None,
) -> Interleaved:
    """Warms up every method once (with `warmup[name]` where given, e.g. on one batch; else the method itself), then
    times `repeats` interleaved rounds. peak_memory: also measure each call's peak memory (max over the repeats)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not methods:
        raise ValueError("no methods to time")
    device, names = torch.device(device), list(methods)
    bar = progress(desc=desc, total=len(names) * (repeats + 1)) if desc else None
    for name in names:
        (warmup or {}).get(name, methods[name])()
        if bar:
            bar.update()
    seconds = {name: [] for name in names}
    peaks = {name: 0.0 for name in names}
    outputs, order = {}, []
    for names_r in run_order(names, repeats):
        for name in names_r:
            outputs[name], s, peak = timed(methods[name], device, peak_memory)
            seconds[name].append(s)
            peaks[name] = max(peaks[name], peak / 2**20)
            order.append(name)
            if bar:
                bar.set_postfix_str(f"{name} {s:.3g}s")
                bar.update()
    if bar:
        bar.close()
    timings = {name: Timing(seconds[name], peaks[name] if peak_memory else None) for name in names}
    return Interleaved(timings, outputs, order)


def spread(values) -> dict:
    """Numbers -> {median, min, max}."""
    return {"median": float(np.median(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def ratio(a: Timing, b: Timing) -> dict:
    """Seconds of a over seconds of b (b's speed-up over a): the ratio of medians, and its range from the extremes
    (low = min a / max b, high = max a / min b); within_noise when the range holds 1 (the two ranges overlap).
    per_repeat: the ratio within each interleaved repeat (for the record)."""
    low, high = a.min / b.max, a.max / b.min
    return {
        "median": a.median / b.median,
        "low": low,
        "high": high,
        "within_noise": low <= 1.0 <= high,
        "per_repeat": [x / y for x, y in zip(a.seconds, b.seconds)],
    }


def overlap(a: Timing, b: Timing) -> bool:
    """The two methods' [min, max] seconds overlap: no winner can be named."""
    return a.min <= b.max and b.min <= a.max


def fmt_ratio(r: dict, digits: int = 2) -> str:
    """'3.10x (2.80-3.40)'."""
    return f"{r['median']:.{digits}f}x ({r['low']:.{digits}f}-{r['high']:.{digits}f})"


def fmt_spread(s: dict, digits: int = 2) -> str:
    """'12.3 (11.9-13.0)': the median, and the min-max range."""
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def compare(fast: str, slow: str, r: dict) -> str:
    """The verdict on two interleaved methods, r = ratio(seconds of `slow`, seconds of `fast`): '`fast` 3.10x (2.80-
    3.40) faster than `slow`' from the medians, or 'within noise' when the ranges overlap; a median below 1 names
    `slow` the faster one."""
    if r["within_noise"]:
        return f"{fast} vs {slow}: within noise ({fmt_ratio(r)} by medians)"
    if r["median"] >= 1:
        return f"{fast} {fmt_ratio(r)} faster than {slow}"
    inverse = {"median": 1 / r["median"], "low": 1 / r["high"], "high": 1 / r["low"]}
    return f"{slow} {fmt_ratio(inverse)} faster than {fast}"


@contextmanager
def torch_threads(n: int | None):
    """torch's intra-op threads set to n in the block (None: left as they are), and put back after it."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, peak_memory: bool = False) -> tuple[Any, float, int]:
    """fn() -> (its output, wall seconds with the device synchronised, peak bytes above the start or 0)."""
    synchronize(device)
    t0 = time.perf_counter()
    if peak_memory:
        with PeakMemory(device) as mem:
            out = fn()
    else:
        out = fn()
    synchronize(device)
    return out, time.perf_counter() - t0, mem.peak if peak_memory else 0


class PeakMemory:
    """Peak memory above the start of the block: CUDA allocator peak, or sampled process RSS on CPU."""

    def __init__(self, device: torch.device):
        self.device, self.peak = device, 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
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
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.done = True
            self.thread.join()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def in_fresh_process(module: str, spec: dict, what: str, env: dict | None = None) -> dict:
    """`python -m module SPEC` (spec as JSON) in a fresh process from the checkout's root, `env` over this process's
    environment -> the JSON of its last line of output; a RuntimeError naming `what`, with its stderr's end, if it
    fails."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **(env or {}), "PYTHONPATH": path}
    run = subprocess.run(
        [sys.executable, "-m", module, json.dumps(spec)], cwd=root, env=env, capture_output=True, text=True
    )
    if run.returncode != 0:
        raise RuntimeError(f"{what} failed: {run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def progress(iterable=None, desc: str = "", total: int | None = None, leave: bool = False):
    """A progress bar on stderr for one benchmark sweep (inner bars clear themselves when done)."""
    return tqdm(iterable, desc=desc, total=total, leave=leave, dynamic_ncols=True, mininterval=0.5)


# ------------------------------------------------------------------ what every report carries


def hardware(device: torch.device, dtype: str) -> dict:
    """CPU model, cores, memory, the GPU if there is one, and the precision `dtype` resolves to on `device`."""
    out = {
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "device": str(device),
        "dtype": str(pick_dtype(dtype, device)).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device.type == "cuda" else 0)
        out.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
        )
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
    out["git_commit"] = git_commit(Path(__file__).resolve().parents[2])
    return out


def git_commit(root: Path) -> str:
    """HEAD of the checkout, `+dirty` when tracked files differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def environment(device: str | None, command: str) -> dict:
    """Versions, the device's name, torch threads and the command line, for a section's footer."""
    import transformers

    dev = pick_device(device)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "cpu_threads": torch.get_num_threads(),
        "command": command,
    }


def report_head(p, command: str, device: str | None = None) -> dict:
    """What every section's result starts with: its parameters ("args") and where and by which command it ran
    ("environment", on `device`, else the parameters' device)."""
    return {"args": asdict(p), "environment": environment(device or getattr(p, "device", None), command)}


def report(p, command: str, run: Callable[..., dict], markdown: Callable[[dict], str], device=None, **kw) -> tuple:
    """A section run: report_head, then the section's own figures, run(p, **kw) -> (result, markdown(result)). The
    section runs first: its own checks (missing models, no such device) speak before the head asks for the device."""
    body = run(p, **kw)
    result = {**report_head(p, command, device), **body}
    return result, markdown(result)


def aligned(left: int, right: int) -> list[str]:
    """A table's alignments (pipeline/markdown.py::table): `left` columns of names, then `right` columns of numbers."""
    return ["left"] * left + ["right"] * right


def footer(env: dict) -> str:
    return (
        f"`{env['command']}` (torch {env['torch']}, transformers {env['transformers']}, {env['cpu_threads']} threads)"
    )


def write_result(out: Path, name: str, result: dict, md: str, echo: bool = True) -> None:
    """OUT/NAME.json and OUT/NAME.md, each replaced whole, and (echo) the Markdown on stdout."""
    write_atomic(out / f"{name}.json", json.dumps(result, indent=2, default=str))
    write_atomic(out / f"{name}.md", md + "\n")
    if echo:
        print(md)
