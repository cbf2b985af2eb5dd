"""The right-sized pool section of REPORT.md, its README row and its figure.

``pool_section`` renders the section from ``summary["pool"]`` (``pool_bench.summarize_pool``);
``pool_headline_row`` is the one row the README can copy; ``save_pool_plot`` draws device
occupancy over time (one row per device, one colour per trial) of the pools and the best
fixed layout to ``results/pool_occupancy.png``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from configuration import (
    POOL_SCHEDULING_GOAL_MS,
    POOL_UTILIZATION_GOAL,
    POOL_WALL_GOAL,
    RESULTS,
)
from pool_bench import POOL_LABELS, POOL_VARIANTS, is_pool
from report import Row, markdown_table, number, verdict

Summary = dict[str, Any]
PLOT_NAME = "pool_occupancy.png"


def label(key: str) -> str:
    return POOL_LABELS.get(key, f"{key.replace('x', ' x ')} (fixed)")


def percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def mix_text(mix: dict[str, int]) -> str:
    """``12x 1 ep on 1, 6x 3 ep on 2``: how many trials of each (epochs, ranks)."""
    return ", ".join(f"{count}x {shape}" for shape, count in mix.items())


def pool_headline_row(summary: Summary) -> Row:
    """The README's row: the pool's search wall against the best fixed layout's, utilization
    and scheduling cost (ours column), the wall ratio (ratio column)."""
    pool = summary["pool"]
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
        f" hyperband, {pool['evaluations']} trials) vs the best fixed layout"
        f" ({best or 'n/a'}): search wall, device utilization, scheduling cost median",
        text,
        "-",
        f"{number(goals['wall_ratio'])}x (pool / best fixed; goal <= {POOL_WALL_GOAL:g}x)",
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
        " | search wall (s) | / best fixed | device utilization | idle tail (s)"
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


def goals_table(pool: Summary) -> str:
    rows = []
    goals = pool["goals"]
    keys = list(POOL_VARIANTS)
    rows.append(
        (
            f"device utilization >= {POOL_UTILIZATION_GOAL:.0%}",
            *(
                f"{percent(goals[key]['utilization'])}: {verdict(goals[key]['utilization_met'])}"
                for key in keys
            ),
        )
    )
    rows.append(
        (
            f"search wall <= {POOL_WALL_GOAL:g}x the best fixed layout's ({pool['best_fixed']})",
            *(
                f"{number(goals[key]['wall_ratio'])}x: {verdict(goals[key]['wall_met'])}"
                for key in keys
            ),
        )
    )
    rows.append(
        (
            f"scheduling cost median <= {POOL_SCHEDULING_GOAL_MS:g} ms + start cost"
            f" ({number(pool['start_cost_ms'], 1)} ms) ="
            f" {number(goals['pool']['sched_limit_ms'], 1)} ms",
            *(
                f"{number(goals[key]['sched_ms'], 1)} ms: {verdict(goals[key]['sched_met'])}"
                for key in keys
            ),
        )
    )
    return markdown_table("goal | " + " | ".join(label(key) for key in keys), rows)


def pool_section(summary: Summary, note: str = "") -> str:
    """The section of REPORT.md (``note``: a paragraph under its title, e.g. where it was
    measured when not in the report's own run)."""
    pool = summary["pool"]
    devices = pool["devices"]
    s = pool["serial_fraction"]
    return f"""## Right-sized pool vs fixed layouts ({devices} simulated devices)

{note + chr(10) + chr(10) if note else ""}`neps-bcast launch --pool {devices}` against every fixed `--groups G --nproc-per-group N`
with G x N = {devices}, one launch each, interleaved, the same search
(`benchmarks/workloads/pool_sim.py`): NePS `optimizer=("hyperband", {{"eta": 3}})`,
fidelity `epochs = neps.IntegerFidelity(1, 9)`, budget `total_evaluations_to_spend=
{pool["evaluations"]}` (in-progress trials count, NePS's default), every layout. The
devices are **simulated** (2 CPU cores): an epoch on k ranks sleeps
`t_epoch * (s + (1 - s) / k)` with t_epoch = {pool["t_epoch"]:g} s and serial fraction
s = {s:g} (Amdahl), then all-reduces one float over gloo, so the ranks are one DDP group
and a rank costs no CPU while its device works. In the pool each trial is right-sized by
its fidelity: 1 rank for 1 epoch, 2 for 3, 4 for 9; in a fixed layout every trial of a
group runs on its N ranks. The script imports torch and NePS only, so each pool rank
imports Lightning's cluster environments inside its first trial
(`neps_bcast.startup.launch.detect`, called per trial by the pool's ranks; a fixed
layout's ranks import them in `neps_bcast.run`, before their first trial): hence the
columns "after first trials".

- *search wall*: the first trial's device work starts -> the last trial's ends (the
  ranks' own records). Every process waits at a start barrier until all of the launch's
  processes have imported torch and NePS, so no trial shares the cores with imports;
  *start-up* (launch -> first device work; of it *imports*: launch -> the last process
  imported) and *shutdown* (last device work -> the launcher exits) are left out.
- *device-s busy*: the ranks' device work, summed (the sleeps and the epochs'
  all-reduces); *of the curve alone*: what the trials trained ask of Amdahl's curve,
  sum of epochs x t_epoch x (s + (1 - s) / k) x k. *Wall no placement beats*: the larger
  of the curve's device-seconds / {devices} and the longest trial.
- *device utilization*: busy device-seconds (each rank's device work) / ({devices} x the
  search wall). *idle tail*: from the moment fewer than half the devices are busy for good
  to the end of the search wall.
- *scheduling cost*: from the placement (the agent logs `trial X runs on device(s) ...` on
  the launcher's message, sent right after the ranks' orders) to the last rank of the
  trial entering the function. *Start cost*: what a fixed layout takes to start a trial,
  NePS's `time_started` -> the last rank in the function, median over the fixed layouts'
  trials.

{layouts_table(pool)}

Starting a trial (per trial, medians; "after first trials" leaves out every trial with a
rank that had trained nothing before):

{starts_table(pool)}

Goals (measured, not tuned for):

{goals_table(pool)}

![device occupancy over time]({PLOT_NAME})
"""


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


def save_pool_plot(
    summary: Summary, launches: list[dict[str, Any]], folder: Path = RESULTS
) -> Path:
    """``pool_occupancy.png``: the pools and the best fixed layout, on one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pool = summary["pool"]
    keys = [*POOL_VARIANTS, pool["best_fixed"]]
    chosen = [
        next((run for run in launches if run["layout"] == key and run["work"]), None)
        for key in keys
    ]
    shown = [(key, run) for key, run in zip(keys, chosen, strict=True) if run is not None]
    figure, axes_list = plt.subplots(
        len(shown), 1, figsize=(12, 2.2 + 0.35 * pool["devices"] * len(shown)), sharex=True
    )
    if len(shown) == 1:
        axes_list = [axes_list]
    for axes, (key, run) in zip(axes_list, shown, strict=True):
        title = (
            f"{label(key)}{' (best fixed layout)' if key == pool['best_fixed'] else ''}:"
            f" search wall {number(run['search_wall_s'], 1)} s, utilization"
            f" {percent(run['utilization'])}, idle tail {number(run['idle_tail_s'], 1)} s"
            " (from the dashed line)"
        )
        plot_occupancy(axes, run, pool["devices"], title)
    axes_list[-1].set_xlabel(
        "seconds since the first trial's device work started (label: epochs of the trial)"
    )
    figure.tight_layout()
    path = folder / PLOT_NAME
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
