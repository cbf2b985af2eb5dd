"""End to end: no trial is ever stuck. Real processes, real NePS, Lightning
``strategy="ddp"`` (``python lightning_search.py``) and torchrun, 2 ranks.

NePS picks up only pending trials and has no heartbeat: a trial whose worker died would
stay ``evaluating`` for ever. Every class kills something for real, then runs the same
command again and reads NePS's own record of the root: how each trial ended, that
nothing is left ``evaluating``, and which processes evaluated the interrupted trial,
with which arguments. A fixture snapshots NePS's record after each launch.
"""

from __future__ import annotations

import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import (
    LIGHTNING,
    CleanLaunch,
    Rerun,
    RerunChecks,
    Result,
    assert_nothing_left,
    evaluated,
    first_fault,
    identical_on_every_rank,
    neps_trials,
    python,
    run,
    start,
    states,
)
from neps_bcast.recovery.lease_file import Lease, read_lease

SHORT_LEASE = {"NEPS_BCAST_LEASE_GRACE_S": "4", "NEPS_BCAST_HEARTBEAT_S": "0.5"}


def led(result: Result) -> list[str]:
    """The trials the leader evaluated, in order."""
    return [
        e["trial_id"] for e in sorted(result.of("trial"), key=lambda e: e["t"]) if e["rank"] == 0
    ]


@dataclass
class Retried:
    """Three launches on one root and NePS's states after each."""

    first: Result
    after_first: dict[str, str]
    second: Result
    after_second: dict[str, str]
    last: Result


class TestAKilledFollowerIsRetriedUpToTheLimitThenCrashed(CleanLaunch):
    """NEPS_BCAST_MAX_RETRIES=1. SIGKILL on the follower in trial 2: back to pending,
    the leader stops (its group lost a rank) without sampling anything else. The rerun
    evaluates trial 2 first; the follower is killed again: past the limit, recorded
    crashed naming both attempts. A third run (``launch``: its checks are inherited)
    finishes the budget (ignore_errors=True, NePS's rule for a root holding a crashed
    trial)."""

    @pytest.fixture(scope="class")
    def retried(self, tmp_path_factory: pytest.TempPathFactory) -> Retried:
        tmp = tmp_path_factory.mktemp("retries")
        env = {"NEPS_BCAST_MAX_RETRIES": "1"}
        command = python(LIGHTNING, "--trials", 4)
        first = run(command, tmp, name="first", env=env, fault="sigkill:follower:trial=2")
        after_first = states(first.root)
        # In the rerun, trial 2 is the follower's first trial.
        second = run(command, tmp, name="second", env=env, fault="sigkill:follower:trial=1")
        after_second = states(first.root)
        last = run([*command, "--ignore-errors"], tmp, name="last", env=env)
        return Retried(first, after_first, second, after_second, last)

    @pytest.fixture(scope="class")
    def launch(self, retried: Retried) -> Result:
        return retried.last

    def test_the_first_launch_exits_with_1(self, retried: Retried) -> None:
        assert retried.first.returncode == 1, retried.first.tail()

    def test_the_first_launch_left_no_process(self, retried: Retried) -> None:
        assert_nothing_left(retried.first)

    def test_after_the_first_kill_the_trial_is_pending(self, retried: Retried) -> None:
        assert retried.after_first == {"1": "success", "2": "pending"}, retried.first.tail()

    def test_the_first_leader_names_the_lost_follower(self, retried: Retried) -> None:
        error = retried.first.exits[0]["error"]
        assert "FollowerLostError: [neps_bcast rank 0/2 leader] rank 1 lost: " in error

    def test_the_second_launch_exits_with_1_or_lightnings_sigkill(self, retried: Retried) -> None:
        """Trial 2 is the follower's first: Lightning's fresh child, whose death makes
        Lightning's observer SIGKILL the launch once neps_bcast settled the trial."""
        assert retried.second.returncode in (1, -signal.SIGKILL), retried.second.tail()

    def test_the_second_launch_left_no_process(self, retried: Retried) -> None:
        assert_nothing_left(retried.second)

    def test_the_second_launch_evaluated_only_the_interrupted_trial(self, retried: Retried) -> None:
        assert [e["trial_id"] for e in retried.second.of("trial") if e["rank"] == 0] == ["2"]

    def test_past_the_limit_the_trial_is_crashed(self, retried: Retried) -> None:
        assert retried.after_second == {"1": "success", "2": "crashed"}, retried.second.tail()

    def test_the_crash_record_names_both_attempts(self, retried: Retried) -> None:
        text = str(neps_trials(retried.last.root)["2"].report.err)
        assert text.startswith(
            "neps_bcast: trial 2 was interrupted 2 times by infrastructure failures"
            " (NEPS_BCAST_MAX_RETRIES=1): attempt 1 (pid "
        ), text
        assert text.count("FollowerLostError: [neps_bcast rank 0/2 leader] rank 1 lost: ") == 2

    def test_the_last_launch_finished_the_budget_around_the_crashed_trial(
        self, retried: Retried
    ) -> None:
        assert states(retried.last.root) == {
            "1": "success",
            "2": "crashed",
            "3": "success",
            "4": "success",
        }

    def test_the_last_launch_did_not_evaluate_the_crashed_trial(self, retried: Retried) -> None:
        assert not evaluated(retried.last, "2")


