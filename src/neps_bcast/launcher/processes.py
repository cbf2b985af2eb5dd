"""The processes of one launch, for both ``neps-bcast launch`` modes (groups of torchrun,
and a pool's agents and ranks): one supervisor, so that both start, stop and clean up
the same way.

- Each process is started in a session of its own (a Ctrl-C in the terminal reaches only
  the launcher, which then stops everything the same way) and gets SIGTERM when the
  launcher dies (``PR_SET_PDEATHSIG``): a launcher killed outright leaves nothing.
- The stop signals become bytes on a pipe the launcher's loop selects on.
- A stop is SIGTERM to every process now and SIGKILL to whatever of the launch is left
  at ``--stop-timeout`` (or at a second signal), found by the ``NEPS_BCAST_LAUNCH_ID``
  that every process of the launch inherits (torchrun starts each worker in a session
  of its own, so a session or process group misses them).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO

from neps_bcast.compat import procfs
from neps_bcast.launcher.plan import ENV_LAUNCH_ID

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Settings:
    status_interval_s: float = 5.0
    stop_timeout_s: float = 45.0
    """After SIGTERM, how long groups get to record their trials and exit (torchrun
    itself SIGKILLs its workers 30 s after forwarding SIGTERM)."""


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """A launcher killed outright (SIGKILL) must not leave its processes running: each
    gets SIGTERM when the launcher dies (Linux), and settles its trial."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


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
            self.drain()


def left_of_launch(launch_id: str) -> list[int]:
    return procfs.pids_with_env(ENV_LAUNCH_ID, launch_id)


class Supervisor:
    """One launch's processes: started, stopped (SIGTERM, then SIGKILL at the deadline
    or a second signal) and cleaned up after, the same for groups and pools."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.launch_id = uuid.uuid4().hex
        self.signals = Signals()
        self.stop_deadline: float | None = None
        self.killed = False

    @property
    def stopping(self) -> bool:
        return self.stop_deadline is not None

    def spawn(
        self, argv: Sequence[str], env: dict[str, str], out: IO[bytes]
    ) -> subprocess.Popen[bytes]:
        """``argv`` in a session of its own, output to ``out``, dying with the launcher."""
        return subprocess.Popen(
            list(argv),
            env={**env, ENV_LAUNCH_ID: self.launch_id},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 - the launcher starts no threads
        )

    def stop(self, now: float, pids: Iterable[int]) -> None:
        """SIGTERM to ``pids`` (those still running); SIGKILL at the deadline."""
        if self.stop_deadline is not None:
            return
        for pid in pids:
            procfs.kill(pid, signal.SIGTERM)
        self.stop_deadline = now + self.settings.stop_timeout_s

    def kill_if_due(self, now: float, pids: Iterable[int]) -> bool:
        """Past the stop's deadline, or at a second signal: SIGKILL to ``pids`` and to
        everything else of the launch, once; True when it did."""
        due = self.stop_deadline is not None and (
            now >= self.stop_deadline or len(self.signals.received) > 1
        )
        if not due or self.killed:
            return False
        for pid in [*pids, *left_of_launch(self.launch_id)]:
            procfs.kill(pid)
        self.killed = True
        return True

    def clean_up(self) -> list[int]:
        """After every process it started exited: nothing of the launch may be left (a
        torchrun killed outright leaves its workers). SIGTERM, a bounded wait, then
        SIGKILL; the pids that were left."""
        left = left_of_launch(self.launch_id)
        if not left:
            return []
        for pid in left:
            procfs.kill(pid, signal.SIGTERM)
        until = time.monotonic() + min(self.settings.stop_timeout_s, 10.0)
        while left and time.monotonic() < until:
            time.sleep(0.1)  # bounded: processes exiting after SIGTERM
            left = left_of_launch(self.launch_id)
        for pid in left:
            procfs.kill(pid)
        return left

    def exit_status(self) -> int | None:
        """128 + the first stop signal received, or None."""
        return 128 + self.signals.received[0] if self.signals.received else None
