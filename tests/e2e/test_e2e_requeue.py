"""End to end: a plain-DDP script with the signal handlers SLURM users install
(tests/scripts/requeue_ddp.py: a SIGTERM handler that saves a checkpoint, and a SIGUSR1
handler that saves one, requeues and exits, both installed before ``neps_bcast.run``),
stopped in the middle of trial 2 on every rank as SLURM stops a job.

The handler installed before run still runs; trial 2 goes back to ``pending`` (not
``crashed``); the next launch (the requeued job) evaluates it first on every rank as
attempt 2, resumes it from its own checkpoint (the step it trains from is the saved one,
not 0), and NePS records it once. Real torchrun, gloo, NePS; the real SLURM version of
the USR1 path is in tests/slurm/test_e2e_slurm_users.py.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from harness import TORCHRUN
from neps_bcast.recovery.lease_file import read_lease
from user_launch import SCRIPTS, UserLaunch, records, signal_all, states

SCRIPT = SCRIPTS / "requeue_ddp.py"


def launch(tmp_path: Path, name: str) -> UserLaunch:
    rec = tmp_path / "rec"
    rec.mkdir(exist_ok=True)
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", str(SCRIPT), "--root", "root"]
    env = {"REQUEUE_RECORD": str(rec), "REQUEUE_SLOW": "2"}
    return UserLaunch(cmd, tmp_path, name, env)


def of(events: list[dict], event: str, pids: set[int] | None = None) -> list[dict]:
    return [e for e in events if e["event"] == event and (pids is None or e["pid"] in pids)]


@pytest.mark.parametrize(
    ("signum", "handler", "exit_code", "how"),
    [
        (signal.SIGTERM, "TERM", 143, "preempted: SIGTERM on the leader (exit code 143)"),
        (
            signal.SIGUSR1,
            "USR1",
            0,
            "preempted: SystemExit(0) in the SIGUSR1 handler on the leader (exit code 0)",
        ),
    ],
    ids=["sigterm_handler_installed_before_run", "usr1_handler_that_exits"],
)
def test_a_stopped_trial_goes_back_to_pending_and_resumes_from_its_checkpoint(
    tmp_path: Path, signum: int, handler: str, exit_code: int, how: str
) -> None:
    rec = tmp_path / "rec"
    first = launch(tmp_path, "first")
    # Both ranks are a few steps into trial 2 (slow on its first attempt): stop the job.
    in_trial_2 = first.wait_for(
        "both ranks at step 3 of trial 2",
        lambda: {e["pid"] for e in of(records(rec), "step") if e["step"] >= 3} or None,
    )
    assert len(in_trial_2) == 2, records(rec)
    signal_all(in_trial_2, signum)
    first.finish()
    events = records(rec)
    report = f"{first.log()}\nrecords: {events}"

    # The user's handler ran on every rank; every rank exited with the stop's code.
    assert sorted(e["rank"] for e in of(events, "handler")) == [0, 1], report
    assert {e["signal"] for e in of(events, "handler")} == {handler}, report
    assert {e["rank"]: e["code"] for e in of(events, "exit")} == {0: exit_code, 1: exit_code}
    assert states(tmp_path / "root") == {"1": "success", "2": "pending"}, report
    trial_dir = tmp_path / "root" / "configs" / "config_2"
    saved = torch.load(trial_dir / "checkpoint.pt")["step"]
    assert saved >= 3, report
    lease = read_lease(trial_dir)
    assert lease is not None
    assert [a.how for a in lease.attempts] == [how], lease

    second = launch(tmp_path, "second")  # the requeued job: the same command
    assert second.finish() == 0, second.log()
    events = records(rec)
    again = {e["pid"] for e in events if e["pid"] not in {*in_trial_2, first.proc.pid}}
    trained = of(events, "trained", again)
    report = f"{second.log()}\nrecords: {events}"
    # Trial 2 first, on both ranks, as attempt 2, from the saved step (not from 0).
    for rank in (0, 1):
        mine = [
            (e["trial"], e["attempt"], e["start"], e["end"]) for e in trained if e["rank"] == rank
        ]
        assert mine == [("2", 2, saved, 12), ("3", 1, 0, 12)], report
    assert states(tmp_path / "root") == dict.fromkeys("123", "success"), report
    assert {e["rank"]: e["code"] for e in of(events, "exit", again)} == {0: 0, 1: 0}, report