@dataclass
class TakeOver:
    victim: Result
    orphan: str
    lease: Lease | None
    orphan_state: str
    survivor: Result
    root: Path


class TestTwoWorkersOneKilledTheOtherTakesOverAfterTheGrace(CleanLaunch):
    """Two Lightning workers on one root; the victim runs in a pid namespace of its own
    (another container on this node: its pids mean nothing here, so only its heartbeat
    counts). It is SIGKILLed in its first trial. The survivor (``launch``) holds its 2nd
    trial until the victim's heartbeat is older than the grace period (4 s,
    NEPS_BCAST_LEASE_GRACE_S), then takes the orphan over: exactly once, and the root
    ends with 4 successes."""

    @pytest.fixture(scope="class")
    def takeover(self, tmp_path_factory: pytest.TempPathFactory) -> TakeOver:
        tmp = tmp_path_factory.mktemp("takeover")
        root = tmp / "root"
        release = tmp / "release"
        args = ("--trials", 4, "--root", root)
        survivor = start(
            python(LIGHTNING, *args),
            tmp,
            name="survivor",
            env=SHORT_LEASE,
            fault=f"hold:all:trial=2:at=before:until={release}",
        )
        try:
            survivor.wait_for(
                "the survivor's first trial", lambda ev: any(e["event"] == "trial" for e in ev)
            )
            in_its_own_pid_namespace = ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c"]
            victim_command = shlex.join(python(LIGHTNING, *args)) + "; exit $?"
            victim = start(
                [*in_its_own_pid_namespace, victim_command],
                tmp,
                name="victim",
                env=SHORT_LEASE,
                fault="sigkill:leader:trial=1",
            )
            victim.wait_for("the victim's fault", lambda ev: any(e["event"] == "fault" for e in ev))
            killed = victim.finish()
            orphan = next(e["trial_id"] for e in killed.of("trial") if e["rank"] == 0)
            lease = read_lease(root / "configs" / f"config_{orphan}")
            orphan_state = states(root)[orphan]
            # Observe (bounded) the victim's heartbeat getting older than the grace period.
            deadline = time.monotonic() + 60
            while lease and time.time() - lease.heartbeat <= 4.5 and time.monotonic() < deadline:
                time.sleep(0.1)  # waiting for wall-clock age of a file we read, not for a process
        except BaseException:
            survivor.kill_all()
            raise
        release.touch()
        return TakeOver(killed, orphan, lease, orphan_state, survivor.finish(), root)

    @pytest.fixture(scope="class")
    def launch(self, takeover: TakeOver) -> Result:
        return takeover.survivor

    def test_the_victim_left_no_process(self, takeover: TakeOver) -> None:
        assert_nothing_left(takeover.victim)

    def test_the_victims_trial_was_left_evaluating_under_its_lease(
        self, takeover: TakeOver
    ) -> None:
        assert takeover.lease is not None
        assert takeover.lease.owner is not None
        assert takeover.orphan_state == "evaluating"

    def test_the_root_ends_with_four_successes(self, takeover: TakeOver) -> None:
        final = states(takeover.root)
        assert final == dict.fromkeys(final, "success")
        assert len(final) == 4

    def test_the_survivor_evaluated_the_orphan_once_on_both_ranks(self, takeover: TakeOver) -> None:
        taken = [e for e in takeover.survivor.of("trial") if e["trial_id"] == takeover.orphan]
        assert sorted(e["rank"] for e in taken) == [0, 1]

    def test_the_lease_records_the_victims_attempt_and_why_it_ended(
        self, takeover: TakeOver
    ) -> None:
        history = read_lease(takeover.root / "configs" / f"config_{takeover.orphan}")
        assert history is not None and takeover.lease is not None
        assert len(history.attempts) == 1
        assert history.attempts[0].owner == takeover.lease.owner
        assert "no heartbeat from its leader" in history.attempts[0].how
        assert "(grace 4 s)" in history.attempts[0].how

    def test_the_survivor_took_the_orphan_over_once(self, takeover: TakeOver) -> None:
        assert takeover.survivor.log.count(f"orphaned trial {takeover.orphan} ") == 1


