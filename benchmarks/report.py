"""REPORT.md and the README's benchmark table, from a run's summary.

The main table is data: ``REPORT_ROWS`` lists one ``Metric`` per row (or per row and world
size), each naming how to read a system's value from the summary, how to format it, which
ratio to show and the goal. The README table (``readme_table``) combines the same metrics
across world sizes, so both tables always agree with ``summary_<mode>.json``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from configuration import (
    FOLLOWER_CPU_GOAL_PERCENT,
    GROUP_LAYOUTS,
    HANDOFF_GOAL_MS,
    PAYLOAD_BYTES,
    SYSTEM_LABELS,
    SYSTEMS,
    BenchConfig,
    Mode,
    layout_key,
    make_target,
)

Summary = dict[str, Any]
Cell = float | str | tuple[float | None, ...] | None
"""A metric's value for one system: a number, a pair of numbers (median / p95), or text."""
ValueReader = Callable[[Summary, str, str], Cell]
"""(summary, system, world) -> the value. ``world`` is "" for rows without a world size."""


def dig(tree: Any, *keys: str) -> Any:
    """``tree[k1][k2]...``, or None where a key is missing (a system or world not measured)."""
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def scaled(value: Any, scale: float) -> float | None:
    return None if value is None else value * scale


# ----------------------------------------------------------------------------- formatting
def format_number(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_cell(cell: Cell, digits: int) -> str:
    if isinstance(cell, str):
        return cell
    if isinstance(cell, tuple):
        return " / ".join(format_number(value, digits) for value in cell)
    return format_number(cell, digits)


def format_ratio(numerator: Cell, denominator: Cell, *, short: bool = False) -> str:
    if not isinstance(numerator, float | int) or not isinstance(denominator, float | int):
        return "n/a"
    if denominator == 0:
        return "n/a (ours ~0)"
    ratio = numerator / denominator
    return f"{ratio:.0f}x" if short and ratio >= 10 else f"{ratio:.2f}x"


# ----------------------------------------------------------------------------- row specs
@dataclass(frozen=True)
class AtMost:
    """A goal on neps_bcast's value: at most ``limits[world]`` (or ``limits[0]`` for any)."""

    limits: dict[int, float]
    unit: str

    def limit(self, world: str) -> float | None:
        return self.limits.get(int(world) if world else 0)

    def describe(self, world: str) -> str:
        limit = self.limit(world)
        return "" if limit is None else f"ours <= {limit:g}{self.unit}"

    def verdict(self, ours: Cell, world: str) -> str:
        limit = self.limit(world)
        if limit is None:
            return ""
        if not isinstance(ours, float | int):
            return f"{self.describe(world)}: no data"
        return f"{self.describe(world)}: {'met' if ours <= limit else 'NOT met'}"


@dataclass(frozen=True)
class Metric:
    """One row of the main table; with ``per_world``, one row per measured world size."""

    label: str
    """Row title; may name ``{world}`` and any field of ``BenchConfig``."""
    value: ValueReader
    digits: int = 2
    ratio: Literal["builtin/ours", "ours/builtin", "first/second", "none"] = "builtin/ours"
    """``first/second``: the ours cell is a pair, the ratio is its first over its second
    value, followed by ``ratio_note`` (which says what the two are)."""
    ratio_note: str = ""
    goal: AtMost | str = ""
    per_world: Literal["plain", "channel"] | None = None
    """Which section's world sizes the row repeats over."""
    builtin_applies: bool = True
    """False for neps_bcast-only measurements (the built-in cell shows "-")."""

    def worlds(self, summary: Summary) -> list[str]:
        if self.per_world is None:
            return [""]
        return sorted(summary.get(self.per_world, {}), key=int)

    def cells(self, summary: Summary, world: str) -> tuple[Cell, Cell]:
        ours = self.value(summary, "ours", world)
        builtin = self.value(summary, "builtin", world) if self.builtin_applies else "-"
        return ours, builtin

    def ratio_text(self, ours: Cell, builtin: Cell, *, short: bool = False) -> str:
        if self.ratio == "builtin/ours":
            return format_ratio(builtin, ours, short=short)
        if self.ratio == "ours/builtin":
            return format_ratio(ours, builtin, short=short) + ("" if short else " (ours/built-in)")
        if self.ratio == "first/second":
            first, second = ours if isinstance(ours, tuple) else (None, None)
            return f"{format_ratio(first, second, short=short)} ({self.ratio_note})"
        return "-"

    def goal_text(self, ours: Cell, world: str) -> str:
        return self.goal.verdict(ours, world) if isinstance(self.goal, AtMost) else self.goal


def plain(*path: str, scale: float = 1.0) -> ValueReader:
    """A value from the plain-DDP section: ``plain[world][system][path...]``."""
    return lambda summary, system, world: scaled(dig(summary, "plain", world, system, *path), scale)


def section(name: str, *path: str, scale: float = 1.0) -> ValueReader:
    """A value from a per-system section: ``summary[name][system][path...]``."""
    return lambda summary, system, world: scaled(dig(summary, name, system, *path), scale)


def channel_median_p95(summary: Summary, system: str, world: str) -> Cell:
    latency = dig(summary, "channel", world, "latency_ms", "1000") or {}
    return (latency.get("median"), latency.get("p95"))


def completed_and_lost(summary: Summary, system: str, world: str) -> Cell:
    runs = summary["reliability"][system]
    return f"{runs['completed']}/{runs['runs']} / {runs['lost']}"


def runs_and_processes_left(summary: Summary, system: str, world: str) -> Cell:
    runs = summary["reliability"][system]
    return f"{runs['runs_with_leftovers']} / {runs['left_processes']}"


HANDOFF_GOAL = AtMost(dict(HANDOFF_GOAL_MS), " ms")

HANDOFF = Metric(
    "handoff median, NePS trial start -> last follower starts (ms), world {world}",
    plain("all", "median"),
    goal=HANDOFF_GOAL,
    per_world="plain",
)
HANDOFF_P95 = Metric("handoff p95 (ms), world {world}", plain("all", "p95"), per_world="plain")
CHANNEL = Metric(
    "neps_bcast channel alone, median / p95 (ms), world {world}, 1 KB",
    channel_median_p95,
    ratio="none",
    per_world="channel",
    builtin_applies=False,
)
OVERHEAD = Metric(
    "per-trial control overhead, median (ms), world {world}",
    plain("overhead_ms", "median"),
    per_world="plain",
)
FOLLOWER_CPU = Metric(
    "follower CPU while the leader holds the trial (% of a core), world {world}",
    plain("wait_cpu_per_s", "mean", scale=100),
    digits=1,
    goal=AtMost(dict(FOLLOWER_CPU_GOAL_PERCENT), "%"),
    per_world="plain",
)
E2E_WALL = Metric(
    "end to end, {e2e_trials} trials, Lightning ddp x2: wall time (s)",
    section("e2e", "wall_s"),
    digits=1,
    goal="ours <= built-in",
)
E2E_CPU = Metric(
    "end to end: CPU-seconds of all processes (up to the leader's exit)",
    section("e2e", "cpu_s"),
    digits=1,
    goal="built-in/ours >= 1.3x",
)
E2E_THROUGHPUT = Metric(
    "end to end: trials per minute",
    section("e2e", "trials_per_min"),
    digits=1,
    ratio="ours/builtin",
)
E2E_HANDOFF = Metric(
    "end to end: handoff median (ms), Lightning ddp x2", section("e2e", "latency_ms", "median")
)
RUNS_COMPLETED = Metric(
    "reliability: runs completed / lost (Lightning ddp x2, {rel_trials}-{e2e_trials} trials)",
    completed_and_lost,
    ratio="none",
    goal="ours: 0 lost",
)
RUNS_LEFT = Metric(
    "reliability: runs that left processes alive / processes left",
    runs_and_processes_left,
    ratio="none",
    goal="ours: 0",
)
LEFT_CPU = Metric(
    "reliability: CPU of each left-behind process (% of a core)",
    section("reliability", "left_cpu_per_s", scale=100),
    digits=0,
    ratio="none",
)
NEXT_TRIAL = Metric(
    "Bayesian optimization: time to the next trial at ~{bo_trials} trials,"
    " median of last 5 (s), world 2",
    section("bo", "sample_s_last5", "median"),
    digits=3,
)


def auth_share(summary: Summary, system: str, world: str) -> Cell:
    """Authenticating one trial message (tag + check), as % of the handoff median."""
    cost_us = dig(summary, "auth", "median_us")
    handoff_ms = dig(summary, "plain", world, "ours", "all", "median")
    if not isinstance(cost_us, float | int) or not isinstance(handoff_ms, float | int):
        return None
    return 100 * cost_us / (1000 * handoff_ms)


AUTH = Metric(
    "authenticating a 1 KB trial (HMAC tag + check) as % of the handoff median, world {world}",
    auth_share,
    digits=2,
    ratio="none",
    goal=AtMost({2: 5.0, 4: 5.0, 8: 5.0}, "%"),
    per_world="plain",
    builtin_applies=False,
)


def groups_throughput(summary: Summary, system: str, world: str) -> Cell:
    """Trials per minute of each ``neps-bcast launch`` layout: (2x2, 1x4)."""
    return tuple(
        dig(summary, "groups", layout_key(*layout), "trials_per_min") for layout in GROUP_LAYOUTS
    )


GROUPS = Metric(
    "trials per minute, 2 groups x 2 ranks / 1 group x 4 ranks (`neps-bcast launch`,"
    " {groups_trials} trials, Lightning ddp on CPU, first trial start -> last trial end)",
    groups_throughput,
    digits=1,
    ratio="first/second",
    ratio_note="2x2 / 1x4",
    builtin_applies=False,
)
REPORT_ROWS: tuple[tuple[Metric, ...], ...] = (
    (HANDOFF, HANDOFF_P95),
    (AUTH,),
    (CHANNEL,),
    (OVERHEAD,),
    (FOLLOWER_CPU,),
    (E2E_WALL,),
    (E2E_CPU,),
    (E2E_THROUGHPUT,),
    (E2E_HANDOFF,),
    (RUNS_COMPLETED,),
    (RUNS_LEFT,),
    (LEFT_CPU,),
    (NEXT_TRIAL,),
    (GROUPS,),
)
"""The main table of REPORT.md, top to bottom. Each group repeats world by world: for
world 2 the handoff median then its p95, then the same for world 4, and so on."""


# ----------------------------------------------------------------------------- tables
def label_fields(summary: Summary, config: BenchConfig) -> dict[str, Any]:
    """What a row label may name: every ``BenchConfig`` field and ``runs`` (Lightning runs)."""
    return {**asdict(config), "runs": dig(summary, "reliability", "ours", "runs")}


def markdown_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


MAIN_HEADER = ("metric", "neps_bcast (ours)", "NePS built-in", "built-in / ours", "goal")


def metric_row(
    metric: Metric, summary: Summary, fields: dict[str, Any], world: str = ""
) -> tuple[str, ...]:
    """One row of the main table (``MAIN_HEADER``'s columns)."""
    ours, builtin = metric.cells(summary, world)
    return (
        metric.label.format(**fields, world=world),
        format_cell(ours, metric.digits),
        format_cell(builtin, metric.digits),
        metric.ratio_text(ours, builtin),
        metric.goal_text(ours, world),
    )


def main_table(summary: Summary, config: BenchConfig) -> str:
    fields = label_fields(summary, config)
    rows = [
        metric_row(metric, summary, fields, world)
        for group in REPORT_ROWS
        for world in group[0].worlds(summary)
        for metric in group
    ]
    return markdown_table(MAIN_HEADER, rows)


def payload_table(summary: Summary) -> str:
    rows = []
    for world in sorted(summary["plain"], key=int):
        for size in PAYLOAD_BYTES:
            ours, builtin = (
                dig(summary, "plain", world, system, "by_payload", str(size)) or {}
                for system in SYSTEMS
            )
            channel = dig(summary, "channel", world, "latency_ms", str(size)) or {}
            rows.append(
                (
                    world,
                    f"{size // 1000} KB",
                    f"{format_number(ours.get('median'))} (n={ours.get('n', 0)})",
                    f"{format_number(builtin.get('median'))} (n={builtin.get('n', 0)})",
                    format_ratio(builtin.get("median"), ours.get("median")),
                    f"{format_number(channel.get('median'))} / {format_number(channel.get('p95'))}",
                )
            )
    header = (
        "world",
        "payload",
        "neps_bcast",
        "NePS built-in",
        "built-in / ours",
        "neps_bcast channel alone, median / p95",
    )
    return markdown_table(header, rows)


def launches_table(summary: Summary) -> str:
    """Every plain-DDP launch: did it finish, what did it leave behind, how did it fail."""
    launches = [
        (f"{world}, 1 KB", system, dig(summary, "plain", world, system))
        for world in sorted(summary["plain"], key=int)
        for system in SYSTEMS
    ]
    launches += [("2, 100 KB + 1 MB", system, dig(summary, "sweep", system)) for system in SYSTEMS]
    launches += [
        ("2, Bayesian optimization", system, dig(summary, "bo", system)) for system in SYSTEMS
    ]
    rows = []
    for name, system, entry in launches:
        found = entry or {}
        left = found.get("left")
        rows.append(
            (
                name,
                SYSTEM_LABELS[system],
                f"{found.get('trials_done', found.get('neps_successes'))}/{found.get('trials_wanted', '?')}",
                "yes" if found.get("completed") else "no",
                str(len(left) if isinstance(left, list) else left if left is not None else "?"),
                found.get("error") or "",
            )
        )
    header = ("world, payload", "system", "trials done", "completed", "processes left", "error")
    return markdown_table(header, rows)


def groups_table(summary: Summary) -> str:
    """Each ``neps-bcast launch`` layout: runs, throughput both ways, times, workers, leftovers."""
    rows = []
    for groups, nproc_per_group in GROUP_LAYOUTS:
        entry = dig(summary, "groups", layout_key(groups, nproc_per_group))
        if entry is None:
            continue
        rows.append(
            (
                f"{groups} x {nproc_per_group}",
                f"{entry['runs']}/{entry['runs_total']}",
                format_number(entry["trials_per_min"], 1),
                format_number(entry["trials_per_min_wall"], 1),
                format_number(entry["span_s"], 1),
                format_number(entry["wall_s"], 1),
                format_number(entry["cpu_s"], 1),
                ", ".join(map(str, entry["workers"])),
                str(entry["left"]),
                "; ".join(entry["errors"]),
            )
        )
    header = (
        "groups x ranks",
        "runs completed",
        "trials/min (span)",
        "trials/min (wall)",
        "span (s)",
        "wall (s)",
        "CPU-s",
        "NePS workers",
        "processes left",
        "errors",
    )
    return markdown_table(header, rows) if rows else "Not measured in this run."


def goal_lines(summary: Summary) -> list[str]:
    """One line per world size with a handoff goal: the figure next to its goal."""
    lines = []
    for world, limit in sorted(HANDOFF_GOAL_MS.items()):
        ours, builtin = HANDOFF.cells(summary, str(world))
        lines.append(
            f"handoff median, world {world}: ours {format_cell(ours, 2)} ms,"
            f" built-in {format_cell(builtin, 2)} ms (built-in / ours"
            f" {HANDOFF.ratio_text(ours, builtin)}); goal <= {limit:g} ms:"
            f" {HANDOFF_GOAL.verdict(ours, str(world)).rpartition(': ')[2]}"
        )
    return lines


# ----------------------------------------------------------------------------- documents
def render_report(
    summary: Summary, config: BenchConfig, mode: Mode, machine: dict[str, str], seconds: float
) -> str:
    """REPORT.md."""
    lightning_errors = [
        f"- {SYSTEM_LABELS[system]}: `{error}`"
        for system in SYSTEMS
        for error in summary["reliability"][system]["errors"]
    ]
    goals = "\n".join(f"- {line}" for line in goal_lines(summary))
    return f"""# neps_bcast vs NePS built-in DDP mode

Mode: `{mode}`. Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --{mode}`
(`make {make_target(mode)}`); took {seconds / 60:.1f} min.
Machine: {", ".join(f"{key} {value}" for key, value in machine.items())}.
Generated {time.strftime("%Y-%m-%d %H:%M:%S")}. Both systems ran in this one run, interleaved
(for each cell: neps_bcast, then NePS built-in, then the next cell), on the same workloads.

Handoff against the goal (issue 8):
{goals}

Ratios are **built-in / ours** (higher = neps_bcast better) unless marked otherwise.

{main_table(summary, config)}

Definitions:
- *handoff*: from the moment the leader's NePS marks the trial as started (`time_started`,
  just before it writes the trial to disk) to the moment the **last** follower enters the
  trial function (CLOCK_REALTIME, same machine). Plain-DDP workload (no Lightning: ranks started
  like torchrun, trivial trial function, random search, 1 KB of trial arguments), first trial excluded. It
  includes NePS writing the trial, so it is a lower bound neither system can beat; the
  *channel alone* rows measure neps_bcast's broadcast between real processes without NePS.
- *control overhead*: leader's trial function returned -> last follower entered the next trial
  (NePS bookkeeping + sampling + handoff; for neps_bcast also the end-of-trial exchanges).
- *follower CPU while waiting*: the leader sleeps {config.hold} s inside a trial after the
  followers returned; CPU-seconds per wall-second of each follower from `/proc/<pid>/stat`
  (utime+stime, sampled every 0.2 s), mean over followers.
- *end to end*: `benchmarks/workloads/lightning_search.py` (Lightning `strategy="ddp"`, `devices=2`, CPU,
  tiny MLP, 1 epoch, random search), {config.e2e_trials} trials; wall from launch to the
  leader's exit; CPU = all processes of the launch (found by a marker in their environment)
  up to the leader's exit.
- *reliability*: every Lightning launch of this run (end to end + {config.rel_runs} more
  runs of {config.rel_trials} trials per system). Lost = non-zero exit, deadline, or fewer
  successful trials than asked. Left = processes of the launch alive 5 s after the leader
  exited; each was measured for 2 s, then killed by PID.
- *Bayesian optimization*: plain-DDP workload, world 2, `optimizer="bayesian_optimization"`,
  {config.bo_trials} trials; time from the leader's trial function returning to NePS marking the
  next trial as started, median of the last 5 trials.
- *2 groups x 2 ranks / 1 group x 4 ranks*: `neps-bcast launch --groups K --nproc-per-group N
  benchmarks/workloads/groups_search.py` with (K, N) = (2, 2) and (1, 4), the same 4 CPU ranks either way,
  {config.groups_trials} trials (`total_evaluations_to_spend`), {config.groups_runs} run(s) per
  layout, interleaved. Each trial is Lightning `strategy="ddp"`, one epoch of the same 8192
  samples in global batches of 64 (128 steps per rank in both layouts), MLP 8-256-256-1,
  random search over the learning rate. Trials per minute = NePS's successful trials / (last
  `time_end` - first `time_started` in the trials' `metadata.json`), median over completed
  runs; the ratio is 2x2 / 1x4 (higher = two groups search faster). neps_bcast only: NePS's
  built-in mode has no launcher for several groups.

## Handoff by payload (plain-DDP workload, median ms)

The trial's arguments include a string of this size (a `Categorical` choice), so it travels
with the trial: neps_bcast broadcasts it, NePS's followers read it from the trial file.

{payload_table(summary)}

## 2 groups x 2 ranks vs 1 group x 4 ranks (`neps-bcast launch`)

Trials/min (span): between the first trial's start and the last trial's end (the main
table's figure); trials/min (wall): over the whole launch, imports and shutdown included.

{groups_table(summary)}

## Plain-DDP launches

{launches_table(summary)}

Errors seen in the Lightning runs:
{chr(10).join(lightning_errors) or "- none"}

![handoff latency](latency.png)

![follower CPU over time](follower_cpu.png)
"""
