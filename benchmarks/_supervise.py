"""Run one launch and account for every process it starts.

    BENCH_LAUNCH=<id> python benchmarks/_supervise.py --out run.json --log run.log \\
        --deadline 300 -- python script.py ...

Every process of the launch (Lightning's children, NePS's followers that never exit)
inherits ``BENCH_LAUNCH`` from the supervisor's environment; that marker is how they are
found (``_proc.launch_pids``). The supervisor makes itself a child subreaper, so processes
orphaned by the launch are re-parented to it and their CPU time is accounted when it reaps
them. It records:

- the target's exit code and wall time (the target is the leader / launcher process);
- ``cpu_at_exit_s``: CPU seconds of all processes of the launch up to the target's exit
  (reaped descendants via RUSAGE_CHILDREN, live ones and exited-but-unreaped children
  from /proc);
- a CPU timeline of every process, sampled every ``--sample-every`` seconds;
- the processes still alive ``--grace`` seconds after the target exited (left behind),
  their CPU use over the next ``--linger`` seconds, then kills each of them by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from _proc import LAUNCH_MARKER, describe, launch_pids, procfs

PR_SET_CHILD_SUBREAPER = 36
KILL_ALL_TIMEOUT_S = 10.0


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def reap_exited_children() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] != 0:
            pass


def realtime() -> float:
    return time.clock_gettime(time.CLOCK_REALTIME)


class Census:
    """The launch's processes: each one's role and CPU-time samples (realtime, cpu_s)."""

    def __init__(self, launch_id: str) -> None:
        self.launch_id = launch_id
        self.own_pid = os.getpid()
        self.roles: dict[int, dict[str, str]] = {}
        self.samples: dict[int, list[tuple[float, float]]] = {}

    def pids(self) -> list[int]:
        return launch_pids(self.launch_id, exclude=(self.own_pid,))

    def role(self, pid: int) -> dict[str, str]:
        if pid not in self.roles:
            self.roles[pid] = describe(pid)
        return self.roles[pid]

    def sample(self) -> dict[int, float]:
        """CPU seconds of every live process of the launch, appended to its timeline."""
        now = realtime()
        cpu_by_pid = {}
        for pid in self.pids():
            stat = procfs.read_stat(pid)
            if stat is None:
                continue
            self.role(pid)
            self.samples.setdefault(pid, []).append((now, stat.cpu_seconds))
            cpu_by_pid[pid] = stat.cpu_seconds
        return cpu_by_pid

    def exited_unreaped_cpu(self, exclude: dict[int, float]) -> float:
        """CPU seconds of the supervisor's children that exited but are not reaped yet.

        A process that exits between the last reap and the last sample is a zombie: no
        longer live, not yet in RUSAGE_CHILDREN; its stat still holds its CPU time. (As
        the subreaper, the supervisor is the parent of every orphaned launch process.)
        """
        total = 0.0
        for pid in procfs.all_pids():
            if pid in exclude:
                continue
            stat = procfs.read_stat(pid)
            if stat is not None and stat.ppid == self.own_pid and stat.is_zombie:
                total += stat.cpu_seconds
        return total

    def timelines(self) -> dict[str, dict[str, object]]:
        return {
            str(pid): {**self.roles.get(pid, {}), "samples": samples}
            for pid, samples in self.samples.items()
        }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--deadline", type=float, default=300.0)
    parser.add_argument("--grace", type=float, default=5.0)
    parser.add_argument("--linger", type=float, default=2.0)
    parser.add_argument("--sample-every", type=float, default=0.2)
    parser.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    if args.cmd and args.cmd[0] == "--":
        args.cmd = args.cmd[1:]
    return args


def main() -> None:
    args = parse_args()
    launch_id = os.environ.get(LAUNCH_MARKER)
    if not launch_id:
        sys.exit(f"_supervise.py needs {LAUNCH_MARKER} in its environment")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    census = Census(launch_id)

    t_start = realtime()
    started = time.monotonic()
    with Path(args.log).open("wb") as log:
        target = subprocess.Popen(
            args.cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    timed_out = False
    killed_at_deadline: list[dict[str, object]] = []
    while (exit_code := target.poll()) is None:
        if time.monotonic() - started > args.deadline:
            timed_out = True
            for pid in census.pids():
                killed_at_deadline.append({"pid": pid, **census.role(pid)})
                procfs.kill(pid)
            exit_code = target.wait()
            break
        census.sample()
        time.sleep(args.sample_every)
    wall_s = time.monotonic() - started
    t_exit = realtime()
    reap_exited_children()
    cpu_by_pid = census.sample()
    cpu_at_exit_s = (
        children_cpu_seconds()
        + sum(cpu_by_pid.values())
        + census.exited_unreaped_cpu(exclude=cpu_by_pid)
    )

    # Give processes that stop on their own the chance to do so.
    grace_end = time.monotonic() + args.grace
    while time.monotonic() < grace_end and cpu_by_pid:
        time.sleep(args.sample_every)
        reap_exited_children()
        cpu_by_pid = census.sample()
    left_before = dict(cpu_by_pid)
    time.sleep(args.linger if left_before else 0)
    left_after = census.sample()
    left = []
    for pid, cpu_before in sorted(left_before.items()):
        cpu_after = left_after.get(pid, cpu_before)
        left.append(
            {
                "pid": pid,
                **census.role(pid),
                "cpu_s_total": cpu_after,
                "cpu_per_wall_s": (cpu_after - cpu_before) / args.linger,
                "killed": procfs.kill(pid),
            }
        )
    kill_all_end = time.monotonic() + KILL_ALL_TIMEOUT_S
    while time.monotonic() < kill_all_end:
        for pid in census.pids():
            procfs.kill(pid)
        try:  # reap every child (orphans included) so that its CPU time is accounted
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.05)
        except ChildProcessError:
            break
    record = {
        "cmd": args.cmd,
        "exit_code": exit_code,
        "timed_out": timed_out,
        "wall_s": wall_s,
        "t_start": t_start,
        "t_exit": t_exit,
        "cpu_at_exit_s": cpu_at_exit_s,
        "cpu_all_s": children_cpu_seconds(),
        "left": left,
        "killed_at_deadline": killed_at_deadline,
        "still_alive_after_kill": census.pids(),
        "processes": census.timelines(),
    }
    Path(args.out).write_text(json.dumps(record))


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main()
