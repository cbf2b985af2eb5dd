"""End to end: real NePS searches over Lightning strategy="ddp" trials, `python script.py`.

Each class is one launch (its ``launch`` fixture, run once for the class) and the tests
that read what it left: the ranks' records, NePS's own record of the root, the logs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import (
    LIGHTNING,
    CleanLaunch,
    Result,
    identical_on_every_rank,
    neps_trials,
    python,
    run,
    start,
)
from neps_bcast.compat import procfs
from test_e2e_guarantees import TestEveryRankEvaluatesTheLeadersTrials as EveryRankChecks

BASIC_KEYS = ("lr", "hidden", "activation")


class TestEveryRankEvaluatesTheLeadersTrialsOn3Ranks(EveryRankChecks):
    """The top tier's launch of this scenario (tests/test_e2e_guarantees.py) on 3 ranks:
    a second follower."""

    @pytest.fixture(scope="class", params=[3], ids=["3_ranks"])
    def devices(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)


class TestDdpSpawnKeepsWorking(CleanLaunch):
    """Lightning ddp_spawn: only the leader runs the script; Lightning's spawned workers
    run the fit only."""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        # Two trials: the second shows the search goes on after a spawned fit. Every fit
        # starts two fresh interpreters that import torch and Lightning (~5 CPU-seconds
        # each), the most start-up work of any launch here: at load 25-29 on 2 cores
        # three trials overran the default 240 s deadline in trial 3, still training.
        command = python(LIGHTNING, "--strategy", "ddp_spawn", "--trials", 2)
        return run(command, tmp_path_factory.mktemp("spawn"), timeout=420.0)

    def test_only_the_script_itself_evaluated_the_trials(self, launch: Result) -> None:
        trials = launch.of("trial")
        assert len(trials) == 2 and {e["rank"] for e in trials} == {0}
        assert len({e["pid"] for e in trials}) == 1

    def test_neps_recorded_two_successes(self, launch: Result) -> None:
        recorded = neps_trials(launch.root)
        assert len(recorded) == 2
        assert all(t.report.reported_as == "success" for t in recorded.values())

    def test_the_spawned_workers_trained_every_trial_on_both_ranks(self, launch: Result) -> None:
        steps = launch.of("step")
        assert sorted((e["trial_id"], e["rank"]) for e in steps) == sorted(
            (e["trial_id"], r) for e in launch.of("trial") for r in (0, 1)
        ), steps

    def test_the_script_itself_trained_nothing(self, launch: Result) -> None:
        script_pid = launch.of("trial")[0]["pid"]
        assert script_pid not in {e["pid"] for e in launch.of("step")}


@dataclass
class Waiting:
    """The follower's CPU time over a window in which it waited for its leader."""

    launch: Result
    before: procfs.ProcStat | None
    after: procfs.ProcStat | None
    window: float
    cpu_ns: int  # every thread's CPU time over the window, in ns (the scheduler's count)


