"""REPORT.md from a run's summary: one function per table, each returning its rows.

The "Headline" table at the top is what the README shows: its rows are rows of the main
table (or of several, world sizes side by side), so the two never disagree.
"""

from __future__ import annotations

import time
from typing import Any

from configuration import (
    AUTH_GOAL_PERCENT,
    BO_E2E_CPU_GOAL,
    BO_GAP_GOAL_MS,
    FOLLOWER_CPU_GOAL_PERCENT,
    GROUP_LAYOUTS,
    HANDOFF_GOAL_MS,
    PAYLOAD_BYTES,
    STEPS_GOAL_MS,
    SYSTEM_LABELS,
    SYSTEMS,
    BenchConfig,
    Mode,
    layout_key,
)
from pool_report import pool_headline_row, pool_section
from tables import Row, Summary, markdown_table, number, verdict

MAIN_HEADER = "metric | neps_bcast (ours) | NePS built-in | built-in / ours | goal"
HANDOFF = "handoff median, NePS trial start -> last follower starts (ms), world {world}"
OVERHEAD = "per-trial control overhead, median (ms), world {world}"
STEPS = "per-trial control steps alone (NePS's report and sampling left out), median (ms), world {world}"
FOLLOWER_CPU = "follower CPU while the leader holds the trial (% of a core), world {world}"


def dig(tree: Any, *keys: str) -> Any:
    """``tree[k1][k2]...``, or None where a key is missing (a system or world not measured)."""
    for key in keys:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def both(summary: Summary, section: tuple[str, ...], *path: str, scale: float = 1.0) -> list[Any]:
    """[ours, built-in]: ``summary[*section][system][*path]`` times ``scale``."""
    values = (dig(summary, *section, system, *path) for system in SYSTEMS)
    return [None if value is None else value * scale for value in values]


def worlds(summary: Summary, section: str = "plain") -> list[str]:
    return sorted(summary.get(section, {}), key=int)


def ratio(numerator: Any, denominator: Any) -> str:
    if not isinstance(numerator, float | int) or not isinstance(denominator, float | int):
        return "n/a"
    return "n/a (ours ~0)" if denominator == 0 else f"{numerator / denominator:.2f}x"


def at_most(value: float | None, limit: float | None, unit: str) -> str:
    """The goal cell of "ours <= limit" (empty where this world size has no goal)."""
    if limit is None:
        return ""
    return f"ours <= {limit:g}{unit}: {verdict(None if value is None else value <= limit)}"


def goals_text(goals: dict[int, float]) -> str:
    """ "world 2 <= 2 ms, world 8 <= 10 ms": a per-world goal in a headline label."""
    return ", ".join(f"world {world} <= {limit:g} ms" for world, limit in goals.items())


def compared(label: str, values: list[Any], digits: int = 2, goal: str = "") -> Row:
    """A row measured for both systems; the ratio is built-in / ours."""
    ours, builtin = values
    return (label, number(ours, digits), number(builtin, digits), ratio(builtin, ours), goal)


# ----------------------------------------------------------------------------- main table
def per_world(
    summary: Summary,
    label: str,
    *path: str,
    digits: int = 2,
    scale: float = 1.0,
    goals: dict[int, float] | None = None,
    unit: str = "",
) -> list[Row]:
    """One row per plain-DDP world size: ``plain[world][system][*path]``, the goal its limit."""
    rows = []
    for world in worlds(summary):
        values = both(summary, ("plain", world), *path, scale=scale)
        goal = at_most(values[0], (goals or {}).get(int(world)), unit)
        rows.append(compared(label.format(world=world), values, digits, goal))
    return rows


