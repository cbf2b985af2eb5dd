"""neps_bcast vs NePS 0.17's built-in DDP mode, side by side, interleaved, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --quick   # make bench (< 5 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --full    # make bench-full

Every launch runs under ``_supervise.py`` with a launch marker in its environment, with a fresh
temporary root, no fixed ports and a deadline; the supervisor counts, measures and kills
(by PID) every process the launch leaves behind. Raw JSON per launch goes to
``benchmarks/results/raw/`` (git-ignored); ``summary.json``, ``REPORT.md`` and the PNG
plots go to ``benchmarks/results/``. Measures only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _proc import LAUNCH_MARKER, clean_env, launch_pids, new_launch_id, procfs  # noqa: E402

RESULTS = HERE / "results"
RAW = RESULTS / "raw"
PY = sys.executable
SYSTEMS = ("ours", "builtin")
LABEL = {"ours": "neps_bcast", "builtin": "NePS built-in"}

# Quick fits in < 5 min on 2 cores: every extra rank costs ~10 CPU-s of imports, so world 8
# is measured for the channel only, and NePS-level launches run at world 2.
QUICK = dict(
    channel_worlds=(2, 8),
    channel_reps=10,
    hold=3.0,
    plain_worlds=(2,),
    plain_trials=6,
    sweep_trials=6,
    e2e_trials=20,
    e2e_runs=1,
    rel_runs=1,
    rel_trials=6,
    bo_trials=8,
)
# Full: 30 Lightning runs per system in all (3 end-to-end runs + 27 reliability runs).
FULL = dict(
    channel_worlds=(2, 4, 8),
    channel_reps=100,
    hold=5.0,
    plain_worlds=(2, 4, 8),
    plain_trials=20,
    sweep_trials=20,
    e2e_trials=20,
    e2e_runs=3,
    rel_runs=27,
    rel_trials=6,
    bo_trials=30,
)
PAYLOADS = (1000, 100_000, 1_000_000)


# ----------------------------------------------------------------------------- launching
def supervised(
    name: str,
    cmd: list[str],
    *,
    cwd: Path,
    deadline: float,
    role: str | None = None,
    grace: float = 5.0,
    linger: float = 2.0,
) -> dict[str, Any]:
    """Run ``cmd`` under the supervisor in a new session; return the supervisor's record."""
    out, log = cwd / "supervisor.json", cwd / "launch.log"
    launch_id = new_launch_id(name)
    env = clean_env(**{LAUNCH_MARKER: launch_id}, **({"BENCH_ROLE": role} if role else {}))
    sup = [
        PY,
        str(HERE / "_supervise.py"),
        "--out",
        str(out),
        "--log",
        str(log),
        "--deadline",
        str(deadline),
        "--grace",
        str(grace),
        "--linger",
        str(linger),
        "--",
        *cmd,
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(sup, cwd=cwd, env=env, start_new_session=True, stdin=subprocess.DEVNULL)
    try:
        proc.wait(timeout=deadline + grace + linger + 60)
    except subprocess.TimeoutExpired:
        pass
    # Backstop: nothing of this session may survive, whatever the supervisor did.
    stray = launch_pids(launch_id)
    for pid in stray:
        procfs.kill(pid)
    if proc.poll() is None:
        proc.wait(timeout=10)
    record: dict[str, Any] = (
        json.loads(out.read_text())
        if out.exists()
        else {
            "exit_code": None,
            "timed_out": True,
            "left": [],
            "processes": {},
            "cpu_at_exit_s": None,
            "wall_s": time.monotonic() - t0,
            "supervisor_failed": True,
        }
    )
    record["stray_killed_by_runner"] = stray
    record["log_tail"] = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    record["name"] = name
    return record


def read_jsonl(folder: Path) -> list[dict[str, Any]]:
    rows = []
    for f in sorted(folder.glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
    return rows


def neps_successes(root: Path) -> int:
    csv = root / "summary" / "full.csv"
    if not csv.exists():
        return 0
    import pandas as pd

    return int((pd.read_csv(csv)["state"] == "success").sum())


def error_line(log_tail: str) -> str:
    lines = [ln for ln in log_tail.splitlines() if "Error" in ln or "error" in ln]
    return lines[-1].strip()[:200] if lines else ""


# ----------------------------------------------------------------------------- analysis
def q(values: list[float], p: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def trials_from_timings(rows: list[dict[str, Any]], key: str, world: int) -> list[dict[str, Any]]:
    """One entry per trial the leader started: handoff latency and control overhead."""
    leader = [r for r in rows if r["rank"] == 0 and "t_started" in r]
    exits = {r[key]: r["t_exit"] for r in rows if r["rank"] == 0 and "t_exit" in r}
    out, prev_exit = [], None
    for i, lead in enumerate(leader):
        follow = [
            r["t_enter"]
            for r in rows
            if r["rank"] > 0 and r.get(key) == lead[key] and "t_enter" in r
        ]
        ranks = {r["rank"] for r in rows if r["rank"] > 0 and r.get(key) == lead[key]}
        complete = len(ranks) == world - 1
        out.append(
            {
                "index": i + 1,
                "payload": lead.get("payload"),
                "complete": complete,
                "latency_s": (max(follow) - lead["t_started"]) if complete else None,
                "overhead_s": (max(follow) - prev_exit) if complete and prev_exit else None,
                "sample_s": (lead["t_started"] - prev_exit) if prev_exit else None,
            }
        )
        prev_exit = exits.get(lead[key])
    return out


def wait_cpu(record: dict[str, Any], windows: list[tuple[float, float]]) -> list[float]:
    """CPU-seconds per wall-second of each follower inside the leader's hold windows."""
    rates = []
    for proc in record.get("processes", {}).values():
        if proc.get("role") in ("rank0", "launcher") or "supervise" in proc.get("cmd", ""):
            continue
        samples = proc["samples"]
        for a, b in windows:
            inside = [s for s in samples if a + 0.2 <= s[0] <= b - 0.2]
            if len(inside) >= 2 and inside[-1][0] > inside[0][0]:
                rates.append((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]))
    return rates


# ----------------------------------------------------------------------------- sections
def run_channel(cfg: dict[str, Any], tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for world in cfg["channel_worlds"]:
        d = tmp / f"channel_w{world}"
        d.mkdir()
        res = d / "channel.json"
        rec = supervised(
            f"channel_w{world}",
            [
                PY,
                str(HERE / "channel_bench.py"),
                "--world",
                str(world),
                "--reps",
                str(cfg["channel_reps"]),
                "--payloads",
                ",".join(map(str, PAYLOADS)),
                "--hold",
                str(cfg["hold"]),
                "--out",
                str(res),
            ],
            cwd=d,
            deadline=240,
            role="rank0",
        )
        data = json.loads(res.read_text()) if res.exists() else {}
        save_raw(f"channel_w{world}", {"supervisor": slim(rec), "result": data})
        lat = data.get("latency_s", {})
        out[str(world)] = {
            "ok": bool(data) and rec["exit_code"] == 0,
            "latency_ms": {
                s: {"median": q(v, 0.5) * 1e3, "p95": q(v, 0.95) * 1e3, "n": len(v)}
                for s, v in lat.items()
            },
            "wait_cpu_per_s": [w["cpu_s"] / w["wall_s"] for w in data.get("wait", [])],
            "left": len(rec["left"]),
        }
        print(f"  channel w={world}: {out[str(world)]['latency_ms']}", flush=True)
    return out


def plain_launch(
    system: str,
    world: int,
    tmp: Path,
    *,
    trials: int,
    payloads: tuple[int, ...],
    optimizer: str,
    hold: float,
    hold_trials: str,
    tag: str,
) -> dict[str, Any]:
    d = tmp / f"{tag}_{system}_w{world}"
    d.mkdir()
    cmd = [
        PY,
        str(HERE / "plain_launch.py"),
        "--world",
        str(world),
        "--system",
        system,
        "--root",
        str(d / "root"),
        "--timings",
        str(d / "timings"),
        "--trials",
        str(trials),
        "--optimizer",
        optimizer,
        "--payloads",
        ",".join(map(str, payloads)),
        "--hold",
        str(hold),
        "--hold-trials",
        hold_trials,
        "--barrier-timeout",
        "150",
    ]
    rec = supervised(
        f"{tag}_{system}_w{world}", cmd, cwd=d, deadline=200 + 20 * trials, role="launcher"
    )
    rows = read_jsonl(d / "timings")
    trials_ = trials_from_timings(rows, "x", world)
    holds = [tuple(r["hold"]) for r in rows if "hold" in r]
    done = neps_successes(d / "root")
    result = {
        "system": system,
        "world": world,
        "exit_code": rec["exit_code"],
        "timed_out": rec["timed_out"],
        "neps_successes": done,
        "trials_wanted": trials,
        "completed": rec["exit_code"] == 0 and done >= trials,
        "error": "" if rec["exit_code"] == 0 else error_line(rec["log_tail"]),
        "trials": trials_,
        "wait_cpu_per_s": wait_cpu(rec, holds),
        "holds": holds,
        "left": rec["left"],
        "killed_at_deadline": rec.get("killed_at_deadline", []),
        "wall_s": rec["wall_s"],
        "cpu_at_exit_s": rec["cpu_at_exit_s"],
    }
    save_raw(f"{tag}_{system}_w{world}", {"supervisor": slim(rec), "result": result})
    result["timeline"] = follower_timeline(rec)
    print(
        f"  {tag} {system} w={world}: exit={rec['exit_code']} ok={result['completed']}"
        f" trials={done}/{trials} left={len(rec['left'])} {result['error'][:100]}",
        flush=True,
    )
    return result


def lightning_launch(system: str, tmp: Path, *, trials: int, tag: str) -> dict[str, Any]:
    d = tmp / f"{tag}_{system}"
    d.mkdir()
    cmd = [
        PY,
        str(HERE / "lightning_search.py"),
        "--system",
        system,
        "--root",
        str(d / "root"),
        "--timings",
        str(d / "timings"),
        "--trials",
        str(trials),
    ]
    rec = supervised(f"{tag}_{system}", cmd, cwd=d, deadline=60 + 15 * trials)
    rows = read_jsonl(d / "timings")
    done = neps_successes(d / "root")
    left = rec["left"]
    result = {
        "system": system,
        "exit_code": rec["exit_code"],
        "timed_out": rec["timed_out"],
        "neps_successes": done,
        "trials_wanted": trials,
        "completed": rec["exit_code"] == 0 and not rec["timed_out"] and done >= trials,
        "error": "" if rec["exit_code"] == 0 else error_line(rec["log_tail"]),
        "wall_s": rec["wall_s"],
        "cpu_at_exit_s": rec["cpu_at_exit_s"],
        "left": len(left),
        "left_cpu_per_s": sum(p["cpu_per_wall_s"] for p in left),
        "killed_at_deadline": len(rec.get("killed_at_deadline", [])),
        "trials": trials_from_timings(rows, "lr", 2),
    }
    save_raw(f"{tag}_{system}", {"supervisor": slim(rec), "result": result})
    result["timeline"] = follower_timeline(rec)
    print(
        f"  {tag} {system}: exit={rec['exit_code']} ok={result['completed']} trials={done}/"
        f"{trials} wall={rec['wall_s']:.1f}s cpu={rec['cpu_at_exit_s']} left={len(left)}"
        f" {result['error'][:100]}",
        flush=True,
    )
    return result


def follower_timeline(rec: dict[str, Any]) -> dict[str, Any]:
    """CPU time series of rank 1 (and the leader) for the plot."""
    out: dict[str, Any] = {"t_start": rec.get("t_start"), "t_exit": rec.get("t_exit")}
    for proc in rec.get("processes", {}).values():
        if proc.get("role") in ("rank0", "rank1") and "supervise" not in proc.get("cmd", ""):
            out.setdefault(proc["role"], proc["samples"])
    return out


def slim(rec: dict[str, Any]) -> dict[str, Any]:
    return rec


def save_raw(name: str, data: dict[str, Any]) -> None:
    RAW.mkdir(parents=True, exist_ok=True)
    (RAW / f"{name}.json").write_text(json.dumps(data))


# ----------------------------------------------------------------------------- summary
def stats(values: list[float | None], scale: float = 1.0) -> dict[str, Any]:
    v = [x * scale for x in values if x is not None]
    return {
        "median": q(v, 0.5),
        "p95": q(v, 0.95),
        "mean": statistics.fmean(v) if v else None,
        "n": len(v),
    }


def summarize(raw: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {"channel": raw["channel"]}
    lat: dict[str, Any] = {}
    for key, runs in raw["plain"].items():
        system, world = key.split(":")
        measured = [t for t in runs["trials"] if t["index"] > 1]
        extra = raw["sweep"].get(system, {}).get("trials", []) if world == "2" else []
        by_size = measured + [t for t in extra if t["index"] > 1]
        lat.setdefault(world, {})[system] = {
            "all": stats([t["latency_s"] for t in measured], 1e3),
            "by_payload": {
                str(p): stats([t["latency_s"] for t in by_size if t["payload"] == p], 1e3)
                for p in PAYLOADS
            },
            "overhead_ms": stats([t["overhead_s"] for t in measured], 1e3),
            "wait_cpu_per_s": stats(runs["wait_cpu_per_s"]),
            "completed": runs["completed"],
            "error": runs["error"],
            "left": len(runs["left"]),
            "trials_done": runs["neps_successes"],
            "trials_wanted": runs["trials_wanted"],
        }
    s["plain"] = lat
    e2e: dict[str, Any] = {}
    for system in SYSTEMS:
        runs = [r for r in raw["e2e"] if r["system"] == system and r["completed"]]
        walls = [r["wall_s"] for r in runs]
        cpus = [r["cpu_at_exit_s"] for r in runs if r["cpu_at_exit_s"] is not None]
        e2e[system] = {
            "runs": len(runs),
            "runs_total": len([r for r in raw["e2e"] if r["system"] == system]),
            "wall_s": statistics.median(walls) if walls else None,
            "cpu_s": statistics.median(cpus) if cpus else None,
            "trials_per_min": (60 * cfg["e2e_trials"] / statistics.median(walls))
            if walls
            else None,
            "latency_ms": stats(
                [t["latency_s"] for r in runs for t in r["trials"] if t["index"] > 1], 1e3
            ),
        }
    s["e2e"] = e2e
    rel: dict[str, Any] = {}
    for system in SYSTEMS:
        runs = [r for r in raw["e2e"] + raw["reliability"] if r["system"] == system]
        rel[system] = {
            "runs": len(runs),
            "completed": sum(r["completed"] for r in runs),
            "lost": sum(not r["completed"] for r in runs),
            "runs_with_leftovers": sum(r["left"] > 0 for r in runs),
            "left_processes": sum(r["left"] for r in runs),
            "left_cpu_per_s": statistics.fmean([r["left_cpu_per_s"] for r in runs if r["left"]])
            if any(r["left"] for r in runs)
            else 0.0,
            "errors": sorted({r["error"] for r in runs if r["error"]}),
        }
    s["reliability"] = rel
    bo: dict[str, Any] = {}
    for system in SYSTEMS:
        r = raw["bo"][system]
        samples = [t["sample_s"] for t in r["trials"] if t["sample_s"] is not None]
        tail = samples[-5:]
        bo[system] = {
            "completed": r["completed"],
            "trials_done": r["neps_successes"],
            "sample_s_last5": stats(tail),
            "sample_s_all": samples,
            "error": r["error"],
        }
    s["bo"] = bo
    s["sweep"] = {
        k: {f: v[f] for f in ("neps_successes", "trials_wanted", "completed", "left", "error")}
        for k, v in raw["sweep"].items()
    }
    return s


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(v: float | None, digits: int = 2, unit: str = "") -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}{unit}"


def fx(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def machine() -> dict[str, str]:
    import importlib.metadata as md

    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    return {
        "nproc": str(os.cpu_count()),
        "cpu": model or platform.processor(),
        "python": platform.python_version(),
        "torch": md.version("torch"),
        "lightning": md.version("lightning"),
        "neps": md.version("neural-pipeline-search"),
        "kernel": platform.release(),
        "load average (1/5/15 min) at the end": " ".join(
            Path("/proc/loadavg").read_text().split()[:3]
        ),
    }


def report(
    s: dict[str, Any], cfg: dict[str, Any], mode: str, mach: dict[str, str], seconds: float
) -> str:
    P, E, R, B = s["plain"], s["e2e"], s["reliability"], s["bo"]
    rows = []

    def row(metric: str, ours: str, builtin: str, r: str, goal: str) -> None:
        rows.append(f"| {metric} | {ours} | {builtin} | {r} | {goal} |")

    for w in sorted(P, key=int):
        o, b = P[w].get("ours", {}), P[w].get("builtin", {})
        om, bm = o.get("all", {}).get("median"), b.get("all", {}).get("median")
        goal = {"2": "ours <= 2 ms", "8": "ours <= 10 ms"}.get(w, "")
        row(
            f"handoff median, NePS trial start -> last follower starts (ms), world {w}",
            fmt(om),
            fmt(bm),
            fx(ratio(bm, om)),
            goal,
        )
        row(
            f"handoff p95 (ms), world {w}",
            fmt(o.get("all", {}).get("p95")),
            fmt(b.get("all", {}).get("p95")),
            fx(ratio(b.get("all", {}).get("p95"), o.get("all", {}).get("p95"))),
            "",
        )
    for w in sorted(s["channel"], key=int):
        c = s["channel"][w]["latency_ms"]
        row(
            f"neps_bcast channel alone, median / p95 (ms), world {w}, 1 KB",
            f"{fmt(c.get('1000', {}).get('median'))} / {fmt(c.get('1000', {}).get('p95'))}",
            "-",
            "-",
            {"2": "<= 2 ms", "8": "<= 10 ms"}.get(w, ""),
        )
    for w in sorted(P, key=int):
        o, b = P[w].get("ours", {}), P[w].get("builtin", {})
        row(
            f"per-trial control overhead, median (ms), world {w}",
            fmt(o.get("overhead_ms", {}).get("median")),
            fmt(b.get("overhead_ms", {}).get("median")),
            fx(
                ratio(
                    b.get("overhead_ms", {}).get("median"), o.get("overhead_ms", {}).get("median")
                )
            ),
            "",
        )
    for w in sorted(P, key=int):
        o, b = P[w].get("ours", {}), P[w].get("builtin", {})
        ow, bw = o.get("wait_cpu_per_s", {}).get("mean"), b.get("wait_cpu_per_s", {}).get("mean")
        row(
            f"follower CPU while the leader holds the trial (% of a core), world {w}",
            fmt(ow * 100 if ow is not None else None, 1),
            fmt(bw * 100 if bw is not None else None, 1),
            fx(ratio(bw, ow)) if ow else "n/a (ours ~0)",
            "ours <= 1%" if w == "2" else "",
        )
    eo, eb = E["ours"], E["builtin"]
    row(
        f"end to end, {cfg['e2e_trials']} trials, Lightning ddp x2: wall time (s)",
        fmt(eo["wall_s"], 1),
        fmt(eb["wall_s"], 1),
        fx(ratio(eb["wall_s"], eo["wall_s"])),
        "ours <= built-in",
    )
    row(
        "end to end: CPU-seconds of all processes (up to the leader's exit)",
        fmt(eo["cpu_s"], 1),
        fmt(eb["cpu_s"], 1),
        fx(ratio(eb["cpu_s"], eo["cpu_s"])),
        "built-in/ours >= 1.3x",
    )
    row(
        "end to end: trials per minute",
        fmt(eo["trials_per_min"], 1),
        fmt(eb["trials_per_min"], 1),
        fx(ratio(eo["trials_per_min"], eb["trials_per_min"])) + " (ours/built-in)",
        "",
    )
    row(
        "end to end: handoff median (ms), Lightning ddp x2",
        fmt(eo["latency_ms"]["median"]),
        fmt(eb["latency_ms"]["median"]),
        fx(ratio(eb["latency_ms"]["median"], eo["latency_ms"]["median"])),
        "",
    )
    ro, rb = R["ours"], R["builtin"]
    row(
        f"reliability: runs completed / lost (Lightning ddp x2, {cfg['rel_trials']}-"
        f"{cfg['e2e_trials']} trials)",
        f"{ro['completed']}/{ro['runs']} / {ro['lost']}",
        f"{rb['completed']}/{rb['runs']} / {rb['lost']}",
        "-",
        "ours: 0 lost",
    )
    row(
        "reliability: runs that left processes alive / processes left",
        f"{ro['runs_with_leftovers']} / {ro['left_processes']}",
        f"{rb['runs_with_leftovers']} / {rb['left_processes']}",
        "-",
        "ours: 0",
    )
    row(
        "reliability: CPU of each left-behind process (% of a core)",
        fmt(ro["left_cpu_per_s"] * 100, 0),
        fmt(rb["left_cpu_per_s"] * 100, 0),
        "-",
        "",
    )
    bo_o, bo_b = B["ours"]["sample_s_last5"]["median"], B["builtin"]["sample_s_last5"]["median"]
    row(
        f"Bayesian optimization: time to the next trial at ~{cfg['bo_trials']} trials,"
        " median of last 5 (s), world 2",
        fmt(bo_o, 3),
        fmt(bo_b, 3),
        fx(ratio(bo_b, bo_o)),
        "",
    )

    table = "\n".join(
        [
            "| metric | neps_bcast (ours) | NePS built-in | built-in / ours | goal |",
            "|---|---|---|---|---|",
            *rows,
        ]
    )
    pay = []
    for w in sorted(P, key=int):
        for p in PAYLOADS:
            o = P[w].get("ours", {}).get("by_payload", {}).get(str(p), {})
            b = P[w].get("builtin", {}).get("by_payload", {}).get(str(p), {})
            c = s["channel"].get(w, {}).get("latency_ms", {}).get(str(p), {})
            pay.append(
                f"| {w} | {p // 1000} KB | {fmt(o.get('median'))} (n={o.get('n', 0)}) |"
                f" {fmt(b.get('median'))} (n={b.get('n', 0)}) |"
                f" {fx(ratio(b.get('median'), o.get('median')))} |"
                f" {fmt(c.get('median'))} / {fmt(c.get('p95'))} |"
            )
    runs = []
    for w in sorted(P, key=int):
        for system in SYSTEMS:
            x = P[w].get(system, {})
            runs.append(
                f"| {w}, 1 KB | {LABEL[system]} |"
                f" {x.get('trials_done')}/{x.get('trials_wanted')}"
                f" | {'yes' if x.get('completed') else 'no'} | {x.get('left')} |"
                f" {x.get('error') or ''} |"
            )
    for system in SYSTEMS:
        x = s["sweep"].get(system, {})
        runs.append(
            f"| 2, 100 KB + 1 MB | {LABEL[system]} |"
            f" {x.get('neps_successes')}/{x.get('trials_wanted')}"
            f" | {'yes' if x.get('completed') else 'no'} | {len(x.get('left', []))} |"
            f" {x.get('error') or ''} |"
        )
    errors = "\n".join(f"- {LABEL[k]}: `{e}`" for k in SYSTEMS for e in R[k]["errors"]) or "- none"
    mach_line = ", ".join(f"{k} {v}" for k, v in mach.items())
    return f"""# neps_bcast vs NePS built-in DDP mode

Mode: `{mode}`. Command: `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --{mode}`
(`make {"bench" if mode == "quick" else "bench-full"}`); took {seconds / 60:.1f} min.
Machine: {mach_line}.
Generated {time.strftime("%Y-%m-%d %H:%M:%S")}. Both systems ran in this one run, interleaved
(for each cell: neps_bcast, then NePS built-in, then the next cell), on the same workloads.

Ratios are **built-in / ours** (higher = neps_bcast better) unless marked otherwise.

{table}

Definitions:
- *handoff*: from the moment the leader's NePS marks the trial as started (`time_started`,
  just before it writes the trial to disk) to the moment the **last** follower enters the
  trial function (CLOCK_REALTIME, same machine). Plain-DDP workload (no Lightning: ranks started
  like torchrun, trivial trial function, random search, 1 KB of trial arguments), first trial excluded. It
  includes NePS writing the trial, so it is a lower bound neither system can beat; the
  *channel alone* rows measure neps_bcast's broadcast between real processes without NePS.
- *control overhead*: leader's trial function returned -> last follower entered the next trial
  (NePS bookkeeping + sampling + handoff; for neps_bcast also the end-of-trial exchanges).
- *follower CPU while waiting*: the leader sleeps {cfg["hold"]} s inside a trial after the
  followers returned; CPU-seconds per wall-second of each follower from `/proc/<pid>/stat`
  (utime+stime, sampled every 0.2 s), mean over followers.
- *end to end*: `python lightning_search.py` (Lightning `strategy="ddp"`, `devices=2`, CPU,
  tiny MLP, 1 epoch, random search), {cfg["e2e_trials"]} trials; wall from launch to the
  leader's exit; CPU = all processes of the launch's session up to the leader's exit.
- *reliability*: every Lightning launch of this run (end to end + {cfg["rel_runs"]} more
  runs of {cfg["rel_trials"]} trials per system). Lost = non-zero exit, deadline, or fewer
  successful trials than asked. Left = processes of the launch alive 5 s after the leader
  exited; each was measured for 2 s, then killed by PID.
- *Bayesian optimization*: plain-DDP workload, world 2, `optimizer="bayesian_optimization"`,
  {cfg["bo_trials"]} trials; time from the leader's trial function returning to NePS marking the
  next trial as started, median of the last 5 trials.

## Handoff by payload (plain-DDP workload, median ms)

The trial's arguments include a string of this size (a `Categorical` choice), so it travels
with the trial: neps_bcast broadcasts it, NePS's followers read it from the trial file.

| world | payload | neps_bcast | NePS built-in | built-in / ours | neps_bcast channel alone, median / p95 |
|---|---|---|---|---|---|
{chr(10).join(pay)}

## Plain-DDP launches

| world, payload | system | trials done | completed | processes left | error |
|---|---|---|---|---|---|
{chr(10).join(runs)}

Errors seen in the Lightning runs:
{errors}

![handoff latency](latency.png)

![follower CPU over time](follower_cpu.png)
"""


# ----------------------------------------------------------------------------- plots
def plots(s: dict[str, Any], raw: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for system, color in (("ours", "tab:blue"), ("builtin", "tab:red")):
        ws = sorted(int(w) for w in s["plain"] if system in s["plain"][w])
        med = [s["plain"][str(w)][system]["all"]["median"] for w in ws]
        p95 = [s["plain"][str(w)][system]["all"]["p95"] for w in ws]
        ax.plot(
            ws,
            [m if m is not None else float("nan") for m in med],
            "o-",
            color=color,
            label=f"{LABEL[system]} median",
        )
        ax.plot(
            ws,
            [m if m is not None else float("nan") for m in p95],
            "o--",
            color=color,
            alpha=0.6,
            label=f"{LABEL[system]} p95",
        )
    cw = sorted(int(w) for w in s["channel"])
    ax.plot(
        cw,
        [
            s["channel"][str(w)]["latency_ms"].get("1000", {}).get("median", float("nan"))
            for w in cw
        ],
        "s:",
        color="tab:green",
        label="neps_bcast channel alone (1 KB)",
    )
    ax.set_xticks([2, 4, 8])
    ax.set_yscale("log")
    ax.set_xlabel("world size (processes)")
    ax.set_ylabel("handoff latency (ms, log)")
    ax.set_title("Trial start -> last follower starts (plain DDP)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    for w, marker in (("2", "o"), ("4", "s"), ("8", "^")):
        if w not in s["plain"]:
            continue
        for system, color in (("ours", "tab:blue"), ("builtin", "tab:red")):
            bp = s["plain"][w].get(system, {}).get("by_payload", {})
            ys = [bp.get(str(p), {}).get("median") for p in PAYLOADS]
            ax.plot(
                [p / 1000 for p in PAYLOADS],
                [y if y is not None else float("nan") for y in ys],
                marker=marker,
                color=color,
                linestyle="-" if system == "ours" else "--",
                label=f"{LABEL[system]}, world {w}",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("trial arguments (KB, log)")
    ax.set_ylabel("median handoff latency (ms, log)")
    ax.set_title("Handoff vs payload")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(RESULTS / "latency.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(11, 7))
    sources = [
        ("plain", "Plain DDP, world 2: leader holds trial 3 (shaded)"),
        ("e2e", "Lightning ddp x2, end to end: leader exits at the dotted line"),
    ]
    for ax, (kind, title) in zip(axes, sources, strict=True):
        for system, color in (("ours", "tab:blue"), ("builtin", "tab:red")):
            if kind == "plain":
                run = raw["plain"].get(f"{system}:2")
            else:
                run = next((r for r in raw["e2e"] if r["system"] == system), None)
            if not run or "rank1" not in run["timeline"]:
                continue
            tl = run["timeline"]
            samples = tl["rank1"]
            t0 = tl["t_start"]
            xs, ys = [], []
            for (ta, ca), (tb, cb) in itertools.pairwise(samples):
                if tb > ta:
                    xs.append(tb - t0)
                    ys.append(100 * (cb - ca) / (tb - ta))
            ax.plot(xs, ys, color=color, label=f"{LABEL[system]} follower (rank 1)", lw=1.2)
            if tl.get("t_exit"):
                ax.axvline(tl["t_exit"] - t0, color=color, ls=":", lw=1)
            if kind == "plain":
                for a, b in run.get("holds", []):
                    ax.axvspan(a - t0, b - t0, color=color, alpha=0.12)
        ax.set_title(title)
        ax.set_xlabel("seconds since launch")
        ax.set_ylabel("CPU (% of one core)")
        ax.set_ylim(-5, 130)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(RESULTS / "follower_cpu.png", dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true")
    g.add_argument("--full", action="store_true")
    p.add_argument("--keep-tmp", action="store_true")
    args = p.parse_args()
    mode = "full" if args.full else "quick"
    cfg = FULL if args.full else QUICK
    os.environ["OMP_NUM_THREADS"] = "1"
    if RAW.exists():
        shutil.rmtree(RAW)
    RAW.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="neps_bcast_bench_"))
    start = time.monotonic()
    raw: dict[str, Any] = {"plain": {}, "sweep": {}, "e2e": [], "reliability": [], "bo": {}}
    try:
        print(f"[{mode}] tmp root {tmp}", flush=True)
        print("1/5 neps_bcast channel alone", flush=True)
        raw["channel"] = run_channel(cfg, tmp)
        print("2/5 plain DDP: handoff, overhead, waiting CPU (interleaved)", flush=True)
        for world in cfg["plain_worlds"]:
            for system in SYSTEMS:
                raw["plain"][f"{system}:{world}"] = plain_launch(
                    system,
                    world,
                    tmp,
                    trials=cfg["plain_trials"],
                    payloads=PAYLOADS[:1],
                    optimizer="random_search",
                    hold=cfg["hold"],
                    hold_trials="3",
                    tag="plain",
                )
        # Big trial arguments in runs of their own: NePS's followers crash on them often
        # (half-written trial file), which would leave the world-size runs without data.
        for system in SYSTEMS:
            raw["sweep"][system] = plain_launch(
                system,
                2,
                tmp,
                trials=cfg["sweep_trials"],
                payloads=PAYLOADS[1:],
                optimizer="random_search",
                hold=0,
                hold_trials="",
                tag="sweep",
            )
        print("3/5 end to end, Lightning ddp x2 (interleaved)", flush=True)
        for i in range(cfg["e2e_runs"]):
            order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                raw["e2e"].append(
                    lightning_launch(system, tmp, trials=cfg["e2e_trials"], tag=f"e2e{i}")
                )
        print("4/5 reliability, Lightning ddp x2 (interleaved)", flush=True)
        for i in range(cfg["rel_runs"]):
            order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
            for system in order:
                raw["reliability"].append(
                    lightning_launch(system, tmp, trials=cfg["rel_trials"], tag=f"rel{i}")
                )
        print("5/5 Bayesian optimization at world 2 (interleaved)", flush=True)
        for system in SYSTEMS:
            raw["bo"][system] = plain_launch(
                system,
                2,
                tmp,
                trials=cfg["bo_trials"],
                payloads=(),
                optimizer="bayesian_optimization",
                hold=0,
                hold_trials="",
                tag="bo",
            )
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - start
    summary = summarize(raw, cfg)
    mach = machine()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"summary_{mode}.json").write_text(
        json.dumps(
            {"mode": mode, "config": cfg, "machine": mach, "seconds": seconds, "summary": summary},
            indent=1,
        )
    )
    (RESULTS / "REPORT.md").write_text(report(summary, cfg, mode, mach, seconds))
    plots(summary, raw)
    print(f"done in {seconds / 60:.1f} min: {RESULTS / 'REPORT.md'}", flush=True)


if __name__ == "__main__":
    main()
