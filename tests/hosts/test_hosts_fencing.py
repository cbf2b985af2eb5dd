"""Two NePS workers on one root, each a ``torchrun --standalone`` group on a host of its
own (network namespaces with their own hostname, tests/hosts/hostnet.py; a folder under
``tmp_path`` is the shared filesystem; 2 ranks a host), with short leases: what a lease must do when
the hosts' clocks disagree, when a host dies, and when a frozen host comes back.

Each class is one cell: one launch per host, both started together, running the
user-shaped plain-DDP script with ``--tag-host`` (NePS's record of each trial names the
host whose evaluation it kept, in the report's ``extra``). Host h1 (A) stops its leader
at a marker in its first trial (the ``hold`` fault: its "fault" record says the rank is
there), and the cell's fault lands then, not after a sleep:

- clock ahead: h2 (B) runs under libfaketime 10 min ahead, nothing else happens;
  no live trial of A's is taken over (B's own clock calls A's leases 600 s old);
- clock behind: B 10 min behind, every process of A's launch SIGKILLed at the marker:
  B takes the trial over, having timed its lease unchanged on its own monotonic clock;
- zombie: every process of A's launch SIGSTOPped at the marker (a whole host frozen)
  until B has taken the trial over and NePS recorded B's rerun; then SIGCONT, A's
  heartbeat kept from the trial's lease: A's leader trains the trial to its end, NePS's
  record of its result is refused (the record fence), it exits 1, its group with it,
  and NePS keeps exactly one result for the trial, B's;
- cut off from the shared folder: A's host loses it (an empty tmpfs over it, in A's
  mount namespace only) for as long, its processes running on and its leader's main
  thread held at the marker: the same outcome, but what stops A is its heartbeat,
  which finds the takeover once the folder is back (the heartbeat fence).

Every leader's first training step of a trial sleeps ``TRIAL_S`` (the ``sleep`` fault):
B's leader looks for orphans only before a trial, so its trials must span the grace
period (and a look either side) before the budget is spent, or a dead trial would be
left evaluating whatever the leases said. Bounds nest: ``GRACE_S`` < ``TAKEN_S`` (a hang
detector, from the fault) < ``DEADLINE_S`` (a launch's) < pytest's timeout.
"""

from __future__ import annotations

import re
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import timings
from hostnet import (
    Host,
    Network,
    OnHost,
    hide_folder,
    kill_marked,
    show_folder,
    signal_marked,
    start_on,
)

from harness import (
    MARKER,
    TORCH_DDP,
    TORCHRUN,
    Result,
    assert_every_exit_was_heard_as_recorded,
    assert_every_process_exited_0,
    assert_nothing_left,
    neps_trials,
    states,
)
from neps_bcast.compat import procfs
from neps_bcast.launcher.lease_record import Lease, parse_lease
from neps_bcast.recovery.lease_file import LOCK_FILE

GRACE_S = 6.0
"""``NEPS_BCAST_LEASE_GRACE_S`` in every cell (the library's default is 300 s)."""
HEARTBEAT_S = 1.5
"""``NEPS_BCAST_HEARTBEAT_S`` (below a third of the grace, as the library requires)."""
TRIAL_S = 3.0
"""How long every leader's first training step of a trial sleeps: a trial that takes
time, so that B's looks for orphans (one before each of its trials) span the grace."""
TRIALS = 6
"""The clock-ahead cell's budget: A's held trial, B's looks at it, a few more."""
TAKEOVER_TRIALS = 8
"""The budget where B must take A's trial over: A's trial counts towards it while it is
evaluating, so B runs at most 7 of its own, looking before each: the look that first
sees A's last lease, then the grace (more than 2 of B's trials: ``TRIAL_S`` x 2 =
``GRACE_S``), then the look that takes it over; the rest is the margin for an A that
reached its marker late."""
SHIFT_S = 600
"""How far B's wall clock is shifted (libfaketime), far beyond the grace."""
TAKEN_S = GRACE_S + HEARTBEAT_S + 2 * TRIAL_S + 30.0
"""A hang detector: B has taken A's trial over this long after the fault (the bound is
the grace, plus a look's interval either side: a heartbeat or one of B's trials; the
30 s are a loaded machine's slack)."""
DEADLINE_S = 180.0
"""One launch's deadline (harness: every process killed past it)."""
CELL = "NB_FENCING_CELL"
"""Every process of a cell, on both hosts, carries this marker."""
ORPHANED = re.compile(r"orphaned trial (\S+) \((.*)\): ")
SUPERSEDED = "superseded"
EXITED_S = 2 * HEARTBEAT_S + 10.0
"""A hang detector: A's leader, its main thread held, has exited this long after the
folder is back (its heartbeat's next look, a second one, and a loaded machine's slack)."""