class ContinuesFromThePreviousCheckpoint:
    """A multi-fidelity search's promoted trials resume the checkpoint their previous
    trial saved, on every rank: the checks of one Lightning ddp launch of 2 ranks
    (``launch``) that trained a promotion. The follower never calls NePS, and under the
    root it opens only that checkpoint (Lightning's ``fit(ckpt_path=...)`` reads it on
    every rank: the user's own code; the same reading sees those opens, the positive
    control)."""

    @staticmethod
    def promoted(launch: Result) -> list[dict[str, Any]]:
        return [e for e in launch.of("trial") if e["previous_pipeline_directory"]]

    def test_both_ranks_evaluated_the_same_trials(self, launch: Result) -> None:
        identical_on_every_rank(launch, 2)

    def test_hyperband_promoted_a_trial(self, launch: Result) -> None:
        """Without a promotion nothing below tests a continuation."""
        assert self.promoted(launch), launch.tail()

    def test_both_ranks_continued_the_promoted_trials(self, launch: Result) -> None:
        assert {e["rank"] for e in self.promoted(launch)} == {0, 1}

    def test_the_previous_checkpoint_was_there_on_every_rank(self, launch: Result) -> None:
        assert all(e["ckpt_exists"] for e in self.promoted(launch)), self.promoted(launch)

    def test_the_previous_directory_is_the_one_neps_recorded(self, launch: Result) -> None:
        recorded = neps_trials(launch.root)
        for e in self.promoted(launch):
            location = recorded[str(e["trial_id"])].metadata.previous_trial_location
            assert Path(str(e["previous_pipeline_directory"])) == Path(location)

    def test_a_promoted_trial_trains_more_epochs(self, launch: Result) -> None:
        assert all(e["kwargs"]["epochs"] > 1 for e in self.promoted(launch))

    def test_the_follower_never_touched_neps(self, launch: Result) -> None:
        assert launch.exits[1]["calls"] == {"neps.run": 0, "NePSState.create_or_load": 0}

    def test_the_follower_opened_only_the_checkpoints_under_the_root(self, launch: Result) -> None:
        paths = launch.exits[1]["root_access"]["paths"]
        assert paths, "the user's checkpoint load was not seen"
        assert all(p.endswith("/last.ckpt") for p in paths), paths


