"""torchrun across hosts (network namespaces, tests/hosts/hostnet.py), one rank per host,
running the user-shaped plain-DDP script, and a host cut off from the others.

Each class is one cell: one launch (one torchrun per host, the same command on each,
with a c10d rendezvous on one host's address) and, after a cut, the same command again.
A cell that cuts a host stops one rank at a marker (``hold``, tests/scripts/faults.py:
its "fault" record says the rank is there), pulls the host's cable, and lets the rank
go on into its collectives: no sleep decides when the cut lands.

What a cut must cost (``NEPS_BCAST_PEER_TIMEOUT_S``): every rank that lives
on exits with an error within the bound plus a few seconds, its log naming the silent
rank; the trial goes back to ``pending`` (a cut-off leader sees its followers silent
and hands it back too: it can still write the shared folder); after the cable is back
and whatever still runs is killed, the same command finishes the budget with every
trial a success. Bounds nest: ``PEER_TIMEOUT_S`` < ``GONE_S`` (a hang detector, from
the cut) < ``DEADLINE_S`` (a launch's) < pytest's timeout (600 s).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
import timings
from hostnet import Host, Network, OnHost, kill_marked, start_on

from exits import ExitWatch
from harness import (
    TORCH_DDP,
    TORCHRUN,
    Result,
    assert_every_exit_was_heard_as_recorded,
    assert_every_process_exited_0,
    assert_nothing_left,
    identical_on_every_rank,
    states,
)
from neps_bcast.compat import procfs

PEER_TIMEOUT_S = 6.0
"""``NEPS_BCAST_PEER_TIMEOUT_S`` in every cell (the library's default is 30 s)."""
GONE_S = PEER_TIMEOUT_S + 30.0
"""A hang detector: every rank that lives on is gone this long after the cut. Far above
the bound plus an exit on a loaded machine, far below every other wait that could end
it instead (torch's 60 s store reads, gloo's 30 min, the kernel's ~15 min)."""
DEADLINE_S = 150.0
"""One launch's deadline (harness: every process killed past it)."""
TRIALS = 3
CELL = "NB_HOSTS_CELL"
"""Every process of a cell, on every host and in every launch, carries this marker."""
SILENT = re.compile(r"silent", re.IGNORECASE)


@dataclass
class Search:
    """One search across the hosts: one torchrun per host, the same command on each."""

    net: Network
    tmp: Path
    store: Host
    """The host that serves torchrun's c10d rendezvous store (``--rdzv-endpoint``)."""
    port: int
    cell: str = field(default_factory=lambda: uuid.uuid4().hex)
    secret: str = field(default_factory=lambda: uuid.uuid4().hex + uuid.uuid4().hex)

    @property
    def root(self) -> Path:
        return self.tmp / "shared" / "results"

    def command(self, host: Host) -> list[str]:
        return [
            TORCHRUN,
            f"--nnodes={len(self.net.hosts)}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.store.address}:{self.port}",
            f"--rdzv-id=hosts{self.port}",
            f"--rdzv-conf=is_host={host is self.store},join_timeout=60",
            f"--local-addr={host.address}",  # torch cannot resolve the hostname
            "--max-restarts=0",
            str(TORCH_DDP),
            "--trials", str(TRIALS),
            "--root", str(self.root),
        ]  # fmt: skip

    def env(self, host: Host) -> dict[str, str]:
        return {
            "GLOO_SOCKET_IFNAME": "eth0",  # gloo would resolve the hostname otherwise
            "NEPS_BCAST_LEADER_ADDR": host.address,
            "NEPS_BCAST_PEER_TIMEOUT_S": f"{PEER_TIMEOUT_S:g}",
            "NEPS_BCAST_JOIN_TIMEOUT_S": "60",
            "NEPS_BCAST_SECRET": self.secret,  # as a multi-host user exports it
            CELL: self.cell,
        }

    def start(self, name: str, fault: str = "") -> dict[str, OnHost]:
        """The same command on every host (``name``: the launch's folder prefix)."""
        return {
            h.name: start_on(
                h,
                self.command(h),
                self.tmp,
                name=f"{name}-{h.name}",
                env=self.env(h),
                timeout=DEADLINE_S,
                fault=fault,
            )
            for h in self.net.hosts
        }

    def left(self) -> list[int]:
        """Processes of this cell still alive (on any host, of any launch)."""
        return procfs.pids_with_env(CELL, self.cell)


@contextmanager
def hosts(count: int, tmp: Path, store: str = "h1") -> Iterator[Search]:
    """``count`` hosts and a search on them; afterwards, whatever happened, every process
    of the cell killed and every namespace removed."""
    net = Network(count)
    search = None
    try:
        search = Search(net, tmp, net.host(store), net.held_port(net.host(store)))
        yield search
    finally:
        if search is not None:
            kill_marked(CELL, search.cell)
        net.remove()


def finish(runs: dict[str, OnHost]) -> dict[str, Result]:
    return {name: run.finish() for name, run in runs.items()}


def events(results: dict[str, Result]) -> list[dict[str, Any]]:
    return sorted((e for r in results.values() for e in r.events), key=lambda e: e["t"])


def logs(results: dict[str, Result]) -> dict[str, str]:
    return {f"{h}/{name}": text for h, r in results.items() for name, text in r.rank_logs.items()}


def tails(results: dict[str, Result], n: int = 40) -> str:
    return "\n".join(f"=== {h}\n{r.tail(n)}" for h, r in results.items())


def silent_lines(results: dict[str, Result]) -> list[str]:
    return [
        f"{name}: {line}"
        for name, text in logs(results).items()
        for line in text.splitlines()
        if SILENT.search(line)
    ]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes ``host`` runs once for each host of its class's cell."""
    if "host" in metafunc.fixturenames and metafunc.cls is not None:
        metafunc.parametrize("host", metafunc.cls.hosts)


# ------------------------------------------------------------------------ healthy


@dataclass
class Healthy:
    search: Search
    launch: dict[str, Result]
    states: dict[str, str]
    left: list[int]
    partition: tuple[float, float] | None = None
    """(cut, healed) times of a partition shorter than the bound."""


class HealthyChecks:
    """A search across hosts that finishes: every host's launch clean, every trial a
    success, nothing of the cell left."""

    hosts = ("h1", "h2")

    def test_the_hosts_torchrun_exits_with_0(self, cell: Healthy, host: str) -> None:
        launch = cell.launch[host]
        assert launch.returncode == 0, tails(cell.launch)

    def test_every_process_on_the_host_exited_with_0(self, cell: Healthy, host: str) -> None:
        assert_every_process_exited_0(cell.launch[host])

    def test_every_exit_the_kernel_reported_is_the_one_recorded(
        self, cell: Healthy, host: str
    ) -> None:
        assert_every_exit_was_heard_as_recorded(cell.launch[host])

    def test_no_process_of_the_hosts_launch_is_left(self, cell: Healthy, host: str) -> None:
        assert_nothing_left(cell.launch[host])

    def test_nothing_of_the_cell_is_left_on_any_host(self, cell: Healthy) -> None:
        assert cell.left == []

    def test_every_trial_is_a_success(self, cell: Healthy) -> None:
        assert cell.states == {str(i): "success" for i in range(1, TRIALS + 1)}, tails(cell.launch)

    def test_every_rank_evaluated_the_leaders_trials(self, cell: Healthy) -> None:
        assert len(identical_on_every_rank(events(cell.launch), len(self.hosts))) == TRIALS

    def test_rank_n_ran_on_host_n_plus_1(self, cell: Healthy) -> None:
        """One rank per host, in the hosts' order (torch sorts the nodes' addresses)."""
        where = {e["proc_rank"]: h for h, r in cell.launch.items() for e in r.of("start")}
        assert where == {i: f"h{i + 1}" for i in range(len(self.hosts))}

    def test_no_rank_was_ever_taken_for_silent(self, cell: Healthy) -> None:
        """The cut cells show that a silent peer is named so (the positive control)."""
        assert silent_lines(cell.launch) == []


class TestAHealthySearchAcrossTwoHosts(HealthyChecks):
    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Healthy:
        with hosts(2, tmp_path_factory.mktemp("healthy")) as search:
            launch = finish(search.start("run"))
            return Healthy(search, launch, states(search.root), search.left())


class TestAPartitionShorterThanTheBoundHeals(HealthyChecks):
    """The follower's host cut off for a third of the bound in trial 2's training, then
    back: TCP carries on, nothing is lost, no rerun."""

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Healthy:
        tmp = tmp_path_factory.mktemp("heals")
        release = tmp / "release"
        with hosts(2, tmp) as search:
            runs = search.start("run", fault=f"hold:follower:trial=2:until={release}")
            runs["h2"].wait_for("rank 1 at trial 2's training", held)
            h2 = search.net.host("h2")
            cut = search.net.cut(h2)
            release.touch()  # rank 1 goes on into its collectives, into the void
            time.sleep(PEER_TIMEOUT_S / 3)  # the fault itself: how long the cable is out
            healed = search.net.heal(h2)
            launch = finish(runs)
            return Healthy(search, launch, states(search.root), search.left(), (cut, healed))

    def test_rank_1_went_on_into_training_while_its_host_was_cut_off(self, cell: Healthy) -> None:
        assert cell.partition is not None
        cut, healed = cell.partition
        released = [e["t"] for e in cell.launch["h2"].of("released")]
        assert len(released) == 1 and cut < released[0] < healed, (cell.partition, released)

    def test_the_leaders_training_waited_for_the_cable(self, cell: Healthy) -> None:
        """The positive control of the cut: rank 0 could not finish trial 2's training
        (its allreduce needs rank 1's gradients) until h2 was back."""
        assert cell.partition is not None
        trained = [e["t"] for e in cell.launch["h1"].of("trained")]
        assert len(trained) == TRIALS and trained[1] > cell.partition[1], (cell.partition, trained)

    def test_the_partition_was_shorter_than_the_bound(self, cell: Healthy) -> None:
        assert cell.partition is not None
        cut, healed = cell.partition
        assert healed - cut < PEER_TIMEOUT_S


def held(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The "fault" record of a ``hold``: the rank is at its marker, waiting."""
    return [e for e in evs if e["event"] == "fault" and e["kind"] == "hold"]


# ------------------------------------------------------------------------ cut off


@dataclass
class RankEnd:
    rank: int
    host: str
    pid: int
    status: int | None
    """The kernel's exit status (None: still alive ``GONE_S`` after the cut; then killed)."""
    after_cut: float | None
    """Seconds from the cut to its exit."""
    log: str
    error: str | None
    """What its script ended with (its "exit" record), if it recorded one."""


@dataclass
class Cut:
    search: Search
    cut_host: str
    cut_at: float
    hold: dict[str, Any]
    released: list[dict[str, Any]]
    ends: dict[int, RankEnd]
    killed: list[str]
    """What was still alive once the survivors were gone (or GONE_S ran out) and the
    cable was back: killed, "pid cmdline"."""
    first: dict[str, Result]
    after_first: dict[str, str]
    cut_trial: str
    again: dict[str, Result]
    after_again: dict[str, str]
    left: list[int]


def rank_ends(runs: dict[str, OnHost], since: float, cut_at: float) -> dict[int, RankEnd]:
    """Wait (bounded by ``GONE_S`` from the cut) for every rank to exit; how each did."""
    starts = {
        e["proc_rank"]: (h, e)
        for h, run in runs.items()
        for e in run.events()
        if e["event"] == "start"
    }
    watch = ExitWatch.get()
    ends: dict[int, Any] = {}
    for rank, (host, start) in sorted(starts.items()):
        heard = watch.wait(start["pid"], since=since, timeout=max(cut_at + GONE_S - time.time(), 0))
        ends[rank] = (host, start["pid"], heard)
    return {
        rank: RankEnd(
            rank,
            host,
            pid,
            None if heard is None else heard.status,
            None if heard is None else heard.t - cut_at,
            "",
            None,
        )
        for rank, (host, pid, heard) in ends.items()
    }


def with_logs(ends: dict[int, RankEnd], first: dict[str, Result]) -> dict[int, RankEnd]:
    for end in ends.values():
        result = first[end.host]
        end.log = next((t for n, t in result.rank_logs.items() if n.endswith(f"pid{end.pid}")), "")
        end.error = next((e["error"] for e in result.of("exit") if e["pid"] == end.pid), None)
    return ends


def cut_cell(
    tmp: Path, *, count: int, store: str, fault: str, held_on: str, cut: str, cell: str
) -> Cut:
    """One launch whose rank on ``held_on`` stops at ``fault``'s marker; ``cut``'s cable
    pulled there; every rank's end awaited; the cable back, whatever lives killed;
    NePS's states; the same command again."""
    release = tmp / "release"
    with hosts(count, tmp, store) as search:
        since = time.time()
        runs = search.start("first", fault=f"{fault}:until={release}")
        hold = runs[held_on].wait_for("the rank at its marker", held)[0]
        cut_host = search.net.host(cut)
        cut_at = search.net.cut(cut_host)
        release.touch()
        ends = rank_ends(runs, since, cut_at)
        after_first = states(search.root)  # before anything is killed: the ranks' own doing
        search.net.heal(cut_host)
        killed = kill_marked(CELL, search.cell)
        first = finish(runs)
        trials = [e["trial_id"] for e in events(first) if e["event"] == "neps_trial"]
        again = finish(search.start("again"))
        ends = with_logs(ends, first)
        timings.add(cell, cut, ends, killed)
        return Cut(
            search=search,
            cut_host=cut,
            cut_at=cut_at,
            hold=hold,
            released=[e for e in events(first) if e["event"] == "released"],
            ends=ends,
            killed=killed,
            first=first,
            after_first=after_first,
            cut_trial=trials[1] if len(trials) > 1 else "?",
            again=again,
            after_again=states(search.root),
            left=search.left(),
        )


def names_the_silent_rank(log: str, ranks: tuple[int, ...]) -> bool:
    """A line of ``log`` says "silent" and names one of ``ranks``."""
    return any(
        SILENT.search(line) and re.search(rf"\brank ({'|'.join(map(str, ranks))})\b", line)
        for line in log.splitlines()
    )


class CutChecks:
    """A host cut off: what every rank, NePS and the same command again must show."""

    reachable: tuple[int, ...] = ()
    """Ranks on hosts that can still be reached: each must end on its own."""
    cut_off: tuple[int, ...] = ()
    """Ranks on the host that was cut off."""
    silent: ClassVar[dict[int, tuple[int, ...]]] = {}
    """Rank -> the ranks one of which its error names silent."""
    hosts: tuple[str, ...] = ("h1", "h2")

    def test_the_rank_stopped_at_its_marker_in_trial_2(self, cell: Cut) -> None:
        assert cell.hold["seq"] == 2, cell.hold

    def test_the_rank_went_on_after_the_cut(self, cell: Cut) -> None:
        assert [e["t"] > cell.cut_at for e in cell.released] == [True], cell.released

    def test_every_rank_on_a_reachable_host_exits_with_an_error(self, cell: Cut) -> None:
        statuses = {r: cell.ends[r].status for r in self.reachable}
        assert all(s is not None and s > 0 for s in statuses.values()), (
            f"exit statuses by rank {statuses} (None: alive {GONE_S:g} s after the cut);"
            f" killed afterwards: {cell.killed}\n{tails(cell.first)}"
        )

    def test_every_rank_on_a_reachable_host_is_gone_within_the_bound(self, cell: Cut) -> None:
        """A hang detector: ``GONE_S`` is the bound plus a generous exit."""
        took = {r: cell.ends[r].after_cut for r in self.reachable}
        assert all(t is not None and t < GONE_S for t in took.values()), took

    def test_every_rank_on_a_reachable_host_logs_an_error_naming_the_silent_rank(
        self, cell: Cut
    ) -> None:
        missing = {
            r: self.silent[r]
            for r in self.reachable
            if not names_the_silent_rank(cell.ends[r].log, self.silent[r])
        }
        assert not missing, (
            f"rank -> the silent rank its log does not name: {missing};"
            f" errors: { {r: cell.ends[r].error for r in self.reachable} }\n{tails(cell.first)}"
        )

    def test_the_cut_off_ranks_exit_with_an_error_naming_their_silent_peer(self, cell: Cut) -> None:
        """From the cut-off host it is the others who went silent."""
        found = {
            r: (cell.ends[r].status, names_the_silent_rank(cell.ends[r].log, self.silent[r]))
            for r in self.cut_off
        }
        assert all(s is not None and s > 0 and named for s, named in found.values()), (
            f"rank -> (exit status, names its silent peer): {found};"
            f" errors: { {r: cell.ends[r].error for r in self.cut_off} }; killed: {cell.killed}"
            f"\n{tails(cell.first)}"
        )

    def test_the_interrupted_trial_went_back_to_pending(self, cell: Cut) -> None:
        assert cell.after_first.get(cell.cut_trial) == "pending", (cell.cut_trial, cell.after_first)

    def test_the_trial_before_it_is_a_success(self, cell: Cut) -> None:
        assert cell.after_first.get("1") == "success", cell.after_first

    def test_the_same_command_again_finishes_the_budget_every_trial_a_success(
        self, cell: Cut
    ) -> None:
        assert cell.after_again == {str(i): "success" for i in range(1, TRIALS + 1)}, (
            f"{cell.after_again}\n{tails(cell.again)}"
        )

    def test_the_same_command_again_exits_with_0_on_the_host(self, cell: Cut, host: str) -> None:
        assert cell.again[host].returncode == 0, tails(cell.again)
        assert_every_process_exited_0(cell.again[host])
        assert_every_exit_was_heard_as_recorded(cell.again[host])
        assert_nothing_left(cell.again[host])

    def test_nothing_of_the_cell_is_left_on_any_host(self, cell: Cut) -> None:
        assert cell.left == []


class TestTheFollowersHostCutOffMidTraining(CutChecks):
    """Rank 1 stops at trial 2's first training step (rank 0 waits in DDP's allreduce),
    h2's cable is pulled, rank 1 goes on into its allreduce."""

    reachable = (0,)
    cut_off = (1,)
    silent: ClassVar[dict[int, tuple[int, ...]]] = {0: (1,), 1: (0,)}

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Cut:
        return cut_cell(
            tmp_path_factory.mktemp("follower_mid"),
            count=2,
            store="h1",
            fault="hold:follower:trial=2",
            held_on="h2",
            cut="h2",
            cell="follower's host, mid-training",
        )


class TestTheFollowersHostCutOffBetweenTrials(CutChecks):
    """The leader stops right after it took trial 2's lease, before the hand-over (rank
    1 waits for the next trial), h2's cable is pulled, the leader hands trial 2 over."""

    reachable = (0,)
    cut_off = (1,)
    silent: ClassVar[dict[int, tuple[int, ...]]] = {0: (1,), 1: (0,)}

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Cut:
        return cut_cell(
            tmp_path_factory.mktemp("follower_between"),
            count=2,
            store="h1",
            fault="hold:leader:trial=2:at=leased",
            held_on="h1",
            cut="h2",
            cell="follower's host, between trials",
        )


class TestTheLeadersHostCutOffMidTraining(CutChecks):
    """Rank 0 stops at trial 2's first training step, h1's cable is pulled, rank 0 goes
    on into its allreduce. h1 also serves torchrun's rendezvous store and the workers'
    store (torch puts it on the node of rank 0): the leader's host is the store's host."""

    reachable = (1,)
    cut_off = (0,)
    silent: ClassVar[dict[int, tuple[int, ...]]] = {0: (1,), 1: (0,)}

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Cut:
        return cut_cell(
            tmp_path_factory.mktemp("leader_mid"),
            count=2,
            store="h1",
            fault="hold:leader:trial=2",
            held_on="h1",
            cut="h1",
            cell="leader's host (and the stores), mid-training",
        )


class TestTheRendezvousStoresHostCutOffMidTraining(CutChecks):
    """Three hosts, torchrun's c10d rendezvous store on h3 (rank 2's host; the workers'
    store is on rank 0's, h1): rank 1 stops at trial 2's first training step, h3's cable
    is pulled, rank 1 goes on into its allreduce."""

    reachable = (0, 1)
    cut_off = (2,)
    silent: ClassVar[dict[int, tuple[int, ...]]] = {0: (2,), 1: (2,), 2: (0, 1)}
    hosts = ("h1", "h2", "h3")

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Cut:
        return cut_cell(
            tmp_path_factory.mktemp("store_mid"),
            count=3,
            store="h3",
            fault="hold:follower:trial=2",
            held_on="h2",
            cut="h3",
            cell="rendezvous store's host (a follower's), mid-training",
        )
