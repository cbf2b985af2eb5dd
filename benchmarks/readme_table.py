"""The README's benchmark table, regenerated from a ``summary_<mode>.json``.

    .venv/bin/python benchmarks/run.py --readme-table benchmarks/results/summary_full.json

Each README row combines metrics of REPORT.md's main table (``report.Metric``) across world
sizes ("3.5 / 5.6 / 14.6"), so the README and the report always show the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from configuration import HANDOFF_GOAL_MS, BenchConfig, Mode, make_target
from report import (
    E2E_CPU,
    E2E_WALL,
    FOLLOWER_CPU,
    GROUPS,
    HANDOFF,
    NEXT_TRIAL,
    OVERHEAD,
    Cell,
    Metric,
    Summary,
    dig,
    format_cell,
    label_fields,
    markdown_table,
)


def channel_median(summary: Summary, system: str, world: str) -> Cell:
    return dig(summary, "channel", world, "latency_ms", "1000", "median")


def lightning_runs_left_behind(summary: Summary, system: str, world: str) -> Cell:
    runs = summary["reliability"][system]
    text = f"{runs['runs_with_leftovers']} of {runs['runs']}"
    if runs["left_processes"]:
        text += f", each spinning at {100 * runs['left_cpu_per_s']:.0f}% of a core"
    return text


def plain_launches(summary: Summary, system: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, summary entry) of every plain-DDP launch of one system."""
    launches = [
        (f"world {world}", dig(summary, "plain", world, system))
        for world in sorted(summary["plain"], key=int)
    ]
    launches.append(("large-payload", dig(summary, "sweep", system)))
    launches.append(("Bayesian-optimization", dig(summary, "bo", system)))
    return [(name, entry) for name, entry in launches if entry is not None]


def runs_lost(summary: Summary, system: str, world: str) -> Cell:
    lightning = summary["reliability"][system]
    launches = plain_launches(summary, system)
    lost = [(name, entry) for name, entry in launches if not entry["completed"]]
    text = f"{lightning['lost']} of {lightning['runs']} Lightning, {len(lost)} of {len(launches)} plain-DDP"
    for name, entry in lost:
        done = entry.get("trials_done", entry.get("neps_successes"))
        wanted = entry.get("trials_wanted", "?")
        text += f"; the {name} run died with {done}/{wanted} trials done (`{entry['error']}`)"
    return text


CHANNEL_MEDIAN = Metric(
    "neps_bcast channel alone, broadcast median (ms), 1 KB, world {worlds}",
    channel_median,
    ratio="none",
    per_world="channel",
    builtin_applies=False,
)
LIGHTNING_LEFT = Metric(
    "Lightning runs left processes alive ({runs} runs x {rel_trials}-{e2e_trials} trials)",
    lightning_runs_left_behind,
    ratio="none",
)
LOST = Metric(
    "runs lost ({runs} Lightning runs + plain-DDP runs)", runs_lost, ratio="none", goal="ours: 0"
)


@dataclass(frozen=True)
class ReadmeRow:
    """One README row: one or more metrics, each over its world sizes, joined with " / "."""

    label: str
    """May name ``{worlds}`` (the first part's world sizes, "2 / 4 / 8"), ``{handoff_goal}``,
    ``{runs}`` and any field of ``BenchConfig``."""
    parts: tuple[Metric, ...]
    digits: int
    needs: str | None = None
    """A summary section the row needs; summaries written before it existed skip the row."""


README_ROWS: tuple[ReadmeRow, ...] = (
    ReadmeRow(
        "follower CPU while the leader holds the trial (% of a core), world {worlds}",
        (FOLLOWER_CPU,),
        digits=1,
    ),
    ReadmeRow(LIGHTNING_LEFT.label, (LIGHTNING_LEFT,), digits=0),
    ReadmeRow(LOST.label, (LOST,), digits=0),
    ReadmeRow(
        "handoff median, NePS trial start -> last follower starts (ms), world {worlds}"
        " (goal: {handoff_goal})",
        (HANDOFF,),
        digits=1,
    ),
    ReadmeRow("per-trial control overhead, median (ms), world {worlds}", (OVERHEAD,), digits=0),
    ReadmeRow(CHANNEL_MEDIAN.label, (CHANNEL_MEDIAN,), digits=2),
    ReadmeRow(
        "Bayesian optimization: time to the next trial at ~{bo_trials} trials (s), world 2",
        (NEXT_TRIAL,),
        digits=2,
    ),
    ReadmeRow(
        "end to end, {e2e_trials} trials, Lightning ddp x2: wall time (s) / CPU-seconds",
        (E2E_WALL, E2E_CPU),
        digits=1,
    ),
    ReadmeRow(
        "`neps-bcast launch`, {groups_trials} trials, Lightning ddp on 4 CPU ranks: trials per"
        " minute, 2 groups x 2 ranks / 1 group x 4 ranks",
        (GROUPS,),
        digits=1,
        needs="groups",
    ),
)


def join_parts(parts: list[str]) -> str:
    """ "a / b / c", or a single "-" when no part applies."""
    return "-" if set(parts) == {"-"} else " / ".join(parts)


def readme_table(summary: Summary, config: BenchConfig) -> str:
    """The README's benchmark table: world sizes side by side, ratios rounded for reading."""
    handoff_goal = ", ".join(
        f"world {world} <= {limit:g} ms" for world, limit in sorted(HANDOFF_GOAL_MS.items())
    )
    fields = {**label_fields(summary, config), "handoff_goal": handoff_goal}
    rows = []
    for readme_row in README_ROWS:
        if readme_row.needs is not None and not summary.get(readme_row.needs):
            continue
        worlds = " / ".join(readme_row.parts[0].worlds(summary))
        ours_parts, builtin_parts, ratio_parts = [], [], []
        for metric in readme_row.parts:
            for world in metric.worlds(summary):
                ours, builtin = metric.cells(summary, world)
                ours_parts.append(format_cell(ours, readme_row.digits))
                builtin_parts.append(format_cell(builtin, readme_row.digits))
                ratio_parts.append(metric.ratio_text(ours, builtin, short=True))
        rows.append(
            (
                readme_row.label.format(**fields, worlds=worlds),
                join_parts(ours_parts),
                join_parts(builtin_parts),
                join_parts(ratio_parts),
            )
        )
    return markdown_table(("metric", "neps_bcast", "NePS built-in", "built-in / ours"), rows)


def readme_section(document: dict[str, Any]) -> str:
    """The README's benchmark paragraph head and table, from a ``summary_<mode>.json``."""
    mode: Mode = document["mode"]
    machine = document["machine"]
    config = BenchConfig.from_json(document["config"])
    intro = (
        f"Latest {mode} run (`make {make_target(mode)}`, {document['seconds'] / 60:.1f} min;"
        f" {machine['nproc']}-core {machine['cpu']}, torch {machine['torch']},"
        f" Lightning {machine['lightning']}, NePS {machine['neps']}):"
    )
    return f"{intro}\n\n{readme_table(document['summary'], config)}\n"