@dataclass
class Pair:
    """One search on one root by two workers: a 2-rank torchrun group on each host."""

    net: Network
    tmp: Path
    trials: int
    """The search's budget (``--trials``)."""
    cell: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def root(self) -> Path:
        return self.tmp / "shared" / "results"

    def command(self, host: Host) -> list[str]:
        return [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",  # one rank makes no group: a trial's DDP needs two
            # torch cannot resolve the hostname; the group is this host's: loopback
            "--local-addr=127.0.0.1",
            "--max-restarts=0",
            str(TORCH_DDP),
            "--trials", str(self.trials),
            "--root", str(self.root),
            "--tag-host",
        ]  # fmt: skip

    def env(self, host: Host) -> dict[str, str]:
        return {
            # One host's group: loopback (gloo would resolve the hostname otherwise).
            "GLOO_SOCKET_IFNAME": "lo",
            "NEPS_BCAST_LEASE_GRACE_S": f"{GRACE_S:g}",
            "NEPS_BCAST_HEARTBEAT_S": f"{HEARTBEAT_S:g}",
            CELL: self.cell,
        }

    def start(self, host: str, fault: str, shift_s: int = 0) -> OnHost:
        """``host``'s launch; ``shift_s``: its wall clock shifted (libfaketime; its
        monotonic clock keeps its pace: FAKETIME_DONT_FAKE_MONOTONIC would make
        time.sleep fail in libfaketime 0.9.10)."""
        h = self.net.host(host)
        return start_on(
            h,
            self.command(h),
            self.tmp,
            name=f"run-{host}",
            env=self.env(h),
            timeout=DEADLINE_S,
            fault=f"sleep:leader:at=fit:s={TRIAL_S:g}" + (f", {fault}" if fault else ""),
            under=["faketime", "-f", f"{shift_s:+d}s"] if shift_s else (),
            clock_shift_s=shift_s,
        )


@contextmanager
def pair(tmp: Path, trials: int) -> Iterator[Pair]:
    """Two hosts and a search on them; afterwards, whatever happened, every process of
    the cell continued (a frozen one cannot die), killed, and every namespace removed."""
    net = Network(2)
    search = Pair(net, tmp, trials)
    try:
        yield search
    finally:
        signal_marked(CELL, search.cell, signal.SIGCONT)
        kill_marked(CELL, search.cell)
        net.remove()