def e2e_rows(summary: Summary, config: BenchConfig) -> list[Row]:
    throughput = both(summary, ("e2e",), "trials_per_min")
    return [
        compared(
            f"end to end, {config.e2e_trials} trials, Lightning ddp x2: wall time (s)",
            both(summary, ("e2e",), "wall_s"),
            1,
            "ours <= built-in",
        ),
        compared(
            "end to end: CPU-seconds of all processes (up to the leader's exit)",
            both(summary, ("e2e",), "cpu_s"),
            1,
            "built-in/ours >= 1.3x",
        ),
        (
            "end to end: trials per minute",
            *(number(value, 1) for value in throughput),
            ratio(*throughput) + " (ours/built-in)",
            "",
        ),
        compared(
            "end to end: handoff median (ms), Lightning ddp x2",
            both(summary, ("e2e",), "latency_ms", "median"),
        ),
    ]


def bo_e2e_rows(summary: Summary, config: BenchConfig) -> list[Row]:
    """End to end under Bayesian optimization: wall and CPU, ours against the built-in's."""
    wall = both(summary, ("bo_e2e",), "wall_s")
    cpu = both(summary, ("bo_e2e",), "cpu_s")
    runs = both(summary, ("bo_e2e",), "runs")
    wall_met = None if None in wall else wall[0] <= wall[1]
    cpu_met = None if None in cpu else cpu[0] <= BO_E2E_CPU_GOAL * cpu[1]
    label = (
        f"end to end under Bayesian optimization, {config.bo_e2e_trials} trials, Lightning ddp"
        f" x2, seeded, median of {'/'.join(number(n, 0) for n in runs)} runs:"
    )
    return [
        compared(f"{label} wall time (s)", wall, 1, f"ours <= built-in: {verdict(wall_met)}"),
        compared(
            f"{label} CPU-seconds of all processes",
            cpu,
            1,
            f"ours <= {BO_E2E_CPU_GOAL:g}x built-in: {verdict(cpu_met)}",
        ),
    ]


def bo_row(summary: Summary, config: BenchConfig) -> Row:
    return compared(
        f"Bayesian optimization: time to the next trial at ~{config.bo_trials} trials,"
        " median of last 5 (s), world 2",
        both(summary, ("bo",), "sample_s_last5", "median"),
        3,
    )


def bo_gap_row(summary: Summary) -> Row:
    """Ours minus the built-in's time to the next trial, the same BO step in both (seeded)."""
    gap = dig(summary, "bo_gap", "last5_ms", "median")
    return (
        "Bayesian optimization, seeded alike: ours minus built-in, time to the next trial,"
        " median of the last 5 (ms)",
        number(gap, 1),
        "-",
        "-",
        f"ours <= built-in + {BO_GAP_GOAL_MS:g} ms:"
        f" {verdict(None if gap is None else gap <= BO_GAP_GOAL_MS)}",
    )


def groups_row(summary: Summary, config: BenchConfig) -> Row:
    """Trials per minute of each ``neps-bcast launch`` layout (2x2, 1x4) and their ratio."""
    first, second = (
        dig(summary, "groups", layout_key(*layout), "trials_per_min") for layout in GROUP_LAYOUTS
    )
    label = (
        "trials per minute, 2 groups x 2 ranks / 1 group x 4 ranks (`neps-bcast launch`,"
        f" {config.groups_trials} trials, Lightning ddp on CPU, first trial start -> last trial end)"
    )
    cell = f"{number(first, 1)} / {number(second, 1)}"
    return (label, cell, "-", f"{ratio(first, second)} (2x2 / 1x4)", "")


