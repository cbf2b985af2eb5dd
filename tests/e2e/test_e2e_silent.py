"""End to end on one host: a silent rank costs only its trial, and a busy rank is never
taken for a silent one (``NEPS_BCAST_PEER_TIMEOUT_S``; transport/liveness.py).

A frozen process (SIGSTOP, tests/scripts/faults.py's ``sigstop``) is what a hung node
looks like to its peers: its sockets stay open and its packets just stop. Each cell
freezes one rank in a training step of trial 2 of a 4-trial search, under torchrun x2
(plain DDP) and under Lightning ddp x2, then runs the same command again:

- the rank that lives on ends by its own path, its log naming the silent rank, its pid,
  its host, what it was doing and for how long; the frozen one is SIGKILLed (-9) by it;
- a frozen follower's trial goes back to ``pending`` at once; a frozen leader's stays
  ``evaluating`` until the next leader (the same command) finds its owner dead;
- the same command again finishes the budget, every trial a success, trial 2 first.

The detection time (the frozen rank's "fault" record, written just before it stops, to
the survivor's log line) is printed for each cell. What is asserted is why each process
ended; seconds only as a hang detector, nested: the bound (``PEER_TIMEOUT_S``) <
``DETECTED_WITHIN_S`` < a launch's deadline (240 s) < pytest's timeout (600 s).

No false alarm: a search whose ranks are busy but healthy (the GIL held for half the
bound on a follower and on the leader, the leader sampling for three bounds, both ranks
writing a large checkpoint), and a search whose processes share one core with 4
CPU-burning ones (a run queue of 6 or more on that core, as load >= 8 on two), each
finish every trial with no line saying "silent" anywhere: the silent cells above are
the positive control that such a line is written when a rank is silent.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from harness import (
    LIGHTNING,
    TORCH_DDP,
    CleanLaunch,
    Rerun,
    RerunChecks,
    Result,
    assert_every_exit_was_heard_as_recorded,
    closed_by_torchrun,
    first_fault,
    python,
    run,
    states,
    torchrun,
    trials_by_rank,
)

PEER_TIMEOUT_S = 4.0
"""``NEPS_BCAST_PEER_TIMEOUT_S`` in every launch here (the library's default is 30 s)."""
ENV = {"NEPS_BCAST_PEER_TIMEOUT_S": f"{PEER_TIMEOUT_S:g}"}
BEAT_S = PEER_TIMEOUT_S / 10
"""transport/liveness.py: a beat every tenth of the bound."""
DETECTED_WITHIN_S = PEER_TIMEOUT_S + 40.0
"""A hang detector, not a measure: the survivor names the silent rank this long after
it froze. Far above the bound plus a loaded machine's delays, far below every other wait
that could end the launch instead (torch's store reads, gloo's 30 min, the kernel's
~15 min, the launch's deadline)."""
TRIALS = 4
STEP = re.compile(r"evaluating trial 2 \(#2\)|in a meeting of the ranks of trial 2 \(#2\)")
"""Trial 2 as a rank's beats name what it does: ``evaluating trial 2 (#2)`` from its
start, ``in a meeting of the ranks of trial 2 (#2)`` while they meet at its start, then
``evaluating trial 2 (#2)`` again. A survivor names the later of the last step it heard
(a beat is read every tenth of the bound) and the step its own steps prove the silent
rank reached: a leader frozen ~50 ms after the meeting (its first training step under
Lightning) is named in the meeting, never at the hand-over its last beat told of (CI saw
that once, before a follower's own meeting counted)."""
HOST = socket.gethostname()
SILENT = re.compile(r"silent", re.IGNORECASE)
SILENCE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?"
    r"(?P<lost_leader>lost the leader: )?rank (?P<rank>\d+) \(pid (?P<pid>\d+) on host"
    r" (?P<host>\S+)\) silent for (?P<seconds>\d+) s while (?P<doing>[^:]+):"
)
"""A survivor's log line naming a silent rank (``liveness.Silence.describe``), with the
time the logging format of the scripts starts it with."""


@dataclass(frozen=True)
class Named:
    """A survivor's log line naming the silent rank."""

    at: float
    lost_leader: bool
    rank: int
    pid: int
    host: str
    seconds: int
    doing: str