def threads_cpu_ns(pid: int) -> int:
    """The CPU time of every thread of ``pid`` so far, in ns (``/proc/PID/task/*/schedstat``:
    exact, where ``stat``'s ticks charge 10 ms to whoever runs when one lands)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended between the listing and the read
    return total


class TheFunctionChangesDirectoryUnderARelativeRoot:
    """The function os.chdir()s into a fresh folder under ``cwd/moved`` at its start, on
    every rank, and the root is relative ("results", to the launch's cwd): every trial is
    still recorded in <cwd>/results, nothing lands under the folders it moved to. A class
    provides ``launch`` (3 trials on 2 ranks, ``--chdir-into cwd/moved``) and ``cwd``."""

    def test_the_leader_resolved_the_root_under_the_launch_cwd(
        self, launch: Result, cwd: Path
    ) -> None:
        """(Lightning starts the follower at the first fit, in the folder the function
        moved to: a follower never uses the root.)"""
        leader = next(e for e in launch.of("start") if e["proc_rank"] == 0)
        assert leader["root"] == str(cwd / "results"), leader

    def test_every_rank_moved_in_every_trial(self, launch: Result) -> None:
        assert {(e["proc_rank"], e["seq"]) for e in launch.of("chdir")} == {
            (r, s) for r in (0, 1) for s in (1, 2, 3)
        }

    def test_neps_recorded_every_trial_in_the_root(self, launch: Result, cwd: Path) -> None:
        recorded = neps_trials(cwd / "results")
        assert sorted(recorded) == ["1", "2", "3"]
        assert all(t.report.reported_as == "success" for t in recorded.values())

    def test_nothing_landed_under_the_folders_it_moved_to(self, cwd: Path, launch: Result) -> None:
        moved = cwd / "moved"
        assert not list(moved.rglob("results")), sorted(moved.rglob("*"))

    def test_both_ranks_evaluated_the_same_trials(self, launch: Result) -> None:
        identical_on_every_rank(launch, 2)


class TestAWaitingFollowerUsesNoCpuInAFunctionThatChangesDirectory(
    CleanLaunch, TheFunctionChangesDirectoryUnderARelativeRoot
):
    """While the leader's NePS takes 5 s to sample trial 3, the follower waits for it:
    it must use < 1% of a core over that window (a polling loop uses ~100%). The same
    launch's function moves into a folder of its own in every trial, under the relative
    root ``results`` (``TheFunctionChangesDirectoryUnderARelativeRoot``): one launch for
    both, since neither scenario touches what the other's checks read (the move happens
    at the function's start, before ``session()``; the pause is the leader's sampling,
    between trials; the CPU window is the follower's wait on the channel, after it
    freed trial 2)."""

    @pytest.fixture(scope="class")
    def cwd(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        cwd = tmp_path_factory.mktemp("waiting")
        (cwd / "moved").mkdir()
        return cwd

    @pytest.fixture(scope="class")
    def waiting(self, cwd: Path) -> Waiting:
        running = start(
            python(LIGHTNING, "--trials", 3, "--root", "results", "--chdir-into", cwd / "moved"),
            cwd,
            fault="sleep:leader:trial=2:at=sample:s=5",
        )
        follower_pid = running.wait_for(
            "the follower's start",
            lambda ev: next(
                (e["pid"] for e in ev if e["event"] == "start" and e["proc_rank"] == 1), 0
            ),
        )

        def pause(event: str) -> object:
            return lambda ev: any(e["event"] == event and e["where"] == "sample" for e in ev)

        running.wait_for("the leader's sampling pause", pause("fault"))
        # The follower frees what trial 2 left while the leader samples (its clean start
        # off the critical path): the window opens once it has, so that it holds the wait
        # alone, which blocks on the channel.
        running.wait_for(
            "the follower's clean start after trial 2",
            lambda _: (
                sum(
                    line.count("freed what earlier trials left")
                    for log in running.rank_logs().values()
                    for line in log.splitlines()
                    if "rank 1/2" in line
                )
                >= 2
            ),
        )
        before, t0 = procfs.read_stat(follower_pid), time.monotonic()
        ns0 = threads_cpu_ns(follower_pid)
        running.wait_for("the end of the pause", pause("slept"))
        ns1 = threads_cpu_ns(follower_pid)
        after, t1 = procfs.read_stat(follower_pid), time.monotonic()
        return Waiting(running.finish(), before, after, t1 - t0, ns1 - ns0)

    @pytest.fixture(scope="class")
    def launch(self, waiting: Waiting) -> Result:
        return waiting.launch

    def test_the_follower_was_alive_while_it_waited(self, waiting: Waiting) -> None:
        assert waiting.before is not None and waiting.after is not None

    def test_the_reading_counts_the_followers_own_work(self, waiting: Waiting) -> None:
        """The positive control: imports and two fits show in the same reading."""
        assert waiting.before is not None and waiting.before.cpu_seconds > 1.0, waiting.before

    def test_the_window_lasted_over_3_s(self, waiting: Waiting) -> None:
        assert waiting.window > 3.0, waiting.window

    def test_the_waiting_follower_used_under_1_percent_of_a_core(self, waiting: Waiting) -> None:
        assert waiting.before is not None and waiting.after is not None
        share = waiting.cpu_ns / 1e9 / waiting.window
        assert share < 0.01, f"the follower used {share:.1%} of a core over {waiting.window:.1f} s"

    def test_the_follower_evaluated_every_trial(self, launch: Result) -> None:
        assert [e["trial_id"] for e in launch.of("trial") if e["rank"] == 1] == ["1", "2", "3"]
