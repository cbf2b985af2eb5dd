"""The guarantees, each on one real launch: the top tier's end-to-end tests (``make test``).

Every guarantee README.md and docs/failures.md make is checked here on one launch of a
user-shaped script, the way users launch it; the launchers' own shapes are the README's
commands (tests/test_examples.py). Each class is one launch (or a launch and its rerun)
and the tests that read what it left:

- every rank evaluates the leader's trials, followers never touch NePS or its root;
- a single process behaves like ``neps.run``;
- an error on any rank surfaces on every rank, NePS records the trial crashed with it,
  and the search goes on;
- Ctrl-C stops every rank, records the trial, and leaves no process;
- a lost leader's trial (SIGKILL) is left to the next leader, and the same command
  again evaluates it first and finishes the budget;
- SIGTERM to the whole launch (preemption) puts the trial back, and the rerun finishes;
- the handshake refuses a rank with another secret before trial 1, on every rank.

The same scenarios under other launchers, and every other end-to-end scenario, are in
tests/e2e (``make test-e2e``); every fault at every step is tests/sweep (``make
test-faults``). docs/test-tiers.md lists which launch checks what.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import (
    HANG_S,
    LIGHTNING,
    SINGLE,
    TIMED_OUT,
    TORCH_DDP,
    CleanLaunch,
    Rerun,
    RerunChecks,
    Result,
    assert_followers_never_touch_neps,
    assert_nothing_left,
    assert_the_leader_touched_neps,
    assert_trials_freed_before_finalization,
    evaluated,
    first_fault,
    identical_on_every_rank,
    listening_ports,
    marked_pids,
    neps_trials,
    python,
    raised,
    reports,
    run,
    start,
    states,
    trials_by_rank,
)
from neps_bcast.compat import procfs
from neps_bcast.recovery.lease_file import read_lease
from ports import HeldPort

BASIC_KEYS = ("lr", "hidden", "activation")
ABORTED = ("terminate called", "Fatal Python error", "Aborted", "core dumped")
"""What a rank's log holds when its interpreter aborted at exit."""