def main_rows(summary: Summary, config: BenchConfig) -> list[Row]:
    """The main table, top to bottom: world by world, the handoff median then its p95."""
    handoff = per_world(summary, HANDOFF, "all", "median", goals=HANDOFF_GOAL_MS, unit=" ms")
    p95 = per_world(summary, "handoff p95 (ms), world {world}", "all", "p95")
    rows = [row for pair in zip(handoff, p95, strict=True) for row in pair]
    for world in worlds(summary):  # authenticating one 1 KB trial message, % of the handoff
        cost_us = dig(summary, "auth", "median_us")
        handoff_ms = dig(summary, "plain", world, "ours", "all", "median")
        share = None if None in (cost_us, handoff_ms) else 100 * cost_us / (1000 * handoff_ms)
        label = "authenticating a 1 KB trial (HMAC tag + check) as % of the handoff median"
        goal = at_most(share, AUTH_GOAL_PERCENT, "%")
        rows.append((f"{label}, world {world}", number(share), "-", "-", goal))
    for world in worlds(summary, "channel"):
        latency = dig(summary, "channel", world, "latency_ms", "1000") or {}
        label = f"neps_bcast channel alone, median / p95 (ms), world {world}, 1 KB"
        cell = f"{number(latency.get('median'))} / {number(latency.get('p95'))}"
        rows.append((label, cell, "-", "-", ""))
    rows += per_world(summary, OVERHEAD, "overhead_ms", "median")
    rows += per_world(summary, STEPS, "steps_ms", "median", goals=STEPS_GOAL_MS, unit=" ms")
    rows += per_world(
        summary,
        FOLLOWER_CPU,
        *("wait_cpu_per_s", "mean"),
        digits=1,
        scale=100,
        goals=FOLLOWER_CPU_GOAL_PERCENT,
        unit="%",
    )
    rows += e2e_rows(summary, config)
    runs = [summary["reliability"][system] for system in SYSTEMS]
    label = f"reliability: runs completed / lost (Lightning ddp x2, {config.rel_trials}-{config.e2e_trials} trials)"
    cells = [f"{each['completed']}/{each['runs']} / {each['lost']}" for each in runs]
    rows.append((label, *cells, "-", "ours: 0 lost"))
    label = "reliability: runs that left processes alive / processes left"
    cells = [f"{each['runs_with_leftovers']} / {each['left_processes']}" for each in runs]
    rows.append((label, *cells, "-", "ours: 0"))
    label = "reliability: CPU of each left-behind process (% of a core)"
    rows.append((label, *(number(100 * each["left_cpu_per_s"], 0) for each in runs), "-", ""))
    return [
        *rows,
        bo_row(summary, config),
        bo_gap_row(summary),
        *bo_e2e_rows(summary, config),
        groups_row(summary, config),
    ]


# ----------------------------------------------------------------------------- headline
def side_by_side(label: str, rows: list[Row]) -> Row:
    """Several main-table rows as one: each cell's values joined with " / "."""
    return (label, *(" / ".join(row[column] for row in rows) for column in (1, 2, 3)))


def plain_launches(summary: Summary) -> list[tuple[str, dict[str, Any]]]:
    """(what it measured, {system: summary entry}) of every plain-DDP launch."""
    launches = [(f"{world}, 1 KB", summary["plain"][world]) for world in worlds(summary)]
    launches.append(("2, 100 KB + 1 MB", summary["sweep"]))
    return [*launches, ("2, Bayesian optimization", summary["bo"])]


def runs_lost(summary: Summary, system: str) -> str:
    lightning = summary["reliability"][system]
    launches = [by_system[system] for _, by_system in plain_launches(summary)]
    lost = [entry for entry in launches if not entry["completed"]]
    errors = "".join(
        f" (`{error}`)" for error in sorted({entry["error"] for entry in lost if entry["error"]})
    )
    return (
        f"{lightning['lost']} of {lightning['runs']} Lightning,"
        f" {len(lost)} of {len(launches)} plain-DDP{errors}"
    )


def runs_left_behind(summary: Summary, system: str) -> str:
    runs = summary["reliability"][system]
    each = f", each at {100 * runs['left_cpu_per_s']:.0f}% of a core"
    return (
        f"{runs['runs_with_leftovers']} of {runs['runs']}{each if runs['left_processes'] else ''}"
    )


