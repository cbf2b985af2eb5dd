"""End to end: ``neps-bcast status ROOT`` on live searches, launched as users launch them.

One launch per launcher shape, each held in a trial by the test scripts' ``hold`` fault
(tests/scripts/faults.py: the process waits until the test creates a file), so the
status is read while a trial certainly runs:

- Lightning ``strategy="ddp"``, 2 ranks (``python lightning_search.py``): held in trial
  2, the status shows it running on 2 ranks with a fresh heartbeat; then the test
  SIGKILLs the leader the status names, and the status shows that trial's lease stale.
- torchrun, 2 ranks: held in trial 2, then released; after the search, every trial's
  final state, the best trial, and ``--json`` parses.
- ``neps-bcast launch --pool 2``, trials of 2 ranks: held in a trial, the status shows
  its devices and each device of the pool; after the search, every final state.

The status is the real console script, run as a user runs it, from the launch's cwd.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness import (
    LIGHTNING,
    PYTHON,
    TORCH_DDP,
    Result,
    Running,
    base_env,
    python,
    start,
    states,
    torchrun,
)

NEPS_BCAST = str(Path(PYTHON).with_name("neps-bcast"))
POOL_SCRIPT = Path(__file__).resolve().parents[1] / "sweep" / "pool_fault_search.py"
TRIALS = 3


def status(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NEPS_BCAST, "status", str(root), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=base_env(),
        check=False,
    )


def status_json(root: Path) -> dict[str, Any]:
    done = status(root, "--json")
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def running_trial(launch: Running, placed: bool = False) -> dict[str, Any]:
    """The status of the held trial, once its lease is written (``placed``: and its
    pool placement): a bounded poll of the status; the hold keeps the trial running
    until the test releases it."""

    def leased() -> dict[str, Any] | None:
        for trial in status_json(launch.root)["trials"]:
            if trial["state"] == "evaluating" and trial["heartbeat_age_s"] is not None:
                if not placed or trial["devices"] is not None:
                    return dict(trial)
        return None

    launch.wait_for("the hold", lambda events: [e for e in events if e["event"] == "fault"])
    return dict(launch._poll("a leased trial in the status", leased, 120.0))


def release(hold_file: Path) -> None:
    hold_file.write_text("go")


def leader_pid(events: list[dict[str, Any]]) -> int:
    starts = [e for e in events if e["event"] == "start" and e.get("proc_rank") == 0]
    assert len(starts) == 1, starts
    return int(starts[0]["pid"])


# -- Lightning ddp x2, then a SIGKILLed leader ------------------------------------------------
class TestLightningDdp:
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("status_lightning")
        hold = tmp / "release"
        running = start(
            python(LIGHTNING, "--devices", 2, "--trials", TRIALS),
            tmp,
            fault=f"hold:leader:trial=2:at=fit:until={hold}",
        )
        during = running_trial(running)
        text = status(running.root).stdout
        leader = leader_pid(running.events())
        os.kill(during["pid"], signal.SIGKILL)
        result = running.finish()
        return {
            "during": during,
            "text": text,
            "leader": leader,
            "result": result,
            "after": status_json(running.root),
            "after_text": status(running.root).stdout,
        }

    def test_the_running_trial_shows_its_leader_ranks_attempt_and_a_fresh_heartbeat(
        self, launch: dict[str, Any]
    ) -> None:
        during = launch["during"]
        assert (during["trial_id"], during["pid"], during["ranks"], during["attempt"]) == (
            "2",
            launch["leader"],
            2,
            1,
        )
        assert during["stale"] is None
        assert during["heartbeat_age_s"] < 30.0  # NEPS_BCAST_HEARTBEAT_S, its default

    def test_the_text_shows_one_line_per_trial_and_the_counts(self, launch: dict[str, Any]) -> None:
        lines = launch["text"].splitlines()
        assert any(line.startswith("1 ") and " success " in line for line in lines), lines
        assert any(
            line.startswith("2 ") and f"pid {launch['leader']}, 2 ranks" in line for line in lines
        ), lines
        assert "trials: 1 evaluating, 1 success (2 in all)" in lines, lines

    def test_after_the_sigkill_the_trial_lease_is_stale(self, launch: dict[str, Any]) -> None:
        result: Result = launch["result"]
        assert result.returncode == -signal.SIGKILL, result.tail()
        assert result.left_alive == [], result.tail()
        trial = next(t for t in launch["after"]["trials"] if t["trial_id"] == "2")
        assert trial["state"] == "evaluating"
        assert trial["stale"] == (f"its leader (pid {launch['leader']} on {trial['host']}) is gone")
        assert "STALE: its leader" in launch["after_text"]


# -- torchrun x2: during, then after the search -----------------------------------------------
class TestTorchrun:
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("status_torchrun")
        hold = tmp / "release"
        running = start(
            torchrun(2, TORCH_DDP, "--trials", TRIALS),
            tmp,
            fault=f"hold:leader:trial=2:at=fit:until={hold}",
        )
        during = running_trial(running)
        release(hold)
        result = running.finish()
        return {
            "during": during,
            "result": result,
            "after": status(running.root),
            "json": status_json(running.root),
            "neps": states(running.root),
            "bad": status(tmp / "no_such_root"),
            "leader": leader_pid(result.events),
        }

    def test_the_running_trial_shows_its_leader_ranks_and_a_fresh_heartbeat(
        self, launch: dict[str, Any]
    ) -> None:
        during = launch["during"]
        assert (during["trial_id"], during["pid"], during["ranks"], during["attempt"]) == (
            "2",
            launch["leader"],
            2,
            1,
        )
        assert during["stale"] is None and during["heartbeat_age_s"] < 30.0

    def test_the_search_ended_cleanly(self, launch: dict[str, Any]) -> None:
        result: Result = launch["result"]
        assert (result.returncode, result.left_alive) == (0, []), result.tail()

    def test_after_the_search_every_trial_shows_the_state_neps_recorded(
        self, launch: dict[str, Any]
    ) -> None:
        shown = {t["trial_id"]: t["state"] for t in launch["json"]["trials"]}
        assert shown == launch["neps"] == dict.fromkeys(("1", "2", "3"), "success")
        assert launch["json"]["counts"] == {"success": TRIALS}
        assert launch["json"]["budget"]["evaluations"] == TRIALS

    def test_after_the_search_the_best_trial_is_the_lowest_objective(
        self, launch: dict[str, Any]
    ) -> None:
        trials = launch["json"]["trials"]
        best = min(trials, key=lambda t: t["objective"])
        assert launch["json"]["best"]["trial_id"] == best["trial_id"]
        assert f"best: trial {best['trial_id']}, objective" in launch["after"].stdout

    def test_a_bad_root_gives_the_clear_error(self, launch: dict[str, Any]) -> None:
        bad = launch["bad"]
        assert bad.returncode == 2
        assert bad.stderr.startswith("[neps_bcast status] ")
        assert "no_such_root does not exist; expected the root_directory" in bad.stderr
        assert "HINT: pass that directory" in bad.stderr


# -- a pool of 2 devices, trials of 2 ranks ----------------------------------------------------
class TestPool:
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("status_pool")
        hold = tmp / "release"
        root = tmp / "root"
        command = [
            NEPS_BCAST,
            "launch",
            "--pool",
            "2",
            "--log-dir",
            str(tmp / "run" / "logs"),
            str(POOL_SCRIPT),
            "--root",
            str(root),
            "--trials",
            str(TRIALS),
        ]
        running = start(command, tmp, fault=f"hold:all:at=fit:until={hold}", timeout=420.0)
        during = running_trial(running, placed=True)
        during_json = status_json(root)
        text = status(root).stdout
        release(hold)
        result = running.finish()
        return {
            "during": during,
            "during_json": during_json,
            "text": text,
            "result": result,
            "json": status_json(root),
            "neps": states(root),
        }

    def test_the_running_trial_shows_its_devices_and_ranks(self, launch: dict[str, Any]) -> None:
        during = launch["during"]
        assert (during["devices"], during["ranks"], during["attempt"]) == ([0, 1], 2, 1)

    def test_the_running_trial_shows_the_pids_of_the_ranks_that_ran_it(
        self, launch: dict[str, Any]
    ) -> None:
        during = launch["during"]
        result: Result = launch["result"]
        ran = sorted(
            (e["rank"], e["pid"])
            for e in result.events
            if e["event"] == "trial" and e["trial_id"] == during["trial_id"]
        )
        assert during["rank_pids"] == [pid for _, pid in ran]
        assert during["pid"] not in during["rank_pids"]  # the lease's: the trial's agent
        assert during["stale"] is None and during["heartbeat_age_s"] < 30.0

    def test_each_device_shows_the_trial_on_it(self, launch: dict[str, Any]) -> None:
        trial_id = launch["during"]["trial_id"]
        devices = [(d["device"], d["trial_id"]) for d in launch["during_json"]["devices"]]
        assert devices == [(0, trial_id), (1, trial_id)]
        assert f"device 0: trial {trial_id}" in launch["text"]
        assert f"device 1: trial {trial_id}" in launch["text"]

    def test_after_the_search_every_trial_shows_the_state_neps_recorded(
        self, launch: dict[str, Any]
    ) -> None:
        result: Result = launch["result"]
        assert (result.returncode, result.left_alive) == (0, []), result.tail()
        shown = {t["trial_id"]: t["state"] for t in launch["json"]["trials"]}
        assert shown == launch["neps"]
        assert set(shown.values()) == {"success"} and len(shown) == TRIALS
        assert launch["json"]["devices"] == []  # nothing runs any more
