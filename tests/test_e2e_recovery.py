"""End to end: no trial is ever stuck (issue 11). Real processes, real NePS, Lightning
``strategy="ddp"`` (``python script.py``) and torchrun, 2 ranks.

Every test kills something for real, then runs the same command again and reads NePS's
own record of the root: how each trial ended, that nothing is left ``evaluating``, and
which processes evaluated the interrupted trial, with which arguments.
"""

from __future__ import annotations

import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness import (
    PYTHON,
    SCRIPTS,
    Result,
    assert_clean_launch,
    marked_pids,
    neps_trials,
    run,
    start,
    torchrun_cmd,
)
from neps_bcast.compat import procfs
from neps_bcast.recovery.lease_file import read_lease
from scenario import Fault, Scenario

SCRIPT = SCRIPTS / "recovery_search.py"
BOUND_S = 60.0
"""Every process of a launch is gone within this bound of the fault."""


def python_cmd() -> list[str]:
    return [PYTHON, str(SCRIPT)]


def torchrun(nproc: int = 2) -> list[str]:
    return [*torchrun_cmd(nproc)[:-1], str(SCRIPT)]


def states(root: Path) -> dict[str, str]:
    return {tid: str(t.metadata.state.value) for tid, t in neps_trials(root).items()}


def evaluated(result: Result, trial_id: str) -> list[dict[str, Any]]:
    """Every rank's "trial" record of ``trial_id`` in this launch."""
    return [e for e in result.of("trial") if e["trial_id"] == trial_id]


def fault_time(result: Result) -> float:
    return min(e["t"] for e in result.of("fault"))


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_leader_killed_the_orphan_is_evaluated_by_the_rerun(tmp_path: Path, launcher: str) -> None:
    """SIGKILL on the leader in trial 2 (as the OOM killer or a node failure would); then
    the same command: trial 2 is evaluated again first, with the same arguments, and the
    root ends with exactly 4 successes."""
    cmd = python_cmd() if launcher == "python" else torchrun()
    scenario = Scenario(trials=4, root=str(tmp_path / "root"), extra_args=True)
    first = run(
        replace(scenario, faults=(Fault("kill", rank=0, seq=2),)), tmp_path, name="first", cmd=cmd
    )
    assert not first.left_alive, first.tail()
    assert first.gone_at - fault_time(first) < BOUND_S
    root = first.root
    assert states(root) == {"1": "success", "2": "evaluating"}, first.tail()
    before = evaluated(first, "2")

    again = run(scenario, tmp_path, name="again", cmd=cmd)
    assert_clean_launch(again)
    assert states(root) == dict.fromkeys("1234", "success")
    assert "orphaned trial 2 (its leader (pid" in again.log
    after = evaluated(again, "2")
    assert sorted(e["rank"] for e in after) == [0, 1]
    for e in after:  # the same configuration, the same pipeline directory
        assert e["kwargs"] == before[0]["kwargs"]
    # Taken before NePS sampled anything new: the rerun's first trial is trial 2.
    first_trial = min(again.of("trial"), key=lambda e: e["t"])
    assert first_trial["trial_id"] == "2"
    lease = read_lease(Path(before[0]["kwargs"]["pipeline_directory"]))
    assert lease is not None
    assert len(lease.attempts) == 1
    assert "is gone" in lease.attempts[0].how


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_sigterm_to_the_whole_launch_puts_the_trial_back(tmp_path: Path, launcher: str) -> None:
    """SIGTERM to every process of the launch during trial 2 (SLURM preemption, a time
    limit, scancel): every process exits promptly, 143 ("requeue me"); trial 2 is
    pending, not crashed; the same command (NePS's default ignore_errors=False) evaluates
    it and finishes the budget."""
    cmd = python_cmd() if launcher == "python" else torchrun()
    scenario = Scenario(trials=3, root=str(tmp_path / "root"))
    # Trial 2 trains for a long while (a slow step on every rank), so that the signal
    # arrives in its middle, whatever the machine's load.
    slow = Fault("sleep", rank=None, seq=2, where="fit", seconds=120)
    running = start(replace(scenario, faults=(slow,)), tmp_path, name="first", cmd=cmd)
    running.wait_for(
        "both ranks inside trial 2's training",
        lambda ev: {e["rank"] for e in ev if e["event"] == "fault" and e["seq"] == 2} == {0, 1},
    )
    pids = marked_pids(running.marker)
    sent = time.time()
    for pid in pids:
        procfs.kill(pid, signal.SIGTERM)
    first = running.finish()
    assert not first.left_alive, first.tail()
    assert first.gone_at - sent < BOUND_S, first.tail()
    # torchrun itself ends with 1 (torch's SignalException); its workers with 143.
    assert first.returncode == (143 if launcher == "python" else 1), first.tail()
    exits = first.exits
    assert {r: e["code"] for r, e in exits.items()} == {0: 143, 1: 143}, first.tail()
    root = first.root
    assert states(root) == {"1": "success", "2": "pending"}, first.tail()
    assert "exit code 143 asks to requeue" in first.log

    again = run(scenario, tmp_path, name="again", cmd=cmd)
    assert_clean_launch(again)
    assert states(root) == dict.fromkeys("123", "success")
    assert sorted(e["rank"] for e in evaluated(again, "2")) == [0, 1]


