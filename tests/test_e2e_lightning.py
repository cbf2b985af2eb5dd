"""End to end: real NePS searches over Lightning strategy="ddp" trials, `python script.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness import (
    PYTHON,
    SEARCH,
    assert_clean_launch,
    base_env,
    launch,
    neps_trials,
    read_records,
    trials_by_rank,
)

BASIC_KEYS = ("lr", "hidden", "activation")


def run_search(tmp_path: Path, **env: str):  # type: ignore[no-untyped-def]
    root, rec = tmp_path / "root", tmp_path / "rec"
    result = launch(
        [PYTHON, str(SEARCH)],
        log_path=tmp_path / "launch.log",
        env=base_env(NB_ROOT=str(root), NB_RECORD=str(rec), **env),
        cwd=tmp_path,
    )
    return result, root, read_records(rec)


@pytest.mark.parametrize("devices", [2, 3])
def test_every_rank_evaluates_the_leaders_trials(tmp_path: Path, devices: int) -> None:
    result, root, events = run_search(
        tmp_path, NB_DEVICES=str(devices), NB_TRIALS="5", NB_EXTRA_ARGS="1"
    )
    assert_clean_launch(result)

    by_rank = trials_by_rank(events)
    assert sorted(by_rank) == list(range(devices)), result.tail()
    leader = by_rank[0]
    assert len(leader) == 5
    for rank in range(1, devices):
        # Same trial ids, same exact keyword arguments, same order.
        assert json.dumps(by_rank[rank], sort_keys=True) == json.dumps(leader, sort_keys=True)

    recorded = neps_trials(root)
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
    for e in (e for e in events if e["event"] == "trial"):
        assert e["world_size"] == (None if e["trial_id"] == first_id else devices), e

    exits = [e for e in events if e["event"] == "exit"]
    assert len(exits) == devices and all(e["ok"] for e in exits)
    followers = [e for e in exits if e["proc_rank"] != 0]
    assert len(followers) == devices - 1
    for e in followers:
        # Followers never call neps.run and never open NePS's state.
        assert e["calls"] == {"neps.run": 0, "NePSState.create_or_load": 0}
    # Every rank logs with its rank and role; only the leader's NePS speaks.
    assert f"[neps_bcast rank 1/{devices} follower]" in result.log
    assert "[neps_bcast rank 0/" in result.log


def test_multi_fidelity_continues_from_the_previous_checkpoint(tmp_path: Path) -> None:
    result, root, events = run_search(
        tmp_path, NB_SPACE="fidelity", NB_OPTIMIZER="hyperband", NB_TRIALS="6"
    )
    assert_clean_launch(result)
    by_rank = trials_by_rank(events)
    assert sorted(by_rank) == [0, 1]
    assert json.dumps(by_rank[1], sort_keys=True) == json.dumps(by_rank[0], sort_keys=True)
    promoted = [e for e in events if e["event"] == "trial" and e["previous_pipeline_directory"]]
    assert promoted, "hyperband promoted no trial: the test must exercise a continuation"
    assert {e["rank"] for e in promoted} == {0, 1}
    assert all(e["ckpt_exists"] for e in promoted)
    recorded = neps_trials(root)
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


def test_single_process_behaves_like_neps_run(tmp_path: Path) -> None:
    result, root, events = run_search(tmp_path, NB_STRATEGY="none", NB_TRIALS="4")
    assert_clean_launch(result)
    trials = [e for e in events if e["event"] == "trial"]
    assert len(trials) == 4
    assert {(e["rank"], e["world_size"], e["is_leader"]) for e in trials} == {(0, None, True)}
    recorded = neps_trials(root)
    assert sorted(recorded) == sorted(e["trial_id"] for e in trials)
    for e in trials:
        assert recorded[e["trial_id"]].report.objective_to_minimize == pytest.approx(
            e["kwargs"]["lr"]
        )
    assert "neps_bcast rank 1" not in result.log


def test_ddp_spawn_keeps_working(tmp_path: Path) -> None:
    result, root, events = run_search(tmp_path, NB_STRATEGY="ddp_spawn", NB_TRIALS="3")
    assert_clean_launch(result)
    trials = [e for e in events if e["event"] == "trial"]
    # Only the leader runs the script; Lightning's spawned workers run the fit only.
    assert len(trials) == 3 and {e["rank"] for e in trials} == {0}
    assert len({e["pid"] for e in trials}) == 1
    recorded = neps_trials(root)
    assert all(t.report.reported_as == "success" for t in recorded.values())
    assert len(recorded) == 3
