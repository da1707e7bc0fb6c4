"""A run of cells under a time budget (`bench gpu`): each cell one measurement, run in the order given (the most
valuable first), its row written to the report as soon as it is known, so that a run cut off returns what it measured.

A cell runs while time is left; a cell with a cost estimate (a compiled engine's cold compile) runs only when the
estimate fits in what is left, and says so when it does not; a cell that fails keeps its error and the run goes on; a
cell never started says "not reached: budget". The report is rewritten after every cell (and before each, naming the
cell under way), each file replaced whole (written beside it, then renamed).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

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


def run_cells(
    cells: list[Cell],
    budget_s: float,
    write: Callable[[list[dict]], None],
    after: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict]:
    """Runs `cells` in order within `budget_s` seconds -> one row per cell: {cell, kind, status, seconds, ...its
    figures}, status "ok", "error" (with the error), "skipped: ..." or NOT_REACHED. `write(rows)` is called with every
    row at the start, before each cell and after it; `after()` after each cell (freeing what it built)."""
    start = clock()
    rows = [{"cell": c.name, "kind": c.kind, "status": NOT_REACHED} for c in cells]
    write(rows)
    for i, cell in enumerate(cells):
        left = budget_s - (clock() - start)
        if left <= 0:
            break
        need = cell.cost_s() if cell.cost_s else 0.0
        if need > left:
            rows[i]["status"] = f"skipped: needs about {need:.0f} s (its compile included), {left:.0f} s left"
            write(rows)
            continue
        rows[i] = {**rows[i], "status": RUNNING, "expected_s": need or None}
        write(rows)
        rows[i] = {**rows[i], **measured(cell, clock)}
        after()
        write(rows)
    return rows


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
