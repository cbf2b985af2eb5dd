"""Start one torchrun per group, watch them, stop them all: the launcher's only moving part.

Why torchrun and not our own process manager: restarts (``--max-restarts``), rendezvous
and forwarding signals to the workers are torch's, already correct and known to users.
Each group is ``python -m torch.distributed.run --standalone --nproc-per-node N`` in a
process session of its own: ``--standalone`` makes torch bind its rendezvous store to a
port the OS picks (never a fixed one; a port in use elsewhere never matters), and the
own session means a Ctrl-C in the terminal reaches only this launcher, which then stops
every group the same way: SIGTERM to each torchrun (which forwards it to its workers and
SIGKILLs them after its own 30 s), a bounded wait, then SIGKILL to whatever is left of
the launch, found by the ``NEPS_BCAST_LAUNCH_ID`` every process of it inherits (torchrun
starts each worker in a session of its own, so a session or process group misses them).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO

from neps_bcast.compat import procfs
from neps_bcast.launcher import status
from neps_bcast.launcher.plan import ENV_LAUNCH_ID, GroupPlan, LaunchPlan, group_environment

RANK_LOG_MODULE = "neps_bcast.launcher.rank_log"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """A launcher killed outright (SIGKILL) must not leave its groups running: each
    torchrun gets SIGTERM when the launcher dies (Linux), and stops its workers."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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


def start_group(group: GroupPlan, plan: LaunchPlan, launch_id: str) -> Group:
    out: IO[bytes]
    with (group.log_dir / "torchrun.log").open("wb") as out:
        proc = subprocess.Popen(
            torchrun_command(group, plan),
            env=group_environment(os.environ, group, launch_id),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads exist yet
        )
    return Group(group, proc, follower=status.LogFollower(group.log_dir / "rank0.log"))


class Signals:
    """The stop signals, turned into bytes on a pipe that the main loop selects on."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        os.set_blocking(self._read, False)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        previous_child = signal.signal(signal.SIGCHLD, lambda *_: None)
        old_fd = signal.set_wakeup_fd(self._write)
        try:
            yield
        finally:
            signal.set_wakeup_fd(old_fd)
            signal.signal(signal.SIGCHLD, previous_child)
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: object) -> None:
        self.received.append(signum)

    def fileno(self) -> int:
        """The pipe's read end, readable once a signal (or a child's exit) arrived."""
        return self._read

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._read, 4096)

    def wait(self, seconds: float) -> None:
        """Return after ``seconds``, or as soon as a signal (or a child's exit) arrives."""
        ready, _, _ = select.select([self._read], [], [], max(seconds, 0.0))
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._read, 4096)


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


def left_of_launch(launch_id: str) -> list[int]:
    return procfs.pids_with_env(ENV_LAUNCH_ID, launch_id)


def _kill_everything(groups: Sequence[Group], launch_id: str) -> None:
    for g in groups:
        if g.proc.poll() is None:
            procfs.kill(g.proc.pid)
    for pid in left_of_launch(launch_id):
        procfs.kill(pid)


@dataclass(frozen=True)
class Settings:
    status_interval_s: float = 5.0
    stop_timeout_s: float = 45.0
    """After SIGTERM, how long groups get to record their trials and exit (torchrun
    itself SIGKILLs its workers 30 s after forwarding SIGTERM)."""


class Launcher:
    """One launch: its groups, the signals it received, and how it stops."""

    def __init__(self, plan: LaunchPlan, settings: Settings, out: IO[str]) -> None:
        self.plan = plan
        self.settings = settings
        self.display = status.Display(out, settings.status_interval_s)
        self.launch_id = uuid.uuid4().hex
        self.signals = Signals()
        self.groups: list[Group] = []
        self.stop_deadline: float | None = None
        self.killed = False

    def run(self) -> int:
        prepare_logs(self.plan)
        for note in self.plan.notes:
            self.display.say(note)
        with self.signals.installed():
            for group in self.plan.groups:
                if self.signals.received:
                    break
                self.groups.append(start_group(group, self.plan, self.launch_id))
                self.display.say(
                    f"{group.describe()}, pid {self.groups[-1].proc.pid}, logs {group.log_dir}/"
                )
            while self._step(time.monotonic()):
                self.signals.wait(min(self.settings.status_interval_s, 0.5))
            left = _clean_up(self.launch_id, self.settings)
            if left:
                self.display.say(f"SIGKILLed {len(left)} process(es) left running: {left}.")
        return self._exit_status()

    def _step(self, now: float) -> bool:
        """One look at everything; False once no group is running."""
        if self.signals.received and self.stop_deadline is None:
            self._stop(now)
        if (
            self.stop_deadline is not None
            and not self.killed
            and (now >= self.stop_deadline or len(self.signals.received) > 1)
        ):
            self.display.say("groups still running: SIGKILL to every process of the launch.")
            _kill_everything(self.groups, self.launch_id)
            self.killed = True
        for g in self.groups:
            code = g.proc.poll()
            if code not in (None, 0) and g.failed_at is None:
                g.failed_at = now
                if self.stop_deadline is None:
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
        for g in self.groups:
            if g.proc.poll() is None:
                procfs.kill(g.proc.pid, signal.SIGTERM)
        self.stop_deadline = now + self.settings.stop_timeout_s

    def _exit_status(self) -> int:
        if self.signals.received:
            return 128 + self.signals.received[0]
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


def _clean_up(launch_id: str, settings: Settings) -> list[int]:
    """After every torchrun exited: nothing of the launch may be left (a torchrun killed
    outright leaves its workers). SIGTERM, a bounded wait, then SIGKILL."""
    left = left_of_launch(launch_id)
    if not left:
        return []
    for pid in left:
        procfs.kill(pid, signal.SIGTERM)
    until = time.monotonic() + min(settings.stop_timeout_s, 10.0)
    while left and time.monotonic() < until:
        time.sleep(0.1)  # bounded: processes exiting after SIGTERM
        left = left_of_launch(launch_id)
    for pid in left:
        procfs.kill(pid)
    return left