def held(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The "fault" record of a ``hold``: the leader is at its marker, waiting."""
    return [e for e in evs if e["event"] == "fault" and e["kind"] == "hold"]


def leased_by(search: Pair, run: OnHost, host: str) -> Any:
    """The trial A's leader holds at its marker, once its lease names ``host`` on disk:
    (trial id, trial directory)."""
    trial = next(e for e in run.events() if e["event"] == "trial" and e["rank"] == 0)
    trial_dir = Path(trial["pipeline_directory"])
    lease = parse_lease(trial_dir)
    if lease is None or lease.owner is None or lease.owner.host != host:
        return None
    return trial["trial_id"], trial_dir


def orphan_lines(result: Result) -> list[tuple[str, str]]:
    """(trial id, reason) of every "orphaned trial" line in the launch's logs."""
    return [m.groups() for m in ORPHANED.finditer(result.log)]


def leader_log(result: Result) -> str:
    """Rank 0's log (the probe names each rank's log by its pid)."""
    pid = next(e["pid"] for e in result.of("start") if e["proc_rank"] == 0)
    return next(t for n, t in result.rank_logs.items() if n.endswith(f"pid{pid}"))


def recorded_by(root: Path) -> dict[str, str]:
    """trial id -> the host whose result NePS recorded ("" for none)."""
    return {
        tid: (t.report.extra or {}).get("host", "") if t.report else ""
        for tid, t in neps_trials(root).items()
    }


def evaluated_by(results: dict[str, Result]) -> dict[str, list[str]]:
    """trial id -> the hosts whose leader began evaluating it, in order."""
    found: dict[str, list[tuple[float, str]]] = {}
    for host, result in results.items():
        for e in result.of("trial"):
            if e["rank"] == 0:
                found.setdefault(e["trial_id"], []).append((e["t"], host))
    return {tid: [h for _, h in sorted(v)] for tid, v in found.items()}


def stored_result(root: Path, trial_id: str) -> dict[str, Any]:
    """NePS's stored result of ``trial_id``: whose, how, its objective and duration."""
    report = neps_trials(root)[trial_id].report
    if report is None:
        return {}
    return {
        "host": (report.extra or {}).get("host", ""),
        "reported_as": report.reported_as,
        "objective_to_minimize": report.objective_to_minimize,
        "evaluation_duration": report.evaluation_duration,
    }


def tails(results: dict[str, Result], n: int = 40) -> str:
    return "\n".join(f"=== {h}\n{r.tail(n)}" for h, r in results.items())


# ------------------------------------------------------------------------ clock ahead


@dataclass
class Ahead:
    runs: dict[str, Result]
    held_trial: str
    states: dict[str, str]
    recorded: dict[str, str]
    evaluated: dict[str, list[str]]
    left: list[int]


class TestAHostWhoseClockIsAheadTakesOverNoLiveTrial:
    """B 10 min ahead: every lease of A's is 600 s old by B's clock, fresh by the
    filesystem's, and renewed under B's eyes: none is taken over."""

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Ahead:
        tmp = tmp_path_factory.mktemp("ahead")
        release = tmp / "release"
        with pair(tmp, TRIALS) as search:
            a = search.start("h1", f"hold:leader:trial=1:until={release}")
            b = search.start("h2", "", shift_s=SHIFT_S)
            a.wait_for("A's leader at its marker in its first trial", held)
            trial_id, _ = a.wait_for("A's lease", lambda _: leased_by(search, a, "h1"))
            # B looks at the held trial before each of its own (a lease 600 s old by
            # its clock); A goes on once B has said so, a live owner's trial kept.
            b.wait_for_log(f"trial {trial_id}: no heartbeat from", timeout=DEADLINE_S)
            release.touch()
            runs = {"h1": a.finish(), "h2": b.finish()}
            return Ahead(
                runs,
                trial_id,
                states(search.root),
                recorded_by(search.root),
                evaluated_by(runs),
                kill_marked(CELL, search.cell),
            )

    def test_b_saw_a_live_trial_of_as_as_stale_by_its_own_clock(self, cell: Ahead) -> None:
        """The positive control: B looked at A's held trial and its clock said the
        lease was ~600 s old (the issue's bug took it over there)."""
        lines = [ln for ln in cell.runs["h2"].log.splitlines() if "no heartbeat from" in ln]
        ages = [int(m.group(1)) for ln in lines if (m := re.search(r" for (\d+) s;", ln))]
        assert ages and min(ages) >= SHIFT_S - 2 * GRACE_S, lines

    def test_no_trial_was_taken_over(self, cell: Ahead) -> None:
        orphans = {h: orphan_lines(r) for h, r in cell.runs.items()}
        assert orphans == {"h1": [], "h2": []}, tails(cell.runs)

    def test_every_trial_was_evaluated_once(self, cell: Ahead) -> None:
        assert all(len(hosts) == 1 for hosts in cell.evaluated.values()), cell.evaluated

    def test_both_hosts_evaluated_trials(self, cell: Ahead) -> None:
        assert {h for hs in cell.evaluated.values() for h in hs} == {"h1", "h2"}, cell.evaluated

    def test_every_trial_is_a_success(self, cell: Ahead) -> None:
        assert cell.states == {str(i): "success" for i in range(1, TRIALS + 1)}, tails(cell.runs)

    def test_each_trials_result_is_from_the_host_that_ran_it(self, cell: Ahead) -> None:
        ran = {tid: hosts[-1] for tid, hosts in cell.evaluated.items()}
        assert cell.recorded == ran

    @pytest.mark.parametrize("host", ["h1", "h2"])
    def test_the_hosts_launch_exits_with_0(self, cell: Ahead, host: str) -> None:
        assert cell.runs[host].returncode == 0, tails(cell.runs)
        assert_every_process_exited_0(cell.runs[host])
        assert_every_exit_was_heard_as_recorded(cell.runs[host])
        assert_nothing_left(cell.runs[host])

    def test_nothing_of_the_cell_is_left_on_any_host(self, cell: Ahead) -> None:
        assert cell.left == []


# ------------------------------------------------------------------------ dead host


@dataclass
class Takeover:
    runs: dict[str, Result]
    trial_id: str
    fault_at: float
    taken_after: float | None
    """Seconds from the fault to B's "orphaned trial" line (None: not within TAKEN_S)."""
    states: dict[str, str]
    recorded: dict[str, str]
    lease: Lease | None
    left: list[int]
    resumed_after: float | None = None
    """Zombie: seconds from the takeover's record to SIGCONT."""
    exited_after: float | None = None
    """Zombie: seconds from SIGCONT to A's leader's exit."""
    recorded_at: float = 0.0
    """When the test saw NePS hold B's result (this machine's wall clock)."""
    result_then: dict[str, Any] = field(default_factory=dict)
    """NePS's stored result of the trial then (``stored_result``)."""
    result_at_end: dict[str, Any] = field(default_factory=dict)
    """The same once both launches ended."""


def taken_over(b: OnHost, trial_id: str, since: float) -> float | None:
    """Seconds from ``since`` to B's line that took ``trial_id`` over (bounded)."""
    text = f"orphaned trial {trial_id} ("
    try:
        b.wait_for_log(text, timeout=max(since + TAKEN_S - time.time(), 0.1))
    except AssertionError:
        return None
    return time.time() - since


class TakeoverChecks:
    """A's trial taken over by B: what NePS, the lease and B's launch must show."""

    def test_b_took_the_trial_over_within_the_bound(self, cell: Takeover) -> None:
        assert cell.taken_after is not None, tails(cell.runs)

    def test_b_took_it_over_once(self, cell: Takeover) -> None:
        reasons = [r for tid, r in orphan_lines(cell.runs["h2"]) if tid == cell.trial_id]
        assert len(reasons) == 1, reasons

    def test_every_trial_is_a_success(self, cell: Takeover) -> None:
        every = {str(i): "success" for i in range(1, TAKEOVER_TRIALS + 1)}
        assert cell.states == every, tails(cell.runs)

    def test_the_trials_result_is_bs(self, cell: Takeover) -> None:
        assert cell.recorded.get(cell.trial_id) == "h2", cell.recorded

    def test_the_leases_history_lists_as_interrupted_attempt(self, cell: Takeover) -> None:
        lease = cell.lease
        assert lease is not None and lease.owner is not None
        assert [a.owner.host for a in lease.attempts] == ["h1"], lease
        assert (lease.owner.host, lease.attempt) == ("h2", 2), lease

    def test_bs_launch_exits_with_0(self, cell: Takeover) -> None:
        assert cell.runs["h2"].returncode == 0, tails(cell.runs)
        assert_every_process_exited_0(cell.runs["h2"])
        assert_every_exit_was_heard_as_recorded(cell.runs["h2"])

    @pytest.mark.parametrize("host", ["h1", "h2"])
    def test_no_process_of_the_hosts_launch_is_left(self, cell: Takeover, host: str) -> None:
        assert_nothing_left(cell.runs[host])

    def test_nothing_of_the_cell_is_left_on_any_host(self, cell: Takeover) -> None:
        assert cell.left == []


class TestAHostWhoseClockIsBehindTakesOverADeadHostsTrial(TakeoverChecks):
    """B 10 min behind; every process of A's launch SIGKILLed at its marker in its
    first trial: by B's clock A's lease is from the future, yet B takes it over."""

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Takeover:
        tmp = tmp_path_factory.mktemp("behind")
        with pair(tmp, TAKEOVER_TRIALS) as search:
            a = search.start("h1", f"hold:leader:trial=1:until={tmp / 'never'}")
            b = search.start("h2", "", shift_s=-SHIFT_S)
            a.wait_for("A's leader at its marker in its first trial", held)
            trial_id, trial_dir = a.wait_for("A's lease", lambda _: leased_by(search, a, "h1"))
            killed = kill_marked(MARKER, a.marker)
            fault_at = time.time()
            assert killed, "nothing of A's launch was killed"
            taken_after = taken_over(b, trial_id, fault_at)
            runs = {"h1": a.finish(), "h2": b.finish()}
            timings.LINES.append(
                f"fencing, B's clock behind: A killed; B took trial {trial_id} over"
                f" {taken_after if taken_after is None else round(taken_after, 1)} s later"
            )
            return Takeover(
                runs,
                trial_id,
                fault_at,
                taken_after,
                states(search.root),
                recorded_by(search.root),
                parse_lease(trial_dir),
                kill_marked(CELL, search.cell),
            )

    def test_b_timed_the_lease_unchanged_on_its_own_clock(self, cell: Takeover) -> None:
        """Why B called A gone: its lease unchanged for the grace as timed on B's
        monotonic clock; its wall clock, 10 min behind, calls the lease fresh (where the
        clocks agree, as in the cells below, "stale by both clocks" may come first)."""
        reasons = [r for tid, r in orphan_lines(cell.runs["h2"]) if tid == cell.trial_id]
        assert len(reasons) == 1 and "timed on this host" in reasons[0], reasons

    def test_as_launch_was_killed(self, cell: Takeover) -> None:
        """The fault landed: A's torchrun ended by SIGKILL (a negative status)."""
        assert cell.runs["h1"].returncode == -signal.SIGKILL, tails(cell.runs)


def comes_back(
    tmp: Path,
    cell: str,
    lose: Callable[[OnHost], None],
    back: Callable[[OnHost], None],
    *,
    goes_on: bool,
    before_back: Callable[[Path], None] = lambda _: None,
) -> Takeover:
    """A's host lost (``lose``) at its leader's marker in its first trial, until B has
    taken the trial over and NePS recorded B's rerun; then back (``back``). ``goes_on``:
    A's leader is released from its marker as it is lost (it trains on as soon as it
    can), else it stays there (a main thread stuck, as on a hung mount): what stops it
    is its heartbeat's finding. ``before_back``: done to the trial's directory while A
    is still lost, right before it is back."""
    release = tmp / "release"
    with pair(tmp, TAKEOVER_TRIALS) as search:
        a = search.start("h1", f"hold:leader:trial=1:until={release}")
        b = search.start("h2", "")
        a.wait_for("A's leader at its marker in its first trial", held)
        trial_id, trial_dir = a.wait_for("A's lease", lambda _: leased_by(search, a, "h1"))
        lose(a)
        fault_at = time.time()
        if goes_on:
            release.touch()
        taken_after = taken_over(b, trial_id, fault_at)
        b.wait_for(
            "NePS's record of B's rerun",
            lambda _: states(search.root).get(trial_id) == "success",
            timeout=DEADLINE_S,
        )
        recorded_at = time.time()
        result_then = stored_result(search.root, trial_id)
        before_back(trial_dir)
        back(a)
        back_at = time.time()
        runs = {"h1": a.finish(), "h2": b.finish()}
        leader = next(e for e in runs["h1"].of("start") if e["proc_rank"] == 0)
        exit_t = a.watch.wait(leader["pid"], since=fault_at, timeout=1.0)
        exited_after = None if exit_t is None else exit_t.t - back_at
        timings.LINES.append(
            f"fencing, {cell}: B took trial {trial_id} over"
            f" {taken_after if taken_after is None else round(taken_after, 1)} s after the"
            f" fault, NePS held its result {recorded_at - fault_at:.1f} s after it; A back,"
            f" its leader exited (status {runs['h1'].os_exits.get(leader['pid'])})"
            f" {exited_after if exited_after is None else round(exited_after, 1)} s later"
        )
        return Takeover(
            runs,
            trial_id,
            fault_at,
            taken_after,
            states(search.root),
            recorded_by(search.root),
            parse_lease(trial_dir),
            kill_marked(CELL, search.cell),
            back_at - recorded_at,
            exited_after,
            recorded_at,
            result_then,
            stored_result(search.root, trial_id),
        )


class ComesBackChecks(TakeoverChecks):
    """A's host lost past the grace period, its trial rerun by B, then back: A's group
    stops, and NePS keeps B's result only."""

    def test_as_leader_logs_that_its_attempt_was_superseded_by_bs(self, cell: Takeover) -> None:
        log = leader_log(cell.runs["h1"])
        line = f"trial {cell.trial_id}: this leader's attempt 1 was superseded by attempt 2 on"
        found = [ln for ln in log.splitlines() if line in ln]
        assert found and " on h2 " in found[0], log[-3000:]

    def test_as_leader_stops_because_of_it(self, cell: Takeover) -> None:
        """Why it ended: the superseded line, then its exit, not a timeout."""
        log = leader_log(cell.runs["h1"])
        assert "superseded" in log and "this worker stops now (exit code 1)" in log, log[-3000:]
        assert cell.runs["h1"].waits_that_timed_out() == []

    def test_as_leader_exits_with_1(self, cell: Takeover) -> None:
        leader = next(e for e in cell.runs["h1"].of("start") if e["proc_rank"] == 0)
        assert cell.runs["h1"].os_exits[leader["pid"]] == 1, tails(cell.runs)

    def test_as_follower_ends_too(self, cell: Takeover) -> None:
        """Ended on its own (its leader watch, or torchrun's), never left for the harness."""
        follower = next(e for e in cell.runs["h1"].of("start") if e["proc_rank"] == 1)
        status = cell.runs["h1"].os_exits[follower["pid"]]
        assert status is not None and status != 0, tails(cell.runs)
        assert cell.runs["h1"].left_alive == []

    def test_as_torchrun_exits_with_an_error(self, cell: Takeover) -> None:
        assert cell.runs["h1"].returncode == 1, tails(cell.runs)


def freeze(run: OnHost) -> None:
    assert signal_marked(MARKER, run.marker, signal.SIGSTOP), "nothing of A's launch to freeze"


def thaw(run: OnHost) -> None:
    assert signal_marked(MARKER, run.marker, signal.SIGCONT), "nothing of A's launch to thaw"


def superseded_lines(cell: Takeover, ending: str) -> list[str]:
    """A's leader's lines that say its attempt at the trial was superseded by B's, and
    hold ``ending`` (which fence found it)."""
    line = f"trial {cell.trial_id}: this leader's attempt 1 was superseded by attempt 2 on"
    log = leader_log(cell.runs["h1"])
    return [ln for ln in log.splitlines() if line in ln and " on h2 " in ln and ending in ln]


def keep_the_heartbeat_out(trial_dir: Path) -> None:
    """A directory where the trial's lease lock file was: a heartbeat can no longer take
    the lock, so it neither renews the lease nor reads it (each try fails, logged), and
    never finds the takeover. The record fence reads the lease without that lock."""
    lock = trial_dir / LOCK_FILE
    lock.unlink(missing_ok=True)
    lock.mkdir()


class TestAFrozenHostThatComesBackIsFencedOff(ComesBackChecks):
    """Every process of A's launch SIGSTOPped at its marker (a whole host frozen, found
    by the launch's marker variable) until B has taken the trial over and NePS recorded
    B's rerun, then SIGCONT; A's leader goes on into its training as soon as it can.

    The fence shown here is the record's: A's heartbeat is kept from the trial's lease
    while A is frozen (``keep_the_heartbeat_out``). Left alone, its overdue heartbeat
    finds the takeover first, 0.0-0.2 s after SIGCONT, and ends the leader before its
    training does (the cut-off cell shows that fence): what stops A here is NePS's
    record of its result, refused."""

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Takeover:
        tmp = tmp_path_factory.mktemp("zombie")
        return comes_back(
            tmp, "zombie", freeze, thaw, goes_on=True, before_back=keep_the_heartbeat_out
        )

    def test_as_leader_trained_the_trial_to_its_end_after_it_came_back(
        self, cell: Takeover
    ) -> None:
        """A's evaluation went on to its result: there was a result to refuse."""
        trained = [
            e for e in cell.runs["h1"].of("trained") if e["rank"] == 0 and e["t"] > cell.fault_at
        ]
        assert trained, tails(cell.runs)

    def test_as_result_was_refused_as_neps_recorded_it(self, cell: Takeover) -> None:
        found = superseded_lines(cell, "its result is dropped: not recorded")
        assert found, leader_log(cell.runs["h1"])[-3000:]

    def test_neps_kept_bs_result_as_it_was_when_b_recorded_it(self, cell: Takeover) -> None:
        assert cell.result_then.get("host") == "h2", cell.result_then
        assert cell.result_at_end == cell.result_then, tails(cell.runs)

    def test_as_heartbeat_never_found_the_takeover(self, cell: Takeover) -> None:
        """The set-up held: back, A's heartbeat failed to take the lease lock and never
        logged the takeover; the record fence alone found it."""
        log = leader_log(cell.runs["h1"])
        assert "could not renew the lease" in log, log[-3000:]
        assert superseded_lines(cell, "no longer renewing its lease") == [], log[-3000:]


class TestAHostCutOffFromTheSharedFolderIsFencedOff(ComesBackChecks):
    """A's host loses the shared folder (an empty tmpfs over it in its launch's mount
    namespace: hostnet.hide_folder) at its leader's marker until B has taken the trial
    over and NePS recorded B's rerun, then sees it again; A's processes run on
    throughout, its leader's main thread held at the marker (stuck, as on a hung
    mount; and its NePS never writes into the empty folder): its heartbeat thread
    fails to renew the lease while the folder is gone, then finds it taken over."""

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Takeover:
        tmp = tmp_path_factory.mktemp("cut_off")
        shared = tmp / "shared"

        def lose(run: OnHost) -> None:
            hide_folder(procfs.pids_with_env(MARKER, run.marker)[0], shared)

        def back(run: OnHost) -> None:
            show_folder(procfs.pids_with_env(MARKER, run.marker)[0], shared)

        return comes_back(tmp, "cut off from the shared folder", lose, back, goes_on=False)

    def test_as_leader_could_not_renew_its_lease_while_cut_off(self, cell: Takeover) -> None:
        """The positive control of the cut: the folder was gone for A's leader."""
        log = leader_log(cell.runs["h1"])
        assert "could not renew the lease" in log, log[-3000:]

    def test_as_heartbeat_found_the_takeover_and_ended_its_leader(self, cell: Takeover) -> None:
        """The fence shown here is the heartbeat's (A's main thread never left its
        marker): back, it read the lease, found B's attempt and logged it, and the leader
        then exited (with 1, checked above) within a few heartbeats of the folder's
        return."""
        found = superseded_lines(cell, "no longer renewing its lease")
        assert found, leader_log(cell.runs["h1"])[-3000:]
        assert cell.exited_after is not None and cell.exited_after < EXITED_S, cell.exited_after

    def test_as_heartbeat_wrote_nothing_over_bs_lease(self, cell: Takeover) -> None:
        """The lease's history ends with B's attempt as B left it: its last renewal came
        before NePS recorded B's result (a renewal of A's once back would be later)."""
        lease = cell.lease
        assert lease is not None, tails(cell.runs)
        assert lease.heartbeat <= cell.recorded_at, (lease, cell.recorded_at)