def silence_lines(result: Result, log_prefix: str) -> list[Named]:
    """Every line naming a silent rank in the rank logs whose name starts ``log_prefix``
    (``rank0.``: the leader's; ``rank1.``: the follower's)."""
    found = []
    for name, text in result.rank_logs.items():
        if not name.startswith(log_prefix):
            continue
        for line in text.splitlines():
            m = SILENCE.search(line)
            if m is None:
                continue
            at = datetime.datetime.strptime(m["time"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found.append(
                Named(
                    at,
                    m["lost_leader"] is not None,
                    int(m["rank"]),
                    int(m["pid"]),
                    m["host"],
                    int(m["seconds"]),
                    m["doing"].strip(),
                )
            )
    return found


def lines_saying_silent(result: Result) -> list[str]:
    return [
        f"{name}: {line.strip()}"
        for name, text in result.rank_logs.items()
        for line in text.splitlines()
        if SILENT.search(line)
    ]


class SilentRankChecks(RerunChecks):
    """One rank frozen (SIGSTOP) in a training step of trial 2, then the same command
    again (the checks ``RerunChecks`` inherits are the rerun's: a clean launch)."""

    frozen: ClassVar[int]
    """The group rank that is frozen (0: the leader)."""
    launcher_code: ClassVar[int]
    """What the launcher of the first launch ends with."""
    state_left: ClassVar[str]
    """Trial 2's state once the first launch is gone."""

    def command(self) -> list[str]:
        raise NotImplementedError

    @property
    def survivor(self) -> int:
        return 1 - self.frozen

    @pytest.fixture(scope="class")
    def rerun(self, tmp_path_factory: pytest.TempPathFactory) -> Rerun:
        tmp = tmp_path_factory.mktemp(type(self).__name__)
        who = "leader" if self.frozen == 0 else "follower"
        first = run(self.command(), tmp, name="first", fault=f"sigstop:{who}:trial=2", env=ENV)
        after_first = states(first.root)
        return Rerun(first, after_first, run(self.command(), tmp, name="again", env=ENV))

    def pids(self, result: Result) -> dict[int, int]:
        """Rank -> pid, from the "start" records."""
        return {e["proc_rank"]: e["pid"] for e in result.of("start")}

    def named(self, rerun: Rerun) -> Named:
        """The survivor's first line naming the silent rank (the leader names it again
        when it cannot stop its followers)."""
        lines = silence_lines(rerun.first, f"rank{self.survivor}.")
        assert lines, rerun.first.tail()
        return min(lines, key=lambda named: named.at)

    def test_the_frozen_rank_froze_in_a_training_step_of_trial_2(self, rerun: Rerun) -> None:
        fired = [(e["kind"], e["where"], e["seq"], e["rank"]) for e in rerun.first.of("fault")]
        assert fired == [("sigstop", "fit", 2, self.frozen)], (fired, rerun.first.tail())

    def test_the_frozen_rank_ended_by_sigkill(self, rerun: Rerun) -> None:
        pid = self.pids(rerun.first)[self.frozen]
        assert rerun.first.os_exits[pid] == -9, (rerun.first.os_exits, rerun.first.tail())

    def test_the_first_launcher_exits_with_its_expected_code(self, rerun: Rerun) -> None:
        assert rerun.first.returncode == self.launcher_code, rerun.first.tail()

    def test_the_survivor_names_the_silent_rank_its_pid_host_and_step(self, rerun: Rerun) -> None:
        named = self.named(rerun)
        pid = self.pids(rerun.first)[self.frozen]
        assert (named.rank, named.pid, named.host, STEP.fullmatch(named.doing) is not None) == (
            self.frozen,
            pid,
            HOST,
            True,
        ), (named, rerun.first.tail())

    def test_the_survivor_names_how_long_it_was_silent_at_least_the_bound(
        self, rerun: Rerun
    ) -> None:
        """``silent for S s`` with S the bound or more (rounded to whole seconds)."""
        seconds = self.named(rerun).seconds
        assert PEER_TIMEOUT_S <= seconds < DETECTED_WITHIN_S, rerun.first.tail()

    def test_the_silence_was_found_after_the_bound_within_the_hang_detector(
        self, rerun: Rerun, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """From the frozen rank's "fault" record (just before it stopped) to the
        survivor's line. Its silence may count from its last beat (up to two beats
        before it froze), never from less than the bound less those beats."""
        took = self.named(rerun).at - first_fault(rerun.first)
        with capsys.disabled():
            print(
                f"\n{type(self).__name__}: rank {self.frozen} found silent {took:.2f} s"
                f" after it froze (NEPS_BCAST_PEER_TIMEOUT_S={PEER_TIMEOUT_S:g})"
            )
        assert PEER_TIMEOUT_S - 2 * BEAT_S - 0.01 <= took < DETECTED_WITHIN_S, (
            f"{took:.2f} s; {rerun.first.tail()}"
        )

    def test_every_process_of_the_first_launch_ended_on_its_own(self, rerun: Rerun) -> None:
        rerun.first.ended_on_their_own(first_fault(rerun.first))

    def test_every_exit_of_the_first_launch_is_the_one_recorded(self, rerun: Rerun) -> None:
        assert_every_exit_was_heard_as_recorded(rerun.first)

    def test_trial_1_is_a_success_and_trial_2_left_as_expected(self, rerun: Rerun) -> None:
        assert rerun.after_first == {"1": "success", "2": self.state_left}, rerun.first.tail()

    def test_the_rerun_finished_the_budget_every_trial_a_success(self, rerun: Rerun) -> None:
        recorded = states(rerun.again.root)
        assert recorded == {str(n): "success" for n in range(1, TRIALS + 1)}, rerun.again.tail()

    def test_the_rerun_evaluated_trial_2_again_first_on_every_rank(self, rerun: Rerun) -> None:
        by_rank = trials_by_rank(rerun.again.events)
        assert {r: [tid for tid, _ in trials] for r, trials in by_rank.items()} == {
            0: ["2", "3", "4"],
            1: ["2", "3", "4"],
        }, rerun.again.tail()


class FrozenFollowerChecks(SilentRankChecks):
    """The leader SIGKILLs its frozen follower and ends as for a lost follower: the trial
    back to ``pending`` at once, ``FollowerLostError`` naming the silence, exit 1."""

    frozen = 1
    state_left = "pending"

    def test_the_leader_exited_1_with_follower_lost_naming_the_silence(self, rerun: Rerun) -> None:
        """By its ``FollowerLostError`` (its "exit" record); or, where its main thread was
        still blocked max(5 s, the bound) after the verdict (a loaded machine), by the
        verdict's own thread (``runtime._settle_or_leave``: exit 1 at once, no record, its
        log line naming the silence); or 143: torchrun SIGTERMs the leader once its
        follower ended (-9), and that may land first (torchrun's log says it sent it)."""
        pids = self.pids(rerun.first)
        record = rerun.first.exits.get(0)
        silence = f"rank 1 (pid {pids[1]} on host {HOST}) silent for"
        logs = "".join(t for name, t in rerun.first.rank_logs.items() if name.startswith("rank0."))
        closed = closed_by_torchrun(rerun.first, pids[0])
        by_torchrun = closed and (
            record["code"] in (143, -15)
            if record is not None
            else rerun.first.os_exits.get(pids[0]) in (-15, 143)
        )
        # Its own FollowerLostError naming the silence, exit 1; or that error raised and
        # torchrun's closing SIGTERM landing in its exit (the record says -15).
        by_itself = (
            record is not None
            and record["error"].startswith("FollowerLostError: [neps_bcast rank 0/2 leader] ")
            and silence in record["error"]
            and (record["code"] == 1 or (closed and record["code"] in (143, -15)))
        )
        by_its_verdict = (
            record is None
            and rerun.first.os_exits.get(pids[0]) == 1
            and any(silence in line and "still blocked" in line for line in logs.splitlines())
        )
        seen = (
            None if record is None else (record["code"], str(record.get("error"))[:400]),
            rerun.first.os_exits.get(pids[0]),
        )
        assert by_torchrun or by_itself or by_its_verdict, (seen, rerun.first.tail())


class FrozenLeaderChecks(SilentRankChecks):
    """The follower SIGKILLs its frozen leader, logs that it lost it and exits 1; the
    trial stays ``evaluating`` (its lease no longer renewed) until the rerun's leader
    finds its owner dead and evaluates it again."""

    frozen = 0
    state_left = "evaluating"

    def test_the_follower_exited_1_having_lost_the_leader(self, rerun: Rerun) -> None:
        pid = self.pids(rerun.first)[1]
        named = self.named(rerun)
        assert (rerun.first.os_exits[pid], named.lost_leader) == (1, True), rerun.first.tail()


class TestTorchrunAFrozenFollowerIsKilledAndItsTrialPutBack(FrozenFollowerChecks):
    launcher_code = 1

    def command(self) -> list[str]:
        return torchrun(2, TORCH_DDP, "--trials", TRIALS, "--ignore-errors")


class TestTorchrunAFrozenLeaderIsKilledByItsFollower(FrozenLeaderChecks):
    launcher_code = 1

    def command(self) -> list[str]:
        return torchrun(2, TORCH_DDP, "--trials", TRIALS, "--ignore-errors")


class TestLightningAFrozenFollowerIsKilledAndItsTrialPutBack(FrozenFollowerChecks):
    launcher_code = 1

    def command(self) -> list[str]:
        return python(LIGHTNING, "--trials", TRIALS, "--ignore-errors")


class TestLightningAFrozenLeaderIsKilledByItsFollower(FrozenLeaderChecks):
    """The leader is the launcher here (``python script.py``): it ends by the SIGKILL."""

    launcher_code = -9

    def command(self) -> list[str]:
        return python(LIGHTNING, "--trials", TRIALS, "--ignore-errors")


class NoFalseAlarmChecks(CleanLaunch):
    """A healthy search: every trial a success (``CleanLaunch``: exit 0 everywhere,
    nothing left), and no line of any log says "silent"."""

    trials: ClassVar[int]

    def test_every_trial_is_a_success(self, launch: Result) -> None:
        recorded = states(launch.root)
        assert recorded == {str(n): "success" for n in range(1, self.trials + 1)}, launch.tail()

    def test_no_log_says_a_rank_was_silent(self, launch: Result) -> None:
        """The silent cells above are the positive control (they find such lines)."""
        assert lines_saying_silent(launch) == [], launch.tail()


class TestBusyRanksAreNeverTakenForSilent(NoFalseAlarmChecks):
    """torchrun x2, plain DDP, 5 trials, each quiet spell in a trial of its own: the
    follower's main thread holds the GIL for half the bound in a training step of trial
    1, the leader's in trial 2; the leader samples trial 4 for three bounds (NePS's
    ``sample`` point, after trial 3); both ranks ``torch.save`` 600 MB (synced) in a
    training step of trial 5."""

    trials = 5
    gil_s = PEER_TIMEOUT_S / 2
    sample_s = 3 * PEER_TIMEOUT_S

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        faults = (
            f"gil:follower:trial=1:s={self.gil_s:g}, gil:leader:trial=2:s={self.gil_s:g},"
            f" sleep:leader:trial=3:at=sample:s={self.sample_s:g}, save:all:trial=5:mb=600"
        )
        return run(
            torchrun(2, TORCH_DDP, "--trials", self.trials),
            tmp_path_factory.mktemp("busy"),
            fault=faults,
            env=ENV,
        )

    def spells(self, launch: Result, event: str) -> list[tuple[int, int]]:
        return sorted((e["rank"], e["seq"]) for e in launch.of(event))

    def test_a_followers_gil_held_for_half_the_bound_in_trial_1(self, launch: Result) -> None:
        held = [e for e in launch.of("held_gil") if e["rank"] == 1]
        assert [(e["seq"], e["s"]) for e in held] == [(1, self.gil_s)], launch.tail()

    def test_the_leaders_gil_held_for_half_the_bound_in_trial_2(self, launch: Result) -> None:
        held = [e for e in launch.of("held_gil") if e["rank"] == 0]
        assert [(e["seq"], e["s"]) for e in held] == [(2, self.gil_s)], launch.tail()

    def test_the_leader_sampled_for_three_bounds_after_trial_3(self, launch: Result) -> None:
        """The "fault" record is written when the pause starts, "slept" when it ends."""
        [fault] = [e for e in launch.of("fault") if e["where"] == "sample"]
        [slept] = launch.of("slept")
        assert (slept["seq"], slept["t"] - fault["t"] >= self.sample_s) == (3, True)

    def test_both_ranks_saved_a_600_mb_checkpoint_in_trial_5(self, launch: Result) -> None:
        saved = sorted((e["rank"], e["seq"], e["bytes"] >= 600_000_000) for e in launch.of("saved"))
        assert saved == [(0, 5, True), (1, 5, True)], launch.tail()


@dataclass
class Loaded:
    launch: Result
    burning_at_start: int
    burning_at_end: int
    loadavg_at_end: tuple[float, float, float]
    burners_allowed: set[frozenset[int]]
    """The cores each burner may run on, as the kernel says (``Cpus_allowed_list``)."""
    core: set[int]
    """The one core the burners and the launch were given."""


BURNERS = 4
BURN = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end:\n    pass\n"


def allowed_cores(pid: int) -> frozenset[int]:
    """The cores the kernel lets ``pid`` run on (``Cpus_allowed_list`` of its status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cores: set[int] = set()
            for part in line.split(":", 1)[1].strip().split(","):
                first, _, last = part.partition("-")
                cores.update(range(int(first), int(last or first) + 1))
            return frozenset(cores)
    return frozenset()


def is_running(pid: int) -> bool:
    """The process is runnable (state R: running or waiting for a core)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "R"


class TestASearchUnderLoadIsNeverTakenForSilent(NoFalseAlarmChecks):
    """torchrun x2, plain DDP, 3 trials, pinned to one core with 4 processes that burn
    CPU there (each bounded by its own deadline, killed by pid once the launch is over):
    a run queue of 6 or more on the ranks' core for the whole launch, as load >= 8 spread
    over two cores, while the other core stays free for the tier beside this one."""

    trials = 3
    burn_s = 500.0
    """Each burner's own deadline: beyond the launch's (400 s), below pytest's (600 s)."""

    @pytest.fixture(scope="class")
    def loaded(self, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loaded]:
        # The burners and the launch inherit this worker's affinity: one core, given back
        # once the launch is over.
        cores = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {max(cores)})
        burners = [
            subprocess.Popen(
                [sys.executable, "-c", BURN.format(s=self.burn_s)],
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
            for _ in range(BURNERS)
        ]
        try:
            at_start = 0
            started = time.monotonic()
            while at_start < BURNERS and time.monotonic() - started < 30.0:
                time.sleep(0.05)  # a bounded poll for the burners' state, before the launch
                at_start = sum(is_running(p.pid) for p in burners)
            launch = run(
                torchrun(2, TORCH_DDP, "--trials", self.trials),
                tmp_path_factory.mktemp("loaded"),
                env=ENV,
                timeout=400.0,
            )
            at_end = sum(is_running(p.pid) for p in burners)
            pinned = {allowed_cores(p.pid) for p in burners}
            os.sched_setaffinity(0, cores)
            yield Loaded(launch, at_start, at_end, os.getloadavg(), pinned, {max(cores)})
        finally:
            os.sched_setaffinity(0, cores)
            for p in burners:
                p.kill()
                p.wait()

    @pytest.fixture(scope="class")
    def launch(self, loaded: Loaded) -> Result:
        return loaded.launch

    def test_the_burners_ran_on_the_ranks_core_from_the_launchs_start_to_its_end(
        self, loaded: Loaded, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with capsys.disabled():
            print(
                f"\nunder load: load average at the launch's end {loaded.loadavg_at_end},"
                f" the launch took {loaded.launch.seconds:.1f} s"
            )
        assert (loaded.burning_at_start, loaded.burning_at_end) == (BURNERS, BURNERS)
        assert loaded.burners_allowed == {frozenset(loaded.core)}


class TestACollectiveThatTimesOutPutsTheTrialBack(RerunChecks):
    """A peer that stops answering for longer than the user's group timeout (here the
    follower sleeps 8 s in a training step of trial 2, under a 3 s
    ``new_group(timeout=3)``): the leader's collective times out, which is the
    infrastructure's fault, not the config's. The trial goes back to ``pending``
    (``FollowerLostError``, exit 1) instead of being recorded crashed, and the same
    command again evaluates it and finishes the budget."""

    COMMAND: ClassVar[list[str]] = torchrun(2, TORCH_DDP, "--trials", 3, "--subgroup-timeout", 3)

    @pytest.fixture(scope="class")
    def rerun(self, tmp_path_factory: pytest.TempPathFactory) -> Rerun:
        tmp = tmp_path_factory.mktemp(type(self).__name__)
        fault = "sleep:follower:trial=2:at=fit:s=8"
        first = run(self.COMMAND, tmp, name="first", fault=fault)
        return Rerun(first, states(first.root), run(self.COMMAND, tmp, name="again"))

    def test_the_timed_out_trial_went_back_to_pending(self, rerun: Rerun) -> None:
        assert rerun.after_first == {"1": "success", "2": "pending"}, rerun.first.tail()

    def test_the_leader_named_the_timeout_an_infrastructure_fault(self, rerun: Rerun) -> None:
        leader = rerun.first.exits[0]
        said = "rank 0 timed out waiting for its peers"
        logs = [text for name, text in rerun.first.rank_logs.items() if name.startswith("rank0.")]
        assert leader["code"] in (1, 143), rerun.first.tail()
        assert any(said in text for text in logs), rerun.first.tail()

    def test_the_rerun_finished_the_budget_every_trial_a_success(self, rerun: Rerun) -> None:
        assert set(states(rerun.again.root).values()) == {"success"}


class TestATrialPastItsTimeLimitIsPutBack(RerunChecks):
    """A hang where every rank is alive, so no rank is ever silent: the follower waits
    for ever in a training step of trial 2 (a deadlock in the user's code), the leader
    in its allreduce. ``NEPS_BCAST_TRIAL_TIME_LIMIT_S`` (60 s here; unset by default)
    ends it: the leader's lease thread puts the trial back to ``pending`` and exits 1,
    its follower follows, and the same command again (without a limit) evaluates it and
    finishes the budget. The limit is far above a healthy trial's few seconds: at 8 s, a
    healthy trial 1 on a machine at load 11 ran past it."""

    LIMIT_S = 60
    COMMAND: ClassVar[list[str]] = torchrun(2, TORCH_DDP, "--trials", 3)

    @pytest.fixture(scope="class")
    def rerun(self, tmp_path_factory: pytest.TempPathFactory) -> Rerun:
        tmp = tmp_path_factory.mktemp(type(self).__name__)
        env = {"NEPS_BCAST_TRIAL_TIME_LIMIT_S": str(self.LIMIT_S)}
        first = run(self.COMMAND, tmp, name="first", fault="hang:follower:trial=2", env=env)
        return Rerun(first, states(first.root), run(self.COMMAND, tmp, name="again"))

    def test_the_follower_hung_in_a_training_step_of_trial_2(self, rerun: Rerun) -> None:
        fired = [(e["kind"], e["where"], e["seq"], e["rank"]) for e in rerun.first.of("fault")]
        assert fired == [("hang", "fit", 2, 1)], (fired, rerun.first.tail())

    def test_the_hung_trial_went_back_to_pending(self, rerun: Rerun) -> None:
        assert rerun.after_first == {"1": "success", "2": "pending"}, rerun.first.tail()

    def test_the_leader_named_the_limit_and_exited_1(self, rerun: Rerun) -> None:
        said = f"trial 2 is still running {self.LIMIT_S} s after it started"
        logs = [text for name, text in rerun.first.rank_logs.items() if name.startswith("rank0.")]
        leader = {e["proc_rank"]: e["pid"] for e in rerun.first.of("start")}[0]
        assert rerun.first.os_exits[leader] == 1, (rerun.first.os_exits, rerun.first.tail())
        assert any(said in text for text in logs), rerun.first.tail()

    def test_no_rank_was_taken_for_silent(self, rerun: Rerun) -> None:
        """Every rank lived: the limit ended the trial, not the silence check."""
        assert lines_saying_silent(rerun.first) == [], rerun.first.tail()

    def test_the_first_launch_ended_on_its_own(self, rerun: Rerun) -> None:
        rerun.first.ended_on_their_own(first_fault(rerun.first))

    def test_the_rerun_finished_the_budget_every_trial_a_success(self, rerun: Rerun) -> None:
        assert states(rerun.again.root) == {"1": "success", "2": "success", "3": "success"}
