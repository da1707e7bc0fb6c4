"""The GPU machine's call rehearsed on the CPU: `bash infra/gpu/bench.sh --smoke` on a copy of the checkout's files
alone (git's tracked and unignored files: no .venv, no data, nothing beside it), as the GPU machine runs it: this
Python as the only `python3` on PATH, `ray`, `boto3` and `botocore` unimportable, HOME, the working directory and
TMPDIR in fresh folders, proxies pointing at a closed port and the hub offline.

An audit hook (sitecustomize.py, on PYTHONPATH with the blockers) records every file Python opens outside the copy,
the run's folders and the interpreter's own prefixes, and every socket it connects: both records must stay empty.
"""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.bench.budget import NOT_REACHED, PENDING

ROOT = Path(__file__).resolve().parents[1]
# The whole smoke run (bench.sh, its imports and 14 cells at smoke sizes) in CPU-seconds of its processes: 38 on the
# 2-core development machine (3.8 minutes of wall time there with a load average of 23, so the bound is on CPU time,
# which other jobs do not inflate). 3x that: a run past it has grown a cell that does not belong in every CI run.
SMOKE_BOUND_CPU_S = 120
BLOCKED = ("ray", "boto3", "botocore")
HOOK = """
import os, sys

_roots = tuple(p for p in os.environ["REHEARSAL_ROOTS"].split(os.pathsep) if p) + tuple(
    {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix})
_system = ("/proc/", "/sys/", "/dev/", "/usr/share/zoneinfo/")
_log = os.environ["REHEARSAL_LOG"]


def _note(line):
    with open(_log, "a") as f:
        f.write(line + "\\n")


def _hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes)) and not str(args[0]).startswith(_system):
        path = os.path.realpath(os.fsdecode(args[0]))
        if path != _log and not path.startswith(_roots):
            _note(f"open {path}")
    elif event == "socket.connect" and not isinstance(args[1], str):  # an address other than a unix socket's
        _note(f"connect {args[1]!r}")


sys.addaudithook(_hook)
"""


