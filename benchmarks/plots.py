"""The two figures of REPORT.md and the README: handoff latency and follower CPU over time.

``latency.png``: handoff by world size (median and p95, with the channel alone) and by
payload size. ``follower_cpu.png``: rank 1's CPU use over a plain run (the leader's hold
shaded) and over an end-to-end Lightning run (the leader's exit dotted).
"""

from __future__ import annotations

import itertools
from typing import Any

from configuration import PAYLOAD_BYTES, RESULTS, SYSTEM_LABELS

SYSTEM_COLORS = {"ours": "tab:blue", "builtin": "tab:red"}
NAN = float("nan")


def or_nan(values: list[float | None]) -> list[float]:
    return [NAN if value is None else value for value in values]


def plot_handoff_by_world(axes: Any, summary: dict[str, Any]) -> None:
    plain = summary["plain"]
    for system, color in SYSTEM_COLORS.items():
        worlds = sorted(int(world) for world in plain if system in plain[world])
        for statistic, style, alpha in (("median", "o-", 1.0), ("p95", "o--", 0.6)):
            axes.plot(
                worlds,
                or_nan([plain[str(world)][system]["all"][statistic] for world in worlds]),
                style,
                color=color,
                alpha=alpha,
                label=f"{SYSTEM_LABELS[system]} {statistic}",
            )
    channel_worlds = sorted(int(world) for world in summary["channel"])
    axes.plot(
        channel_worlds,
        or_nan(
            [
                summary["channel"][str(world)]["latency_ms"].get("1000", {}).get("median")
                for world in channel_worlds
            ]
        ),
        "s:",
        color="tab:green",
        label="neps_bcast channel alone (1 KB)",
    )
    axes.set(xticks=[2, 4, 8], xlabel="world size (processes)", yscale="log")
    axes.set_ylabel("handoff latency (ms, log)")
    axes.set_title("Trial start -> last follower starts (plain DDP)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)


def plot_handoff_by_payload(axes: Any, summary: dict[str, Any]) -> None:
    for world, marker in (("2", "o"), ("4", "s"), ("8", "^")):
        if world not in summary["plain"]:
            continue
        for system, color in SYSTEM_COLORS.items():
            by_payload = summary["plain"][world].get(system, {}).get("by_payload", {})
            axes.plot(
                [size / 1000 for size in PAYLOAD_BYTES],
                or_nan([by_payload.get(str(size), {}).get("median") for size in PAYLOAD_BYTES]),
                marker=marker,
                color=color,
                linestyle="-" if system == "ours" else "--",
                label=f"{SYSTEM_LABELS[system]}, world {world}",
            )
    axes.set(xscale="log", yscale="log", xlabel="trial arguments (KB, log)")
    axes.set(ylabel="median handoff latency (ms, log)", title="Handoff vs payload")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7, ncol=2)


def cpu_percent_series(
    samples: list[tuple[float, float]], t_start: float
) -> tuple[list[float], list[float]]:
    """(seconds since launch, % of a core) between consecutive (time, cpu_s) samples."""
    seconds, percent = [], []
    for (time_a, cpu_a), (time_b, cpu_b) in itertools.pairwise(samples):
        if time_b > time_a:
            seconds.append(time_b - t_start)
            percent.append(100 * (cpu_b - cpu_a) / (time_b - time_a))
    return seconds, percent


def plot_follower_cpu(axes: Any, launches: dict[str, Any], title: str) -> None:
    """``launches``: system -> a measurement result with a ``timeline`` (and maybe ``holds``)."""
    for system, color in SYSTEM_COLORS.items():
        launch = launches.get(system)
        if not launch or "rank1" not in launch["timeline"]:
            continue
        timeline = launch["timeline"]
        t_start = timeline["t_start"]
        seconds, percent = cpu_percent_series(timeline["rank1"], t_start)
        axes.plot(
            seconds,
            percent,
            color=color,
            label=f"{SYSTEM_LABELS[system]} follower (rank 1)",
            lw=1.2,
        )
        if timeline.get("t_exit"):
            axes.axvline(timeline["t_exit"] - t_start, color=color, ls=":", lw=1)
        for hold_start, hold_end in launch.get("holds", []):
            axes.axvspan(hold_start - t_start, hold_end - t_start, color=color, alpha=0.12)
    axes.set(
        title=title, xlabel="seconds since launch", ylabel="CPU (% of one core)", ylim=(-5, 130)
    )
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")


def save_plots(summary: dict[str, Any], raw: dict[str, Any]) -> None:
    """Write latency.png and follower_cpu.png to ``results/``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_world, by_payload) = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_handoff_by_world(by_world, summary)
    plot_handoff_by_payload(by_payload, summary)
    figure.tight_layout()
    figure.savefig(RESULTS / "latency.png", dpi=110)
    plt.close(figure)

    figure, (plain_axes, e2e_axes) = plt.subplots(2, 1, figsize=(11, 7))
    plain_runs = {system: raw["plain"].get(f"{system}:2") for system in SYSTEM_COLORS}
    first_e2e_runs = {
        system: next((run for run in raw["e2e"] if run["system"] == system), None)
        for system in SYSTEM_COLORS
    }
    plot_follower_cpu(plain_axes, plain_runs, "Plain DDP, world 2: leader holds trial 3 (shaded)")
    plot_follower_cpu(
        e2e_axes,
        first_e2e_runs,
        "Lightning ddp x2, end to end: leader exits at the dotted line",
    )
    figure.tight_layout()
    figure.savefig(RESULTS / "follower_cpu.png", dpi=110)
    plt.close(figure)
