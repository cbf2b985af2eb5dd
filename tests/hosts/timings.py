"""Each cut cell's measured figures, printed at the end of the tier (conftest.py): how
long after the cut each rank exited, with which status, and what had to be killed."""

from __future__ import annotations

from typing import Any

LINES: list[str] = []


def add(cell: str, cut: str, ends: dict[int, Any], killed: list[str]) -> None:
    for rank, end in sorted(ends.items()):
        took = "still alive: killed" if end.after_cut is None else f"{end.after_cut:.1f} s"
        LINES.append(
            f"{cell}: {cut} cut; rank {rank} on {end.host}: {took} after the cut,"
            f" status {end.status}"
        )
    LINES.extend(f"{cell}: killed after the survivors' wait: {k[:160]}" for k in killed)
