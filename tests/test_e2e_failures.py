"""End to end: failure semantics (issue 4). Real processes, real NePS, real gloo.

Faults are injected through search.py's environment (NB_FAULT & co., see its
docstring), never through the library. Each launch covers several cases, because
every rank pays ~6 s of imports. Time bounds are generous on purpose: they prove
that no 30-minute group timeout is involved, not how fast things are (docs/failures.md
has the measured times).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from harness import (
    PYTHON,
    SEARCH,
    TORCHRUN,
    Launch,
    assert_clean_launch,
    base_env,
    launch,
    neps_trials,
    read_records,
    trials_by_rank,
)

BOUND_S = 60.0
"""No wait involved may be a timeout: every failure is handled within this bound."""


def run(
    tmp_path: Path, name: str = "run", cmd: list[str] | None = None, **env: str
) -> tuple[Launch, Path, list[dict[str, Any]]]:
    root, rec = tmp_path / "root", tmp_path / "rec"
    result = launch(
        cmd or [PYTHON, str(SEARCH)],
        log_path=tmp_path / f"{name}.log",
        env=base_env(NB_ROOT=str(root), NB_RECORD=str(rec), **env),
        cwd=tmp_path,
    )
    return result, root, read_records(rec)


def state(trial: Any) -> str:
    s = trial.metadata.state
    return str(getattr(s, "value", s))


def reports(root: Path) -> dict[int, tuple[str, str, str]]:
    """trial number -> (state, reported_as, error text) as NePS recorded it."""
    return {
        int(tid): (
            state(t),
            t.report.reported_as if t.report else "",
            str(t.report.err) if t.report and t.report.err else "",
        )
        for tid, t in neps_trials(root).items()
    }


def faults(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "fault"]


def raised(events: list[dict[str, Any]], seq: int) -> dict[int, dict[str, Any]]:
    """What each rank's evaluate raised in its seq-th trial, by rank."""
    return {e["rank"]: e for e in events if e["event"] == "raised" and e["seq"] == seq}


def assert_identical_on_all_ranks(events: list[dict[str, Any]], world: int) -> list[str]:
    by_rank = trials_by_rank(events)
    assert sorted(by_rank) == list(range(world))
    for rank in range(1, world):
        assert json.dumps(by_rank[rank], sort_keys=True) == json.dumps(by_rank[0], sort_keys=True)
    return [tid for tid, _ in by_rank[0]]


def test_errors_fail_the_trial_on_every_rank_and_the_search_goes_on(tmp_path: Path) -> None:
    """Lightning ddp, 2 ranks, ignore_errors=True; one launch, eight trials:
    1 ok; 2 follower raises in fit; 3 leader raises before its session; 4 every rank
    raises after fit; 5 the Trainer asks for 3 devices; 6 follower raises before its
    session; 7 an argument cannot be pickled; 8 ok."""
    result, root, events = run(
        tmp_path,
        NB_TRIALS="8",
        NB_IGNORE_ERRORS="1",
        NB_SPACE="unpicklable",
        NB_UNPICKLABLE_SEQS="7",
        NB_DEVICES_AT="5:3",
        NB_FAULT="raise:rank=1:seq=2:where=fit,raise:rank=0:seq=3:where=before,"
        "raise:rank=all:seq=4:where=after,raise:rank=1:seq=6:where=before",
    )
    assert_clean_launch(result)
    recorded = reports(root)
    assert sorted(recorded) == list(range(1, 9)), result.tail()
    for n in (1, 8):
        assert recorded[n][:2] == ("success", "success")
    for n in range(2, 8):
        assert recorded[n][:2] == ("crashed", "crashed"), (n, recorded[n])
    text = {n: recorded[n][2] for n in recorded}

    # 2: the follower's error, with its traceback; the leader's own error is secondary.
    assert (
        "trial 2 failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit."
        " Caused by it: rank 0: RuntimeError:"
    ) in text[2]
    assert "--- traceback of rank 1 (pid " in text[2]
    assert 'raise ValueError(f"injected failure on rank' in text[2]
    # 3 and 6: a rank raised before its session; the other's session names it.
    assert (
        "trial 3 failed on rank 0: rank 0: ValueError: injected failure on rank 0 at before"
        in text[3]
    )
    assert (
        "trial 6 failed on rank 1: rank 1: ValueError: injected failure on rank 1 at before"
        in text[6]
    )
    # 4: the same error on every rank: recorded once, listing the ranks.
    assert re.search(r"trial 4 failed on ranks (0, 1|1, 0): ", text[4])
    head = text[4].splitlines()[0]
    assert head.count("ValueError: injected failure on rank 0 at after") == 1
    assert head.count("ValueError: injected failure on rank 1 at after") == 1
    assert "Caused by it" not in head
    assert text[4].count("--- traceback of rank 0") == 1
    assert text[4].count("--- traceback of rank 1") == 1
    # 5: a Trainer whose devices differ from the group is refused before training.
    assert re.search(r"trial 5 failed on ranks (0, 1|1, 0): ", text[5])
    assert (
        "ProtocolError: [neps_bcast rank 1/2 follower] the Trainer plans 3 processes"
        " (devices=3 x num_nodes=1), but the DDP group it would train on has 2 ranks"
    ) in text[5]
    # 7: the argument that cannot be sent is named; no follower ever saw the trial.
    assert (
        "[neps_bcast rank 0/2 leader] cannot send argument 'tool' (lock) to the other"
        " ranks: TypeError: cannot pickle '_thread.lock' object. HINT:"
    ) in text[7]

    # Every rank's session raised, naming the failing rank and its error (a rank that
    # failed before its session raised its own error).
    for seq, failing, where in ((2, 1, "fit"), (3, 0, "before"), (6, 1, "before")):
        by_rank = raised(events, seq)
        assert sorted(by_rank) == [0, 1], (seq, by_rank)
        own = f"ValueError: injected failure on rank {failing} at {where}"
        for rank, e in by_rank.items():
            if rank == failing and where == "before":
                assert f"{e['type']}: {e['text']}" == own
            else:
                assert e["type"] == "TrialFailedError", e
                assert f"trial {seq} failed on rank {failing}: rank {failing}: {own}" in e["text"]
    for seq in (4, 5):
        assert sorted(raised(events, seq)) == [0, 1]

    # Later trials were evaluated identically on both ranks; trials 3, 6 and 7 never
    # got into a session's body, and trial 5 trained nowhere.
    ids = assert_identical_on_all_ranks(events, 2)
    assert ids == ["1", "2", "4", "5", "8"]
    trained = [e for e in events if e["event"] == "trained"]
    assert len(trained) == 2 * 3  # trials 1, 4 and 8 (2 raised inside fit)

    # Bounded: from each fault to every rank's session raising.
    for f in faults(events):
        for e in raised(events, f["seq"]).values():
            assert e["t"] - f["t"] < BOUND_S


