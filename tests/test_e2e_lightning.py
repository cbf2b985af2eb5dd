"""End to end: real NePS searches over Lightning strategy="ddp" trials, `python script.py`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from harness import (
    assert_clean_launch,
    assert_followers_never_touch_neps,
    neps_trials,
    run,
    start,
    trials_by_rank,
)
from neps_bcast.compat import procfs
from scenario import Fault, Scenario

BASIC_KEYS = ("lr", "hidden", "activation")


@pytest.mark.parametrize("devices", [2, 3])
def test_every_rank_evaluates_the_leaders_trials(tmp_path: Path, devices: int) -> None:
    result = run(Scenario(devices=devices, trials=5, extra_args=True), tmp_path)
    assert_clean_launch(result)
    events = result.events

    by_rank = trials_by_rank(events)
    assert sorted(by_rank) == list(range(devices)), result.tail()
    leader = by_rank[0]
    assert len(leader) == 5
    for rank in range(1, devices):
        # Same trial ids, same exact keyword arguments, same order.
        assert json.dumps(by_rank[rank], sort_keys=True) == json.dumps(leader, sort_keys=True)

    recorded = neps_trials(result.root)
    assert sorted(recorded) == sorted(tid for tid, _ in leader)
    for tid, kwargs in leader:
        trial = recorded[tid]
        assert trial.report is not None and trial.report.reported_as == "success"
        for key in BASIC_KEYS:
            assert trial.config[key] == kwargs[key]
        # NePS injected these because the signature names them; followers got them too.
        assert kwargs["pipeline_id"] == tid
        assert Path(kwargs["pipeline_directory"]) == Path(trial.metadata.location)

    # world_size: None while no group exists (every rank's trial 1 before its first
    # fit), then the group's size.
    first_id = leader[0][0]
    for e in result.of("trial"):
        assert e["world_size"] == (None if e["trial_id"] == first_id else devices), e

    exits = result.exits
    assert sorted(exits) == list(range(devices))
    assert all(e["ok"] and e["code"] == 0 for e in exits.values())
    # The leader is the launched process itself: its record matches its exit code.
    assert exits[0]["pid"] == next(e["pid"] for e in result.of("start") if e["proc_rank"] == 0)
    # Followers never call neps.run, never open NePS's state, never open or list a
    # file under the root; the leader did each (positive controls).
    assert_followers_never_touch_neps(result.exits)
    # Every rank logs with its rank and role; only the leader's NePS speaks.
    assert f"[neps_bcast rank 1/{devices} follower]" in result.log
    assert "[neps_bcast rank 0/" in result.log


def test_multi_fidelity_continues_from_the_previous_checkpoint(tmp_path: Path) -> None:
    result = run(Scenario(space="fidelity", optimizer="hyperband", trials=6), tmp_path)
    assert_clean_launch(result)
    by_rank = trials_by_rank(result.events)
    assert sorted(by_rank) == [0, 1]
    assert json.dumps(by_rank[1], sort_keys=True) == json.dumps(by_rank[0], sort_keys=True)
    promoted = [e for e in result.of("trial") if e["previous_pipeline_directory"]]
    assert promoted, "hyperband promoted no trial: the test must exercise a continuation"
    assert {e["rank"] for e in promoted} == {0, 1}
    assert all(e["ckpt_exists"] for e in promoted)
    recorded = neps_trials(result.root)
    for e in promoted:
        trial = recorded[e["trial_id"]]
        assert Path(e["previous_pipeline_directory"]) == Path(
            trial.metadata.previous_trial_location
        )
        assert e["kwargs"]["epochs"] > 1
    assert "Restored all states from the checkpoint" in result.log
    assert all(
        t.report is not None and t.report.reported_as == "success" for t in recorded.values()
    )
    # The follower opened nothing under the root but the checkpoints the user's own
    # Lightning code loads there (Trainer.fit(ckpt_path=...) reads it on every rank).
    follower = result.exits[1]
    assert follower["calls"] == {"neps.run": 0, "NePSState.create_or_load": 0}
    assert follower["root_access"]["paths"], "the user's checkpoint load was not seen"
    assert all(p.endswith("/last.ckpt") for p in follower["root_access"]["paths"]), follower


def test_single_process_behaves_like_neps_run(tmp_path: Path) -> None:
    result = run(Scenario(strategy="none", trials=4), tmp_path)
    assert_clean_launch(result)
    trials = result.of("trial")
    assert len(trials) == 4
    assert {(e["rank"], e["world_size"], e["is_leader"]) for e in trials} == {(0, None, True)}
    recorded = neps_trials(result.root)
    assert sorted(recorded) == sorted(e["trial_id"] for e in trials)
    for e in trials:
        assert recorded[e["trial_id"]].report.objective_to_minimize == pytest.approx(
            e["kwargs"]["lr"]
        )
    assert "neps_bcast rank 1" not in result.log
    assert result.exits[0]["calls"]["neps.run"] == 1


def test_ddp_spawn_keeps_working(tmp_path: Path) -> None:
    result = run(Scenario(strategy="ddp_spawn", trials=3), tmp_path)
    assert_clean_launch(result)
    trials = result.of("trial")
    # Only the leader runs the script; Lightning's spawned workers run the fit only.
    assert len(trials) == 3 and {e["rank"] for e in trials} == {0}
    assert len({e["pid"] for e in trials}) == 1
    recorded = neps_trials(result.root)
    assert all(t.report.reported_as == "success" for t in recorded.values())
    assert len(recorded) == 3
    # The spawned ranks trained: each trial stepped on ranks 0 and 1, in processes
    # other than the script's.
    script_pid = trials[0]["pid"]
    steps = result.of("step")
    assert sorted((e["trial_id"], e["rank"]) for e in steps) == sorted(
        (e["trial_id"], r) for e in trials for r in (0, 1)
    ), steps
    assert script_pid not in {e["pid"] for e in steps}


def test_a_waiting_follower_uses_no_cpu(tmp_path: Path) -> None:
    """While the leader's NePS takes 4 s to sample trial 3, the follower waits for it:
    it must use < 1% of a core over that window (a polling loop uses ~100%)."""
    running = start(
        Scenario(trials=3, faults=(Fault("sleep", where="sample", rank=0, seq=2, seconds=4),)),
        tmp_path,
    )
    follower_pid = running.wait_for(
        "the follower's start",
        lambda ev: next((e["pid"] for e in ev if e["event"] == "start" and e["proc_rank"] == 1), 0),
    )

    def pause(event: str) -> object:
        return lambda ev: any(e["event"] == event and e["where"] == "sample" for e in ev)

    running.wait_for("the leader's sampling pause", pause("fault"))
    before, t0 = procfs.read_stat(follower_pid), time.monotonic()
    running.wait_for("the end of the pause", pause("slept"))
    after, t1 = procfs.read_stat(follower_pid), time.monotonic()
    result = running.finish()
    assert_clean_launch(result)
    assert before is not None and after is not None, "the follower was gone while waiting"
    # Positive control: the same reading shows the follower's own work (imports, two fits).
    assert before.cpu_seconds > 1.0, before
    window = t1 - t0
    assert window > 3.0, window
    share = (after.cpu_seconds - before.cpu_seconds) / window
    assert share < 0.01, f"the waiting follower used {share:.1%} of a core over {window:.1f} s"
    assert [e["trial_id"] for e in result.of("trial") if e["rank"] == 1] == ["1", "2", "3"]


def test_user_function_changes_directory_with_a_relative_root(tmp_path: Path) -> None:
    """The function os.chdir()s into a fresh folder at its start, on every rank, and
    the root is relative ("results", to the launch's cwd): every trial is still
    recorded in <cwd>/results, nothing lands under the folders it moved to, and every
    process is gone within 15 s of the launcher's exit."""
    moved = tmp_path / "moved"
    moved.mkdir()
    result = run(Scenario(trials=3, root="results", chdir_into=str(moved)), tmp_path)
    assert_clean_launch(result)
    assert result.root == tmp_path / "results"
    chdirs = result.of("chdir")
    assert {(e["proc_rank"], e["seq"]) for e in chdirs} == {
        (r, s) for r in (0, 1) for s in (1, 2, 3)
    }
    recorded = neps_trials(result.root)
    assert sorted(recorded) == ["1", "2", "3"]
    assert all(t.report.reported_as == "success" for t in recorded.values())
    assert not list(moved.rglob("results")), sorted(moved.rglob("*"))
    by_rank = trials_by_rank(result.events)
    assert json.dumps(by_rank[1], sort_keys=True) == json.dumps(by_rank[0], sort_keys=True)
