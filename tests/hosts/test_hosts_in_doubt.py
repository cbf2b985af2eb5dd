"""A worker started right after a host died does not end with that host's trial in doubt.

Two NePS workers on one root, each a ``torchrun --standalone`` group of 2 ranks on a
host of its own (tests/hosts/hostnet.py; the record helpers of
test_hosts_fencing.py), with short leases. Host h1 (A) runs the search alone; its
leader stops at a marker in a training step of its first trial (the ``hold`` fault:
its "fault" record says the rank is there), and once A's lease names it on disk every
process of A's launch is SIGKILLed (a host died). Host h2 (B) is started then, as a user
runs the same command again, with the same budget of ``TRIALS``: A's trial 1 is
``evaluating`` and counts as spent, so B samples and runs trials 2 and 3 and reaches the
budget long before the grace period has passed (``GRACE_S`` is above B's start and its two
trials). Before it ends, B waits for trial 1 (one log line naming it and the longest
wait), finds A gone (its lease unchanged for the grace period as timed on B's own
monotonic clock or, where the clocks agree, stale by B's clock and the filesystem's),
takes the trial over and runs it as attempt 2 (``recovery/in_doubt.py``).

Two cells: B's wall clock 10 min behind (libfaketime: A's lease is from the future by
B's clock, and only B's own timing may call it gone), and not shifted (A's lease grows
stale by both clocks, so only a first look after the grace would take it over: B's
first look comes well before). Each cell is 2 launches (A's, then B's). Seconds are
only hang detectors: what is checked are causes (NePS's states, the lease's attempts,
B's log lines and the launches' exit codes).
"""

from __future__ import annotations

import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import timings
from hostnet import Network, OnHost, kill_marked, start_on
from test_hosts_fencing import (
    CELL,
    SHIFT_S,
    evaluated_by,
    held,
    leader_log,
    orphan_lines,
    recorded_by,
    tails,
)

from harness import (
    MARKER,
    TORCH_DDP,
    TORCHRUN,
    Result,
    assert_every_exit_was_heard_as_recorded,
    assert_every_process_exited_0,
    assert_nothing_left,
    states,
)
from neps_bcast.launcher.lease_record import Lease, parse_lease

GRACE_S = 24.0
"""``NEPS_BCAST_LEASE_GRACE_S``: well above the time B takes from A's death to the start
of its last trial (5.6-7.0 s unshifted, 16-18 s under libfaketime, on 2 shared cores), so
that B reaches its budget with trial 1 still in doubt (checked: its wait line comes
before the takeover)."""
HEARTBEAT_S = 1.0
"""``NEPS_BCAST_HEARTBEAT_S`` (below a third of the grace, as the library requires)."""
TRIALS = 3
"""The budget of both launches: A's trial 1, and B's trials 2 and 3."""
DEADLINE_S = 180.0
"""One launch's deadline (harness: every process killed past it)."""
WAITS = "this worker's search is over, but trial {} is evaluating under the lease of"
"""B's line as it starts waiting for the trial in doubt (``recovery/in_doubt.py``)."""
TAKEN = "trial(s) {} taken over: this worker runs them before it ends"


@dataclass
class InDoubt:
    runs: dict[str, Result]
    trial_id: str
    states: dict[str, str]
    recorded: dict[str, str]
    evaluated: dict[str, list[str]]
    b_trials: list[str]
    """The trials B's leader began, in order."""
    lease: Lease | None
    left: list[int]


def command(root: Path) -> list[str]:
    return [
        TORCHRUN,
        "--standalone",
        "--nproc-per-node=2",
        "--local-addr=127.0.0.1",  # torch cannot resolve the made-up hostname
        "--max-restarts=0",
        str(TORCH_DDP),
        "--trials", str(TRIALS),
        "--root", str(root),
        "--tag-host",
    ]  # fmt: skip


def launch(net: Network, tmp: Path, cell: str, host: str, fault: str, shift_s: int) -> OnHost:
    """``host``'s launch of the search; ``shift_s``: its wall clock shifted (libfaketime;
    its monotonic clock keeps its pace)."""
    h = net.host(host)
    return start_on(
        h,
        command(tmp / "shared" / "results"),
        tmp,
        name=f"run-{host}",
        env={
            "GLOO_SOCKET_IFNAME": "lo",
            "NEPS_BCAST_LEASE_GRACE_S": f"{GRACE_S:g}",
            "NEPS_BCAST_HEARTBEAT_S": f"{HEARTBEAT_S:g}",
            CELL: cell,
        },
        timeout=DEADLINE_S,
        fault=fault,
        under=["faketime", "-f", f"{shift_s:+d}s"] if shift_s else (),
        clock_shift_s=shift_s,
    )


def leased_by_a(a: OnHost) -> tuple[str, Path] | None:
    """The trial A's leader holds at its marker, once its lease names h1 on disk."""
    trial = next(e for e in a.events() if e["event"] == "trial" and e["rank"] == 0)
    trial_dir = Path(trial["pipeline_directory"])
    lease = parse_lease(trial_dir)
    if lease is None or lease.owner is None or lease.owner.host != "h1":
        return None
    return str(trial["trial_id"]), trial_dir


