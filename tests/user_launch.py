"""Launching the user-shaped scripts (tests/scripts/tutorial_ddp.py, requeue_ddp.py, ...)
as their users launch them, and reading back what they recorded.

Those scripts are written the way each ecosystem writes them (no scenario, no probe):
they record what each rank did as JSON lines in a folder named by an environment
variable, and print to one log. Every process of a launch inherits a unique marker
(``harness.MARKER``), which is how "no process left" is proven; each launch runs in its
own process session and is killed whole, with its log tail shown, past its deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import launches
from harness import LINGER_S, MARKER, base_env, default_sigint, kind_of, marked_pids, neps_trials
from neps_bcast.compat import procfs

SCRIPTS = Path(__file__).parent / "scripts"


class UserLaunch:
    """One launch of a user-shaped script: ``cmd`` in ``folder``, output in ``name.log``."""

    def __init__(
        self,
        cmd: list[str],
        folder: Path,
        name: str,
        env: dict[str, str],
        *,
        timeout: float = 240.0,
    ) -> None:
        self.folder = folder
        self.log_path = folder / f"{name}.log"
        self.marker = uuid.uuid4().hex
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        full = base_env(**env)
        full[MARKER] = self.marker
        self._log = self.log_path.open("wb")
        launches.count(kind_of(cmd))
        self.proc = subprocess.Popen(
            cmd,
            cwd=folder,
            env=full,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=default_sigint,  # noqa: PLW1509 - launches start from one thread
        )

    def log(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace")
        return f"--- {self.log_path.name} (last {lines} lines) ---\n" + "\n".join(
            text.splitlines()[-lines:]
        )

    def kill(self) -> None:
        for pid in [self.proc.pid, *marked_pids(self.marker)]:
            procfs.kill(pid)

    def wait_for(self, what: str, probe: Callable[[], Any]) -> Any:
        """Poll ``probe`` (bounded by the deadline) until it is truthy; its value."""
        while time.monotonic() < self.deadline:
            value = probe()
            if value:
                return value
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)  # a bounded poll of the launch's record files
        value = probe()
        if value:
            return value
        self.kill()
        self.proc.wait()
        raise AssertionError(f"never saw {what}\n{self.log()}")

    def finish(self, linger: float = LINGER_S) -> int:
        """Wait for the launcher (bounded), then for every marked process to be gone."""
        try:
            code = self.proc.wait(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
            self.proc.wait()
            raise AssertionError(f"the launch overran {self.timeout} s\n{self.log()}") from None
        finally:
            self._log.close()
        until = time.monotonic() + linger
        while marked_pids(self.marker) and time.monotonic() < until:
            time.sleep(0.05)  # bounded wait for the launch's processes to exit
        left = marked_pids(self.marker)
        if left:
            self.kill()
        assert not left, f"processes {left} left after the launch\n{self.log()}"
        return code


def records(folder: Path) -> list[dict[str, Any]]:
    found = []
    for path in sorted(folder.glob("*.jsonl")):
        found += [json.loads(line) for line in path.read_text().splitlines() if line]
    return sorted(found, key=lambda r: r["t"])


def states(root: Path) -> dict[str, str]:
    """NePS's own record of each trial's state, read with NePS's reader."""
    return {tid: str(t.metadata.state.value) for tid, t in neps_trials(root).items()}


def signal_all(pids: set[int], signum: int) -> None:
    """``signum`` to every rank at once, as SLURM signals every task of a job."""
    for pid in pids:
        os.kill(pid, signum)