class TestEveryRankEvaluatesTheLeadersTrials(CleanLaunch):
    """2 ranks (3 in tests/e2e), 5 trials; the function names NePS's pipeline arguments."""

    @pytest.fixture(scope="class", params=[2], ids=["2_ranks"])
    def devices(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)

    @pytest.fixture(scope="class")
    def launch(self, devices: int, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = python(LIGHTNING, "--devices", devices, "--trials", 5, "--with-dirs")
        return run(command, tmp_path_factory.mktemp("ranks"))

    def test_every_rank_evaluated_the_leaders_trials_with_the_same_arguments(
        self, launch: Result, devices: int
    ) -> None:
        identical_on_every_rank(launch, devices)

    def test_the_leader_evaluated_the_whole_budget(self, launch: Result) -> None:
        assert len(trials_by_rank(launch.events)[0]) == 5, launch.tail()

    def test_neps_recorded_every_trial_as_a_success(self, launch: Result) -> None:
        leader = trials_by_rank(launch.events)[0]
        recorded = neps_trials(launch.root)
        assert sorted(recorded) == sorted(tid for tid, _ in leader)
        assert all(
            t.report is not None and t.report.reported_as == "success" for t in recorded.values()
        )

    def test_the_ranks_got_the_configuration_neps_recorded(self, launch: Result) -> None:
        recorded = neps_trials(launch.root)
        for tid, kwargs in trials_by_rank(launch.events)[0]:
            assert {k: recorded[tid].config[k] for k in BASIC_KEYS} == {
                k: kwargs[k] for k in BASIC_KEYS
            }

    def test_neps_injected_the_pipeline_arguments_the_signature_names(self, launch: Result) -> None:
        """The leader got them from NePS; the followers the same (the identical test)."""
        recorded = neps_trials(launch.root)
        for tid, kwargs in trials_by_rank(launch.events)[0]:
            assert kwargs["pipeline_id"] == tid
            assert Path(kwargs["pipeline_directory"]) == Path(recorded[tid].metadata.location)

    def test_world_size_is_none_before_the_first_fit_then_the_groups_size(
        self, launch: Result, devices: int
    ) -> None:
        first_id = trials_by_rank(launch.events)[0][0][0]
        for e in launch.of("trial"):
            assert e["world_size"] == (None if e["trial_id"] == first_id else devices), e

    def test_every_rank_recorded_exit_code_0(self, launch: Result, devices: int) -> None:
        exits = launch.exits
        assert sorted(exits) == list(range(devices))
        assert all(e["ok"] and e["code"] == 0 for e in exits.values()), exits

    def test_the_leader_is_the_launched_process_itself(self, launch: Result) -> None:
        leader_start = next(e for e in launch.of("start") if e["proc_rank"] == 0)
        assert launch.exits[0]["pid"] == leader_start["pid"]

    def test_followers_never_touched_neps_or_its_root(self, launch: Result) -> None:
        assert_followers_never_touch_neps(launch.exits)

    def test_the_leader_touched_neps_and_its_root(self, launch: Result) -> None:
        """The positive control: the counters that stay 0 on followers count here."""
        assert_the_leader_touched_neps(launch.exits)

    def test_every_rank_logs_with_its_rank_and_role(self, launch: Result, devices: int) -> None:
        assert f"[neps_bcast rank 1/{devices} follower]" in launch.log
        assert "[neps_bcast rank 0/" in launch.log


@dataclass
class Listening:
    launch: Result
    ports: dict[int, str]
    """What the process listened on while trial 2 was held in its session."""


class TestSingleProcessBehavesLikeNepsRun(CleanLaunch):
    """One process, 4 trials. Trial 2 is held inside its session (the ``hold`` fault)
    until the test has read what the process listens on: a single-process search serves
    no store (docs/security.md, "Local launches stay local")."""

    @pytest.fixture(scope="class")
    def listening(self, tmp_path_factory: pytest.TempPathFactory) -> Listening:
        tmp = tmp_path_factory.mktemp("single")
        release = tmp / "release"
        running = start(
            python(SINGLE, "--trials", 4),
            tmp,
            fault=f"hold:leader:trial=2:at=session:until={release}",
        )
        try:
            held = running.wait_for(
                "trial 2 held in its session",
                lambda ev: next((e for e in ev if e["event"] == "fault" and e["seq"] == 2), None),
            )
            ports = listening_ports(int(held["pid"]))
        finally:
            release.touch()
        return Listening(running.finish(), ports)

    @pytest.fixture(scope="class")
    def launch(self, listening: Listening) -> Result:
        return listening.launch

    def test_it_listens_on_no_port(self, listening: Listening) -> None:
        """The same reading sees the Lightning leader's listeners
        (tests/e2e/test_e2e_attacker.py)."""
        assert listening.ports == {}, f"a single-process search listens on {listening.ports}"

    def test_every_trial_ran_on_a_leader_without_a_group(self, launch: Result) -> None:
        trials = launch.of("trial")
        assert len(trials) == 4
        assert {(e["rank"], e["world_size"], e["is_leader"]) for e in trials} == {(0, None, True)}

    def test_neps_recorded_each_trial(self, launch: Result) -> None:
        recorded = neps_trials(launch.root)
        assert sorted(recorded) == sorted(e["trial_id"] for e in launch.of("trial"))

    def test_neps_recorded_what_the_function_returned(self, launch: Result) -> None:
        recorded = neps_trials(launch.root)
        for e in launch.of("trial"):
            assert recorded[e["trial_id"]].report.objective_to_minimize == pytest.approx(
                e["kwargs"]["lr"]
            )

    def test_no_follower_ever_logged(self, launch: Result) -> None:
        assert "neps_bcast rank 1" not in launch.log

    def test_neps_run_was_called_once(self, launch: Result) -> None:
        assert launch.exits[0]["calls"]["neps.run"] == 1


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

    def test_every_ranks_session_raised_because_of_its_fault_not_a_timeout(
        self, launch: Result
    ) -> None:
        """Why each rank's session ended: the fault's own error or the peer's, named; no
        wait ended by its timeout (``HANG_S`` after the fault only detects a hang)."""
        assert launch.of("fault"), "no fault fired: the test did not test"
        for f in launch.of("fault"):
            for e in raised(launch, f["seq"]).values():
                assert (
                    "injected failure" in e["text"]
                    or "ProtocolError" in e["text"]
                    or ("cannot send argument" in e["text"])
                ), (f, e)
                assert not TIMED_OUT.search(e["text"]), (f, e)
                assert e["t"] - f["t"] < HANG_S, (f, e)


class TestCtrlCStopsEveryRankAndRecordsTheTrial:
    """Ctrl-C in a terminal (SIGINT to the whole process group) in fit of trial 2: every
    rank stops with SystemExit 1, NePS records trial 2 crashed as interrupted, and no
    process is left. (SIGTERM to every rank or to the follower and SIGINT to the leader
    are the fault sweep's Lightning ``fit`` cells, with these same checks.)"""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = python(LIGHTNING, "--trials", 4)
        return run(command, tmp_path_factory.mktemp("signal"), fault="ctrl_c:leader:trial=2")

    def test_the_launcher_exits_with_1(self, launch: Result) -> None:
        assert launch.returncode == 1, launch.tail()

    def test_no_process_of_the_launch_is_left(self, launch: Result) -> None:
        assert_nothing_left(launch)

    def test_neps_recorded_trial_1_a_success(self, launch: Result) -> None:
        recorded = reports(launch.root)
        assert sorted(recorded) == [1, 2]
        assert recorded[1][:2] == ("success", "success")

    def test_neps_holds_trial_2_crashed_as_interrupted(self, launch: Result) -> None:
        recorded = reports(launch.root)[2]
        assert recorded[:2] == ("crashed", "crashed")
        assert re.fullmatch(r"interrupted: SystemExit 1", recorded[2], re.DOTALL), recorded[2]

    def test_every_process_ended_on_its_own_after_the_signal(self, launch: Result) -> None:
        launch.ended_on_their_own(first_fault(launch))

    @pytest.mark.parametrize("rank", [0, 1])
    def test_what_the_rank_raised(self, launch: Result, rank: int) -> None:
        by_rank = raised(launch, 2)
        assert sorted(by_rank) == [0, 1]
        assert (by_rank[rank]["type"], by_rank[rank]["text"]) == ("SystemExit", "1"), by_rank

    @pytest.mark.parametrize("rank", [0, 1])
    def test_the_ranks_exit_code(self, launch: Result, rank: int) -> None:
        exits = launch.exits
        assert sorted(exits) == [0, 1]
        assert exits[rank]["code"] == 1, exits[rank]

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


class TestTheLeaderKilledTheOrphanIsEvaluatedByTheRerun(RerunChecks):
    """SIGKILL on the leader in trial 2 (as the OOM killer or a node failure would); then
    the same command: trial 2 is evaluated again first, with the same arguments, and the
    root ends with exactly 4 successes."""

    @pytest.fixture(scope="class")
    def rerun(self, tmp_path_factory: pytest.TempPathFactory) -> Rerun:
        tmp = tmp_path_factory.mktemp("leader_killed")
        command = python(LIGHTNING, "--trials", 4, "--with-dirs")
        first = run(command, tmp, name="first", fault="sigkill:leader:trial=2")
        after_first = states(first.root)
        return Rerun(first, after_first, run(command, tmp, name="again"))

    def test_every_process_of_the_first_launch_ended_on_its_own(self, rerun: Rerun) -> None:
        rerun.first.ended_on_their_own(first_fault(rerun.first))

    def test_the_killed_trial_was_left_evaluating(self, rerun: Rerun) -> None:
        assert rerun.after_first == {"1": "success", "2": "evaluating"}, rerun.first.tail()

    def test_the_rerun_ends_with_four_successes(self, rerun: Rerun) -> None:
        assert states(rerun.again.root) == dict.fromkeys("1234", "success")

    def test_the_rerun_logged_the_orphan_and_its_gone_leader(self, rerun: Rerun) -> None:
        assert "orphaned trial 2 (its leader (pid" in rerun.again.log

    def test_both_ranks_evaluated_the_orphan_with_the_same_arguments(self, rerun: Rerun) -> None:
        """The same configuration, the same pipeline directory."""
        before = evaluated(rerun.first, "2")
        after = evaluated(rerun.again, "2")
        assert sorted(e["rank"] for e in after) == [0, 1]
        assert all(e["kwargs"] == before[0]["kwargs"] for e in after), (before, after)

    def test_the_orphan_is_the_reruns_first_trial(self, rerun: Rerun) -> None:
        """Taken before NePS sampled anything new."""
        assert min(rerun.again.of("trial"), key=lambda e: e["t"])["trial_id"] == "2"

    def test_the_lease_records_one_attempt_whose_owner_is_gone(self, rerun: Rerun) -> None:
        before = evaluated(rerun.first, "2")
        lease = read_lease(Path(before[0]["kwargs"]["pipeline_directory"]))
        assert lease is not None
        assert len(lease.attempts) == 1
        assert "is gone" in lease.attempts[0].how


class TestSigtermToTheWholeLaunchPutsTheTrialBack(RerunChecks):
    """SIGTERM to every process of the launch during trial 2 (SLURM preemption, a time
    limit, scancel): every process exits promptly, 143 ("requeue me"); trial 2 is
    pending, not crashed; the same command (NePS's default ignore_errors=False) evaluates
    it and finishes the budget."""

    @dataclass
    class Terminated(Rerun):
        sent: float

    @pytest.fixture(scope="class")
    def rerun(self, tmp_path_factory: pytest.TempPathFactory) -> Rerun:
        tmp = tmp_path_factory.mktemp("sigterm_all")
        command = python(LIGHTNING, "--trials", 3)
        # Trial 2 trains for a long while (a slow step on every rank), so that the
        # signal arrives in its middle, whatever the machine's load.
        running = start(command, tmp, name="first", fault="sleep:all:trial=2:s=120")
        running.wait_for(
            "both ranks inside trial 2's training",
            lambda ev: {e["rank"] for e in ev if e["event"] == "fault" and e["seq"] == 2} == {0, 1},
        )
        sent = time.time()
        for pid in marked_pids(running.marker):
            procfs.kill(pid, signal.SIGTERM)
        first = running.finish()
        after_first = states(first.root)
        return self.Terminated(first, after_first, run(command, tmp, name="again"), sent)

    def test_every_process_ended_on_its_own_after_the_signal(self, rerun: Terminated) -> None:
        rerun.first.ended_on_their_own(rerun.sent)

    def test_the_launcher_exits_with_143(self, rerun: Rerun) -> None:
        """(torchrun itself ends with 1, its workers with 143: the sweep's torchrun
        ``fit`` ``term_all`` cell.)"""
        assert rerun.first.returncode == 143, rerun.first.tail()

    def test_every_rank_exited_with_143(self, rerun: Rerun) -> None:
        exits = rerun.first.exits
        assert {r: e["code"] for r, e in exits.items()} == {0: 143, 1: 143}, rerun.first.tail()

    def test_the_interrupted_trial_is_pending(self, rerun: Rerun) -> None:
        assert rerun.after_first == {"1": "success", "2": "pending"}, rerun.first.tail()

    def test_the_leader_logged_that_143_asks_to_requeue(self, rerun: Rerun) -> None:
        assert "exit code 143 asks to requeue" in rerun.first.log

    def test_the_rerun_finished_the_budget(self, rerun: Rerun) -> None:
        assert states(rerun.again.root) == dict.fromkeys("123", "success")

    def test_both_ranks_of_the_rerun_evaluated_the_interrupted_trial(self, rerun: Rerun) -> None:
        assert sorted(e["rank"] for e in evaluated(rerun.again, "2")) == [0, 1]


@dataclass
class Secrets:
    launches: dict[int, Result]
    root: Path


class TestARankWithAnotherSecretIsRefusedBeforeTrial1OnEveryRank:
    """Two processes of one group, started by hand with torch's variables; rank 1 has
    another NEPS_BCAST_SECRET."""

    @pytest.fixture(scope="class")
    def secrets(self, tmp_path_factory: pytest.TempPathFactory) -> Secrets:
        tmp = tmp_path_factory.mktemp("secrets")
        running = {}
        secrets = ("a1b2c3d4e5f60718" * 4, "f0e1d2c3b4a59687" * 4)  # 32 bytes each, as hex
        with HeldPort() as port:
            for rank, secret in enumerate(secrets):
                env = {
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": "2",
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "NEPS_BCAST_SECRET": secret,
                }
                command = python(TORCH_DDP, "--trials", 3, "--root", tmp / "root")
                running[rank] = start(command, tmp, name=f"rank{rank}", env=env)
            return Secrets({rank: r.finish() for rank, r in running.items()}, tmp / "root")

    @pytest.mark.parametrize("rank", [0, 1])
    def test_the_rank_exits_with_1(self, secrets: Secrets, rank: int) -> None:
        assert secrets.launches[rank].returncode == 1, secrets.launches[rank].tail()

    @pytest.mark.parametrize("rank", [0, 1])
    def test_no_process_of_the_rank_is_left(self, secrets: Secrets, rank: int) -> None:
        assert_nothing_left(secrets.launches[rank])

    @pytest.mark.parametrize("rank", [0, 1])
    def test_the_rank_names_the_mismatched_secret(self, secrets: Secrets, rank: int) -> None:
        launch = secrets.launches[rank]
        assert "rank 1: refused the value under 'neps_bcast/leader'" in launch.log, launch.tail()

    @pytest.mark.parametrize("rank", [0, 1])
    def test_the_rank_evaluated_no_trial(self, secrets: Secrets, rank: int) -> None:
        assert not secrets.launches[rank].of("trial"), "a trial ran with a mismatched secret"

    def test_neps_holds_no_trial(self, secrets: Secrets) -> None:
        root = secrets.root
        assert not (root / "configs").exists() or not neps_trials(root)
