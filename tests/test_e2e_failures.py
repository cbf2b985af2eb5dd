"""End to end: what a failure does to a search. Real processes, real NePS, real gloo.

Each class is one launch (or one launch and its rerun) of a user-shaped script, with the
fault it injects named in ``NB_FAULT`` (tests/scripts/faults.py), never through the
library; its tests read what the launch left. Time bounds are generous on purpose: they
prove that no 30-minute group timeout is involved, not how fast things are.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import (
    LIGHTNING,
    TORCH_DDP,
    CleanLaunch,
    LaunchChecks,
    Result,
    assert_nothing_left,
    assert_trials_freed_before_finalization,
    identical_on_every_rank,
    neps_trials,
    python,
    raised,
    run,
    start,
    torchrun,
    trials_by_rank,
)
from neps_bcast.compat import procfs

BOUND_S = 60.0
"""No wait involved may be a timeout: every failure is handled within this bound."""


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


def first_fault(launch: Result) -> float:
    faults = launch.of("fault")
    assert faults, f"no fault fired: the test did not test; logs:\n{launch.tail()}"
    return min(e["t"] for e in faults)


class TestErrorsFailTheTrialOnEveryRankAndTheSearchGoesOn(CleanLaunch):
    """Lightning ddp, 2 ranks, ignore_errors; one launch, eight trials: 1 ok; 2 the
    follower raises in fit; 3 the leader raises before its session; 4 every rank raises
    after fit; 5 the Trainer asks for 3 devices; 6 the follower raises before its
    session; 7 an argument cannot be pickled; 8 ok."""

    FAULT = (
        "raise:follower:trial=2:at=fit, raise:leader:trial=3:at=before,"
        " raise:all:trial=4:at=after, too_many_devices:all:trial=5,"
        " raise:follower:trial=6:at=before, unpicklable:leader:trial=7"
    )

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = python(LIGHTNING, "--trials", 8, "--ignore-errors", "--space", "tool")
        return run(command, tmp_path_factory.mktemp("errors"), fault=self.FAULT)

    @pytest.fixture(scope="class")
    def text(self, launch: Result) -> dict[int, str]:
        """trial number -> the error text NePS recorded."""
        return {n: r[2] for n, r in reports(launch.root).items()}

    def test_neps_recorded_all_eight_trials(self, launch: Result) -> None:
        assert sorted(reports(launch.root)) == list(range(1, 9)), launch.tail()

    @pytest.mark.parametrize("trial", [1, 8])
    def test_a_trial_without_a_fault_is_a_success(self, launch: Result, trial: int) -> None:
        assert reports(launch.root)[trial][:2] == ("success", "success")

    @pytest.mark.parametrize("trial", range(2, 8))
    def test_a_failed_trial_is_recorded_crashed(self, launch: Result, trial: int) -> None:
        assert reports(launch.root)[trial][:2] == ("crashed", "crashed")

    def test_a_followers_error_is_recorded_with_its_traceback(self, text: dict[int, str]) -> None:
        """Trial 2: the follower's error first; the leader's own error is secondary."""
        assert (
            "trial 2 failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit."
            " Caused by it: rank 0: RuntimeError:"
        ) in text[2]
        assert "--- traceback of rank 1 (pid " in text[2]
        assert 'raise ValueError(f"injected failure on rank' in text[2]

    @pytest.mark.parametrize(("trial", "rank"), [(3, 0), (6, 1)], ids=["leader", "follower"])
    def test_an_error_before_the_session_is_recorded(
        self, text: dict[int, str], trial: int, rank: int
    ) -> None:
        assert (
            f"trial {trial} failed on rank {rank}: rank {rank}: ValueError: injected failure"
            f" on rank {rank} at before"
        ) in text[trial]

    def test_the_same_error_on_every_rank_is_recorded_once_listing_the_ranks(
        self, text: dict[int, str]
    ) -> None:
        """Trial 4."""
        assert re.search(r"trial 4 failed on ranks (0, 1|1, 0): ", text[4])
        head = text[4].splitlines()[0]
        assert head.count("ValueError: injected failure on rank 0 at after") == 1
        assert head.count("ValueError: injected failure on rank 1 at after") == 1
        assert "Caused by it" not in head
        assert text[4].count("--- traceback of rank 0") == 1
        assert text[4].count("--- traceback of rank 1") == 1

    def test_a_trainer_whose_devices_differ_from_the_group_is_refused(
        self, text: dict[int, str]
    ) -> None:
        """Trial 5: refused before training."""
        assert re.search(r"trial 5 failed on ranks (0, 1|1, 0): ", text[5])
        assert (
            "ProtocolError: [neps_bcast rank 1/2 follower] the Trainer plans 3 processes"
            " (devices=3 x num_nodes=1), but the DDP group it would train on has 2 ranks"
        ) in text[5]

    def test_an_argument_that_cannot_be_sent_is_named(self, text: dict[int, str]) -> None:
        """Trial 7: no follower ever saw the trial."""
        assert (
            "[neps_bcast rank 0/2 leader] cannot send argument 'tool' (lock) to the other"
            " ranks: TypeError: cannot pickle '_thread.lock' object. HINT:"
        ) in text[7]

    @pytest.mark.parametrize(
        ("seq", "failing", "where"),
        [(2, 1, "fit"), (3, 0, "before"), (6, 1, "before")],
        ids=["follower_in_fit", "leader_before_its_session", "follower_before_its_session"],
    )
    def test_every_ranks_session_raised_naming_the_failing_rank(
        self, launch: Result, seq: int, failing: int, where: str
    ) -> None:
        """A rank that failed before its session raised its own error."""
        by_rank = raised(launch, seq)
        assert sorted(by_rank) == [0, 1], by_rank
        own = f"ValueError: injected failure on rank {failing} at {where}"
        for rank, e in by_rank.items():
            if rank == failing and where == "before":
                assert f"{e['type']}: {e['text']}" == own
            else:
                assert e["type"] == "TrialFailedError", e
                assert f"trial {seq} failed on rank {failing}: rank {failing}: {own}" in e["text"]

    @pytest.mark.parametrize("seq", [4, 5])
    def test_both_ranks_raised_when_both_failed(self, launch: Result, seq: int) -> None:
        assert sorted(raised(launch, seq)) == [0, 1]

    def test_the_trials_that_reached_a_session_were_identical_on_both_ranks(
        self, launch: Result
    ) -> None:
        """Trials 3, 6 and 7 never got into a session's body."""
        assert identical_on_every_rank(launch, 2) == ["1", "2", "4", "5", "8"]

    def test_only_trials_1_4_and_8_trained(self, launch: Result) -> None:
        """2 raised inside fit, 5 trained nowhere."""
        assert len(launch.of("trained")) == 2 * 3

    def test_every_ranks_session_raised_within_the_bound_of_its_fault(self, launch: Result) -> None:
        assert launch.of("fault"), "no fault fired: the test did not test"
        for f in launch.of("fault"):
            for e in raised(launch, f["seq"]).values():
                assert e["t"] - f["t"] < BOUND_S, (f, e)


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

    def test_every_process_was_gone_within_the_bound(self, launch: Result) -> None:
        launch.gone_within(first_fault(launch), BOUND_S)


