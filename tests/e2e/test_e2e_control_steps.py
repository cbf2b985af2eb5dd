"""A leader that leaves between two of its control steps never hangs its group.

The leader gets SIGTERM right after it handed trial 2 over (a fault hook in the script,
tests/scripts/interrupted_handover.py): its follower is already on its way into trial
2's meeting. Every control step is the same collective, so the two meet, the trial ends
on both ranks, the trial goes back to ``pending``, and every process is gone within
seconds, on its own: no wait ends by its timeout (before, both ranks waited for the
last-resort timeout of seven days). One launch, one fact per test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import launches
from harness import (
    MARKER,
    SCRIPTS,
    TIMED_OUT,
    TORCHRUN,
    base_env,
    default_sigint,
    marked_pids,
    neps_trials,
)

SCRIPT = SCRIPTS / "interrupted_handover.py"
BOUND_S = 120.0
"""Every process of the launch is gone well within this (seconds, not days)."""


@dataclass(frozen=True)
class Launch:
    root: Path
    returncode: int
    output: str
    wall_s: float
    left: list[int]

    def events(self) -> list[dict[str, Any]]:
        folder = Path(str(self.root) + ".events")
        return [
            json.loads(line)
            for path in sorted(folder.glob("*.jsonl"))
            for line in path.read_text().splitlines()
        ]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    root = tmp_path_factory.mktemp("handover") / "results"
    marker = uuid.uuid4().hex
    command = [TORCHRUN, "--standalone", "--nproc-per-node=2", str(SCRIPT)]
    command += ["--root", str(root), "--trials", "4", "--fault-at", "2"]
    start = time.monotonic()
    launches.count("torchrun")
    proc = subprocess.Popen(
        command,
        env=base_env(**{MARKER: marker}),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=default_sigint,  # noqa: PLW1509 - no threads in the test process
    )
    try:
        output, _ = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        for pid in marked_pids(marker):
            os.kill(pid, 9)
        output, _ = proc.communicate()
        pytest.fail(f"the launch hung past {BOUND_S} s:\n{output.decode(errors='replace')[-6000:]}")
    wall = time.monotonic() - start
    return Launch(root, proc.returncode, output.decode(errors="replace"), wall, marked_pids(marker))


def test_the_fault_fired_right_after_the_hand_over(interrupted: Launch) -> None:
    assert [e["seq"] for e in interrupted.events() if e["event"] == "fault"] == [2]


def test_every_process_ended_on_its_own_and_no_wait_timed_out(interrupted: Launch) -> None:
    """Why it ended, not how fast: nothing was left for the test to kill (the launch's
    bound, ``BOUND_S``, only detects a hang) and no log says a wait ran out of time;
    before, both ranks waited for the last-resort timeout of seven days."""
    assert interrupted.left == []
    timed_out = [line for line in interrupted.output.splitlines() if TIMED_OUT.search(line)]
    assert not timed_out, timed_out


def test_the_leader_exits_143_and_the_follower_returns(interrupted: Launch) -> None:
    # torchrun reads each worker's exit status from the OS and names the failed ones.
    failed = dict(re.findall(r"rank\s*:\s*(\d+).*?\n.*?exitcode\s*:\s*(-?\d+)", interrupted.output))
    assert failed.pop("0", None) == "143", interrupted.output[-4000:]
    # The follower returned from neps_bcast.run. Once the leader failed, torchrun stops
    # the workers still alive with SIGTERM: under load that can be the follower after it
    # returned, before its interpreter exited (-15, neps_bcast's handler gone with run).
    assert failed in ({}, {"1": "-15"}), interrupted.output[-4000:]
    returned = [e["rank"] for e in interrupted.events() if e["event"] == "returned"]
    assert returned == [1]


def test_the_interrupted_trial_is_pending_and_the_first_one_succeeded(interrupted: Launch) -> None:
    states = {tid: t.metadata.state.value for tid, t in neps_trials(interrupted.root).items()}
    assert sorted(states.values()) == ["pending", "success"], states


def test_the_follower_ended_the_trial_with_the_leaders_interrupt_named(interrupted: Launch) -> None:
    ended = r"rank 1/2 follower\] trial (\S+) raised TrialFailedError: .*failed on rank 0: rank 0: Terminated"
    assert re.search(ended, interrupted.output), interrupted.output[-4000:]


def test_the_first_trial_ran_on_both_ranks_and_no_later_one_did(interrupted: Launch) -> None:
    trials = sorted(
        (e["rank"], e["trial_id"]) for e in interrupted.events() if e["event"] == "trial"
    )
    assert [rank for rank, _ in trials] == [0, 1]
    assert trials[0][1] == trials[1][1]
