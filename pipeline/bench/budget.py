"""A run of cells under a time budget (`bench gpu`): each cell one measurement, run in the order given (the most
valuable first), its row written to the report as soon as it is known, so that a run cut off returns what it measured.

The budget counts from the process's start (imports and data preparation included). A cell runs while time is left;
a cell with a cost estimate (an engine cell's decoding, a compiled engine's cold compile) runs only when the estimate
fits in what is left, and says so when it does not; a cell that fails keeps its error and the run goes on. A cell
waits as "pending"; when the budget is spent, the cells never started say "not reached: budget". SIGTERM (or
Ctrl-C) cuts the run: the cell under way says "cut: SIGTERM", the ones after it "not reached: SIGTERM", the report
is written and the process exits at once, 143 (130). The report is rewritten after every cell (and before each,
naming the cell under way), each file replaced whole (written beside it, then renamed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

PENDING = "pending"
NOT_REACHED = "not reached: budget"
RUNNING = "running: a report that ends here was cut off in this cell"


@dataclass(frozen=True)
class Cell:
    """One measurement: `measure()` -> its row's figures; `kind` names the report section it belongs to; `cost_s()`,
    where given, the seconds it is expected to take (it runs only when they fit in what is left)."""

    name: str
    kind: str
    measure: Callable[[], dict]
    cost_s: Callable[[], float] | None = None


def since_process_start() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time against /proc/uptime; 0.0 where
    neither exists): the interpreter's start and the imports count against a budget."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        return max(0.0, float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def run_cells(
    cells: list[Cell],
    budget_s: float,
    write: Callable[[list[dict]], None],
    after: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    spent_s: float = 0.0,
    stop: Callable[[int], None] = lambda signum: os._exit(128 + signum),
) -> list[dict]:
    """Runs `cells` in order within `budget_s` seconds, `spent_s` of them already gone (`since_process_start`) -> one
    row per cell: {cell, kind, status, seconds, ...its figures}, status "ok", "error" (with the error), "skipped: ...",
    NOT_REACHED. `write(rows)` is called with every row at the start, before each cell and after it; `after()` after
    each cell (freeing what it built). SIGTERM or SIGINT (main thread only) marks the cell under way "cut: SIGTERM"
    and the rest "not reached: SIGTERM", writes them and calls `stop(signum)`: the process exits at once (an exception
    raised there could land in a finalizer, which swallows it, and the cell would go on)."""
    start = clock() - spent_s
    rows = [{"cell": c.name, "kind": c.kind, "status": PENDING} for c in cells]

    def on_signal(signum, frame) -> None:
        name = signal.Signals(signum).name
        mark(rows, f"cut: {name}", f"not reached: {name}")
        write(rows)
        print(f"bench: cut by {name}; the report says which cell it cut", file=sys.stderr, flush=True)
        sys.stdout.flush()
        stop(signum)

    with handling_signals(on_signal):
        write(rows)
        run_rows(cells, rows, budget_s, write, after, clock, start)
    return rows


def run_rows(cells, rows, budget_s, write, after, clock, start) -> None:
    """run_cells' loop: each cell's row filled in as the rules say."""
    for i, cell in enumerate(cells):
        left = budget_s - (clock() - start)
        if left <= 0:
            mark(rows, None, NOT_REACHED)
            write(rows)
            return
        need = cell.cost_s() if cell.cost_s else 0.0
        if need > left:
            rows[i]["status"] = f"skipped: needs about {need:.0f} s, {left:.0f} s left"
            write(rows)
            continue
        rows[i] = {**rows[i], "status": RUNNING, "expected_s": need or None}
        write(rows)
        rows[i] = {**rows[i], **measured(cell, clock)}
        after()
        write(rows)


def mark(rows: list[dict], running: str | None, pending: str) -> None:
    """The cell under way (if any) says `running`; the cells not started say `pending`."""
    for r in rows:
        if r["status"] == RUNNING and running:
            r["status"] = running
        elif r["status"] == PENDING:
            r["status"] = pending


@contextlib.contextmanager
def handling_signals(handler) -> Iterator[None]:
    """`handler` for SIGTERM and SIGINT while inside, in the main thread (elsewhere: nothing changes)."""
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
    try:
        yield
    finally:
        for s, previous in saved.items():
            signal.signal(s, previous)


def measured(cell: Cell, clock: Callable[[], float]) -> dict:
    """The cell's figures with status "ok", or its error (type, message, the traceback's end) with status "error";
    its seconds either way."""
    t0 = clock()
    try:
        out = {**cell.measure(), "status": "ok"}
    except Exception as e:  # recorded; the run goes on with the next cell
        out = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    return {**out, "seconds": clock() - t0}


def write_atomic(path: Path, text: str) -> None:
    """`path` replaced whole by `text`: written beside it, then renamed over it (a reader, or a run killed mid-write,
    sees the old file or the new one, never half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
