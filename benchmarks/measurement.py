"""Launching and supervising the measured runs: what each section starts, in which order.

Every launch runs under ``_supervise.py`` with a fresh temporary folder, no fixed ports,
a deadline, and a launch marker in its environment; afterwards nothing carrying the marker
may survive (the runner kills by PID whatever the supervisor missed). Both systems run in
the same section one after the other (interleaved), on the same workload. Each launch's
supervisor record and derived result go to ``results/raw/<launch>.json``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _proc import LAUNCH_MARKER, ROLE_VARIABLE, clean_env, launch_pids, new_launch_id, procfs
from analysis import channel_latency_ms, cpu_timelines, follower_wait_cpu, trial_timings
from configuration import (
    GROUP_LAYOUTS,
    HERE,
    PAYLOAD_BYTES,
    RAW,
    SYSTEMS,
    WORKLOADS,
    BenchConfig,
    layout_key,
)

Record = dict[str, Any]
PYTHON = sys.executable
LOG_TAIL_CHARS = 3000
GRACE_S, LINGER_S = 5.0, 2.0
"""Left behind = alive GRACE_S after the leader's exit; each such process is watched LINGER_S."""
EXCEPTION_LINE = re.compile(r"\b[\w.]*(Error|Exception): ")


def progress(message: str) -> None:
    print(message, flush=True)