@dataclass
class Rerun:
    """A launch that failed, what NePS held after it, and the same command again."""

    first: Result
    after_first: dict[int, tuple[str, str, str]]
    again: Result


class TestAKilledFollowerIsRecordedAndTheSearchResumes(CleanLaunch):
    """SIGKILL on the follower in fit of trial 2; then the same command again (its
    checks inherited here are the rerun's). A lost follower is an infrastructure
    failure: trial 2 goes back to pending (never left "evaluating"), and the rerun
    evaluates it first."""

    @pytest.fixture(scope="class")
    def rerun(self, tmp_path_factory: pytest.TempPathFactory) -> Rerun:
        tmp = tmp_path_factory.mktemp("follower_killed")
        command = python(LIGHTNING, "--trials", 4, "--ignore-errors")
        first = run(command, tmp, name="first", fault="sigkill:follower:trial=2")
        after_first = reports(first.root)
        return Rerun(first, after_first, run(command, tmp, name="again"))

    @pytest.fixture(scope="class")
    def launch(self, rerun: Rerun) -> Result:
        return rerun.again

    def test_the_first_launch_exits_with_1(self, rerun: Rerun) -> None:
        assert rerun.first.returncode == 1, rerun.first.tail()

    def test_the_first_launch_left_no_process(self, rerun: Rerun) -> None:
        assert_nothing_left(rerun.first)

    def test_the_interrupted_trial_went_back_to_pending(self, rerun: Rerun) -> None:
        """Not left "evaluating"."""
        assert sorted(rerun.after_first) == [1, 2]
        assert rerun.after_first[2][0] == "pending"

    def test_the_leader_exited_naming_the_lost_follower(self, rerun: Rerun) -> None:
        exits = rerun.first.exits
        assert sorted(exits) == [0]  # the follower was SIGKILLed: it recorded no exit
        assert exits[0]["code"] == 1
        assert exits[0]["error"].startswith(
            "FollowerLostError: [neps_bcast rank 0/2 leader] rank 1 lost: "
        )

    def test_the_first_launch_was_gone_within_the_bound(self, rerun: Rerun) -> None:
        rerun.first.gone_within(first_fault(rerun.first), BOUND_S)

    def test_the_rerun_finished_every_trial_as_a_success(self, rerun: Rerun) -> None:
        recorded = reports(rerun.again.root)
        assert {n: r[0] for n, r in recorded.items()} == dict.fromkeys(range(1, 5), "success")

    def test_the_rerun_evaluated_trial_2_first_then_the_rest_on_both_ranks(
        self, rerun: Rerun
    ) -> None:
        second = [e for e in rerun.again.of("trial") if e["t"] > rerun.first.gone_at]
        assert sorted({(e["trial_id"], e["rank"]) for e in second}) == [
            (str(t), r) for t in (2, 3, 4) for r in (0, 1)
        ]


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
    naming it, within the bound."""

    returncode = -signal.SIGKILL

    def test_the_follower_started(self, launch: Result) -> None:
        """Without it the test tests nothing."""
        assert len({e["pid"] for e in launch.of("start")}) == 2, launch.tail()

    def test_every_process_was_gone_within_the_bound(self, launch: Result) -> None:
        launch.gone_within(first_fault(launch), BOUND_S)

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


LEADER_KILLS = {
    # when -> the fault: in fit of trial 2; while its NePS chooses trial 3; in trial 1,
    # 3 s after it started, while Lightning's child is still importing
    "fit": "sigkill:leader:trial=2:at=fit",
    "between_trials": "sigkill:leader:trial=2:at=sample",
    "children_starting": "sigkill_in:leader:trial=1:at=before:s=3",
}


class TestTheLeaderKilledEveryFollowerExitsNamingIt(LeaderKilledChecks):
    """In fit of trial 2; between trials (its NePS choosing trial 3); in trial 1 while
    Lightning's child is still importing (before any follower reached the leader)."""

    @pytest.fixture(scope="class", params=list(LEADER_KILLS))
    def when(self, request: pytest.FixtureRequest) -> str:
        return str(request.param)

    @pytest.fixture(scope="class")
    def launch(self, when: str, tmp_path_factory: pytest.TempPathFactory) -> Result:
        # children_starting: the follower's interpreter starts and imports torch,
        # Lightning and NePS after its leader died (up to 16 s on 2 busy cores), before
        # any line of neps_bcast runs; what neps_bcast owes is bounded from its exit
        # record (test_the_follower_was_gone_within_5_s_of_its_exit_record).
        linger = BOUND_S if when == "children_starting" else 15.0
        running = start(
            python(LIGHTNING, "--trials", 4),
            tmp_path_factory.mktemp(f"leader_killed_{when}"),
            fault=LEADER_KILLS[when],
        )
        return running.finish(linger=linger)

    def test_the_follower_exited_with_1_raising_leader_lost(self, launch: Result) -> None:
        exits = launch.exits
        assert sorted(exits) == [1], exits
        assert exits[1]["code"] == 1, exits[1]
        assert exits[1]["error"].startswith("LeaderLostError: [neps_bcast rank 1/")

    def test_the_follower_was_gone_within_5_s_of_its_exit_record(self, launch: Result) -> None:
        """Its last line of Python to its process gone: the interpreter's exit does not
        free every object it imported (2.5 to 7 s under load before, about 1 s now)."""
        launch.gone_within(launch.exits[1]["t"], 5.0)


