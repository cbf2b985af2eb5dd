"""Launch real multi-process searches from tests and read back what happened.

Each launch runs in its own process session (so every process it starts, Lightning's
children included, can be found and killed), logs to a file under ``tmp_path``, and is
bounded: group timeouts < the launch's deadline < pytest's timeout. After the launch
returns, we wait (bounded) for every process of its session to be gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).parent / "scripts"
SEARCH = SCRIPTS / "search.py"
PYTHON = sys.executable
TORCHRUN = str(Path(PYTHON).with_name("torchrun"))

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
)


def base_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "NEPS_BCAST_", "NB_", "PYTEST_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def session_pids(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        # fields[0] is the state, fields[3] the session id; zombies are gone already.
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def kill_session(sid: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@dataclass
class Launch:
    returncode: int
    log: str
    left_alive: list[int]
    seconds: float
    proc: subprocess.Popen[bytes]
    gone_at: float = 0.0
    """Wall-clock time (time.time()) at which no process of the launch was left."""

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log.splitlines()[-n:])


def launch(
    cmd: list[str],
    *,
    log_path: Path,
    env: dict[str, str],
    cwd: Path,
    timeout: float = 240.0,
    linger: float = 15.0,
) -> Launch:
    """Run one launch to the end; fail with every log tail if it overruns ``timeout``."""
    start = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            proc.wait()
            raise AssertionError(
                f"launch {cmd} overran {timeout} s; log tail:\n"
                + "\n".join(log_path.read_text(errors="replace").splitlines()[-80:])
            ) from None
    seconds = time.monotonic() - start
    deadline = time.monotonic() + linger
    left = session_pids(proc.pid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)  # bounded wait for processes to finish exiting, not synchronization
        left = session_pids(proc.pid)
    gone_at = time.time()
    if left:
        kill_session(proc.pid)
    return Launch(
        proc.returncode, log_path.read_text(errors="replace"), left, seconds, proc, gone_at
    )


def read_records(record_dir: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in sorted(record_dir.glob("*.jsonl")):
        events.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return events


def trials_by_rank(events: list[dict[str, Any]]) -> dict[int, list[tuple[str, dict[str, Any]]]]:
    by_rank: dict[int, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for e in sorted((e for e in events if e["event"] == "trial"), key=lambda e: e["t"]):
        by_rank[e["rank"]].append((e["trial_id"], e["kwargs"]))
    return dict(by_rank)


def neps_trials(root: Path) -> dict[str, Any]:
    """NePS's own record of the search, read with NePS's reader."""
    from neps.state.neps_state import NePSState

    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))  # the search space may name search.py's helpers

    state = NePSState.create_or_load(path=root, load_only=True)
    return state.lock_and_read_trials()


def assert_clean_launch(result: Launch, *, expect_rc: int = 0) -> None:
    assert result.returncode == expect_rc, (
        f"exit code {result.returncode} (want {expect_rc}); log tail:\n{result.tail()}"
    )
    assert not result.left_alive, (
        f"processes {result.left_alive} still alive after the launch; log tail:\n{result.tail()}"
    )
