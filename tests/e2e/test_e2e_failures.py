"""End to end: what a failure does to a search. Real processes, real NePS, real gloo.

Each class is one launch (or one launch and its rerun) of a user-shaped script, with the
fault it injects named in ``NB_FAULT`` (tests/scripts/faults.py), never through the
library; its tests read what the launch left. How a launch ended is checked by why
(``Result.ended_on_their_own``: every process ended by its own path, no wait ended by its
timeout), not by how many seconds it took on a machine whose load varies.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

import pytest

from harness import (
    LIGHTNING,
    TORCH_DDP,
    CleanLaunch,
    LaunchChecks,
    Result,
    first_fault,
    identical_on_every_rank,
    python,
    raised,
    reports,
    run,
    start,
    torchrun,
    trials_by_rank,
)


class TestNepsDefaultStopsTheSearchAfterRecordingTheTrial(LaunchChecks):
    """ignore_errors=False (NePS's default): the leader raises in fit in trial 2."""

    returncode = 1

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = python(LIGHTNING, "--trials", 4)
        return run(command, tmp_path_factory.mktemp("default"), fault="raise:leader:trial=2")

    def test_neps_recorded_trial_1_a_success_and_trial_2_crashed(self, launch: Result) -> None:
        recorded = reports(launch.root)
        assert sorted(recorded) == [1, 2]
        assert recorded[1][:2] == ("success", "success")
        assert recorded[2][:2] == ("crashed", "crashed")

    def test_neps_recorded_the_leaders_error(self, launch: Result) -> None:
        assert (
            "trial 2 failed on rank 0: rank 0: ValueError: injected failure on rank 0 at fit"
            in reports(launch.root)[2][2]
        )

    def test_the_leader_exited_with_1_raising_neps_error(self, launch: Result) -> None:
        leader = launch.exits[0]
        assert not leader["ok"] and leader["code"] == 1, leader
        assert "WorkerRaiseError" in leader["error"]

    def test_the_follower_exited_with_0_because_its_leader_said_so(self, launch: Result) -> None:
        assert sorted(launch.exits) == [0, 1]
        follower = launch.exits[1]
        assert follower["ok"] and follower["code"] == 0, follower

    def test_the_followers_session_raised_naming_the_leaders_error(self, launch: Result) -> None:
        follower = raised(launch, 2)[1]
        assert follower["type"] == "TrialFailedError"
        assert "trial 2 failed on rank 0: rank 0: ValueError" in follower["text"]

    def test_every_process_ended_on_its_own(self, launch: Result) -> None:
        launch.ended_on_their_own(first_fault(launch))


@dataclass
class Rerun:
    """A launch that failed, what NePS held after it, and the same command again."""

    first: Result
    after_first: dict[int, tuple[str, str, str]]
    again: Result


class TestAGroupThatCannotBeFormedAgainFailsItsTrialOnEveryRank(CleanLaunch):
    """Lightning ddp, 2 ranks. Trial 2 fails, so the group is formed again for trial 3;
    on one rank that raises right after torch formed it (as a connection lost late in
    the rendezvous does: seen in CI when a peer released the new group at once). Trial 3
    fails on every rank naming that error; trial 4 runs on a group formed once more.
    (Before: on the leader, NePS recorded the error while the follower evaluated the
    trial on its own, and the next trial's broadcast met the follower's report: both
    waited for ever. On a follower, it left the search.)"""

    @pytest.fixture(scope="class", params=[0, 1], ids=["on_the_leader", "on_the_follower"])
    def rank(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)

    @pytest.fixture(scope="class")
    def launch(self, rank: int, tmp_path_factory: pytest.TempPathFactory) -> Result:
        who = "leader" if rank == 0 else "follower"
        return run(
            python(LIGHTNING, "--trials", 4, "--ignore-errors"),
            tmp_path_factory.mktemp("reform"),
            fault=f"raise:follower:trial=2, raise:{who}:trial=3:at=reform",
        )

    def test_neps_recorded_2_and_3_crashed_1_and_4_successes(self, launch: Result) -> None:
        recorded = reports(launch.root)
        assert {n: r[:2] for n, r in recorded.items()} == {
            1: ("success", "success"),
            2: ("crashed", "crashed"),
            3: ("crashed", "crashed"),
            4: ("success", "success"),
        }, launch.tail()

    def test_trial_3s_record_names_the_forming_error(self, launch: Result, rank: int) -> None:
        text = reports(launch.root)[3][2]
        assert (
            f"trial 3 failed on rank {rank}: rank {rank}: ValueError: injected failure on"
            f" rank {rank} at reform"
        ) in text, text

    def test_the_forming_fault_fired_once_on_its_rank_in_trial_3(
        self, launch: Result, rank: int
    ) -> None:
        [fired] = [f for f in launch.of("fault") if f["where"] == "reform"]
        assert (fired["rank"], fired["seq"]) == (rank, 3)

    def test_every_rank_ended_trial_3_and_evaluated_trial_4(self, launch: Result) -> None:
        by_rank = trials_by_rank(launch.events)
        assert {r: [tid for tid, _ in trials] for r, trials in by_rank.items()} == {
            0: ["1", "2", "4"],
            1: ["1", "2", "4"],
        }, launch.tail()


class LeaderKilledChecks(LaunchChecks):
    """The leader is SIGKILLed (the launcher's own exit code: -9); every follower exits,
    naming it, on its own (no wait of it ended by its timeout)."""

    returncode = -signal.SIGKILL

    def test_the_follower_started(self, launch: Result) -> None:
        """Without it the test tests nothing."""
        assert len({e["pid"] for e in launch.of("start")}) == 2, launch.tail()

    def test_every_process_ended_on_its_own_after_the_kill(self, launch: Result) -> None:
        launch.ended_on_their_own(first_fault(launch))

    def test_the_follower_logged_that_it_lost_its_leader(self, launch: Result) -> None:
        assert lost_lines(launch), launch.tail()


def lost_lines(launch: Result) -> list[str]:
    follower = "[neps_bcast rank 1/"
    return [
        line
        for line in launch.log.splitlines()
        if follower in line
        and ("lost the leader (rank 0)" in line or "cannot reach the leader's store" in line)
    ]


class TestTheLeaderKilledWhileLightningsChildIsStarting(LeaderKilledChecks):
    """In trial 1, 3 s after it started, while Lightning's child is still importing
    (before any follower reached the leader). (The leader killed in fit of trial 2 and
    between trials, its NePS choosing trial 3, are the fault sweep's Lightning ``fit``
    and ``sample`` ``kill_leader`` cells, with these checks.)"""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        # The follower's interpreter starts and imports torch, Lightning and NePS after
        # its leader died (up to 16 s on 2 busy cores), before any line of neps_bcast
        # runs: the harness's wait for it (LINGER_S) is a hang detector only.
        running = start(
            python(LIGHTNING, "--trials", 4),
            tmp_path_factory.mktemp("leader_killed_children_starting"),
            fault="sigkill_in:leader:trial=1:at=before:s=3",
        )
        return running.finish()

    def test_the_follower_exited_with_1_raising_leader_lost(self, launch: Result) -> None:
        exits = launch.exits
        assert sorted(exits) == [1], exits
        assert exits[1]["code"] == 1, exits[1]
        assert exits[1]["error"].startswith("LeaderLostError: [neps_bcast rank 1/")

    def test_the_follower_left_by_the_exit_that_skips_the_final_collection(
        self, launch: Result
    ) -> None:
        """Its last line of Python to its process gone: the follower's exit freezes what
        it imported out of the final collection (neps_bcast.roles.follower._freeze_at_exit),
        which took 2.5 to 7 s under load before. Checked by the path its exit took (the
        probe's "exit_path" record), not by seconds a loaded machine stretches; and the
        kernel heard it end with the code it recorded (LaunchChecks)."""
        pid = launch.exits[1]["pid"]
        [path] = [e for e in launch.of("exit_path") if e["pid"] == pid]
        assert path["gc_frozen"] > 0, (path, launch.tail())


class TestTorchrunTheUserDestroysTheGroupAndErrorsRecover(CleanLaunch):
    """torchrun, a plain DDP loop whose function ends with dist.destroy_process_group()
    (as PyTorch's DDP tutorial does); the follower raises in trial 3, the leader in its
    session in trial 4."""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        return run(
            torchrun(2, TORCH_DDP, "--trials", 6, "--ignore-errors", "--destroy-group"),
            tmp_path_factory.mktemp("destroy_group"),
            fault="raise:follower:trial=3, raise:leader:trial=4:at=session",
        )

    def test_the_failed_trials_are_crashed_the_others_successes(self, launch: Result) -> None:
        assert {n: r[0] for n, r in reports(launch.root).items()} == {
            1: "success",
            2: "success",
            3: "crashed",
            4: "crashed",
            5: "success",
            6: "success",
        }

    def test_neps_recorded_the_followers_error(self, launch: Result) -> None:
        assert (
            "trial 3 failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit"
            in reports(launch.root)[3][2]
        )

    def test_neps_recorded_the_leaders_error(self, launch: Result) -> None:
        assert (
            "trial 4 failed on rank 0: rank 0: ValueError: injected failure on rank 0 at session"
            in reports(launch.root)[4][2]
        )

    def test_every_rank_evaluated_every_trial_but_the_leaders_failed_one(
        self, launch: Result
    ) -> None:
        """Trial 4 fails on the leader as soon as its session() formed the group: the
        follower, still completing that group's connections, may then fail in its
        session() before it enters the trial (seen: "Gloo connectFullMesh failed"),
        which fails trial 4 on every rank all the same."""
        others = [e for e in launch.events if not (e["event"] == "trial" and e["trial_id"] == "4")]
        assert identical_on_every_rank(others, 2) == ["1", "2", "3", "5", "6"]
        fourth = {e["rank"]: e["kwargs"] for e in launch.of("trial") if e["trial_id"] == "4"}
        if 1 in fourth:
            assert fourth[1] == fourth[0], fourth
        else:
            (raised,) = [e for e in launch.of("raised") if e["seq"] == 4 and e["rank"] == 1]
            assert "connectFullMesh" in raised["text"], (raised, launch.tail())

    def test_the_four_trials_without_an_error_trained_on_both_ranks(self, launch: Result) -> None:
        assert len(launch.of("trained")) == 2 * 4

    def test_every_trial_trained_on_a_group_of_2(self, launch: Result) -> None:
        assert {e["world_size_after"] for e in launch.of("trained")} == {2}

    def test_the_group_was_formed_again(self, launch: Result) -> None:
        """The script forms none: neps_bcast forms one at session(), each trial anew."""
        for seq in range(1, 7):
            assert f"forming the DDP group for trial #{seq} " in launch.log, launch.tail()
