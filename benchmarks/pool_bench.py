"""The right-sized pool section: ``--pool D`` against every fixed layout, one run, interleaved.

Per stated speedup curve (``PoolConfig.curves``: A, B, BO, C4, C, then D), every launch runs
``workloads/pool_sim.py`` (a hyperband search on D simulated devices, see its docstring)
under ``_supervise.py`` (``measurement.supervised``), with the same curve and budget:
``neps-bcast launch --pool D`` and ``--groups G --nproc-per-group N`` for every G x N = D
(where the curve has a memory model, every feasible one: see ``fixed_keys``). What each launch recorded (the ranks' JSON
lines, NePS's trial metadata, the pool agents' timed log lines) becomes one result per
launch (``launch_figures``), then one summary per curve (``summarize_pool``). Measures only.

Times are CLOCK_REALTIME (``time.time()``) in every process, the supervisor's included.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import yaml

from configuration import (
    POOL_SCHEDULING_GOAL_MS,
    RAW,
    WORKLOADS,
    PoolConfig,
    PoolCurve,
    fixed_layouts,
    layout_key,
)
from measurement import (
    LOG_TAIL_CHARS,
    PYTHON,
    error_line,
    finish,
    neps_trials,
    outcome,
    progress,
    supervised,
)

Record = dict[str, Any]
LOG_LINE = re.compile(
    r"^(?P<t>\d+\.\d+) INFO neps_bcast: .*\btrial (?P<trial>\S+)"
    r" (?:asks for (?P<size>\d+) rank|runs on device\(s\) (?P<devices>[\d,]+))"
)


def pool_keys(curve: PoolCurve) -> list[str]:
    """The curve's pool launches: ``pool`` (``--pool D``, D agents) and, with
    ``more_agents`` k, ``pool+k`` (``--agents D+k``). The script imports torch and NePS
    only (as tests/scripts/pool_search.py), so each warm rank imports Lightning's cluster
    environments inside its first trial (``startup.launch.detect``)."""
    return ["pool", *([f"pool+{curve.more_agents}"] if curve.more_agents else [])]


def fixed_keys(devices: int, curve: PoolCurve) -> list[str]:
    """The fixed layouts measured: the curve's own, or every feasible one of D (a layout
    whose groups are narrower than the widest trial's memory minimum cannot run the
    search: its top-rung trials fail as out of memory, so it is not measured)."""
    layouts = curve.fixed or fixed_layouts(devices)
    return [layout_key(*layout) for layout in layouts if curve.feasible(layout[1])]


def infeasible_keys(devices: int, curve: PoolCurve) -> list[str]:
    """The fixed layouts of D left out because some trial does not fit their groups."""
    if curve.fixed is not None:
        return []
    return [layout_key(*each) for each in fixed_layouts(devices) if not curve.feasible(each[1])]


def layout_order(devices: int, run_index: int, curve: PoolCurve) -> list[str]:
    """One run's launches: the pool's, then the fixed layouts; reversed on odd runs."""
    order = [*pool_keys(curve), *fixed_keys(devices, curve)]
    return order if run_index % 2 == 0 else order[::-1]


def is_pool(key: str) -> bool:
    return key.startswith("pool")


def agents_of(key: str, devices: int) -> int:
    """A pool launch's agents: D, or D + k for ``pool+k``."""
    return devices + int(key.partition("+")[2] or 0)


# ----------------------------------------------------------------------------- one launch
def command(key: str, folder: Path, config: PoolConfig, curve: PoolCurve) -> list[str]:
    devices = config.devices
    if is_pool(key):
        agents = agents_of(key, devices)
        layout_args: tuple[str, ...] = ("--pool", str(devices), "--agents", str(agents))
        processes = devices + agents  # D ranks and the agents
    else:
        groups, ranks = (int(part) for part in key.split("x"))
        layout_args = ("--groups", str(groups), "--nproc-per-group", str(ranks))
        processes = devices
    search: tuple[str, ...] = ()
    if curve.epochs is not None:
        search = ("--optimizer", curve.optimizer, "--epochs", str(curve.epochs))
    return [
        PYTHON,
        *("-m", "neps_bcast", "launch", *layout_args),
        *("--log-dir", str(folder / "logs"), "--status-interval", "30"),
        str(WORKLOADS / "pool_sim.py"),
        *("--root", str(folder / "root"), "--records", str(folder / "records")),
        *("--expect", str(processes), "--evaluations", str(curve.evaluations)),
        *("--t-epoch", str(config.t_epoch), "--serial-fraction", str(curve.serial_fraction)),
        *("--max-epochs", str(curve.max_epochs), "--fixed-epochs", str(curve.fixed_epochs)),
        *("--rule", curve.rule_arg),
        *(("--min-ranks", curve.min_ranks_arg) if curve.min_ranks_arg else ()),
        *search,
    ]