def headline_rows(summary: Summary, config: BenchConfig) -> list[Row]:
    """The README's rows: the main table's figures that say the most, world sizes joined."""
    sizes = " / ".join(worlds(summary))
    cpu = per_world(summary, FOLLOWER_CPU, "wait_cpu_per_s", "mean", digits=1, scale=100)
    return [
        side_by_side(
            HANDOFF.format(world=f"{sizes} (goal: {goals_text(HANDOFF_GOAL_MS)})"),
            per_world(summary, HANDOFF, "all", "median"),
        ),
        side_by_side(
            OVERHEAD.format(world=sizes), per_world(summary, OVERHEAD, "overhead_ms", "median")
        ),
        side_by_side(
            STEPS.format(world=f"{sizes} (goal: {goals_text(STEPS_GOAL_MS)})"),
            per_world(summary, STEPS, "steps_ms", "median"),
        ),
        side_by_side(FOLLOWER_CPU.format(world=sizes), cpu),
        side_by_side(
            f"end to end, {config.e2e_trials} trials, Lightning ddp x2: wall time (s) / CPU-seconds",
            e2e_rows(summary, config)[:2],
        ),
        (
            "runs lost (Lightning ddp x2 runs, plain-DDP runs)",
            *(runs_lost(summary, system) for system in SYSTEMS),
            "-",
        ),
        (
            "Lightning runs that left processes alive",
            *(runs_left_behind(summary, system) for system in SYSTEMS),
            "-",
        ),
        bo_row(summary, config)[:4],
        bo_gap_row(summary)[:4],
        side_by_side(
            f"end to end under Bayesian optimization, {config.bo_e2e_trials} trials, Lightning"
            " ddp x2, seeded: wall time (s) / CPU-seconds",
            bo_e2e_rows(summary, config),
        ),
        groups_row(summary, config)[:4],
        *pool_rows(summary),
    ]


def pool_rows(summary: Summary) -> list[Row]:
    """The right-sized pool's README row, where the run measured it (``--full``)."""
    if "pool" not in summary:
        return []
    return [pool_headline_row(summary)]


def pool_text(summary: Summary) -> str:
    """The right-sized pool's section (``pool_report``), where the run measured it."""
    if "pool" not in summary:
        return ""
    return pool_section(summary) + "\n"


# ----------------------------------------------------------------------------- other tables
def payload_table(summary: Summary) -> str:
    rows = []
    for world in worlds(summary):
        for size in PAYLOAD_BYTES:
            ours, builtin = (
                summary["plain"][world][system]["by_payload"][str(size)] for system in SYSTEMS
            )
            channel = dig(summary, "channel", world, "latency_ms", str(size)) or {}
            rows.append(
                (
                    world,
                    f"{size // 1000} KB",
                    *(f"{number(entry['median'])} (n={entry['n']})" for entry in (ours, builtin)),
                    ratio(builtin["median"], ours["median"]),
                    f"{number(channel.get('median'))} / {number(channel.get('p95'))}",
                )
            )
    header = "world | payload | neps_bcast | NePS built-in | built-in / ours"
    return markdown_table(header + " | neps_bcast channel alone, median / p95", rows)


def launches_table(summary: Summary) -> str:
    """Every plain-DDP launch: did it finish, what did it leave behind, how did it fail."""
    rows = []
    for name, by_system in plain_launches(summary):
        for system in SYSTEMS:
            entry = by_system[system]
            done = entry.get("trials_done", entry.get("neps_successes"))  # the sweep's name
            left = entry["left"]  # the sweep's: the processes themselves
            left_count = len(left) if isinstance(left, list) else left
            completed = "yes" if entry["completed"] else "no"
            row = (name, SYSTEM_LABELS[system], f"{done}/{entry['trials_wanted']}", completed)
            rows.append((*row, str(left_count), entry["error"]))
    header = "world, payload | system | trials done | completed | processes left | error"
    return markdown_table(header, rows)