def test_neps_default_stops_the_search_after_recording_the_trial(tmp_path: Path) -> None:
    """ignore_errors=False (NePS's default): the leader raises in fit in trial 2."""
    result, root, events = run(tmp_path, NB_TRIALS="4", NB_FAULT="raise:rank=0:seq=2:where=fit")
    assert_clean_launch(result, expect_rc=1)
    recorded = reports(root)
    assert sorted(recorded) == [1, 2]
    assert recorded[1][:2] == ("success", "success")
    assert recorded[2][:2] == ("crashed", "crashed")
    assert (
        "trial 2 failed on rank 0: rank 0: ValueError: injected failure on rank 0 at fit"
        in recorded[2][2]
    )
    exits = {e["proc_rank"]: e for e in events if e["event"] == "exit"}
    assert not exits[0]["ok"]
    assert "WorkerRaiseError" in exits[0]["error"]
    assert exits[1]["ok"]  # the follower stopped because its leader said so
    follower_raised = raised(events, 2)[1]
    assert follower_raised["type"] == "TrialFailedError"
    assert "trial 2 failed on rank 0: rank 0: ValueError" in follower_raised["text"]
    assert result.gone_at - faults(events)[0]["t"] < BOUND_S


def test_follower_killed_is_recorded_and_the_search_resumes(tmp_path: Path) -> None:
    """SIGKILL on the follower in fit of trial 2; then the same command again.

    ignore_errors=True: with NePS's default, NePS itself refuses to continue a root
    that holds any crashed trial (OnErrorPossibilities.RAISE_ANY_ERROR)."""
    result, root, events = run(
        tmp_path,
        "first",
        NB_TRIALS="4",
        NB_IGNORE_ERRORS="1",
        NB_FAULT="kill:rank=1:seq=2:where=fit",
    )
    assert_clean_launch(result, expect_rc=1)
    recorded = reports(root)
    assert sorted(recorded) == [1, 2]
    assert recorded[2][:2] == ("crashed", "crashed")  # not left "evaluating"
    assert re.search(r"rank 1 lost: signal 9 \(SIGKILL\) \(pid \d+\)", recorded[2][2])
    exits = [e for e in events if e["event"] == "exit"]
    assert [e["proc_rank"] for e in exits] == [0]
    assert exits[0]["error"].startswith(
        "FollowerLostError: [neps_bcast rank 0/2 leader] rank 1 lost: signal 9 (SIGKILL)"
    )
    assert result.gone_at - faults(events)[0]["t"] < BOUND_S

    again, _, events = run(tmp_path, "again", NB_TRIALS="4", NB_IGNORE_ERRORS="1")
    assert_clean_launch(again)
    recorded = reports(root)
    assert sorted(recorded) == [1, 2, 3, 4]
    assert {n: r[0] for n, r in recorded.items()} == {
        1: "success",
        2: "crashed",
        3: "success",
        4: "success",
    }
    second = [e for e in events if e["event"] == "trial" and e["t"] > result.gone_at]
    assert sorted({(e["trial_id"], e["rank"]) for e in second}) == [
        ("3", 0),
        ("3", 1),
        ("4", 0),
        ("4", 1),
    ]


