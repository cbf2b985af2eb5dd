"""Statistics: from what the launches recorded to the numbers of ``summary_<mode>.json``.

Two levels. Per launch (called by ``measurement``): ``trial_timings`` turns the ranks'
JSON lines into one record per trial (handoff, overhead, sampling time) and
``follower_wait_cpu`` turns the supervisor's CPU samples into CPU rates while the leader
holds a trial. Per run: ``summarize`` reduces all launches to medians, p95s and counts,
one section per measurement (channel, plain, e2e, reliability, bo, sweep, groups).
"""

from __future__ import annotations

import statistics
from typing import Any

from configuration import GROUP_LAYOUTS, PAYLOAD_BYTES, SYSTEMS, BenchConfig, layout_key

Record = dict[str, Any]

HOLD_EDGE_S = 0.2
"""CPU samples this close to either end of a hold window are left out (start-up, wake-up)."""


def quantile(values: list[float], fraction: float) -> float | None:
    """Linear-interpolation quantile (numpy's default), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def describe_values(values: list[float | None], scale: float = 1.0) -> Record:
    """Median, p95, mean and count of the values that exist, each times ``scale``."""
    present = [value * scale for value in values if value is not None]
    return {
        "median": quantile(present, 0.5),
        "p95": quantile(present, 0.95),
        "mean": statistics.fmean(present) if present else None,
        "n": len(present),
    }


# ----------------------------------------------------------------------------- per launch
def channel_latency_ms(latency_s_by_payload: dict[str, list[float]]) -> Record:
    """Median, p95 and count (ms) of the channel-alone broadcasts, by payload size."""
    return {
        size: {key: describe_values(latencies, 1e3)[key] for key in ("median", "p95", "n")}
        for size, latencies in latency_s_by_payload.items()
    }


def trial_timings(rows: list[Record], trial_key: str, world: int) -> list[Record]:
    """One record per trial the leader started: handoff, control overhead, control steps
    alone, sampling time.

    ``rows`` are the ranks' JSON lines; ``trial_key`` is the argument that tells trials
    apart (``x`` in the plain workload, ``lr`` in the Lightning one). A trial is complete
    when every follower entered it.
    """
    leader_starts = [row for row in rows if row["rank"] == 0 and "t_started" in row]
    leader_exits = {
        row[trial_key]: row["t_exit"] for row in rows if row["rank"] == 0 and "t_exit" in row
    }
    neps_calls = {row["trial"]: row for row in rows if row["rank"] == 0 and "t_call" in row}
    trials = []
    previous_exit = None
    previous_return = None
    for index, start in enumerate(leader_starts, start=1):
        trial = start[trial_key]
        follower_rows = [row for row in rows if row["rank"] > 0 and row.get(trial_key) == trial]
        call = neps_calls.get(start.get("trial"))
        follower_entries = [row["t_enter"] for row in follower_rows if "t_enter" in row]
        is_complete = len({row["rank"] for row in follower_rows}) == world - 1
        last_entry = max(follower_entries) if is_complete else None
        trials.append(
            {
                "index": index,
                "payload": start.get("payload"),
                "complete": is_complete,
                "latency_s": None if last_entry is None else last_entry - start["t_started"],
                "overhead_s": None
                if last_entry is None or previous_exit is None
                else last_entry - previous_exit,
                "sample_s": None if previous_exit is None else start["t_started"] - previous_exit,
                "steps_s": control_steps_s(previous_exit, previous_return, call, last_entry),
            }
        )
        previous_exit = leader_exits.get(trial)
        previous_return = None if call is None else call["t_return"]
    return trials


def control_steps_s(
    previous_exit: float | None,
    previous_return: float | None,
    call: Record | None,
    last_entry: float | None,
) -> float | None:
    """The system's own steps between two trials, NePS's left out: from the leader's
    function returning to NePS's ``evaluate_trial`` returning (the trial-end exchange,
    releasing the lease, recording nothing yet), plus from NePS calling the next
    ``evaluate_trial`` to the last follower entering the trial (the lease, the handoff).
    What lies between the two (NePS's report, its bookkeeping, its sampling) is NePS's
    worker loop, the same in both systems."""
    if previous_exit is None or previous_return is None or call is None or last_entry is None:
        return None
    # NePS's followers can find a trial on disk before the leader's NePS calls
    # ``evaluate_trial`` (it writes the trial first): nothing to wait for then, not less.
    return max(0.0, previous_return - previous_exit) + max(0.0, last_entry - call["t_call"])


def is_follower(process: Record) -> bool:
    role = process.get("role")
    return role not in ("rank0", "launcher") and "supervise" not in process.get("cmd", "")


def follower_wait_cpu(
    supervisor_record: Record, hold_windows: list[tuple[float, float]]
) -> list[float]:
    """CPU-seconds per wall-second of each follower inside each of the leader's holds."""
    rates = []
    for process in supervisor_record.get("processes", {}).values():
        if not is_follower(process):
            continue
        for hold_start, hold_end in hold_windows:
            inside = [
                (time_s, cpu_s)
                for time_s, cpu_s in process["samples"]
                if hold_start + HOLD_EDGE_S <= time_s <= hold_end - HOLD_EDGE_S
            ]
            if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
                (first_time, first_cpu), (last_time, last_cpu) = inside[0], inside[-1]
                rates.append((last_cpu - first_cpu) / (last_time - first_time))
    return rates


def cpu_timelines(supervisor_record: Record) -> Record:
    """CPU samples of rank 0 and rank 1, launch start and leader exit: the plot's input."""
    timeline: Record = {
        "t_start": supervisor_record.get("t_start"),
        "t_exit": supervisor_record.get("t_exit"),
    }
    for process in supervisor_record.get("processes", {}).values():
        role = process.get("role")
        if role in ("rank0", "rank1") and "supervise" not in process.get("cmd", ""):
            timeline.setdefault(role, process["samples"])
    return timeline


# ----------------------------------------------------------------------------- per run
def after_first(trials: list[Record]) -> list[Record]:
    """The first trial pays for start-up (imports, group creation): it is left out."""
    return [trial for trial in trials if trial["index"] > 1]


def median_of(launches: list[Record], field: str) -> float | None:
    values = [launch[field] for launch in launches if launch.get(field) is not None]
    return statistics.median(values) if values else None


def errors(launches: list[Record]) -> list[str]:
    return sorted({launch["error"] for launch in launches if launch["error"]})


def summarize_plain(raw: Record) -> Record:
    """Handoff, overhead and follower CPU by world size, then system."""
    by_world: Record = {}
    for key, launch in raw["plain"].items():
        system, world = key.split(":")
        measured = after_first(launch["trials"])
        # At world 2 the large-payload runs (sweep) add their trials to the payload table.
        sweep = raw["sweep"][system]["trials"] if world == "2" else []
        with_payloads = measured + after_first(sweep)
        by_world.setdefault(world, {})[system] = {
            "all": describe_values([trial["latency_s"] for trial in measured], 1e3),
            "by_payload": {
                str(size): describe_values(
                    [trial["latency_s"] for trial in with_payloads if trial["payload"] == size],
                    1e3,
                )
                for size in PAYLOAD_BYTES
            },
            "overhead_ms": describe_values([trial["overhead_s"] for trial in measured], 1e3),
            "steps_ms": describe_values([trial.get("steps_s") for trial in measured], 1e3),
            "wait_cpu_per_s": describe_values(launch["wait_cpu_per_s"]),
            "completed": launch["completed"],
            "error": launch["error"],
            "left": len(launch["left"]),
            "trials_done": launch["neps_successes"],
            "trials_wanted": launch["trials_wanted"],
        }
    return by_world


def summarize_e2e(
    raw: Record, config: BenchConfig, section: str = "e2e", trials: int | None = None
) -> Record:
    """Wall time, CPU time, throughput and handoff of the completed end-to-end runs
    (``section``: ``e2e``, random search, or ``bo_e2e``, Bayesian optimization)."""
    trials = config.e2e_trials if trials is None else trials
    by_system: Record = {}
    for system in SYSTEMS:
        launches = [launch for launch in raw.get(section, []) if launch["system"] == system]
        completed = [launch for launch in launches if launch["completed"]]
        wall_s = median_of(completed, "wall_s")
        latencies = [
            trial["latency_s"] for run in completed for trial in after_first(run["trials"])
        ]
        by_system[system] = {
            "runs": len(completed),
            "runs_total": len(launches),
            "wall_s": wall_s,
            "cpu_s": median_of(completed, "cpu_at_exit_s"),
            "trials_per_min": None if wall_s is None else 60 * trials / wall_s,
            "wall_s_all": [launch["wall_s"] for launch in completed],
            "cpu_s_all": [launch["cpu_at_exit_s"] for launch in completed],
            "latency_ms": describe_values(latencies, 1e3),
        }
    return by_system


def summarize_reliability(raw: Record) -> Record:
    """Every Lightning launch (end to end + reliability): completed, lost, left behind."""
    by_system: Record = {}
    for system in SYSTEMS:
        launches = [run for run in raw["e2e"] + raw["reliability"] if run["system"] == system]
        with_leftovers = [launch for launch in launches if launch["left"]]
        by_system[system] = {
            "runs": len(launches),
            "completed": sum(launch["completed"] for launch in launches),
            "lost": sum(not launch["completed"] for launch in launches),
            "runs_with_leftovers": len(with_leftovers),
            "left_processes": sum(launch["left"] for launch in launches),
            "left_cpu_per_s": statistics.fmean(
                [launch["left_cpu_per_s"] for launch in with_leftovers]
            )
            if with_leftovers
            else 0.0,
            "errors": errors(launches),
        }
    return by_system


def summarize_bo(raw: Record) -> Record:
    """Time from a trial's end to NePS starting the next one, as Bayesian optimization grows."""
    by_system: Record = {}
    for system, launch in raw["bo"].items():
        sample_times = [
            trial["sample_s"] for trial in launch["trials"] if trial["sample_s"] is not None
        ]
        by_system[system] = {
            "completed": launch["completed"],
            "trials_done": launch["neps_successes"],
            "trials_wanted": launch["trials_wanted"],
            "left": len(launch["left"]),
            "sample_s_last5": describe_values(sample_times[-5:]),
            "sample_s_all": sample_times,
            "error": launch["error"],
        }
    return by_system


def summarize_bo_gap(raw: Record) -> Record:
    """Ours minus the built-in's time to the next trial, trial by trial (ms).

    Both launches are seeded alike, so trial n is the same BO step in both (the same
    configs and acquisition work, benchmarks/studies/bo_gap.md): the difference is what each
    system adds around NePS's sampling, not two different BO problems."""
    ours, builtin = (
        [trial["sample_s"] for trial in raw["bo"][system]["trials"]] for system in SYSTEMS
    )
    gaps = [None if o is None or b is None else o - b for o, b in zip(ours, builtin, strict=False)]
    return {"last5_ms": describe_values(gaps[-5:], 1e3), "all_ms": describe_values(gaps, 1e3)}


def summarize_groups(raw: Record) -> Record:
    """``neps-bcast launch`` layouts (``"2x2"``, ``"1x4"``): medians over completed runs.

    ``trials_per_min`` counts NePS's successful trials between the first trial's start and
    the last trial's end; ``trials_per_min_wall`` the same over the whole launch. ``ratio``
    is the first layout's trials per minute over the second's (2x2 / 1x4).
    """
    by_layout: Record = {}
    for layout in GROUP_LAYOUTS:
        launches = [run for run in raw["groups"] if run["layout"] == layout_key(*layout)]
        completed = [launch for launch in launches if launch["completed"]]
        by_layout[layout_key(*layout)] = {
            "runs": len(completed),
            "runs_total": len(launches),
            "trials_per_min": median_of(completed, "trials_per_min"),
            "trials_per_min_wall": median_of(completed, "trials_per_min_wall"),
            "span_s": median_of(completed, "span_s"),
            "wall_s": median_of(completed, "wall_s"),
            "cpu_s": median_of(completed, "cpu_at_exit_s"),
            "workers": sorted({launch["workers"] for launch in launches}),
            "trials_done": [launch["neps_successes"] for launch in launches],
            "trials_wanted": launches[0]["trials_wanted"],
            "left": sum(launch["left"] for launch in launches),
            "errors": errors(launches),
        }
    first, second = (by_layout[layout_key(*layout)]["trials_per_min"] for layout in GROUP_LAYOUTS)
    by_layout["ratio"] = first / second if first is not None and second else None
    return by_layout


def summarize(raw: Record, config: BenchConfig) -> Record:
    """The ``summary`` block of ``summary_<mode>.json``."""
    fields = ("neps_successes", "trials_wanted", "completed", "left", "error")
    return {
        "channel": raw["channel"],
        "plain": summarize_plain(raw),
        "e2e": summarize_e2e(raw, config),
        "bo_e2e": summarize_e2e(raw, config, "bo_e2e", config.bo_e2e_trials),
        "reliability": summarize_reliability(raw),
        "bo": summarize_bo(raw),
        "bo_gap": summarize_bo_gap(raw),
        "sweep": {
            system: {field: launch[field] for field in fields}
            for system, launch in raw["sweep"].items()
        },
        "auth": raw["auth"],
        "groups": summarize_groups(raw),
    }