def a_host_dies_and_b_runs_the_search_again(tmp: Path, shift_s: int) -> InDoubt:
    net = Network(2)
    cell = uuid.uuid4().hex
    root = tmp / "shared" / "results"
    try:
        a = launch(net, tmp, cell, "h1", f"hold:leader:trial=1:until={tmp / 'never'}", 0)
        a.wait_for("A's leader at its marker in its first trial", held)
        trial_id, trial_dir = a.wait_for("A's lease", lambda _: leased_by_a(a))
        assert kill_marked(MARKER, a.marker), "nothing of A's launch was killed"
        killed_at = time.time()
        b = launch(net, tmp, cell, "h2", "", shift_s)
        runs = {"h1": a.finish(), "h2": b.finish()}
        ended = time.monotonic()
        evaluated = evaluated_by(runs)
        b_trials = [
            e["trial_id"] for e in sorted(runs["h2"].of("trial"), key=lambda e: e["t"])
            if e["rank"] == 0
        ]  # fmt: skip
        began = {
            e["trial_id"]: e["t"] - killed_at for e in runs["h2"].of("trial") if e["rank"] == 0
        }
        timings.LINES.append(
            f"in doubt, B's clock {shift_s:+d} s: B began trials "
            + ", ".join(f"{tid} {t:.1f} s" for tid, t in began.items())
            + f" after A was killed; it ended {ended - b.started:.1f} s after its start"
        )
        return InDoubt(
            runs,
            trial_id,
            states(root),
            recorded_by(root),
            evaluated,
            b_trials,
            parse_lease(trial_dir),
            kill_marked(CELL, cell),
        )
    finally:
        kill_marked(CELL, cell)
        net.remove()


class InDoubtChecks:
    """B ends only once A's trial is done: it waited for it, took it over, ran it."""

    def test_as_launch_was_killed(self, cell: InDoubt) -> None:
        """The fault landed: A's torchrun ended by SIGKILL, trial 1 left evaluating."""
        assert cell.runs["h1"].returncode == -signal.SIGKILL, tails(cell.runs)
        assert cell.trial_id == "1", cell.trial_id

    def test_b_waited_for_the_trial_in_doubt_before_it_ended(self, cell: InDoubt) -> None:
        """B reached its budget with trial 1 in doubt and said so, naming A's lease and
        the longest it would wait; no look before its own trials took it over."""
        log = leader_log(cell.runs["h2"])
        lines = [ln for ln in log.splitlines() if WAITS.format(cell.trial_id) in ln]
        assert len(lines) == 1, log[-3000:]
        assert " on h1" in lines[0] and f"at most {GRACE_S + HEARTBEAT_S:.1f} s" in lines[0]
        took = log.index(TAKEN.format(cell.trial_id))
        assert log.index(lines[0]) < log.index(f"orphaned trial {cell.trial_id} (") < took

    reason = ""
    """Why B called A's leader gone (its "orphaned trial" line), as its clock allows."""

    def test_b_called_as_leader_gone_for_the_reason_its_clock_allows(self, cell: InDoubt) -> None:
        reasons = [r for tid, r in orphan_lines(cell.runs["h2"]) if tid == cell.trial_id]
        assert len(reasons) == 1 and self.reason in reasons[0], reasons

    def test_b_ran_its_own_trials_then_the_one_it_took_over(self, cell: InDoubt) -> None:
        assert cell.b_trials == ["2", "3", cell.trial_id], cell.b_trials
        assert cell.evaluated[cell.trial_id] == ["h1", "h2"], cell.evaluated

    def test_the_lease_names_b_as_attempt_2_after_as_interrupted_one(self, cell: InDoubt) -> None:
        lease = cell.lease
        assert lease is not None and lease.owner is not None, tails(cell.runs)
        assert [a.owner.host for a in lease.attempts] == ["h1"], lease
        assert (lease.owner.host, lease.attempt) == ("h2", 2), lease

    def test_every_trial_is_a_success(self, cell: InDoubt) -> None:
        every = {str(i): "success" for i in range(1, TRIALS + 1)}
        assert cell.states == every, tails(cell.runs)

    def test_every_result_is_bs(self, cell: InDoubt) -> None:
        assert cell.recorded == {str(i): "h2" for i in range(1, TRIALS + 1)}, cell.recorded

    def test_bs_launch_exits_with_0(self, cell: InDoubt) -> None:
        assert cell.runs["h2"].returncode == 0, tails(cell.runs)
        assert_every_process_exited_0(cell.runs["h2"])
        assert_every_exit_was_heard_as_recorded(cell.runs["h2"])

    @pytest.mark.parametrize("host", ["h1", "h2"])
    def test_no_process_of_the_hosts_launch_is_left(self, cell: InDoubt, host: str) -> None:
        assert_nothing_left(cell.runs[host])

    def test_nothing_of_the_cell_is_left_on_any_host(self, cell: InDoubt) -> None:
        assert cell.left == []


class TestAWorkerWhoseClockIsBehindFinishesADeadHostsTrialBeforeItEnds(InDoubtChecks):
    """B 10 min behind: by its clock A's lease is from the future, so only B's own
    timing calls it gone: the lease unchanged for the grace since B first saw it."""

    reason = "timed on this host"

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> InDoubt:
        return a_host_dies_and_b_runs_the_search_again(
            tmp_path_factory.mktemp("in_doubt_behind"), -SHIFT_S
        )


class TestAWorkerFinishesADeadHostsTrialBeforeItEnds(InDoubtChecks):
    """B's clock not shifted: A's lease grows stale by B's clock and the filesystem's
    alike, the grace after A's last heartbeat, before B's own timing (from its first
    look, after A's death) reaches the grace."""

    reason = "s by the filesystem's clock (grace"

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> InDoubt:
        return a_host_dies_and_b_runs_the_search_again(
            tmp_path_factory.mktemp("in_doubt_unshifted"), 0
        )