def test_follower_killed_is_retried_up_to_the_limit_then_crashed(tmp_path: Path) -> None:
    """NEPS_BCAST_MAX_RETRIES=1. SIGKILL on the follower in trial 2: back to pending,
    the leader stops (its group lost a rank) without sampling anything else. The rerun
    evaluates trial 2 first; the follower is killed again: past the limit, recorded
    crashed naming both attempts. A third run finishes the budget (ignore_errors=True,
    NePS's rule for a root holding a crashed trial)."""
    env = {"NEPS_BCAST_MAX_RETRIES": "1"}
    scenario = Scenario(trials=4, root=str(tmp_path / "root"))
    kill = replace(scenario, faults=(Fault("kill", rank=1, seq=2),))
    first = run(kill, tmp_path, name="first", env=env)
    assert first.returncode == 1, first.tail()
    assert not first.left_alive
    root = first.root
    assert states(root) == {"1": "success", "2": "pending"}, first.tail()
    assert (
        "FollowerLostError: [neps_bcast rank 0/2 leader] rank 1 lost: " in first.exits[0]["error"]
    )

    retry = replace(scenario, faults=(Fault("kill", rank=1, seq=1),))
    second = run(retry, tmp_path, name="second", env=env)
    # In the rerun, trial 2 is the follower's first: Lightning's fresh child, whose death
    # makes Lightning's observer SIGKILL the launch once neps_bcast settled the trial.
    assert second.returncode in (1, -signal.SIGKILL), second.tail()
    assert not second.left_alive
    assert [e["trial_id"] for e in second.of("trial") if e["rank"] == 0] == ["2"]
    assert states(root) == {"1": "success", "2": "crashed"}, second.tail()
    text = str(neps_trials(root)["2"].report.err)
    assert text.startswith(
        "neps_bcast: trial 2 was interrupted 2 times by infrastructure failures"
        " (NEPS_BCAST_MAX_RETRIES=1): attempt 1 (pid "
    ), text
    assert text.count("FollowerLostError: [neps_bcast rank 0/2 leader] rank 1 lost: ") == 2, text

    last = run(replace(scenario, ignore_errors=True), tmp_path, name="last", env=env)
    assert_clean_launch(last)
    assert states(root) == {"1": "success", "2": "crashed", "3": "success", "4": "success"}
    assert not evaluated(last, "2")


def test_a_user_exception_is_not_retried(tmp_path: Path) -> None:
    """The follower raises in trial 2 (a bad config, not the infrastructure): crashed as
    before, evaluated once, and the search goes on (ignore_errors=True)."""
    result = run(
        Scenario(trials=4, ignore_errors=True, faults=(Fault("raise", rank=1, seq=2),)), tmp_path
    )
    assert_clean_launch(result)
    assert states(result.root) == {"1": "success", "2": "crashed", "3": "success", "4": "success"}
    assert "orphaned" not in result.log
    assert sorted(e["rank"] for e in evaluated(result, "2")) == [0, 1]
    lease = read_lease(result.root / "configs" / "config_2")
    assert lease is not None
    assert lease.attempts == ()


