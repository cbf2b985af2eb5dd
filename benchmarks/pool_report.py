"""The right-sized pool section of REPORT.md, its README row and its figure.

``pool_section`` renders the section from ``summary["pool"]`` (``pool_bench.summarize_pool``:
one summary per speedup curve); ``pool_headline_row`` is the one row the README can copy
(the last curve's: D, where memory forces the widths, the case the pool exists for);
``save_pool_plots`` draws,
per curve, device occupancy over time (one row per device, one colour per trial) of the pool
and the best fixed layout to ``results/pool_occupancy_<curve>.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from configuration import (
    POOL_BOUND_GOAL,
    POOL_SCHEDULING_GOAL_MS,
    POOL_UTILIZATION_GOAL,
    RESULTS,
)
from pool_bench import bound_ratio, is_pool
from tables import Row, Summary, markdown_table, number, verdict


def plot_name(curve: str) -> str:
    return f"pool_occupancy_{curve.lower()}.png"


def label(key: str) -> str:
    if key == "pool":
        return "pool"
    if is_pool(key):
        more = key.partition("+")[2]
        return f"pool, {more} more agents than devices (`--agents D+{more}`)"
    return f"{key.replace('x', ' x ')} (fixed)"


def percent(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{100 * value:.{digits}f}%"


def within(value: float | None, limit: float | None, *, at_least: bool = False) -> bool | None:
    """Whether ``value`` meets a goal's ``limit`` (at most, or ``at_least``); None where
    either was not measured."""
    if value is None or limit is None:
        return None
    return value >= limit if at_least else value <= limit


def mix_text(mix: dict[str, int]) -> str:
    """``12x 1 ep on 1, 6x 3 ep on 2``: how many trials of each (epochs, ranks)."""
    return ", ".join(f"{count}x {shape}" for shape, count in mix.items())


def curve_text(pool: Summary) -> str:
    """``Amdahl s = 0.02 per epoch + 1 epoch-time per trial, epochs 1..27`` (and the
    memory model's minimum widths, where the curve has one)."""
    fixed = pool["fixed_epochs"]
    epochs = pool.get("epochs")
    return (
        f"Amdahl s = {pool['serial_fraction']:g} per epoch"
        + (f" + {fixed:g} epoch-time per trial (not parallel)" if fixed else "")
        + (f", epochs 1..{pool['max_epochs']}" if epochs is None else "")
        + (f", {epochs} epochs every trial (no fidelity)" if epochs else "")
        + (f", memory: {memory_text(pool)}" if pool.get("min_ranks") else "")
    )


def memory_text(pool: Summary) -> str:
    """``9 epochs need >= 2 devices, 27 need >= 4``: the steps of the memory model above
    one device."""
    steps = [(bound, ranks) for bound, ranks in pool.get("min_ranks") or () if ranks > 1]
    parts = [f"{bound} need >= {ranks}" for bound, ranks in steps]
    if parts:
        parts[0] = parts[0].replace(" need", " epochs need") + " devices"
    return ", ".join(parts) or "every trial fits on one device"


def feasibility_text(pool: Summary) -> str:
    """Under a curve with a memory model: which fixed layouts were left out and why, and
    how many trials ran out of memory in the launches measured."""
    if not pool.get("min_ranks"):
        return ""
    widest = max(ranks for _, ranks in pool["min_ranks"])
    left_out = ", ".join(key.replace("x", " x ") for key in pool.get("infeasible", []))
    failed = sum(entry.get("trials_out_of_memory", 0) for entry in pool["layouts"].values())
    return (
        f"Memory: {memory_text(pool)}; a trial on fewer fails as out of memory"
        f" (`--min-ranks`). A fixed layout runs every trial on its groups' N ranks, so only"
        f" N >= {widest} is feasible; {left_out or 'none'} left out, not measured (their"
        f" widest trials would run out of memory, and NePS, raising on a trial's error by"
        f" default, would stop the search there)."
        f" Trials that ran out of memory in the launches above: {failed}.\n\n"
    )


def rule_text(pool: Summary) -> str:
    """``1 rank up to 3 epochs, 2 up to 9, 8 up to 27``."""
    parts = [f"{ranks} up to {bound}" for bound, ranks in pool["rule"]]
    first_bound = pool["rule"][0][0]
    parts[0] = parts[0].replace(" up to ", f" rank{'s' if pool['rule'][0][1] > 1 else ''} up to ")
    parts[0] += " epoch" if first_bound == 1 else " epochs"
    return ", ".join(parts)


def pool_headline_row(summary: Summary) -> Row:
    """The README's row (the last curve's): the pool's search wall against the best fixed
    layout's, utilization and scheduling cost (ours column), the wall ratio (ratio column)."""
    pool = summary["pool"]["curves"][-1]
    best = pool["best_fixed"]
    layouts = pool["layouts"]
    ours, fixed = layouts["pool"], layouts.get(best, {}) if best else {}
    goals = pool["goals"]["pool"]
    text = (
        f"{number(ours['search_wall_s'], 1)} s vs {number(fixed.get('search_wall_s'), 1)} s;"
        f" utilization {percent(ours['utilization'])} vs {percent(fixed.get('utilization'))};"
        f" scheduling {number(ours['sched_ms_median'], 0)} ms"
        f" ({number(ours['warm_sched_ms_median'], 0)} ms after each rank's first trial)"
    )
    return (
        f"right-sized pool (`--pool {pool['devices']}`, {pool['devices']} simulated devices,"
        f" curve {pool['curve']}: {curve_text(pool)}, {pool.get('optimizer', 'hyperband')},"
        f" {pool['evaluations']} trials)"
        f" vs the best fixed layout ({best or 'n/a'}): search wall, device utilization,"
        " scheduling cost median",
        text,
        "-",
        f"{number(goals['wall_ratio'])}x (pool / best fixed; pool / its own bound"
        f" {number(bound_ratio(ours))}x, goal <= {POOL_BOUND_GOAL:g}x)",
    )


def layouts_table(pool: Summary) -> str:
    best = pool["best_fixed"]
    best_wall = pool["layouts"].get(best, {}).get("search_wall_s") if best else None
    rows = []
    for key, entry in pool["layouts"].items():
        wall = entry["search_wall_s"]
        ratio = f"{wall / best_wall:.2f}x" if wall is not None and best_wall else "n/a"
        rows.append(
            (
                label(key) + (" (best fixed)" if key == best else ""),
                f"{entry['runs']}/{entry['runs_total']}",
                f"{number(entry['trials_trained'], 0)}: {mix_text(entry['trial_mix'])}",
                number(entry["epochs_total"], 0),
                f"{number(entry['busy_device_s'], 0)} / {number(entry['model_device_s'], 0)}",
                number(entry["wall_bound_s"], 1),
                number(wall, 1),
                ratio,
                f"{number(entry.get('time_to_best_s'), 1)} ({entry.get('best_trial') or 'n/a'})",
                percent(entry["utilization"]),
                number(entry["idle_tail_s"], 1),
                f"{number(entry['startup_s'], 1)} ({number(entry['imports_s'], 1)})",
                number(entry["shutdown_s"], 1),
                number(entry["cpu_s"], 0),
                str(entry["left"]),
                "; ".join(entry["errors"]) or "-",
            )
        )
    header = (
        "layout | runs completed | trials trained: how many of (epochs, ranks) | epochs"
        " | device-s busy / of the curve alone | wall no placement beats (s)"
        " | search wall (s) | / best fixed | best result known at (s) (the trial: epochs on"
        " ranks) | device utilization | idle tail (s)"
        " | start-up, left out (s) (of it: imports) | shutdown (s) | CPU-s of the launch"
        " | processes left | errors"
    )
    return markdown_table(header, rows)


def starts_table(pool: Summary) -> str:
    rows = []
    for key, entry in pool["layouts"].items():
        pooled = is_pool(key)
        rows.append(
            (
                label(key),
                f"{number(entry['start_ms_median'], 1)} / {number(entry['warm_start_ms_median'], 1)}",
                number(entry["agent_ms_median"], 1) if pooled else "-",
                number(entry["wait_ms_median"], 1) if pooled else "-",
                f"{number(entry['sched_ms_median'], 1)} / {number(entry['warm_sched_ms_median'], 1)}"
                f" / {number(entry['sched_ms_max'], 0)}"
                if pooled
                else "-",
                f"{number(entry['sched_to_work_ms_median'], 1)}"
                f" / {number(entry['warm_sched_to_work_ms_median'], 1)}"
                if pooled
                else "-",
                ", ".join(
                    f"{world}: {number(value, 0)}"
                    for world, value in entry["warm_sched_ms_by_world"].items()
                )
                if pooled
                else "-",
            )
        )
    header = (
        "layout | NePS trial start -> last rank in the function, median: all / after each"
        " rank's first trial (ms) | NePS start -> agent asks (ms) | asked -> placed, waiting"
        " for devices (ms) | **scheduling cost**: placed -> last rank in the function, median:"
        " all / after first trials / max (ms) | placed -> last rank's device work starts,"
        " median: all / after first trials (ms) | scheduling cost after first trials by"
        " trial size, ranks: median (ms)"
    )
    return markdown_table(header, rows)


def goal_rows(pool: Summary) -> list[Row]:
    """The three goals of one curve: the measured value, met or not, and the figures that
    say why (the pool's own lower bound, its idle device-seconds, its start by trial size).
    Judged here, the one place, from the figures a summary keeps, so one measured under an
    earlier goal is judged by today's."""
    goal = pool["goals"]["pool"]
    ours = pool["layouts"]["pool"]
    best = pool["best_fixed"]
    best_wall = pool["layouts"].get(best, {}).get("search_wall_s") if best else None
    bound, ratio = ours.get("wall_bound_s"), bound_ratio(ours)
    wall, busy = ours.get("search_wall_s"), ours.get("busy_device_s")
    idle = None if wall is None or busy is None else pool["devices"] * wall - busy
    utilization = goal["utilization"]
    by_world = ", ".join(
        f"{world} ranks: {number(value, 0)} ms"
        for world, value in ours.get("warm_sched_ms_by_world", {}).items()
    )
    return [
        (
            f"curve {pool['curve']}: device utilization >= {POOL_UTILIZATION_GOAL:.0%}",
            f"{percent(utilization, 1)}:"
            f" {verdict(within(utilization, POOL_UTILIZATION_GOAL, at_least=True))}",
            f"{number(idle, 0)} of {number(None if wall is None else pool['devices'] * wall, 0)}"
            f" device-s idle; idle tail {number(ours.get('idle_tail_s'), 1)} s",
        ),
        (
            f"curve {pool['curve']}: search wall <= {POOL_BOUND_GOAL:g}x the pool's own bound",
            f"{number(ratio)}x: {verdict(within(ratio, POOL_BOUND_GOAL))}",
            f"its trials alone need at least {number(bound, 1)} s (wall no placement beats),"
            f" it took {number(wall, 1)} s; the best fixed layout ({best}) took"
            f" {number(best_wall, 1)} s: pool / best fixed {number(goal['wall_ratio'])}x",
        ),
        (
            f"curve {pool['curve']}: scheduling cost median <= {POOL_SCHEDULING_GOAL_MS:g} ms"
            f" + start cost ({number(pool['start_cost_ms'], 1)} ms) ="
            f" {number(goal['sched_limit_ms'], 1)} ms",
            f"{number(goal['sched_ms'], 1)} ms:"
            f" {verdict(within(goal['sched_ms'], goal['sched_limit_ms']))}",
            f"after each rank's first trial {number(ours.get('warm_sched_ms_median'), 1)} ms;"
            f" by trial size: {by_world or 'n/a'}",
        ),
    ]


def goals_table(curves: list[Summary]) -> str:
    rows = [row for pool in curves for row in goal_rows(pool)]
    return markdown_table("goal | pool, measured | why: the figures behind it", rows)


def search_text(pool: Summary) -> str:
    """The search of a curve: hyperband over the fidelity, or an optimizer without one."""
    if pool.get("epochs") is None:
        return f"Fidelity `epochs = neps.IntegerFidelity(1, {pool['max_epochs']})`"
    return (
        f"NePS `optimizer={pool['optimizer']!r}` over two floats, no fidelity: every trial"
        f" {pool['epochs']} epochs (the other launches' agents and groups wait at NePS's lock"
        " to sample)"
    )


def curve_section(pool: Summary) -> str:
    """One curve's subsection: what it is, the layouts, the trial starts, the figure."""
    fixed = pool["fixed_epochs"]
    c_text = (
        f"`{fixed:g} * t_epoch` once (the trial's fixed time: start, data, validation; it does"
        " not parallelize), then per epoch "
        if fixed
        else "per epoch "
    )
    return f"""### Curve {pool["curve"]}: {curve_text(pool)}

A trial of e epochs on k ranks holds its k devices: {c_text}`t_epoch * (s + (1 - s) / k)`
with t_epoch = {pool["t_epoch"]:g} s, s = {pool["serial_fraction"]:g}. {search_text(pool)}, budget
`total_evaluations_to_spend={pool["evaluations"]}`. Pool rule: {rule_text(pool)}.

{layouts_table(pool)}

{feasibility_text(pool)}Starting a trial (per trial, medians; "after first trials" leaves out every trial with a
rank that had trained nothing before):

{starts_table(pool)}

![device occupancy over time, curve {pool["curve"]}]({plot_name(pool["curve"])})
"""


def pool_section(summary: Summary, note: str = "") -> str:
    """The section of REPORT.md (``note``: a paragraph under its title, e.g. where it was
    measured when not in the report's own run)."""
    curves = summary["pool"]["curves"]
    devices = summary["pool"]["devices"]
    names = " and ".join(pool["curve"] for pool in curves)
    return f"""## Right-sized pool vs fixed layouts ({devices} simulated devices)

{note + chr(10) + chr(10) if note else ""}`neps-bcast launch --pool {devices}` against every fixed `--groups G --nproc-per-group N`
with G x N = {devices} (under a memory model, curve D: every feasible one, whose groups
hold the widest trial), per speedup curve ({names}) one launch each, interleaved, the same
search (`benchmarks/workloads/pool_sim.py`): NePS `optimizer=("hyperband", {{"eta": 3}})`
over one float and the fidelity `epochs` (curve BO: Bayesian optimization without a
fidelity, with a second pool launch that samples ahead), a budget of `total_evaluations_to_spend` trials
(in-progress trials count, NePS's default), every layout. The devices are **simulated**
(2 CPU cores): a rank's "training" sleeps for the device time of its curve, and each
epoch all-reduces one float over gloo, so a trial's ranks are one DDP group and a rank
costs no CPU while its device works. In the pool each trial is right-sized by its
fidelity (the curve's rule, stated before measuring: benchmarks/pool_bench.md); in a
fixed layout every trial of a group runs on its N ranks. The script imports torch and
NePS only, so each pool rank imports Lightning's cluster environments inside its first
trial (`neps_bcast.startup.launch.detect`, called per trial by the pool's ranks; a fixed
layout's ranks import them in `neps_bcast.run`, before their first trial): hence the
columns "after first trials".

- *search wall*: the first trial's device work starts -> the last trial's ends (the
  ranks' own records). Every process waits at a start barrier until all of the launch's
  processes have imported torch and NePS, so no trial shares the cores with imports;
  *start-up* (launch -> first device work; of it *imports*: launch -> the last process
  imported) and *shutdown* (last device work -> the launcher exits) are left out.
- *device-s busy*: the ranks' device work, summed (the sleeps and the epochs'
  all-reduces); *of the curve alone*: what the trials trained ask of the curve, the sum
  over trials of k x the trial's device time. *Wall no placement beats*: the larger of
  the curve's device-seconds / {devices} and the longest trial.
- *best result known at*: the search's start (first device work) -> the end of the device
  work of the trial that produced the search's final best objective (NePS's `report.yaml`
  of each trial): when the result was first known. One draw per launch (each launch
  samples its own configurations); n/a for launches measured before it was recorded.
- *device utilization*: busy device-seconds (each rank's device work) / ({devices} x the
  search wall). *idle tail*: from the moment fewer than half the devices are busy for good
  to the end of the search wall.
- *scheduling cost*: from the placement (the agent logs `trial X runs on device(s) ...` on
  the launcher's message, sent right after the ranks' orders) to the last rank of the
  trial entering the function. *Start cost*: what a fixed layout takes to start a trial,
  NePS's `time_started` -> the last rank in the function, median over the fixed layouts'
  trials of the same curve.

Goals (measured, not tuned for), per curve:

{goals_table(curves)}

{chr(10).join(curve_section(pool) for pool in curves)}"""


def splice_section(report: str, section: str) -> str:
    """``report`` with its pool section replaced by ``section`` (appended if it has none)."""
    title = "## Right-sized pool"
    start = report.find(title)
    if start < 0:
        return report.rstrip("\n") + "\n\n" + section
    end = report.find("\n## ", start + len(title))
    rest = report[end + 1 :] if end >= 0 else ""
    return report[:start] + section + ("\n" + rest if rest else "")


# ----------------------------------------------------------------------------- the figure
def plot_occupancy(axes: Any, launch: dict[str, Any], devices: int, title: str) -> None:
    """One row per device, one bar per rank's device work, one colour per trial."""
    import matplotlib.pyplot as plt

    work = launch["work"]
    colors = plt.get_cmap("tab20").colors
    origin = min(row["start"] for row in work)
    order = {trial: index for index, trial in enumerate(dict.fromkeys(r["trial"] for r in work))}
    for row in work:
        color = colors[order[row["trial"]] % len(colors)]
        width = row["end"] - row["start"]
        axes.barh(
            row["device"],
            width,
            left=row["start"] - origin,
            height=0.8,
            color=color,
            edgecolor="black",
            linewidth=0.4,
        )
        if width > 0.6:
            axes.text(
                row["start"] - origin + width / 2,
                row["device"],
                f"{row['epochs']}e",
                ha="center",
                va="center",
                fontsize=6,
            )
    if launch.get("idle_tail_s") is not None and launch.get("search_wall_s"):
        axes.axvline(launch["search_wall_s"] - launch["idle_tail_s"], color="red", ls="--", lw=1)
    axes.set_yticks(range(devices))
    axes.set_ylim(-0.6, devices - 0.4)
    axes.invert_yaxis()
    axes.set_ylabel("device")
    axes.set_title(title, fontsize=10)
    axes.grid(True, axis="x", alpha=0.3)


def save_pool_plots(
    summary: Summary, launches: list[dict[str, Any]], folder: Path = RESULTS
) -> list[Path]:
    """Per curve, ``pool_occupancy_<curve>.png``: the pool and the best fixed layout, on one
    time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for pool in summary["pool"]["curves"]:
        curve = [run for run in launches if run.get("curve", "A") == pool["curve"]]
        keys = [*(key for key in pool["layouts"] if is_pool(key)), pool["best_fixed"]]
        chosen = [
            next((run for run in curve if run["layout"] == key and run["work"]), None)
            for key in keys
        ]
        shown = [(key, run) for key, run in zip(keys, chosen, strict=True) if run is not None]
        if not shown:
            continue
        figure, axes_list = plt.subplots(
            len(shown), 1, figsize=(12, 2.2 + 0.35 * pool["devices"] * len(shown)), sharex=True
        )
        if len(shown) == 1:
            axes_list = [axes_list]
        for axes, (key, run) in zip(axes_list, shown, strict=True):
            title = (
                f"curve {pool['curve']}, {label(key)}"
                f"{' (best fixed layout)' if key == pool['best_fixed'] else ''}:"
                f" search wall {number(run['search_wall_s'], 1)} s, utilization"
                f" {percent(run['utilization'])}, idle tail {number(run['idle_tail_s'], 1)} s"
                " (from the dashed line)"
            )
            plot_occupancy(axes, run, pool["devices"], title)
        axes_list[-1].set_xlabel(
            "seconds since the first trial's device work started (label: epochs of the trial)"
        )
        figure.tight_layout()
        path = folder / plot_name(pool["curve"])
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths
