"""The cells and tables that REPORT.md's sections share (``report``, ``pool_report``):
kept below both, so that the report can include the pool's section without the pool's
section importing the report back."""

from __future__ import annotations

from typing import Any

Summary = dict[str, Any]
Row = tuple[str, ...]


def number(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def verdict(met: bool | None) -> str:
    """A goal cell's verdict; None: not measured."""
    return "no data" if met is None else "met" if met else "NOT met"


def markdown_table(header: str, rows: list[Row]) -> str:
    lines = [f"| {header} |", "|" + "---|" * (header.count("|") + 1)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