def test_sigterm_to_one_follower_costs_only_its_trial(tmp_path: Path) -> None:
    """SIGTERM to the follower in trial 2, ignore_errors=True (before: trial 2 crashed,
    and trial 3 was handed to the broken group and crashed too). Now: trial 2 goes back
    to pending, the leader samples nothing for the broken group, and the rerun ends with
    every trial a success."""
    scenario = Scenario(trials=4, ignore_errors=True, root=str(tmp_path / "root"))
    first = run(replace(scenario, faults=(Fault("term", rank=1, seq=2),)), tmp_path, name="first")
    assert not first.left_alive, first.tail()
    root = first.root
    assert states(root) == {"1": "success", "2": "pending"}, first.tail()
    assert first.exits[1]["code"] == 143
    assert "rank 1 was terminated (Terminated: 143) in trial 2" in first.exits[0]["error"]
    again = run(scenario, tmp_path, name="again")
    assert_clean_launch(again)
    assert states(root) == dict.fromkeys("1234", "success")


def test_two_workers_one_killed_the_other_takes_over_after_the_grace(tmp_path: Path) -> None:
    """Two Lightning workers on one root; the victim runs in a pid namespace of its own
    (another container on this node: its pids mean nothing here, so only its heartbeat
    counts). It is SIGKILLed in its first trial. The survivor holds its 2nd trial until
    the victim's heartbeat is older than the grace period (4 s, NEPS_BCAST_LEASE_GRACE_S),
    then takes the orphan over: exactly once, and the root ends with 4 successes."""
    env = {"NEPS_BCAST_LEASE_GRACE_S": "4", "NEPS_BCAST_HEARTBEAT_S": "0.5"}
    root = tmp_path / "root"
    scenario = Scenario(trials=4, root=str(root))
    release = tmp_path / "release"
    survivor = start(
        scenario,
        tmp_path,
        name="survivor",
        cmd=python_cmd(),
        env={**env, "NB_HOLD": f"2:{release}"},
    )
    survivor.wait_for(
        "the survivor's first trial", lambda ev: any(e["event"] == "trial" for e in ev)
    )
    victim = start(
        replace(scenario, faults=(Fault("kill", rank=0, seq=1),)),
        tmp_path,
        name="victim",
        cmd=[
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "sh",
            "-c",
            f"{PYTHON} {SCRIPT}; exit $?",
        ],
        env=env,
    )
    try:
        victim.wait_for("the victim's fault", lambda ev: any(e["event"] == "fault" for e in ev))
        killed = victim.finish()
        orphan = next(e["trial_id"] for e in killed.of("trial") if e["rank"] == 0)
        assert not killed.left_alive, killed.tail()
        trial_dir = root / "configs" / f"config_{orphan}"
        lease = read_lease(trial_dir)
        assert lease is not None
        assert lease.owner is not None
        assert states(root)[orphan] == "evaluating"
        # Observe (bounded) the victim's heartbeat getting older than the grace period.
        deadline = time.monotonic() + 60
        while time.time() - lease.heartbeat <= 4.5 and time.monotonic() < deadline:
            time.sleep(0.1)  # waiting for wall-clock age of a file we read, not for a process
    except BaseException:
        survivor.kill_all()
        raise
    release.touch()
    done = survivor.finish()
    assert_clean_launch(done)
    assert states(root) == {tid: "success" for tid in states(root)}
    assert len(states(root)) == 4
    taken = [e for e in done.of("trial") if e["trial_id"] == orphan]
    assert sorted(e["rank"] for e in taken) == [0, 1]  # once, on both ranks of one group
    history = read_lease(trial_dir)
    assert history is not None
    assert len(history.attempts) == 1
    assert history.attempts[0].owner == lease.owner
    assert "no heartbeat from its leader" in history.attempts[0].how
    assert "(grace 4 s)" in history.attempts[0].how
    assert done.log.count(f"orphaned trial {orphan} ") == 1