@pytest.mark.parametrize(
    "when", ["fit", "between_trials", "children_starting", "children_in_rendezvous"]
)
def test_leader_killed_every_follower_exits_naming_it(tmp_path: Path, when: str) -> None:
    fault = {
        "fit": "kill:rank=0:seq=2:where=fit",
        "between_trials": "kill:rank=0:seq=2:where=sample",  # NePS choosing trial 3
        # Trial 1, before any follower reached the leader: Lightning's child is still
        # importing, or (killed by the child itself, right after it got the trial) in
        # Lightning's init_process_group rendezvous on the dead leader's MASTER_PORT.
        "children_starting": "kill_in:rank=0:seq=1:where=before:s=3",
        "children_in_rendezvous": "sigkill_leader:rank=1:seq=1:where=before",
    }[when]
    result, _, events = run(tmp_path, NB_TRIALS="4", NB_FAULT=fault)
    assert result.returncode == -9, result.tail()  # the leader, killed
    assert not result.left_alive, result.tail()
    starts = {e["pid"] for e in events if e["event"] == "start"}
    assert len(starts) == 2, "the follower never started: the test did not test"
    assert result.gone_at - faults(events)[0]["t"] < BOUND_S
    follower = "[neps_bcast rank 1/"
    lost = [
        line
        for line in result.log.splitlines()
        if (follower in line and "lost the leader (rank 0)" in line)
        or (follower in line and "cannot reach the leader's store" in line)
    ]
    assert lost, result.tail()
    exits = [e for e in events if e["event"] == "exit"]
    if when == "children_in_rendezvous":
        # Stuck inside Lightning: the leader watch ends the process (exit code 1).
        assert "Exiting with code 1 (LeaderLostError)" in lost[-1]
        assert exits == []
    else:
        assert [e["proc_rank"] for e in exits] == [1]
        assert exits[0]["error"].startswith("LeaderLostError: [neps_bcast rank 1/")


@pytest.mark.parametrize("signal_name", ["term_all", "term_follower", "int_leader", "ctrl_c"])
def test_sigterm_and_ctrl_c_stop_every_rank_and_record_the_trial(
    tmp_path: Path, signal_name: str
) -> None:
    fault = {
        "term_all": "term_all:rank=all:seq=2:where=fit",  # SLURM preemption
        # One rank only: Lightning's own SIGTERM handler would broadcast on the
        # group from inside the handler and hang every rank.
        "term_follower": "term_all:rank=1:seq=2:where=fit",
        "int_leader": "int:rank=0:seq=2:where=fit",
        "ctrl_c": "int_group:rank=0:seq=2:where=fit",
    }[signal_name]  # whole group
    result, root, events = run(tmp_path, NB_TRIALS="4", NB_FAULT=fault)
    assert result.returncode == (143 if signal_name == "term_all" else 1), result.tail()
    assert not result.left_alive, result.tail()
    recorded = reports(root)
    assert sorted(recorded) == [1, 2]
    assert recorded[2][:2] == ("crashed", "crashed")
    if signal_name == "term_follower":
        assert "trial 2 failed on rank 1: rank 1: Terminated: 143" in recorded[2][2]
        assert "rank 1 lost: exit code 143" in result.log  # not an abort at exit
    else:
        assert recorded[2][2].startswith("interrupted: ")
    assert result.gone_at - faults(events)[0]["t"] < BOUND_S
    exits = {e["proc_rank"]: e for e in events if e["event"] == "exit"}
    assert sorted(exits) == [0, 1]
    assert not exits[0]["ok"]


def test_torchrun_user_destroys_the_group_and_errors_recover(tmp_path: Path) -> None:
    """torchrun, plain DDP whose function ends with dist.destroy_process_group() (as
    PyTorch's DDP tutorial does); the follower raises in trial 3, the leader in its
    session in trial 4."""
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", str(SEARCH)]
    result, root, events = run(
        tmp_path,
        cmd=cmd,
        NB_STRATEGY="plain_ddp",
        NB_TRIALS="6",
        NB_IGNORE_ERRORS="1",
        NB_DESTROY_GROUP="1",
        NB_FAULT="raise:rank=1:seq=3:where=fit,raise:rank=0:seq=4:where=session",
    )
    assert_clean_launch(result)
    recorded = reports(root)
    assert {n: r[0] for n, r in recorded.items()} == {
        1: "success",
        2: "success",
        3: "crashed",
        4: "crashed",
        5: "success",
        6: "success",
    }
    assert (
        "trial 3 failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit"
        in recorded[3][2]
    )
    assert (
        "trial 4 failed on rank 0: rank 0: ValueError: injected failure on rank 0 at session"
    ) in recorded[4][2]
    assert assert_identical_on_all_ranks(events, 2) == ["1", "2", "3", "4", "5", "6"]
    trained = [e for e in events if e["event"] == "trained"]
    assert len(trained) == 2 * 4
    assert {e["world_size_after"] for e in trained} == {2}
    assert "re-forming the DDP group" in result.log
