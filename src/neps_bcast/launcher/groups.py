"""Start one torchrun per group, watch them, stop them all: the launcher's only moving part.

Why torchrun and not our own process manager: restarts (``--max-restarts``), rendezvous
and forwarding signals to the workers are torch's, already correct and known to users.
Each group is ``python -m torch.distributed.run --standalone --nproc-per-node N`` in a
process session of its own (``processes.Supervisor``, the same for a pool):
``--standalone`` makes torch bind its rendezvous store to a port the OS picks (never a
fixed one; a port in use elsewhere never matters), and the own session means a Ctrl-C in
the terminal reaches only this launcher, which then stops every group the same way:
SIGTERM to each torchrun (which forwards it to its workers and SIGKILLs them after its
own 30 s), a bounded wait, then SIGKILL to whatever is left of the launch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from neps_bcast.launcher import status
from neps_bcast.launcher.plan import GroupPlan, LaunchPlan, group_environment
from neps_bcast.launcher.processes import Settings, Supervisor

__all__ = ["Settings", "run", "start_group", "torchrun_command"]

RANK_LOG_MODULE = "neps_bcast.launcher.rank_log"


def torchrun_command(group: GroupPlan, plan: LaunchPlan) -> list[str]:
    """The command group ``group`` runs: torchrun, starting ``rank_log`` per rank
    (``--module``: importing ``neps_bcast`` does not import torch), which runs the
    script with that rank's output in its own log file."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={group.nproc}",
        f"--max-restarts={plan.max_restarts}",
        "--module",
        RANK_LOG_MODULE,
        str(group.index),
        str(group.log_dir.resolve()),
        str(plan.script),
        *plan.script_args,
    ]


@dataclass
class Group:
    plan: GroupPlan
    proc: subprocess.Popen[bytes]
    leader: status.LeaderLog = field(default_factory=status.LeaderLog)
    follower: status.LogFollower | None = None
    failed_at: float | None = None

    @property
    def state(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "running"
        return "finished" if code == 0 else f"exit {code}"


def prepare_logs(plan: LaunchPlan) -> None:
    """Fresh log files for this launch: group folders made, earlier rank logs removed
    (the rank wrapper appends, so a restarted group keeps its earlier attempts)."""
    for group in plan.groups:
        group.log_dir.mkdir(parents=True, exist_ok=True)
        for old in group.log_dir.glob("rank*.log"):
            old.unlink()


def start_group(group: GroupPlan, plan: LaunchPlan, supervisor: Supervisor) -> Group:
    out: IO[bytes]
    with (group.log_dir / "torchrun.log").open("wb") as out:
        proc = supervisor.spawn(
            torchrun_command(group, plan),
            group_environment(os.environ, group, supervisor.launch_id),
            out,
        )
    return Group(group, proc, follower=status.LogFollower(group.log_dir / "rank0.log"))


def _read_logs(groups: Sequence[Group], now: float) -> None:
    for g in groups:
        if g.follower is not None:
            g.leader.feed(g.follower.read_new(), now)


def _lines(groups: Sequence[Group], now: float) -> list[str]:
    return [
        status.status_line(
            g.plan.index,
            g.state,
            g.leader,
            now,
            ",".join(g.plan.devices) if g.plan.devices is not None else None,
        )
        for g in groups
    ]


def _key(groups: Sequence[Group]) -> object:
    return [
        (g.state, g.leader.attempt, g.leader.trial, g.leader.finished, g.leader.failed)
        for g in groups
    ]


class Launcher:
    """One launch: its groups, the signals it received, and how it stops."""

    def __init__(self, plan: LaunchPlan, settings: Settings, out: IO[str]) -> None:
        self.plan = plan
        self.settings = settings
        self.display = status.Display(out, settings.status_interval_s)
        self.supervisor = Supervisor(settings)
        self.signals = self.supervisor.signals
        self.groups: list[Group] = []

    def run(self) -> int:
        prepare_logs(self.plan)
        for note in self.plan.notes:
            self.display.say(note)
        with self.signals.installed():
            for group in self.plan.groups:
                if self.signals.received:
                    break
                self.groups.append(start_group(group, self.plan, self.supervisor))
                self.display.say(
                    f"{group.describe()}, pid {self.groups[-1].proc.pid}, logs {group.log_dir}/"
                )
            while self._step(time.monotonic()):
                self.signals.wait(min(self.settings.status_interval_s, 0.5))
            left = self.supervisor.clean_up()
            if left:
                self.display.say(f"SIGKILLed {len(left)} process(es) left running: {left}.")
        return self._exit_status()

    def _step(self, now: float) -> bool:
        """One look at everything; False once no group is running."""
        if self.signals.received and not self.supervisor.stopping:
            self._stop(now)
        alive = [g.proc.pid for g in self.groups if g.proc.poll() is None]
        if self.supervisor.kill_if_due(now, alive):
            self.display.say("groups still running: SIGKILL to every process of the launch.")
        for g in self.groups:
            code = g.proc.poll()
            if code not in (None, 0) and g.failed_at is None:
                g.failed_at = now
                if not self.supervisor.stopping:
                    log = g.plan.log_dir / "torchrun.log"
                    self.display.say(
                        f"group {g.plan.index} failed (exit {code}); the other groups go on."
                        f" The end of {log}:\n{status.tail(log, 12)}"
                    )
        _read_logs(self.groups, now)
        running = any(g.proc.poll() is None for g in self.groups)
        self.display.show(_lines(self.groups, now), _key(self.groups), now, force=not running)
        return running

    def _stop(self, now: float) -> None:
        name = signal.Signals(self.signals.received[0]).name
        self.display.say(
            f"{name} received: stopping every group (SIGTERM; SIGKILL after"
            f" {self.settings.stop_timeout_s:.0f} s; again to kill at once)."
        )
        self.supervisor.stop(now, [g.proc.pid for g in self.groups if g.proc.poll() is None])

    def _exit_status(self) -> int:
        stopped = self.supervisor.exit_status()
        if stopped is not None:
            return stopped
        failed = [g for g in self.groups if g.failed_at is not None]
        if not failed:
            return 0
        first = min(failed, key=lambda g: g.failed_at or 0.0)
        self.display.say(
            f"group {first.plan.index} failed first (exit {first.proc.returncode});"
            f" see {first.plan.log_dir}/."
        )
        return first.proc.returncode


def run(plan: LaunchPlan, settings: Settings, out: IO[str]) -> int:
    """Run every group to its end; the exit status of the launch.

    0: every group finished; 128 + signum: stopped by that signal; otherwise the exit
    code of the first group that failed (after its restarts)."""
    return Launcher(plan, settings, out).run()