# ----------------------------------------------------------------------------- one launch
def supervised(
    name: str,
    cmd: list[str],
    *,
    cwd: Path,
    deadline_s: float,
    role: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> Record:
    """Run ``cmd`` under the supervisor; return the supervisor's record plus the log's tail."""
    record_path, log_path = cwd / "supervisor.json", cwd / "launch.log"
    launch_id = new_launch_id(name)
    env = clean_env(
        **{LAUNCH_MARKER: launch_id},
        **({ROLE_VARIABLE: role} if role else {}),
        **(extra_env or {}),
    )
    supervisor_cmd = [
        PYTHON,
        str(HERE / "_supervise.py"),
        *("--out", str(record_path), "--log", str(log_path)),
        *("--deadline", str(deadline_s), "--grace", str(GRACE_S), "--linger", str(LINGER_S)),
        "--",
        *cmd,
    ]
    started = time.monotonic()
    supervisor = subprocess.Popen(
        supervisor_cmd, cwd=cwd, env=env, start_new_session=True, stdin=subprocess.DEVNULL
    )
    try:
        supervisor.wait(timeout=deadline_s + GRACE_S + LINGER_S + 60)
    except subprocess.TimeoutExpired:
        pass
    # Backstop: nothing of this launch may survive, whatever the supervisor did.
    stray = launch_pids(launch_id)
    for pid in stray:
        procfs.kill(pid)
    if supervisor.poll() is None:
        supervisor.wait(timeout=10)
    record: Record = {
        "exit_code": None,
        "timed_out": True,
        "left": [],
        "processes": {},
        "cpu_at_exit_s": None,
        "wall_s": time.monotonic() - started,
        "supervisor_failed": True,
    }
    if record_path.exists():
        record = json.loads(record_path.read_text())
    record["stray_killed_by_runner"] = stray
    record["log_tail"] = (
        log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log_path.exists() else ""
    )
    record["name"] = name
    return record


def read_timings(folder: Path) -> list[Record]:
    """Every rank's JSON lines (``rank<r>.jsonl``); a line cut off by a kill is skipped."""
    rows = []
    for path in sorted(folder.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


def neps_successes(root: Path) -> int:
    """Trials NePS recorded as successful in its root directory."""
    path = root / "summary" / "full.csv"
    if not path.exists():
        return 0
    import pandas as pd  # its CSV reader takes the 1 MB trial arguments (csv's limit: 128 KB)

    return int((pd.read_csv(path)["state"] == "success").sum())


def error_line(log_tail: str) -> str:
    """The launch's first exception line (the root cause), else its last line naming an error.

    A follower's crash reaches the leader as a secondary error (a closed gloo connection,
    then NePS's WorkerRaiseError and its advice), so the first exception is the telling one.
    """
    lines = log_tail.splitlines()
    exceptions = [line for line in lines if EXCEPTION_LINE.search(line)]
    mentions = [line for line in lines if "Error" in line or "error" in line]
    chosen = exceptions[0] if exceptions else mentions[-1] if mentions else ""
    return chosen.strip()[:200]


def outcome(record: Record, successes: int, wanted: int) -> Record:
    """What every NePS search reports: did it finish, how it failed, how long, what it cost."""
    return {
        "exit_code": record["exit_code"],
        "timed_out": record["timed_out"],
        "neps_successes": successes,
        "trials_wanted": wanted,
        "completed": record["exit_code"] == 0 and not record["timed_out"] and successes >= wanted,
        "error": "" if record["exit_code"] == 0 else error_line(record["log_tail"]),
        "wall_s": record["wall_s"],
        "cpu_at_exit_s": record["cpu_at_exit_s"],
    }


def save_raw(name: str, record: Record, result: Record, raw_dir: Path = RAW) -> None:
    raw_dir.mkdir(parents=True, exist_ok=True)
    (raw_dir / f"{name}.json").write_text(json.dumps({"supervisor": record, "result": result}))


def finish(name: str, record: Record, result: Record, raw_dir: Path = RAW, note: str = "") -> None:
    """Save the launch's record and result to ``raw_dir`` and say how it went."""
    save_raw(name, record, result, raw_dir)
    progress(
        f"  {name}: exit={result['exit_code']} ok={result['completed']}"
        f" trials={result['neps_successes']}/{result['trials_wanted']} wall={result['wall_s']:.1f}s"
        f" cpu={result['cpu_at_exit_s']} left={len(record['left'])} {note}{result['error'][:100]}"
    )


# ----------------------------------------------------------------------------- workloads
def measure_channel(world: int, config: BenchConfig, tmp: Path) -> Record:
    """neps_bcast's channel alone between ``world`` real processes (workloads/channel_bench.py)."""
    name = f"channel_w{world}"
    folder = tmp / name
    folder.mkdir()
    result_path = folder / "channel.json"
    cmd = [
        PYTHON,
        str(WORKLOADS / "channel_bench.py"),
        *("--world", str(world), "--reps", str(config.channel_reps)),
        *("--payloads", ",".join(map(str, PAYLOAD_BYTES)), "--hold", str(config.hold)),
        *("--out", str(result_path)),
    ]
    record = supervised(name, cmd, cwd=folder, deadline_s=240, role="rank0")
    data = json.loads(result_path.read_text()) if result_path.exists() else {}
    save_raw(name, record, data)
    result = {
        "ok": bool(data) and record["exit_code"] == 0,
        "latency_ms": channel_latency_ms(data.get("latency_s", {})),
        "wait_cpu_per_s": [wait["cpu_s"] / wait["wall_s"] for wait in data.get("wait", [])],
        "left": len(record["left"]),
    }
    progress(f"  channel w={world}: {result['latency_ms']}")
    return result


@dataclass(frozen=True)
class PlainWorkload:
    """One plain-DDP NePS search (workloads/plain_launch.py + plain_search.py): what it varies."""

    tag: str
    """Section name: plain, sweep or bo (also the launch's folder prefix)."""
    trials: int
    payloads: tuple[int, ...]
    """Sizes of the string the trials carry (a Categorical choice); () for none."""
    optimizer: str = "random_search"
    hold_s: float = 0.0
    """How long the leader holds the trials in ``hold_trials`` (follower CPU)."""
    hold_trials: tuple[int, ...] = ()
    seed: int | None = None
    """Seed of every rank's random, numpy and torch (None: unseeded)."""


def measure_plain(system: str, world: int, workload: PlainWorkload, tmp: Path) -> Record:
    """One plain-DDP search: handoff and overhead per trial, follower CPU during holds."""
    name = f"{workload.tag}_{system}_w{world}"
    folder = tmp / name
    folder.mkdir()
    cmd = [
        PYTHON,
        str(WORKLOADS / "plain_launch.py"),
        *("--world", str(world), "--system", system),
        *("--root", str(folder / "root"), "--timings", str(folder / "timings")),
        *("--trials", str(workload.trials), "--optimizer", workload.optimizer),
        *("--payloads", ",".join(map(str, workload.payloads))),
        *("--hold", str(workload.hold_s)),
        *("--hold-trials", ",".join(map(str, workload.hold_trials))),
        *("--barrier-timeout", "150"),
        *(("--seed", str(workload.seed)) if workload.seed is not None else ()),
    ]
    record = supervised(
        name, cmd, cwd=folder, deadline_s=200 + 20 * workload.trials, role="launcher"
    )
    rows = read_timings(folder / "timings")
    holds = [tuple(row["hold"]) for row in rows if "hold" in row]
    result = {
        "system": system,
        "world": world,
        **outcome(record, neps_successes(folder / "root"), workload.trials),
        "trials": trial_timings(rows, "x", world),
        "wait_cpu_per_s": follower_wait_cpu(record, holds),
        "holds": holds,
        "left": record["left"],
    }
    finish(name, record, result)
    return {**result, "timeline": cpu_timelines(record)}


def measure_lightning(
    system: str, trials: int, tag: str, tmp: Path, *, bayesian: bool = False
) -> Record:
    """One Lightning ``strategy="ddp"`` search, devices=2 (workloads/lightning_search.py);
    ``bayesian``: under Bayesian optimization, every rank seeded with 0."""
    name = f"{tag}_{system}"
    folder = tmp / name
    folder.mkdir()
    cmd = [
        PYTHON,
        str(WORKLOADS / "lightning_search.py"),
        *("--system", system, "--trials", str(trials)),
        *("--root", str(folder / "root"), "--timings", str(folder / "timings")),
        *(("--optimizer", "bayesian_optimization", "--seed", "0") if bayesian else ()),
    ]
    record = supervised(name, cmd, cwd=folder, deadline_s=60 + (25 if bayesian else 15) * trials)
    result = {
        "system": system,
        **outcome(record, neps_successes(folder / "root"), trials),
        "left": len(record["left"]),
        "left_cpu_per_s": sum(process["cpu_per_wall_s"] for process in record["left"]),
        "trials": trial_timings(read_timings(folder / "timings"), "lr", 2),
    }
    finish(name, record, result)
    return {**result, "timeline": cpu_timelines(record)}


def neps_trials(root: Path) -> list[Record]:
    """Every trial NePS wrote under ``root``: its state, worker and start / end times."""
    trials = []
    for path in sorted((root / "configs").glob("*/metadata.json")):
        try:
            metadata = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a trial file cut off by a kill
        fields = ("id", "state", "evaluating_worker_id", "time_started", "time_end")
        trials.append({field: metadata.get(field) for field in fields})
    return trials


def group_logs_error(log_dir: Path) -> str:
    """The first exception line of the ranks' logs (the launcher's own log rarely names it)."""
    for path in sorted(log_dir.glob("group*/rank*.log")):
        line = error_line(path.read_text(errors="replace")[-LOG_TAIL_CHARS:])
        if line:
            return f"{path.parent.name}/{path.name}: {line}"
    return ""


def measure_groups(
    groups: int, nproc_per_group: int, trials: int, tag: str, tmp: Path, raw_dir: Path = RAW
) -> Record:
    """One ``neps-bcast launch --groups K --nproc-per-group N groups_search.py`` to the end.

    Throughput comes from NePS's trial metadata: successful trials per minute between the
    first trial's start and the last trial's end (``span``), so the launch's start-up
    (imports, rendezvous) and shutdown stay out of it; the same per wall minute of the
    whole launch is kept next to it.
    """
    key = layout_key(groups, nproc_per_group)
    name = f"{tag}_{key}"
    folder = tmp / name
    folder.mkdir()
    cmd = [
        PYTHON,
        *("-m", "neps_bcast", "launch"),
        *("--groups", str(groups), "--nproc-per-group", str(nproc_per_group)),
        *("--log-dir", str(folder / "logs"), "--status-interval", "30"),
        str(WORKLOADS / "groups_search.py"),
        *("--root", str(folder / "root"), "--trials", str(trials)),
    ]
    # CPU ranks on gloo even where GPUs exist (the launcher would split those among groups).
    record = supervised(
        name, cmd, cwd=folder, deadline_s=90 + 15 * trials, extra_env={"CUDA_VISIBLE_DEVICES": ""}
    )
    recorded = neps_trials(folder / "root")
    succeeded = [
        trial
        for trial in recorded
        if trial["state"] == "success" and trial["time_started"] and trial["time_end"]
    ]
    span_s = None
    if succeeded:
        span_s = max(trial["time_end"] for trial in succeeded) - min(
            trial["time_started"] for trial in succeeded
        )
    result = {
        "layout": key,
        "groups": groups,
        "nproc_per_group": nproc_per_group,
        **outcome(record, len(succeeded), trials),
        "trials_recorded": len(recorded),
        "workers": len({trial["evaluating_worker_id"] for trial in succeeded}),
        "span_s": span_s,
        "trials_per_min": 60 * len(succeeded) / span_s if span_s else None,
        "trials_per_min_wall": 60 * len(succeeded) / record["wall_s"] if record["wall_s"] else None,
        "left": len(record["left"]),
        "trials": recorded,
    }
    if record["exit_code"] != 0:
        result["error"] = group_logs_error(folder / "logs") or result["error"]
    span_text = "n/a" if span_s is None else f"{span_s:.1f}s"
    finish(name, record, result, raw_dir, f"workers={result['workers']} span={span_text} ")
    return result


def measure_group_layouts(config: BenchConfig, tmp: Path, raw_dir: Path = RAW) -> list[Record]:
    """Every layout of GROUP_LAYOUTS ``groups_runs`` times, interleaved; the first layout
    alternates between runs so that neither always goes first."""
    return [
        measure_groups(*layout, config.groups_trials, f"groups{run_index}", tmp, raw_dir)
        for run_index in range(config.groups_runs)
        for layout in (GROUP_LAYOUTS if run_index % 2 == 0 else GROUP_LAYOUTS[::-1])
    ]


# ----------------------------------------------------------------------------- all sections
def alternating(run_index: int) -> tuple[str, ...]:
    """Which system goes first alternates between repeated runs."""
    return SYSTEMS if run_index % 2 == 0 else SYSTEMS[::-1]


def measure_auth(repetitions: int = 2000) -> Record:
    """What authenticating one trial message costs: the leader tags it, a follower checks
    the tag, for a 1 KB trial, in this process (no launch needed)."""
    from neps_bcast.transport.auth import Signer, channel_context, new_nonce, new_secret
    from neps_bcast.transport.messages import TrialMessage, encode

    signer = Signer(new_secret(), new_nonce())
    message = TrialMessage(1, "1", {"x": 0.5, "payload": "p" * 1000}, None, None)
    payload = encode(message, tag="bench")
    samples = []
    for seq in range(repetitions):
        start = time.perf_counter()
        context = channel_context("leader", sender=0, seq=seq, generation=0)
        signer.open(context, signer.sign(context, payload))
        samples.append(time.perf_counter() - start)
    samples.sort()
    return {"bytes": len(payload), "median_us": samples[len(samples) // 2] * 1e6}


def measure_all(config: BenchConfig, tmp: Path) -> Record:
    """Every section in order; returns the raw results ``analysis.summarize`` reads."""
    raw: Record = {"plain": {}, "sweep": {}, "bo": {}}
    raw["auth"] = measure_auth()
    progress("1/7 neps_bcast channel alone")
    raw["channel"] = {
        str(world): measure_channel(world, config, tmp) for world in config.channel_worlds
    }

    progress("2/7 plain DDP: handoff, overhead, waiting CPU (interleaved)")
    plain = PlainWorkload(
        tag="plain",
        trials=config.plain_trials,
        payloads=PAYLOAD_BYTES[:1],
        hold_s=config.hold,
        hold_trials=(3,),
    )
    for world in config.plain_worlds:
        for system in SYSTEMS:
            raw["plain"][f"{system}:{world}"] = measure_plain(system, world, plain, tmp)
    # Big trial arguments in runs of their own: NePS's followers crash on them often
    # (half-written trial file), which would leave the world-size runs without data.
    sweep = PlainWorkload(tag="sweep", trials=config.sweep_trials, payloads=PAYLOAD_BYTES[1:])
    for system in SYSTEMS:
        raw["sweep"][system] = measure_plain(system, 2, sweep, tmp)

    for step, section, tag, runs, trials in (
        ("3/7 end to end", "e2e", "e2e", config.e2e_runs, config.e2e_trials),
        ("4/7 reliability", "reliability", "rel", config.rel_runs, config.rel_trials),
    ):
        progress(f"{step}, Lightning ddp x2 (interleaved)")
        raw[section] = [
            measure_lightning(system, trials, f"{tag}{run_index}", tmp)
            for run_index in range(runs)
            for system in alternating(run_index)
        ]

    progress("5/7 Bayesian optimization at world 2 (interleaved)")
    # Seeded: unseeded, each launch faces another BO problem (benchmarks/studies/bo_gap.md).
    bayesian = PlainWorkload(
        tag="bo", trials=config.bo_trials, payloads=(), optimizer="bayesian_optimization", seed=0
    )
    for system in SYSTEMS:
        raw["bo"][system] = measure_plain(system, 2, bayesian, tmp)

    progress("6/7 end to end under Bayesian optimization, Lightning ddp x2, seeded (interleaved)")
    raw["bo_e2e"] = [
        measure_lightning(system, config.bo_e2e_trials, f"boe2e{run_index}", tmp, bayesian=True)
        for run_index in range(config.bo_e2e_runs)
        for system in alternating(run_index)
    ]

    progress("7/7 neps-bcast launch: 2 groups x 2 ranks vs 1 group x 4 ranks (interleaved)")
    raw["groups"] = measure_group_layouts(config, tmp)
    return raw