class TestTheLeaderKilledWhileItsChildIsInTheRendezvous(LeaderKilledChecks):
    """Trial 1: Lightning's child SIGKILLs the leader right after it got the trial, so
    the child is in Lightning's init_process_group rendezvous on the dead leader's
    MASTER_PORT: stuck inside Lightning, the leader watch ends the process."""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        return run(
            python(LIGHTNING, "--trials", 4),
            tmp_path_factory.mktemp("leader_killed_in_rendezvous"),
            fault="kill_parent:follower:trial=1:at=before",
        )

    def test_the_leader_watch_ended_the_follower_with_code_1(self, launch: Result) -> None:
        assert "Exiting with code 1 (LeaderLostError)" in lost_lines(launch)[-1]

    def test_the_follower_recorded_no_exit(self, launch: Result) -> None:
        """It never got back to the script: the watch ended the process."""
        assert launch.exits == {}


_GLOO_CLOSED = r"RuntimeError: \[[^\]]*gloo/transport/tcp/pair\.cc:\d+\] Connection closed by peer \[127\.0\.0\.1\]:\d+\. [^\n]*"
_TERMINATED_IN_FIT = (
    r"\n--- traceback of rank 1 \(pid {pid1}\) ---\nTraceback \(most recent call last\):\n"
    r".*    faults\.at\(\"fit\"\)\n.*    os\.kill\(pid, SIGNALS\[f\.kind\]\)\n"
    r".*\n[\w.]*Terminated: 143\n"
)
_TERM_FOLLOWER = (
    r"\[neps_bcast rank 0/2 leader\] trial 2 failed on rank 1: rank 1: Terminated: 143\."
    r" Caused by it: rank 0: " + _GLOO_CLOSED + _TERMINATED_IN_FIT
)