@pytest.mark.parametrize("killed_seq", [2, 4], ids=["in_rung_0", "the_promotion"])
def test_leader_killed_in_a_hyperband_bracket_the_bracket_still_promotes(
    tmp_path: Path, killed_seq: int
) -> None:
    """NePS's hyperband (eta=3, fidelity epochs 1..3: rung 0 at 1 epoch, rung 1 at 3),
    Lightning ddp, 2 ranks, 5 trials: 1_rung_0, 2_rung_0, 3_rung_0, then the best of
    those three promoted to rung 1 (the same config, continued from its checkpoint),
    then 4_rung_1. SIGKILL on the leader in its ``killed_seq``-th trial: 2 = 2_rung_0,
    inside the bracket's rung 0 (an ``evaluating`` trial there counts as pending for
    NePS's brackets: had it stayed so, bracket 0 would never promote and NePS would
    only go on sampling other brackets); 4 = the promoted trial itself. The same command
    again (short lease grace and heartbeat, as a rerun on another host would need; here
    the owner is on this host, so its gone pid decides): the orphan is evaluated first,
    same trial id, same config and directories, on both ranks; the root ends with
    exactly 5 successes, nothing ``evaluating``; and bracket 0's best config was
    promoted (NePS's previous_trial_id and location) and trained from its checkpoint."""
    env = {"NEPS_BCAST_LEASE_GRACE_S": "4", "NEPS_BCAST_HEARTBEAT_S": "0.5"}
    root = tmp_path / "root"
    scenario = Scenario(trials=5, optimizer="hyperband", space="fidelity", root=str(root))
    kill = replace(scenario, faults=(Fault("kill", rank=0, seq=killed_seq),))
    first = run(kill, tmp_path, name="first", cmd=python_cmd(), env=env)
    assert not first.left_alive, first.tail()
    assert first.gone_at - fault_time(first) < BOUND_S
    led = [e["trial_id"] for e in sorted(first.of("trial"), key=lambda e: e["t"]) if e["rank"] == 0]
    assert len(led) == killed_seq, first.tail()
    orphan = led[-1]
    if killed_seq == 2:
        assert orphan == "2_rung_0", led
    else:  # the promotion of one of 1..3_rung_0, continued from its checkpoint
        assert orphan.endswith("_rung_1") and led[:3] == ["1_rung_0", "2_rung_0", "3_rung_0"]
    done_before = {tid: "success" for tid in led[:-1]}
    assert states(root) == {**done_before, orphan: "evaluating"}, first.tail()
    before = evaluated(first, orphan)
    assert before, first.tail()
    if killed_seq == 4:
        assert before[0]["previous_pipeline_directory"], before

    again = run(scenario, tmp_path, name="again", cmd=python_cmd(), env=env)
    assert_clean_launch(again)
    # Exactly the asked budget, every trial finished, nothing left evaluating.
    final = states(root)
    assert final == dict.fromkeys(final, "success"), again.tail()
    assert len(final) == 5, final
    assert f"orphaned trial {orphan} (its leader (pid" in again.log
    # The orphan is the rerun's first trial, on both ranks, with the same arguments.
    rerun_led = [
        e["trial_id"] for e in sorted(again.of("trial"), key=lambda e: e["t"]) if e["rank"] == 0
    ]
    assert rerun_led[0] == orphan, rerun_led
    assert rerun_led.count(orphan) == 1, rerun_led
    after = evaluated(again, orphan)
    assert sorted(e["rank"] for e in after) == [0, 1]
    for e in after:
        assert e["kwargs"] == before[0]["kwargs"]
    lease = read_lease(root / "configs" / f"config_{orphan}")
    assert lease is not None
    assert len(lease.attempts) == 1
    assert "is gone" in lease.attempts[0].how

    # The bracket promoted: its best rung-0 config went on to rung 1, as NePS records.
    trials = neps_trials(root)
    rung0 = {tid: trials[tid] for tid in ("1_rung_0", "2_rung_0", "3_rung_0")}
    best = min(rung0, key=lambda tid: rung0[tid].report.objective_to_minimize)
    promoted_id = best.replace("_rung_0", "_rung_1")
    promotions = {tid: t for tid, t in trials.items() if t.metadata.previous_trial_id}
    assert set(promotions) == {promoted_id}, {
        tid: (t.metadata.previous_trial_id, t.report.objective_to_minimize)
        for tid, t in trials.items()
    }
    promoted = trials[promoted_id]
    base = trials[best]
    assert promoted.metadata.previous_trial_id == best
    assert Path(promoted.metadata.previous_trial_location) == Path(base.metadata.location)
    assert promoted.config == {**base.config, "epochs": 3}
    assert base.config["epochs"] == 1
    if killed_seq == 4:
        assert orphan == promoted_id
    # Both ranks of the rerun trained the promotion from the base's checkpoint.
    completed = evaluated(again, promoted_id)
    assert sorted(e["rank"] for e in completed) == [0, 1]
    for e in completed:
        assert Path(e["previous_pipeline_directory"]) == Path(base.metadata.location)
        assert e["ckpt_exists"], e
    assert "Restored all states from the checkpoint" in again.log
    # After the promotion, hyperband's next bracket (rung 1 only) took the last trial.
    assert rerun_led[-1] == "4_rung_1", rerun_led
