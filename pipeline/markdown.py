"""The one Markdown table renderer, for the report (pipeline/report.py) and the benchmarks (pipeline/bench/)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

RULES = {"left": "---", "right": "---:", "center": ":---:"}


def table(header: Sequence[str], rows: Iterable[Sequence[object]], align: str | Sequence[str] = "right") -> str:
    """A GitHub-flavoured Markdown table: one header cell per column, rows of as many cells (each written with
    str(); a '|' inside a cell is escaped); align: "left" | "right" | "center", for every column or one per column."""
    aligns = [align] * len(header) if isinstance(align, str) else list(align)
    if len(aligns) != len(header):
        raise ValueError(f"table: {len(aligns)} alignments for {len(header)} columns")
    lines = [_row(header), "|" + "|".join(RULES[a] for a in aligns) + "|"]
    for r in rows:
        if len(r) != len(header):
            raise ValueError(f"table: a row of {len(r)} cells under {len(header)} columns: {list(r)!r}")
        lines.append(_row(r))
    return "\n".join(lines)


def _row(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