@dataclass(frozen=True)
class Outcome:
    """What one signal leads to."""

    fault: str
    returncode: int
    """The launcher's exit code."""
    neps_text: str | None
    """NePS's whole error text for trial 2 (a pattern); None: the trial went back to
    pending (SIGTERM is preemption, not the trial's fault)."""
    ranks: dict[int, tuple[str, str, int]]
    """Each rank's (what its evaluation raised, that error's whole text, its exit code)."""


SIGNALS = {
    # SLURM preemption: every rank.
    "term_all": Outcome(
        "sigterm:all:trial=2",
        143,
        None,
        {0: ("Terminated", "143", 143), 1: ("Terminated", "143", 143)},
    ),
    # One rank only: Lightning's own SIGTERM handler would broadcast on the group from
    # inside the handler and hang every rank.
    "term_follower": Outcome(
        "sigterm:follower:trial=2",
        1,
        None,
        {0: ("TrialFailedError", _TERM_FOLLOWER, 1), 1: ("Terminated", "143", 143)},
    ),
    "int_leader": Outcome(
        "sigint:leader:trial=2",
        1,
        r"interrupted: SystemExit 1",
        {
            0: ("SystemExit", "1", 1),
            # The follower names the leader's error, then stops when its leader says so.
            1: (
                "TrialFailedError",
                r"\[neps_bcast rank 1/2 follower\] trial 2 failed on rank 0: rank 0:"
                r" SystemExit: 1\. Caused by it: rank 1: " + _GLOO_CLOSED + r"\n"
                r"--- traceback of rank 0 \(pid {pid0}\) ---\n.*\nSystemExit: 1\n",
                0,
            ),
        },
    ),
    # Ctrl-C in a terminal: SIGINT to the whole process group.
    "ctrl_c": Outcome(
        "ctrl_c:leader:trial=2",
        1,
        r"interrupted: SystemExit 1",
        {0: ("SystemExit", "1", 1), 1: ("SystemExit", "1", 1)},
    ),
}

ABORTED = ("terminate called", "Fatal Python error", "Aborted", "core dumped")