def read_records(folder: Path) -> list[Record]:
    rows = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # a line cut off by a kill
    return rows


def agent_events(log_dir: Path) -> dict[str, Record]:
    """Per trial, from the pool agents' logs: when it asked for ranks (and how many) and
    when the agent heard it was placed (the last of each, should a trial run twice)."""
    events: dict[str, Record] = {}
    for path in sorted(log_dir.glob("pool/agent*.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = LOG_LINE.match(line)
            if not match:
                continue
            entry = events.setdefault(match["trial"], {})
            if match["size"] is not None:
                entry.update(asked=float(match["t"]), size=int(match["size"]))
            else:
                entry.update(placed=float(match["t"]), devices=match["devices"])
    return events


def logs_error(log_dir: Path) -> str:
    """The first exception line of the launch's process logs (pool or groups)."""
    for path in sorted(log_dir.glob("**/*.log")):
        line = error_line(path.read_text(errors="replace")[-LOG_TAIL_CHARS:])
        if line and "Error" in line:
            return f"{path.parent.name}/{path.name}: {line}"
    return ""


def measure_layout(
    key: str, config: PoolConfig, curve: PoolCurve, tag: str, tmp: Path, raw_dir: Path = RAW
) -> Record:
    """One launch to the end of its search; its figures (``launch_figures``) and data."""
    name = f"{tag}_{key}"
    folder = tmp / name
    folder.mkdir()
    (folder / "records").mkdir()
    # CPU ranks on gloo even where GPUs exist: the devices are simulated.
    record = supervised(
        name,
        command(key, folder, config, curve),
        cwd=folder,
        deadline_s=config.deadline_s,
        extra_env={"CUDA_VISIBLE_DEVICES": ""},
    )
    rows = read_records(folder / "records")
    trials = neps_trials(folder / "root")
    succeeded = sum(1 for trial in trials if trial["state"] == "success")
    events = agent_events(folder / "logs") if is_pool(key) else {}
    objectives = neps_objectives(folder / "root")
    result: Record = {
        "layout": key,
        "curve": curve.name,
        **outcome(record, succeeded, curve.evaluations),
        "trials_recorded": len(trials),
        "trials_out_of_memory": len({row["trial"] for row in rows if row["event"] == "oom"}),
        "left": len(record["left"]),
        **launch_figures(rows, trials, events, record, config, curve),
        **best_known(work_rows(rows), objectives),
    }
    if record["exit_code"] != 0:
        result["error"] = logs_error(folder / "logs") or result["error"]
    result["work"] = work_rows(rows)
    note = (
        f"search wall={fmt(result['search_wall_s'])}s util={fmt(result['utilization'], 2)}"
        f" best known at={fmt(result['time_to_best_s'])}s"
        f" start-up={fmt(result['startup_s'])}s"
        f" out of memory={result['trials_out_of_memory']} "
    )
    finish(name, record, result, raw_dir, note)
    return result


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


# ----------------------------------------------------------------------------- per launch
def neps_objectives(root: Path) -> dict[str, float]:
    """Per trial id, the objective NePS recorded (``report.yaml`` beside its metadata)."""
    objectives = {}
    for path in sorted((root / "configs").glob("*/report.yaml")):
        try:
            report = yaml.safe_load(path.read_text()) or {}
            trial_id = json.loads((path.parent / "metadata.json").read_text())["id"]
        except (OSError, ValueError, KeyError, yaml.YAMLError):
            continue  # a trial file cut off by a kill
        if isinstance(report.get("objective_to_minimize"), int | float):
            objectives[trial_id] = float(report["objective_to_minimize"])
    return objectives


def best_known(work: list[Record], objectives: dict[str, float]) -> Record:
    """When the search's final best objective was first known: seconds from the search's
    start (the first device work) to the end of the device work of the trial that produced
    it (the earliest such trial on a tie); that trial's objective and shape."""
    ends: dict[str, float] = {}
    for row in work:
        ends[row["trial"]] = max(ends.get(row["trial"], row["end"]), row["end"])
    scored = [trial for trial in ends if trial in objectives]
    if not scored:
        return {"time_to_best_s": None, "best_objective": None, "best_trial": None}
    best = min(objectives[trial] for trial in scored)
    trial = min((t for t in scored if objectives[t] == best), key=ends.__getitem__)
    shape = next(row for row in work if row["trial"] == trial)
    return {
        "time_to_best_s": ends[trial] - min(row["start"] for row in work),
        "best_objective": best,
        "best_trial": f"{trial}: {shape['epochs']} ep on {shape['world']}",
    }


def work_rows(rows: list[Record]) -> list[Record]:
    """Each rank's device work of each trial (its last attempt), in start order."""
    last_attempt: dict[str, int] = {}
    for row in rows:
        if row["event"] == "trial":
            last_attempt[row["trial"]] = max(last_attempt.get(row["trial"], 0), row["attempt"])
    fields = ("trial", "rank", "world", "device", "epochs", "entered", "start", "end")
    work = [
        {field: row[field] for field in fields}
        for row in rows
        if row["event"] == "trial" and row["attempt"] == last_attempt[row["trial"]]
    ]
    return sorted(work, key=lambda row: (row["start"], row["device"]))


def idle_tail_start(intervals: list[tuple[float, float]], devices: int, default: float) -> float:
    """The moment fewer than half the devices are busy for good (``default`` if never half)."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    busy, fell = 0, default
    for moment, change in events:
        before = busy
        busy += change
        if before >= devices / 2 > busy:
            fell = moment
    return fell


def bound_ratio(layout: Record) -> float | None:
    """A launch's search wall over its own lower bound (``wall_bound_s``): what placement
    and everything between trials cost it."""
    wall, bound = layout.get("search_wall_s"), layout.get("wall_bound_s")
    return None if wall is None or not bound else wall / bound


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ms(value: float | None) -> float | None:
    return None if value is None else 1000 * value


def launch_figures(
    rows: list[Record],
    trials: list[Record],
    events: dict[str, Record],
    supervisor: Record,
    config: PoolConfig,
    curve: PoolCurve,
) -> Record:
    """Search wall, utilization, idle tail, start-up, trial mix and per-trial start costs."""
    work = work_rows(rows)
    ready = [row for row in rows if row["event"] == "ready"]
    t_launch = supervisor.get("t_start")
    figures: Record = {
        "search_wall_s": None,
        "utilization": None,
        "idle_tail_s": None,
        "startup_s": None,
    }
    if not work or t_launch is None:
        return figures
    search_start = min(row["start"] for row in work)
    search_end = max(row["end"] for row in work)
    wall = search_end - search_start
    busy = sum(row["end"] - row["start"] for row in work)
    tail_from = idle_tail_start(
        [(row["start"], row["end"]) for row in work], config.devices, search_start
    )
    by_trial: dict[str, list[Record]] = {}
    for row in work:
        by_trial.setdefault(row["trial"], []).append(row)
    epochs = [ranks[0]["epochs"] for ranks in by_trial.values()]
    mix: dict[str, int] = {}
    for trial_ranks in by_trial.values():
        shape = f"{trial_ranks[0]['epochs']} ep on {trial_ranks[0]['world']}"
        mix[shape] = mix.get(shape, 0) + 1
    starts = trial_starts(by_trial, trials, events)
    warm = [entry for entry in starts if not entry["first_on_a_rank"]]
    figures.update(
        {
            "search_wall_s": wall,
            "busy_device_s": busy,
            **curve_figures(work, config, curve),
            "utilization": busy / (config.devices * wall) if wall > 0 else None,
            "idle_tail_s": search_end - tail_from,
            "startup_s": search_start - t_launch,
            "imports_s": max(row["imported"] for row in ready) - t_launch if ready else None,
            "barrier_s": max(row["released"] for row in ready) - t_launch if ready else None,
            "shutdown_s": supervisor["t_exit"] - search_end if supervisor.get("t_exit") else None,
            "launch_wall_s": supervisor.get("wall_s"),
            "cpu_s": supervisor.get("cpu_at_exit_s"),
            "trials_trained": len(by_trial),
            "epochs_total": sum(epochs),
            "trial_mix": dict(sorted(mix.items(), key=lambda item: int(item[0].split()[0]))),
            "trials": starts,
        }
    )
    for name, entries in (("", starts), ("warm_", warm)):
        for field in ("start_ms", "sched_ms", "sched_to_work_ms", "agent_ms", "wait_ms"):
            values = [entry[field] for entry in entries if entry.get(field) is not None]
            figures[f"{name}{field}_median"] = median(values)
            figures[f"{name}{field}_max"] = max(values) if values else None
    figures["warm_sched_ms_by_world"] = sched_by_world(warm)
    figures["pool_start_ms_median"] = median(
        [
            entry["agent_ms"] + entry["sched_ms"]
            for entry in starts
            if entry.get("agent_ms") is not None and entry.get("sched_ms") is not None
        ]
    )
    return figures


def curve_figures(work: list[Record], config: PoolConfig, curve: PoolCurve) -> Record:
    """What the curve alone asks of the devices for the trials trained: device-seconds,
    and the wall no placement can beat (those device-seconds spread evenly over D, or the
    longest trial if longer)."""
    shapes = {row["trial"]: (row["epochs"], row["world"]) for row in work}
    seconds = [
        curve.trial_seconds(epochs, world, config.t_epoch) for epochs, world in shapes.values()
    ]
    device_s = sum(each * world for each, (_, world) in zip(seconds, shapes.values(), strict=True))
    return {
        "model_device_s": device_s,
        "wall_bound_s": max(device_s / config.devices, *seconds) if seconds else None,
    }


def sched_by_world(entries: list[Record]) -> dict[str, float | None]:
    """The scheduling cost's median by trial size (ranks)."""
    return {
        str(world): median(
            [
                entry["sched_ms"]
                for entry in entries
                if entry["world"] == world and entry.get("sched_ms") is not None
            ]
        )
        for world in sorted({entry["world"] for entry in entries})
    }


def trial_starts(
    by_trial: dict[str, list[Record]], trials: list[Record], events: dict[str, Record]
) -> list[Record]:
    """Per trial (start order): what starting it on its ranks took.

    - ``start_ms``: NePS marks the trial started (``time_started``) -> the last of its ranks
      enters the function (every layout; in a pool this includes waiting for free devices);
    - pool only: ``agent_ms`` NePS start -> the agent asks for ranks; ``wait_ms`` asked ->
      placed (devices busy); ``sched_ms`` placed -> the last rank enters the function (the
      scheduling cost); ``sched_to_work_ms`` placed -> the last rank starts its device work
      (after the user's ``init_process_group`` and ``session()``).
    ``first_on_a_rank``: some rank of the trial had trained nothing before (a first trial
    pays one-off costs).
    """
    started = {trial["id"]: trial["time_started"] for trial in trials}
    seen: set[int] = set()
    entries = []
    for trial_id, ranks in sorted(by_trial.items(), key=lambda item: item[1][0]["start"]):
        entered = max(row["entered"] for row in ranks)
        working = max(row["start"] for row in ranks)
        devices = {row["device"] for row in ranks}
        entry: Record = {
            "trial": trial_id,
            "world": ranks[0]["world"],
            "epochs": ranks[0]["epochs"],
            "first_on_a_rank": not devices <= seen,
            "start_ms": ms(entered - started[trial_id]) if started.get(trial_id) else None,
        }
        seen |= devices
        event = events.get(trial_id, {})
        if "placed" in event:
            entry["sched_ms"] = ms(entered - event["placed"])
            entry["sched_to_work_ms"] = ms(working - event["placed"])
        if "asked" in event:
            entry["wait_ms"] = ms(event["placed"] - event["asked"]) if "placed" in event else None
            if started.get(trial_id):
                entry["agent_ms"] = ms(event["asked"] - started[trial_id])
        entries.append(entry)
    return entries


# ----------------------------------------------------------------------------- the section
def measure_pool_section(config: PoolConfig, tmp: Path, raw_dir: Path = RAW) -> list[Record]:
    """Per curve, one after the other: every layout ``config.runs`` times, interleaved
    (``layout_order``). Each launch's record names its ``curve``."""
    launches = []
    for curve in config.curves:
        infeasible = infeasible_keys(config.devices, curve)
        progress(
            f"pool section, curve {curve.name}: {', '.join(pool_keys(curve))} vs"
            f" {', '.join(fixed_keys(config.devices, curve))},"
            f" {curve.evaluations} trials each, simulated devices"
            + (f" ({', '.join(infeasible)}: infeasible, not measured)" if infeasible else "")
        )
        launches += [
            measure_layout(key, config, curve, f"pool{curve.name}{run_index}", tmp, raw_dir)
            for run_index in range(config.runs)
            for key in layout_order(config.devices, run_index, curve)
        ]
    return launches


SCALARS = (
    "search_wall_s",
    "time_to_best_s",
    "utilization",
    "idle_tail_s",
    "startup_s",
    "imports_s",
    "barrier_s",
    "shutdown_s",
    "launch_wall_s",
    "cpu_s",
    "busy_device_s",
    "model_device_s",
    "wall_bound_s",
    "trials_trained",
    "epochs_total",
    "start_ms_median",
    "warm_start_ms_median",
    "sched_ms_median",
    "sched_ms_max",
    "warm_sched_ms_median",
    "warm_sched_ms_max",
    "sched_to_work_ms_median",
    "warm_sched_to_work_ms_median",
    "agent_ms_median",
    "wait_ms_median",
    "pool_start_ms_median",
)


def read_raw_launches(raw_dir: Path) -> list[Record]:
    """The launches saved by ``measure_layout`` (``measurement.save_raw``) in ``raw_dir``:
    each one's result, with its supervisor's start and exit times."""
    launches = []
    for path in sorted(raw_dir.glob("pool*_*.json")):
        data = json.loads(path.read_text())
        supervisor = data.get("supervisor", {})
        launches.append(
            {
                **data["result"],
                "t_start": supervisor.get("t_start"),
                "t_exit": supervisor.get("t_exit"),
            }
        )
    return launches


def summarize_pool(launches: list[Record], config: PoolConfig) -> Record:
    """Per curve (``summarize_curve``), in the order measured."""
    return {
        "devices": config.devices,
        "t_epoch": config.t_epoch,
        "runs": config.runs,
        "curves": [
            summarize_curve(
                [launch for launch in launches if launch.get("curve", "A") == curve.name],
                config,
                curve,
            )
            for curve in config.curves
        ],
    }


def summarize_curve(launches: list[Record], config: PoolConfig, curve: PoolCurve) -> Record:
    """Per layout: medians over its completed launches; the best fixed layout; the goals."""
    layouts: Record = {}
    for key in layout_order(config.devices, 0, curve):
        runs = [launch for launch in launches if launch["layout"] == key]
        completed = [launch for launch in runs if launch["completed"]]
        entry: Record = {
            field: median([run[field] for run in completed if run.get(field) is not None])
            for field in SCALARS
        }
        entry.update(
            runs=len(completed),
            runs_total=len(runs),
            trial_mix=completed[0]["trial_mix"] if completed else {},
            best_trial=completed[0].get("best_trial") if completed else None,
            warm_sched_ms_by_world=completed[0].get("warm_sched_ms_by_world", {})
            if completed
            else {},
            left=sum(run["left"] for run in runs),
            trials_out_of_memory=sum(run.get("trials_out_of_memory", 0) for run in runs),
            errors=sorted({run["error"] for run in runs if run["error"]}),
        )
        layouts[key] = entry
    fixed = fixed_keys(config.devices, curve)
    walls = {
        key: layouts[key]["search_wall_s"]
        for key in fixed
        if layouts[key]["search_wall_s"] is not None
    }
    best = min(walls, key=walls.__getitem__) if walls else None
    # The start cost: a fixed layout's NePS trial start -> every rank in the function.
    start_cost = median(
        [
            entry["start_ms"]
            for launch in launches
            if launch["layout"] in fixed and launch["completed"]
            for entry in launch["trials"]
            if entry["start_ms"] is not None
        ]
    )
    goals: Record = {}
    for key in pool_keys(curve):
        pool = layouts[key]
        ratio = (
            pool["search_wall_s"] / walls[best]
            if best is not None and pool["search_wall_s"] is not None
            else None
        )
        limit = None if start_cost is None else POOL_SCHEDULING_GOAL_MS + start_cost
        goals[key] = {  # the figures the goals are judged on (pool_report.goal_rows)
            "utilization": pool["utilization"],
            "wall_ratio": ratio,
            "bound_ratio": bound_ratio(pool),
            "sched_ms": pool["sched_ms_median"],
            "sched_limit_ms": limit,
        }
    return {
        "curve": curve.name,
        "devices": config.devices,
        "t_epoch": config.t_epoch,
        "evaluations": curve.evaluations,
        "max_epochs": curve.max_epochs,
        "fixed_epochs": curve.fixed_epochs,
        "serial_fraction": curve.serial_fraction,
        "rule": [list(step) for step in curve.rule],
        "min_ranks": None if curve.min_ranks is None else [list(s) for s in curve.min_ranks],
        "infeasible": infeasible_keys(config.devices, curve),
        "optimizer": curve.optimizer,
        "epochs": curve.epochs,
        "runs": config.runs,
        "layouts": layouts,
        "best_fixed": best,
        "start_cost_ms": start_cost,
        "goals": goals,
    }
