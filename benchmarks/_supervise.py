"""Run one launch in its own process session and account for every process it starts.

    python benchmarks/_supervise.py --out run.json --deadline 300 -- python script.py ...

The supervisor must itself be started with ``start_new_session=True``: every process of
the launch (Lightning's children, NePS's followers that never exit) then shares its
session id. It makes itself a child subreaper, so processes orphaned by the launch are
re-parented to it and their CPU time is accounted when it reaps them. It records:

- the target's exit code and wall time (the target is the leader / launcher process);
- ``cpu_at_exit_s``: CPU seconds of all processes of the launch up to the target's exit
  (reaped descendants via RUSAGE_CHILDREN plus live ones from /proc);
- a CPU timeline of every process, sampled every ``--sample-every`` seconds;
- the processes still alive ``--grace`` seconds after the target exited (left behind),
  their CPU use over the next ``--linger`` seconds, then kills each of them by PID.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _proc import describe, kill, read_stat, session_pids

PR_SET_CHILD_SUBREAPER = 36


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=300.0)
    p.add_argument("--grace", type=float, default=5.0)
    p.add_argument("--linger", type=float, default=2.0)
    p.add_argument("--sample-every", type=float, default=0.2)
    p.add_argument("--log", required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args()
    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    me = os.getpid()
    sid = os.getsid(0)
    roles: dict[int, dict[str, str]] = {}
    timeline: dict[int, list[tuple[float, float]]] = {}

    def sample() -> dict[int, float]:
        now = time.clock_gettime(time.CLOCK_REALTIME)
        live = {}
        for pid in session_pids(sid, exclude=(me,)):
            st = read_stat(pid)
            if st is None:
                continue
            if pid not in roles:
                roles[pid] = describe(pid)
            timeline.setdefault(pid, []).append((now, st[2]))
            live[pid] = st[2]
        return live

    t0 = time.clock_gettime(time.CLOCK_REALTIME)
    m0 = time.monotonic()
    with Path(args.log).open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    timed_out = False
    killed_at_deadline: list[dict[str, object]] = []
    while True:
        code = proc.poll()
        if code is not None:
            break
        if time.monotonic() - m0 > args.deadline:
            timed_out = True
            for pid in session_pids(sid, exclude=(me,)):
                killed_at_deadline.append({"pid": pid, **roles.get(pid, describe(pid))})
                kill(pid)
            code = proc.wait()
            break
        sample()
        time.sleep(args.sample_every)
    wall = time.monotonic() - m0
    t_exit = time.clock_gettime(time.CLOCK_REALTIME)
    reap_all()
    live = sample()
    cpu_at_exit = children_cpu() + sum(live.values())

    # Give processes that stop on their own the chance to do so.
    end = time.monotonic() + args.grace
    while time.monotonic() < end and live:
        time.sleep(args.sample_every)
        reap_all()
        live = sample()
    left_pids = sorted(live)
    before = dict(live)
    time.sleep(args.linger if left_pids else 0)
    after = sample()
    left = []
    for pid in left_pids:
        cpu_rate = (after.get(pid, before[pid]) - before[pid]) / args.linger
        left.append(
            {
                "pid": pid,
                **roles.get(pid, {}),
                "cpu_s_total": after.get(pid, before[pid]),
                "cpu_per_wall_s": cpu_rate,
                "killed": kill(pid),
            }
        )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for pid in session_pids(sid, exclude=(me,)):
            kill(pid)
        try:  # reap every child (orphans included) so that its CPU time is accounted
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.05)
        except ChildProcessError:
            break
    still = session_pids(sid, exclude=(me,))
    result = {
        "cmd": cmd,
        "exit_code": code,
        "timed_out": timed_out,
        "wall_s": wall,
        "t_start": t0,
        "t_exit": t_exit,
        "cpu_at_exit_s": cpu_at_exit,
        "cpu_all_s": children_cpu(),
        "left": left,
        "killed_at_deadline": killed_at_deadline,
        "still_alive_after_kill": still,
        "processes": {
            str(pid): {**roles.get(pid, {}), "samples": timeline[pid]} for pid in timeline
        },
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