def tracked_copy(dest: Path) -> Path:
    """The checkout's tracked and unignored files (what the device tool copies) -> a copy at `dest`."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        src = ROOT / name
        if src.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    """A stand-in GPU machine: the copy (nothing beside it), fresh HOME, working directory and TMPDIR, a `python3`
    that is this interpreter, the blockers and the audit hook on PYTHONPATH."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the rehearsal copies the checkout's files as git lists them")
    base = tmp_path_factory.mktemp("gpu-machine")
    m = {name: base / name for name in ("repo", "home", "cwd", "tmp", "bin", "site", "out")}
    for path in m.values():
        path.mkdir()
    tracked_copy(m["repo"])
    (m["bin"] / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (m["bin"] / "python3").chmod(0o755)
    for name in BLOCKED:
        (m["site"] / name).mkdir()
        (m["site"] / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU machine')\n")
    (m["site"] / "sitecustomize.py").write_text(textwrap.dedent(HOOK))
    return m


def rehearse(m: dict, out: Path, *argv: str, **popen) -> subprocess.Popen:
    """`bash infra/gpu/bench.sh ARGV` on the stand-in machine, OUT=out."""
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens
    env = {
        "PATH": f"{m['bin']}{os.pathsep}/usr/bin{os.pathsep}/bin",
        "HOME": str(m["home"]),
        "TMPDIR": str(m["tmp"]),
        "PYTHONPATH": str(m["site"]),
        "OUT": str(out),
        "REHEARSAL_ROOTS": os.pathsep.join(str(m[x]) for x in ("repo", "home", "tmp", "out", "site")),
        "REHEARSAL_LOG": str(out.parent / f"{out.name}.audit"),
        "HF_HUB_OFFLINE": "1",
        **{proxy: dead for proxy in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")},
    }
    script = m["repo"] / "infra" / "gpu" / "bench.sh"
    return subprocess.Popen(["bash", str(script), *argv], cwd=m["cwd"], env=env, text=True, **popen)


def children_cpu_s() -> float:
    """CPU-seconds (user and system) of this process's finished children and theirs, so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def audit(out: Path) -> list[str]:
    log = out.parent / f"{out.name}.audit"
    return log.read_text().splitlines() if log.exists() else []


def test_smoke_rehearsal_writes_every_cell_after_each_and_needs_only_the_copy(machine):
    """The whole smoke run: bench.sh exits 0 within SMOKE_BOUND_CPU_S; gpu.json and gpu.md were already there, valid and
    holding finished cells, while later cells were still to come (the report is rewritten after every cell); at the
    end every cell has its row, each "ok"; nothing was read outside the copy and the run's folders, no socket
    connected, and no report names a path outside them."""
    out = machine["out"] / "full"
    t0, cpu0 = time.monotonic(), children_cpu_s()
    run = rehearse(machine, out, "--smoke", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = None
    while run.poll() is None:
        if partial is None and (out / "gpu.json").is_file():
            rows = json.loads((out / "gpu.json").read_text())["cells"]  # whole at any moment: replaced, not rewritten
            if rows[0]["status"] == "ok" and rows[-1]["status"] == PENDING:
                partial = rows
        time.sleep(0.05)
    stdout, stderr = run.communicate()
    cpu, wall = children_cpu_s() - cpu0, time.monotonic() - t0
    assert run.returncode == 0, stderr[-4000:]
    assert cpu < SMOKE_BOUND_CPU_S, (cpu, wall)
    assert partial is not None, "no report with a finished cell before the last cell ran"
    result = json.loads((out / "gpu.json").read_text())
    rows = result["cells"]
    assert [r["cell"] for r in rows] == [r["cell"] for r in partial]
    assert {r["status"] for r in rows} == {"ok"}, [(r["cell"], r.get("error"), r.get("traceback")) for r in rows]
    kinds = {r["kind"] for r in rows}
    assert kinds == {"matmul", "anchor", "qwen", "auto", "parity", "padding", "shapes"}
    compiled = [r for r in rows if r["cell"].endswith(", compiled")]
    assert len(compiled) == 4 and all("beam_search_compiled" in r["methods"] for r in compiled)
    assert all(r["compiled_agreement"]["same_items_same_order"] == 1.0 for r in compiled)  # float32
    md = (out / "gpu.md").read_text()
    for r in rows:
        assert f"| {r['cell']} | ok |" in md
    [page] = out.glob("gpu-*-*.md")  # the dated page, its provenance on top
    assert page.read_text().startswith("# GPU benchmark: ") and page.read_text().endswith(md)
    assert audit(out) == []
    text = "\n".join(f.read_text() for f in out.iterdir())
    for outside in {str(ROOT), str(Path.cwd())} - {str(machine["repo"])}:
        assert outside not in text, outside
    beside = {p.name for p in machine["repo"].parent.iterdir()}  # the stand-in machine's own folders, no shared/
    assert beside == set(machine) and not (machine["repo"] / ".venv").exists()
    assert f"{len(rows)} cells: {len(rows)} ok" in stdout


def test_a_budget_too_small_leaves_a_valid_partial_report(machine):
    """--budget-s 2 (counted from the process's start: its imports may spend it all): every cell the budget did not
    reach says "not reached: budget" (a compiled cell whose expected compile did not fit, that it was skipped), in
    valid JSON and in the page's table, and nothing runs after the budget."""
    out = machine["out"] / "short"
    run = rehearse(machine, out, "--smoke", "--budget-s", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, stderr = run.communicate()
    assert run.returncode == 0, stderr[-4000:]
    rows = json.loads((out / "gpu.json").read_text())["cells"]
    statuses = [r["status"] for r in rows]
    assert statuses[-1] == NOT_REACHED and PENDING not in statuses
    done = [s for s in statuses if s != NOT_REACHED]
    assert statuses == done + [NOT_REACHED] * (len(statuses) - len(done))  # nothing runs after the budget
    assert all(s == "ok" or s.startswith("skipped: needs about") for s in done), done
    md = (out / "gpu.md").read_text()
    assert md.count(f"| {NOT_REACHED} |") == statuses.count(NOT_REACHED)
    assert audit(out) == []


def test_sigterm_to_bench_sh_cuts_the_cell_and_keeps_the_scratch_until_python_exits(machine):
    """`bench.sh --smoke --out rel` from a caller's folder (the report lands under it, not under the checkout),
    SIGTERM once the first SID-GR cell is under way: the script passes it on and waits, python records the cell it
    cut and writes the report, and only then is the scratch folder removed. Exit 143; no cell claims the budget."""
    caller = machine["out"] / "caller"
    caller.mkdir()
    run = rehearse({**machine, "cwd": caller}, caller / "unused", "--smoke", "--out", "rel", stderr=subprocess.PIPE)
    report, deadline = caller / "rel" / "gpu.json", time.monotonic() + 300
    while time.monotonic() < deadline and run.poll() is None:
        rows = json.loads(report.read_text())["cells"] if report.exists() else []
        if rows and rows[1]["status"].startswith("running"):  # the handler is in place before the first write
            break
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=300)
    assert run.returncode == 143, stderr[-4000:]
    statuses = [r["status"] for r in json.loads(report.read_text())["cells"]]
    done = statuses.index("not reached: SIGTERM")  # the signal may land between two cells: then none says "cut"
    assert set(statuses[done:]) == {"not reached: SIGTERM"} and done >= 2, statuses
    assert statuses[: done - 1] == ["ok"] * (done - 1) and statuses[done - 1] in ("ok", "cut: SIGTERM"), statuses
    assert (caller / "rel" / "gpu.md").read_text().count("| not reached: SIGTERM |") == len(statuses) - done
    assert not list(machine["tmp"].glob("bench-gpu.*")) and not (machine["repo"] / "rel").exists()
    assert "FileNotFoundError" not in stderr


# ------------------------------------------------------------------ the budget's rules, on a clock the test moves


def fake_cells(clock: list, spec: list) -> list:
    """Cells that advance the fake `clock` by their seconds (or raise, for None), with a cost where given."""
    from pipeline.bench.budget import Cell

    def measure(seconds):
        if seconds is None:
            raise RuntimeError("out of luck")
        clock[0] += seconds
        return {"value": seconds}

    return [
        Cell(f"c{i}", "k", lambda s=seconds: measure(s), None if cost is None else (lambda c=cost: c))
        for i, (seconds, cost) in enumerate(spec)
    ]


def test_run_cells_keeps_to_the_budget_records_errors_and_writes_after_every_cell():
    """Budget 10 s: c0 (3 s) runs; c1 fails, its error recorded, and the run goes on; c2 (cost 8 s, 7 s left) is
    skipped and says so; c3 (cost 5 s) runs 5 s; c4 starts with 2 s left and runs over (4 s); c5 is not reached.
    The report was written at the start, before and after every cell run, and after the skip."""
    from pipeline.bench.budget import RUNNING, run_cells

    clock, writes = [0.0], []
    cells = fake_cells(clock, [(3, None), (None, None), (1, 8), (5, 5), (4, None), (1, None)])
    rows = run_cells(cells, 10, lambda r: writes.append([x["status"] for x in r]), clock=lambda: clock[0])
    assert [r["status"] for r in rows] == [
        "ok",
        "error",
        "skipped: needs about 8 s, 7 s left",
        "ok",
        "ok",
        NOT_REACHED,
    ]
    assert rows[1]["error"] == "RuntimeError: out of luck" and "Traceback" in rows[1]["traceback"]
    assert [r.get("seconds") for r in rows] == [3, 0, None, 5, 4, None] and rows[3]["value"] == 5
    assert rows[3]["expected_s"] == 5
    assert len(writes) == 1 + 2 * 4 + 1 + 1  # the start; before and after each of the 4 run; the skip; the budget
    assert writes[1][0] == RUNNING and writes[2][:2] == ["ok", PENDING]  # c0's row as soon as it is known
    assert writes[-2][-1] == PENDING  # "budget" only once the budget stopped the run


def test_a_budget_counts_what_the_process_spent_before_the_cells():
    """spent_s (the process's imports and data preparation) comes off the budget: 9 s of 10 spent, a cell of cost 2
    is skipped; all spent, nothing runs. The process's age is read from /proc: positive, below the test run's."""
    from pipeline.bench.budget import run_cells, since_process_start

    clock = [0.0]
    rows = run_cells(fake_cells(clock, [(1, 2), (1, None)]), 10, lambda r: None, clock=lambda: clock[0], spent_s=9)
    assert [r["status"] for r in rows] == ["skipped: needs about 2 s, 1 s left", "ok"]
    rows = run_cells(fake_cells(clock, [(1, None)]), 10, lambda r: None, clock=lambda: clock[0], spent_s=10)
    assert [r["status"] for r in rows] == [NOT_REACHED]
    assert 0 < since_process_start() < time.monotonic()


def test_sigterm_cuts_the_cell_under_way_and_writes_the_report():
    """SIGTERM during c1: c0 stays ok, c1 says "cut: SIGTERM", c2 "not reached: SIGTERM" (not "budget"), the report
    is written with them, then `stop` is called (the process's exit), and the previous SIGTERM handler is back."""
    from pipeline.bench.budget import run_cells

    class Stopped(BaseException):  # as an exit: no cell error handling catches it
        pass

    def killed():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this
        return {}

    def stop(signum):
        raise Stopped(signum)  # in place of the process's exit

    clock, writes = [0.0], []
    cells = fake_cells(clock, [(1, None), (1, None), (1, None)])
    cells[1] = replace(cells[1], measure=killed)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped, match=str(int(signal.SIGTERM))):
        run_cells(cells, 100, lambda r: writes.append([x["status"] for x in r]), clock=lambda: clock[0], stop=stop)
    assert writes[-1] == ["ok", "cut: SIGTERM", "not reached: SIGTERM"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_eager_cells_carry_a_cost_from_the_measured_matmul_rate():
    """An eager cell's estimate is 0 on a CPU (no CUDA memory); on an H100's memory at the plan's own rate (0.7 of the
    H100's peak) it is the plan's seconds; at a tenth of the rate, more (its FLOP-bound batches ten times slower)."""
    import torch

    from pipeline.bench import gpu, gpu_plan, gpu_shapes
    from pipeline.bench.params import GpuParams

    p = GpuParams(data="unused", engines=["eager", "compiled"])
    b = gpu.Bench(p, torch.device("cpu"), torch.bfloat16, Path("unused"))
    eager = {c.name: c for c in gpu.gpu_cells(b, "test") if c.name.endswith(", eager")}
    shape = gpu_shapes.qwen(p)
    b.rate = gpu_plan.H100_MATMUL_FRACTION * gpu_plan.H100_BF16
    assert eager[f"{shape.name}, eager"].cost_s() == 0.0  # a CPU (no device memory): no estimate
    b.memory = gpu_plan.H100_MEMORY
    planned = {name: compile_s + run_s for name, _, compile_s, run_s in gpu_plan.plan_cells(p)}
    assert eager[f"{shape.name}, eager"].cost_s() == pytest.approx(planned[f"{shape.name}, eager"], rel=1e-9)
    b.rate /= 10
    assert eager[f"{shape.name}, eager"].cost_s() > 5 * planned[f"{shape.name}, eager"]


def test_the_plan_replays_the_run_loop():
    """--plan's last column is run_cells on a clock moved by each cell's expected seconds: at a 100 s budget the
    Qwen2.5-0.5B cells do not fit and are skipped, yet the cheaper padding cell after them runs (a running sum says
    "no"), and the cells past the budget are not reached: the run's statuses, not a sum, fill the column."""
    from pipeline.bench import gpu_plan
    from pipeline.bench.params import GpuParams

    result, md = gpu_plan.plan_result(GpuParams(data="unused", engines=["eager", "compiled"], budget_s=100), "t")
    rows = {r["cell"]: r for r in result["cells"]}
    within = {name: r["within_budget"] for name, r in rows.items()}
    assert within["SID-GR batch 1, compiled"] == "yes"
    assert within["Qwen2.5-0.5B, eager"].startswith("skipped: needs about 32 s")
    assert within["padding"] == "yes" and rows["padding"]["cumulative_s"] > 100
    assert within["SID-GR batch largest, compiled"] == NOT_REACHED
    assert f"| padding | 0 | {rows['padding']['run_s']:.1f} |" in md


def test_a_machine_without_a_module_is_told_which_in_one_line(machine, tmp_path):
    """A `python3` that sees no third-party package (-I -S): bench.sh names the missing modules in one line and exits
    3, before writing anything."""
    bare = tmp_path / "bin"
    bare.mkdir()
    (bare / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -I -S "$@"\n')
    (bare / "python3").chmod(0o755)
    out = tmp_path / "out"
    run = rehearse({**machine, "bin": bare}, out, "--smoke", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, stderr = run.communicate()
    assert run.returncode == 3
    [line] = stderr.splitlines()
    assert line.startswith("bench.sh: python3 lacks torch transformers numpy pyarrow pandas yaml tqdm"), line
    assert not out.exists()


def test_the_plan_has_a_row_for_every_cell_of_a_run():
    """`bench gpu --plan` and a run list the same cells in the same order (one list of shapes behind both)."""
    import torch

    from pipeline.bench import gpu, gpu_plan, gpu_shapes
    from pipeline.bench.params import GpuParams

    p = GpuParams(data="unused", engines=["eager", "compiled"])
    run = gpu.gpu_cells(gpu.Bench(p, torch.device("cpu"), torch.bfloat16, Path("unused")), "test")
    planned = gpu_plan.plan_cells(p)
    assert [(c.name, c.kind) for c in run] == [(name, kind) for name, kind, _, _ in planned]
    assert all(run_s > 0 for *_, run_s in planned[1:])  # every decode cell costs something
    compiles = {name: compile_s for name, _, compile_s, _ in planned}
    assert compiles["SID-GR batch 8, compiled"] == gpu_shapes.COLD_COMPILE_S[-1][1]
    assert compiles["SID-GR batch 8, eager"] == 0