def groups_table(summary: Summary) -> str:
    """Each ``neps-bcast launch`` layout: runs, throughput both ways, times, workers, leftovers."""
    rows = []
    for groups, nproc_per_group in GROUP_LAYOUTS:
        entry = summary["groups"][layout_key(groups, nproc_per_group)]
        fields = ("trials_per_min", "trials_per_min_wall", "span_s", "wall_s", "cpu_s")
        rows.append(
            (
                f"{groups} x {nproc_per_group}",
                f"{entry['runs']}/{entry['runs_total']}",
                *(number(entry[field], 1) for field in fields),
                ", ".join(map(str, entry["workers"])),
                str(entry["left"]),
                "; ".join(entry["errors"]),
            )
        )
    header = "groups x ranks | runs completed | trials/min (span) | trials/min (wall) | span (s)"
    header += " | wall (s) | CPU-s | NePS workers | processes left | errors"
    return markdown_table(header, rows)


# ----------------------------------------------------------------------------- the document
def render_report(
    summary: Summary, config: BenchConfig, mode: Mode, machine: dict[str, str], seconds: float
) -> str:
    """REPORT.md."""
    lightning_errors = [
        f"- {SYSTEM_LABELS[system]}: `{error}`"
        for system in SYSTEMS
        for error in summary["reliability"][system]["errors"]
    ]
    return f"""# neps_bcast vs NePS built-in DDP mode

Mode: `{mode}`. Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --{mode}`
(`make {"bench" if mode == "quick" else "bench-full"}`); took {seconds / 60:.1f} min.
Machine: {", ".join(f"{key} {value}" for key, value in machine.items())}.
Generated {time.strftime("%Y-%m-%d %H:%M:%S")}. Both systems ran in this one run, interleaved
(for each cell: neps_bcast, then NePS built-in, then the next cell), on the same workloads.

The README's benchmark table is the Headline table below, copied as it is after a run
(with the run's date, mode and machine from above); nothing else generates it.
Ratios are **built-in / ours** (higher = neps_bcast better) unless marked otherwise.

## Headline

Each row is one or more rows of the main table below, world sizes side by side
("world 2 / 8"): the same figures, the same definitions.

{markdown_table(MAIN_HEADER.rpartition(" | ")[0], headline_rows(summary, config))}

## Main table

{markdown_table(MAIN_HEADER, main_rows(summary, config))}

Definitions:
- *handoff*: from the moment the leader's NePS marks the trial as started (`time_started`,
  just before it writes the trial to disk) to the moment the **last** follower enters the
  trial function (CLOCK_REALTIME, same machine). Plain-DDP workload (no Lightning: ranks started
  like torchrun, trivial trial function, random search, 1 KB of trial arguments), first trial excluded. It
  includes NePS writing the trial, so it is a lower bound neither system can beat; the
  *channel alone* rows measure one control step of neps_bcast's channel (an allgather: each follower's frame to the leader, then every frame from the leader to each follower) between real processes without NePS.
- *control overhead*: leader's trial function returned -> last follower entered the next trial
  (NePS bookkeeping + sampling + handoff; for neps_bcast also the end-of-trial exchanges).
- *control steps alone*: the part of the control overhead that is the system's, not NePS's
  worker loop: from the leader's trial function returning to NePS's `evaluate_trial`
  returning (neps_bcast: the trial-end exchange and the lease), plus from NePS calling the
  next `evaluate_trial` to the last follower entering the trial (neps_bcast: the lease, the
  orphan look when due, the handoff; built-in: its followers finding the trial on disk).
  NePS's report, bookkeeping and sampling between the two are left out.
- *end to end under Bayesian optimization*: the end-to-end workload with
  `optimizer="bayesian_optimization"`, every rank seeded with 0 before the search,
  {config.bo_e2e_trials} trials, {config.bo_e2e_runs} run(s) per system, interleaved; medians.
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
  {config.bo_trials} trials, every rank seeded with 0 (random, numpy, torch), so trial n is the
  same BO step in both systems; time from the leader's trial function returning to NePS
  marking the next trial as started, median of the last 5 trials; the gap row is the median
  of ours minus the built-in's, trial by trial.
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

{pool_text(summary)}## Plain-DDP launches

{launches_table(summary)}

Errors seen in the Lightning runs:
{chr(10).join(lightning_errors) or "- none"}

![handoff latency](latency.png)

![follower CPU over time](follower_cpu.png)
"""