class TestSigtermAndCtrlCStopEveryRankAndRecordTheTrial:
    """A signal in fit of trial 2 (SIGTERM to every rank or to the follower, SIGINT to
    the leader, Ctrl-C to the process group): every rank stops, each with the error and
    exit code its signal means, and NePS holds trial 2 as it should."""

    @pytest.fixture(scope="class", params=list(SIGNALS))
    def outcome(self, request: pytest.FixtureRequest) -> Outcome:
        return SIGNALS[request.param]

    @pytest.fixture(scope="class")
    def launch(self, outcome: Outcome, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = python(LIGHTNING, "--trials", 4)
        return run(command, tmp_path_factory.mktemp("signal"), fault=outcome.fault)

    @staticmethod
    def pids(launch: Result) -> dict[str, int]:
        return {f"pid{e['proc_rank']}": e["pid"] for e in launch.of("start")}

    def test_the_launcher_exits_with_the_signals_code(
        self, launch: Result, outcome: Outcome
    ) -> None:
        assert launch.returncode == outcome.returncode, launch.tail()

    def test_no_process_of_the_launch_is_left(self, launch: Result) -> None:
        assert_nothing_left(launch)

    def test_neps_recorded_trial_1_a_success(self, launch: Result) -> None:
        recorded = reports(launch.root)
        assert sorted(recorded) == [1, 2]
        assert recorded[1][:2] == ("success", "success")

    def test_neps_holds_trial_2_as_the_signal_means(self, launch: Result, outcome: Outcome) -> None:
        recorded = reports(launch.root)[2]
        if outcome.neps_text is None:
            assert recorded[0] == "pending", recorded
        else:
            assert recorded[:2] == ("crashed", "crashed")
            want = outcome.neps_text.format(**self.pids(launch))
            assert re.fullmatch(want, recorded[2], re.DOTALL), recorded[2]

    def test_every_process_was_gone_within_the_bound(self, launch: Result) -> None:
        launch.gone_within(first_fault(launch), BOUND_S)

    @pytest.mark.parametrize("rank", [0, 1])
    def test_what_the_rank_raised(self, launch: Result, outcome: Outcome, rank: int) -> None:
        kind, pattern, _ = outcome.ranks[rank]
        by_rank = raised(launch, 2)
        assert sorted(by_rank) == [0, 1]
        assert by_rank[rank]["type"] == kind, by_rank[rank]
        want = pattern.format(**self.pids(launch))
        assert re.fullmatch(want, by_rank[rank]["text"], re.DOTALL), by_rank[rank]

    @pytest.mark.parametrize("rank", [0, 1])
    def test_the_ranks_exit_code(self, launch: Result, outcome: Outcome, rank: int) -> None:
        exits = launch.exits
        assert sorted(exits) == [0, 1]
        assert exits[rank]["code"] == outcome.ranks[rank][2], exits[rank]

    def test_the_leader_did_not_exit_ok(self, launch: Result) -> None:
        assert not launch.exits[0]["ok"]

    def test_both_ranks_watched_their_trials_objects(self, launch: Result) -> None:
        """The positive control of the next test: each rank's DDP wrapper and process
        group (what could abort at exit, about one Ctrl-C run in ten before) were
        watched."""
        at_exit = {e["proc_rank"]: e for e in launch.of("at_exit")}
        assert sorted(at_exit) == [0, 1], launch.tail()
        assert all(e["trial_objects_seen"] > 0 for e in at_exit.values()), at_exit

    def test_no_trial_object_is_left_to_the_interpreters_finalization(self, launch: Result) -> None:
        assert_trials_freed_before_finalization(launch)

    def test_no_rank_aborted_at_exit(self, launch: Result) -> None:
        """The recorded exit code is what the interpreter was about to end with; an abort
        at exit would come after it, and would write to that rank's own log."""
        for name, log in launch.rank_logs.items():
            for marker in ABORTED:
                assert marker not in log, (name, marker, launch.tail())


class TestASecondSigtermWhileTheLeaderSettlesTheTrial(LaunchChecks):
    """SIGTERM to every rank in fit of trial 2 (SLURM preemption), then a second SIGTERM
    to the leader while it settles trial 2 (puts it back to pending in NePS): trial 2 is
    still put back (not left "evaluating"), the leader still exits 143 (the first signal's
    code, which SLURM's requeue reads), and every process is gone within BOUND_S of the
    first signal."""

    returncode = 143

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        return run(
            python(LIGHTNING, "--trials", 4),
            tmp_path_factory.mktemp("second_sigterm"),
            fault="sigterm:all:trial=2, sigterm:leader:trial=2:at=settle",
        )

    def test_the_second_sigterm_came_while_the_leader_settled_trial_2(self, launch: Result) -> None:
        fired = [(e["kind"], e["where"], e["seq"], e["rank"]) for e in launch.of("fault")]
        assert ("sigterm", "settle", 2, 0) in fired, (fired, launch.tail())

    def test_trial_1_is_a_success_and_trial_2_pending(self, launch: Result) -> None:
        recorded = reports(launch.root)
        assert sorted(recorded) == [1, 2], (recorded, launch.tail())
        assert recorded[1][:2] == ("success", "success")
        assert recorded[2][0] == "pending", (recorded[2], launch.tail())

    def test_the_leader_exited_143_as_the_kernel_reports(self, launch: Result) -> None:
        assert launch.exits[0]["code"] == 143, (launch.exits, launch.tail())

    def test_every_process_was_gone_within_the_bound(self, launch: Result) -> None:
        launch.gone_within(first_fault(launch), BOUND_S)


@dataclass
class Signalled:
    launch: Result
    delivered: bool
    sent: float


class TestSigtermToAFollowerWaitingBetweenTrials:
    """SIGTERM to the follower while it waits for trial 3 (the leader's NePS takes 5 s
    to sample it): the follower exits with 143, no trial is left "evaluating", trials
    1 and 2 stay successes, and every process is gone within BOUND_S of the signal."""

    @pytest.fixture(scope="class")
    def signalled(self, tmp_path_factory: pytest.TempPathFactory) -> Signalled:
        running = start(
            python(LIGHTNING, "--trials", 4),
            tmp_path_factory.mktemp("sigterm_waiting"),
            fault="sleep:leader:trial=2:at=sample:s=5",
        )
        follower = running.wait_for(
            "the follower's start",
            lambda ev: next(
                (e["pid"] for e in ev if e["event"] == "start" and e["proc_rank"] == 1), 0
            ),
        )
        running.wait_for(
            "the leader's sampling pause",
            lambda ev: any(e["event"] == "fault" and e["where"] == "sample" for e in ev),
        )
        delivered = procfs.kill(follower, signal.SIGTERM)
        sent = time.time()
        return Signalled(running.finish(), delivered, sent)

    def test_the_follower_was_alive_to_get_the_signal(self, signalled: Signalled) -> None:
        assert signalled.delivered, "the follower was gone before the signal"

    def test_no_process_of_the_launch_is_left(self, signalled: Signalled) -> None:
        assert_nothing_left(signalled.launch)

    def test_the_launcher_exits_with_an_error(self, signalled: Signalled) -> None:
        assert signalled.launch.returncode != 0, signalled.launch.tail()

    def test_the_follower_evaluated_nothing_after_the_signal(self, signalled: Signalled) -> None:
        assert not [
            e for e in signalled.launch.of("trial") if e["rank"] == 1 and e["t"] > signalled.sent
        ]

    def test_the_follower_exited_with_143(self, signalled: Signalled) -> None:
        exits = signalled.launch.exits
        assert exits[1]["code"] == 143, (exits, signalled.launch.tail())

    def test_trials_1_and_2_stay_successes_and_none_is_evaluating(
        self, signalled: Signalled
    ) -> None:
        recorded = reports(signalled.launch.root)
        assert recorded[1][:2] == ("success", "success")
        assert recorded[2][:2] == ("success", "success")
        assert {r[0] for r in recorded.values()} <= {"success", "crashed", "pending"}, recorded

    def test_every_process_was_gone_within_the_bound(self, signalled: Signalled) -> None:
        signalled.launch.gone_within(signalled.sent, BOUND_S)


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