class TestTheLeaderKilledInAHyperbandBracketTheBracketStillPromotes(
    RerunChecks, ContinuesFromThePreviousCheckpoint
):
    """NePS's hyperband (eta=3, fidelity epochs 1..3: rung 0 at 1 epoch, rung 1 at 3),
    Lightning ddp, 2 ranks, 5 trials: 1_rung_0, 2_rung_0, 3_rung_0, then the best of
    those three promoted to rung 1 (the same config, continued from its checkpoint),
    then 4_rung_1. SIGKILL on the leader in its n-th trial: 2 = 2_rung_0, inside the
    bracket's rung 0 (an ``evaluating`` trial there counts as pending for NePS's
    brackets: had it stayed so, bracket 0 would never promote and NePS would only go on
    sampling other brackets); 4 = the promoted trial itself. The same command again
    (short lease grace and heartbeat, as a rerun on another host would need; here the
    owner is on this host, so its gone pid decides): the orphan is evaluated first, same
    trial id, same config and directories, on both ranks; the root ends with exactly 5
    successes, nothing ``evaluating``; and bracket 0's best config was promoted (NePS's
    previous_trial_id and location) and trained from its checkpoint. The rerun trains
    that promotion (after the orphan in rung 0, or as the orphan itself), so it is also
    the launch of ``ContinuesFromThePreviousCheckpoint``: a fresh search of the same
    command would check nothing more."""

    @pytest.fixture(scope="class", params=[2, 4], ids=["in_rung_0", "the_promotion"])
    def killed_seq(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)

    @pytest.fixture(scope="class")
    def rerun(self, killed_seq: int, tmp_path_factory: pytest.TempPathFactory) -> Rerun:
        tmp = tmp_path_factory.mktemp("hyperband")
        command = python(
            LIGHTNING, "--trials", 5, "--optimizer", "hyperband", "--space", "fidelity"
        )
        fault = f"sigkill:leader:trial={killed_seq}"
        first = run(command, tmp, name="first", env=SHORT_LEASE, fault=fault)
        after_first = states(first.root)
        return Rerun(first, after_first, run(command, tmp, name="again", env=SHORT_LEASE))

    @staticmethod
    def orphan(rerun: Rerun) -> str:
        return led(rerun.first)[-1]

    def test_every_process_of_the_first_launch_ended_on_its_own(self, rerun: Rerun) -> None:
        rerun.first.ended_on_their_own(first_fault(rerun.first))

    def test_the_leader_was_killed_in_the_trial_asked_for(
        self, rerun: Rerun, killed_seq: int
    ) -> None:
        trials = led(rerun.first)
        assert len(trials) == killed_seq, rerun.first.tail()
        if killed_seq == 2:
            assert trials[-1] == "2_rung_0", trials
        else:  # the promotion of one of 1..3_rung_0, continued from its checkpoint
            assert trials[-1].endswith("_rung_1"), trials
            assert trials[:3] == ["1_rung_0", "2_rung_0", "3_rung_0"], trials
            assert evaluated(rerun.first, trials[-1])[0]["previous_pipeline_directory"]

    def test_the_killed_trial_was_left_evaluating_the_earlier_ones_successes(
        self, rerun: Rerun
    ) -> None:
        done_before = dict.fromkeys(led(rerun.first)[:-1], "success")
        assert rerun.after_first == {**done_before, self.orphan(rerun): "evaluating"}

    def test_the_root_ends_with_exactly_five_successes(self, rerun: Rerun) -> None:
        final = states(rerun.again.root)
        assert final == dict.fromkeys(final, "success"), rerun.again.tail()
        assert len(final) == 5, final

    def test_the_rerun_logged_the_orphan(self, rerun: Rerun) -> None:
        assert f"orphaned trial {self.orphan(rerun)} (its leader (pid" in rerun.again.log

    def test_the_orphan_is_the_reruns_first_trial_and_only_once(self, rerun: Rerun) -> None:
        rerun_led = led(rerun.again)
        assert rerun_led[0] == self.orphan(rerun), rerun_led
        assert rerun_led.count(self.orphan(rerun)) == 1, rerun_led

    def test_both_ranks_evaluated_the_orphan_with_the_same_arguments(self, rerun: Rerun) -> None:
        before = evaluated(rerun.first, self.orphan(rerun))
        after = evaluated(rerun.again, self.orphan(rerun))
        assert sorted(e["rank"] for e in after) == [0, 1]
        assert all(e["kwargs"] == before[0]["kwargs"] for e in after), (before, after)

    def test_the_lease_records_one_attempt_whose_owner_is_gone(self, rerun: Rerun) -> None:
        lease = read_lease(rerun.again.root / "configs" / f"config_{self.orphan(rerun)}")
        assert lease is not None
        assert len(lease.attempts) == 1
        assert "is gone" in lease.attempts[0].how

    @staticmethod
    def bracket(root: Path) -> tuple[dict[str, Any], str, str]:
        """NePS's trials, bracket 0's best rung-0 trial, and its promotion's id."""
        trials = neps_trials(root)
        rung0 = {tid: trials[tid] for tid in ("1_rung_0", "2_rung_0", "3_rung_0")}
        best = min(rung0, key=lambda tid: rung0[tid].report.objective_to_minimize)
        return trials, best, best.replace("_rung_0", "_rung_1")

    def test_only_the_brackets_best_config_was_promoted(self, rerun: Rerun) -> None:
        trials, _, promoted_id = self.bracket(rerun.again.root)
        promotions = {tid for tid, t in trials.items() if t.metadata.previous_trial_id}
        assert promotions == {promoted_id}, {
            tid: (t.metadata.previous_trial_id, t.report.objective_to_minimize)
            for tid, t in trials.items()
        }

    def test_the_promotion_continues_its_base_at_3_epochs(self, rerun: Rerun) -> None:
        trials, best, promoted_id = self.bracket(rerun.again.root)
        promoted, base = trials[promoted_id], trials[best]
        assert promoted.metadata.previous_trial_id == best
        assert Path(promoted.metadata.previous_trial_location) == Path(base.metadata.location)
        assert promoted.config == {**base.config, "epochs": 3}
        assert base.config["epochs"] == 1

    def test_the_killed_promotion_is_the_one_neps_recorded(
        self, rerun: Rerun, killed_seq: int
    ) -> None:
        _, _, promoted_id = self.bracket(rerun.again.root)
        if killed_seq == 4:
            assert self.orphan(rerun) == promoted_id
        else:
            assert self.orphan(rerun) == "2_rung_0"

    def test_both_ranks_of_the_rerun_trained_the_promotion_from_the_bases_checkpoint(
        self, rerun: Rerun
    ) -> None:
        trials, best, promoted_id = self.bracket(rerun.again.root)
        completed = evaluated(rerun.again, promoted_id)
        assert sorted(e["rank"] for e in completed) == [0, 1]
        for e in completed:
            assert Path(e["previous_pipeline_directory"]) == Path(trials[best].metadata.location)
            assert e["ckpt_exists"], e

    def test_lightning_restored_the_checkpoint_in_the_rerun(self, rerun: Rerun) -> None:
        assert "Restored all states from the checkpoint" in rerun.again.log

    def test_hyperbands_next_bracket_took_the_last_trial(self, rerun: Rerun) -> None:
        """After the promotion, the next bracket (rung 1 only) takes the last trial."""
        assert led(rerun.again)[-1] == "4_rung_1", led(rerun.again)
