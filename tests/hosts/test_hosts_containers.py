"""torchrun across two containers on one host that share its hostname and network, one
rank in each, and one rank frozen: the survivor ends, and no other process is touched.

Containers that share a host's network (Kubernetes ``hostNetwork``, ``docker run --network
host``) share its name and addresses but not its pids: each numbers its processes from 1.
Here each container is a pid namespace of its own with its own ``/proc`` (``unshare --pid
--fork --mount-proc``: a ``sleep`` is its pid 1), and a launch is started inside it with
``nsenter`` (DESIGN.md, "Containers and several nodes"). Each container's processes start at
a pid of its own (``/proc/sys/kernel/ns_last_pid``), so that a decoy (a ``sleep``, nothing of
the search) can be given, in the survivor's container, the pid number the victim rank has
in its own (pids are handed out in order inside a namespace).

Each class is one cell: ``torchrun --nnodes 2`` (static rendezvous on 127.0.0.1), the
victim frozen (SIGSTOP, tests/scripts/faults.py's ``sigstop``) in a training step of trial
2, the survivor awaited, then the same command again in fresh containers. What must hold:
the survivor exits with an error naming the silent rank and saying it was not signalled
(another pid namespace), within the bound plus a hang detector; the decoy is alive
afterwards; a frozen follower's trial goes back to ``pending`` (a frozen leader's stays
``evaluating`` under its lease until the next leader finds it stale, ``GRACE_S``); the same
command again finishes the budget with every trial a success. Bounds nest:
``PEER_TIMEOUT_S`` < ``GONE_S`` (a hang detector, from the freeze) < ``DEADLINE_S`` (a
launch's) < pytest's timeout (600 s).
"""

from __future__ import annotations

import re
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hostnet import OnHost, kill_marked, start_on

from exits import Exit, ExitWatch
from harness import TORCH_DDP, TORCHRUN, Result, states
from neps_bcast.compat import procfs
from ports import HeldPort

PEER_TIMEOUT_S = 4.0
"""``NEPS_BCAST_PEER_TIMEOUT_S`` (the library's default is 30 s)."""
GRACE_S = 3.0
"""``NEPS_BCAST_LEASE_GRACE_S``: a frozen leader's lease is stale this long after it froze
(its owner is in another container: only the heartbeat's age can prove it gone)."""
HEARTBEAT_S = 0.5
"""``NEPS_BCAST_HEARTBEAT_S`` (below a third of the grace, as the library requires)."""
GONE_S = PEER_TIMEOUT_S + 30.0
"""A hang detector: the survivor has exited this long after the victim froze. Far above
the bound plus an exit on a loaded machine, far below every other wait that could end it
(the settle wait's own exit, torch's store reads, gloo's 30 min)."""
DEADLINE_S = 150.0
"""One launch's deadline (the harness kills every process of it past this)."""
TRIALS = 3
CELL = "NB_CONTAINERS_CELL"
"""Every process of a cell, in every container and launch, carries this marker."""
VICTIM_FIRST_PID = 100
SURVIVOR_FIRST_PID = 300
"""Where each container's launch starts numbering (``ns_last_pid``): apart, so that the
victim's pid number is free in the survivor's container for the decoy."""


def _pid_namespace(pid: int) -> str:
    return str(Path(f"/proc/{pid}/ns/pid").readlink())


def _nspid(pid: int) -> int | None:
    """A process's pid in its own (innermost) pid namespace (``NSpid:`` in its status)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    except OSError:
        return None
    return None


@dataclass
class Container:
    """A pid namespace with its own ``/proc`` (its pid 1 a ``sleep``), on this host's
    network and hostname; ``remove`` ends it (the kernel kills all that runs inside)."""

    name: str
    first_pid: int
    holder: subprocess.Popen[bytes] = field(init=False)
    pid1: int = field(init=False)
    """Its pid 1, as this (the host's) pid namespace numbers it."""
    namespace: str = field(init=False)

    def __post_init__(self) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "3600"]
        )
        deadline = time.monotonic() + 30.0
        children: list[int] = []
        while not children:
            assert time.monotonic() < deadline, f"container {self.name}: its pid 1 never started"
            children = [
                p
                for p in procfs.all_pids()
                if (st := procfs.read_stat(p)) is not None and st.ppid == self.holder.pid
            ]
            time.sleep(0.01)  # bounded: unshare forks its pid 1 at once
        self.pid1 = children[0]
        self.namespace = _pid_namespace(self.pid1)
        assert self.namespace != procfs.pid_namespace()

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run inside, its processes numbered from ``first_pid`` on."""
        start_at = 'echo "$0" > /proc/sys/kernel/ns_last_pid && exec "$@"'
        return [
            "nsenter", "-t", str(self.pid1), "-p", "-m", "--",
            "sh", "-c", start_at, str(self.first_pid), *cmd,
        ]  # fmt: skip

    def host_pid(self, pid: int) -> int | None:
        """The host's pid of the process that is ``pid`` inside this container."""
        for p in procfs.all_pids():
            try:
                if _pid_namespace(p) == self.namespace and _nspid(p) == pid:
                    return p
            except OSError:
                continue
        return None

    def decoy(self, pid: int) -> Decoy:
        """A ``sleep`` inside, given the pid number ``pid`` (the next one handed out)."""
        script = "echo $(($0 - 1)) > /proc/sys/kernel/ns_last_pid; sleep 3600 & echo $!; wait"
        proc = subprocess.Popen(
            ["nsenter", "-t", str(self.pid1), "-p", "-m", "--", "sh", "-c", script, str(pid)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        inside = int(proc.stdout.readline())
        host = self.host_pid(inside)
        process = procfs.Process.of(host) if host is not None else None
        assert process is not None, f"the decoy (pid {inside} in {self.name}) is not found"
        return Decoy(proc, inside, process, _pid_namespace(host or 0), time.time())

    def remove(self) -> None:
        self.holder.kill()
        self.holder.wait()


@dataclass
class Decoy:
    proc: subprocess.Popen[str]
    inside: int
    """Its pid inside its container."""
    process: procfs.Process
    """Who it is, as the host names it."""
    namespace: str
    started: float


@dataclass
class Search:
    tmp: Path
    port: int
    cell: str = field(default_factory=lambda: uuid.uuid4().hex)
    secret: str = field(default_factory=lambda: uuid.uuid4().hex + uuid.uuid4().hex)

    @property
    def root(self) -> Path:
        return self.tmp / "shared" / "results"

    def command(self, node_rank: int) -> list[str]:
        return [
            TORCHRUN,
            "--nnodes=2",
            "--nproc-per-node=1",
            f"--node-rank={node_rank}",
            "--master-addr=127.0.0.1",
            f"--master-port={self.port}",
            "--max-restarts=0",
            str(TORCH_DDP),
            "--trials", str(TRIALS),
            "--root", str(self.root),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        return {
            "GLOO_SOCKET_IFNAME": "lo",
            "NEPS_BCAST_PEER_TIMEOUT_S": f"{PEER_TIMEOUT_S:g}",
            "NEPS_BCAST_LEASE_GRACE_S": f"{GRACE_S:g}",
            "NEPS_BCAST_HEARTBEAT_S": f"{HEARTBEAT_S:g}",
            "NEPS_BCAST_SECRET": self.secret,
            CELL: self.cell,
        }

    def start(
        self, containers: dict[int, Container], name: str, fault: str = ""
    ) -> dict[int, OnHost]:
        """Node ``n`` in ``containers[n]``: the same command in each."""
        return {
            node: start_on(
                box,  # type: ignore[arg-type]  # a container wraps a command as a host does
                self.command(node),
                self.tmp,
                name=f"{name}-{box.name}",
                env=self.env(),
                timeout=DEADLINE_S,
                fault=fault,
            )
            for node, box in containers.items()
        }


def started(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in evs if e["event"] == "start"]


def frozen(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in evs if e["event"] == "fault" and e["kind"] == "sigstop"]


@dataclass
class Cell:
    victim_start: dict[str, Any]
    fault: dict[str, Any]
    decoy: Decoy
    survivor_namespace: str
    survivor_exit: Exit | None
    survivor: Result
    decoy_alive: bool
    after_first: dict[str, str]
    again: dict[int, Result]
    after_again: dict[str, str]
    left: list[int]


def run_cell(tmp: Path, victim_node: int, who: str) -> Cell:
    """The victim's container runs node ``victim_node``; the survivor's the other."""
    survivor_node = 1 - victim_node
    boxes: list[Container] = []
    search: Search | None = None
    port = HeldPort()
    try:
        search = Search(tmp, port.number)
        victim_box = Container("victim", VICTIM_FIRST_PID)
        boxes.append(victim_box)
        survivor_box = Container("survivor", SURVIVOR_FIRST_PID)
        boxes.append(survivor_box)
        containers = {victim_node: victim_box, survivor_node: survivor_box}
        runs = search.start(containers, "first", fault=f"sigstop:{who}:trial=2")
        since = time.time()
        victim_start = runs[victim_node].wait_for("the victim's start", started)[0]
        survivor_start = runs[survivor_node].wait_for("the survivor's start", started)[0]
        survivor_pid = survivor_box.host_pid(survivor_start["pid"])
        assert survivor_pid is not None, survivor_start
        decoy = survivor_box.decoy(victim_start["pid"])
        fault = runs[victim_node].wait_for("the victim frozen", frozen)[0]
        heard = ExitWatch.get().wait(
            survivor_pid, since=since, timeout=max(fault["t"] + GONE_S - time.time(), 0)
        )
        survivor = runs[survivor_node].finish()
        decoy_alive = decoy.process.is_running()
        after_first = states(search.root)
        victim_box.remove()  # the frozen victim and its torchrun end with their container
        runs[victim_node].finish()
        fresh = {n: Container(f"again{n}", VICTIM_FIRST_PID) for n in (0, 1)}
        boxes.extend(fresh.values())
        again = {n: run.finish() for n, run in search.start(fresh, "again").items()}
        decoy.proc.kill()
        return Cell(
            victim_start=victim_start,
            fault=fault,
            decoy=decoy,
            survivor_namespace=survivor_box.namespace,
            survivor_exit=heard,
            survivor=survivor,
            decoy_alive=decoy_alive,
            after_first=after_first,
            again=again,
            after_again=states(search.root),
            left=procfs.pids_with_env(CELL, search.cell),
        )
    finally:
        if search is not None:
            kill_marked(CELL, search.cell)
        for box in boxes:
            box.remove()
        port.release()


def survivor_lines(cell: Cell, pattern: str) -> list[str]:
    return [
        line
        for name, text in cell.survivor.rank_logs.items()
        if name.startswith("rank")
        for line in text.splitlines()
        if re.search(pattern, line)
    ]


class ContainerChecks:
    victim: ClassVar[int]
    """The group rank frozen (0: the leader)."""
    state_left: ClassVar[str]
    """Trial 2's state once the survivor is gone."""
    not_signalled: ClassVar[str]
    """What the survivor's log says instead of signalling the victim's pid number."""

    @pytest.fixture(scope="class")
    def cell(self, tmp_path_factory: pytest.TempPathFactory) -> Cell:
        who = "leader" if self.victim == 0 else "follower"
        return run_cell(tmp_path_factory.mktemp(f"containers_{who}"), self.victim, who)

    def test_the_victim_froze_in_a_training_step_of_trial_2(self, cell: Cell) -> None:
        fired = (cell.fault["where"], cell.fault["seq"], cell.fault["rank"])
        assert fired == ("fit", 2, self.victim), cell.fault

    def test_the_decoy_held_the_victims_pid_number_in_the_survivors_container(
        self, cell: Cell
    ) -> None:
        """Before the victim froze: the pid number a verdict by pid alone would kill."""
        decoy = cell.decoy
        assert (decoy.inside, decoy.namespace, decoy.started < cell.fault["t"]) == (
            cell.victim_start["pid"],
            cell.survivor_namespace,
            True,
        )

    def test_the_decoy_is_alive_after_the_survivor_ended(self, cell: Cell) -> None:
        assert cell.decoy_alive

    def test_the_survivor_exited_1(self, cell: Cell) -> None:
        status = None if cell.survivor_exit is None else cell.survivor_exit.status
        assert status == 1, (status, cell.survivor.tail())

    def test_the_survivor_ended_within_the_hang_detector(self, cell: Cell) -> None:
        assert cell.survivor_exit is not None
        assert cell.survivor_exit.t - cell.fault["t"] < GONE_S

    def test_the_survivor_names_the_silent_rank_and_its_pid(self, cell: Cell) -> None:
        pid = cell.victim_start["pid"]
        named = survivor_lines(cell, rf"rank {self.victim} \(pid {pid} on host \S+\) silent for")
        assert named, cell.survivor.tail()

    def test_the_survivor_did_not_signal_the_victims_pid_number(self, cell: Cell) -> None:
        said = survivor_lines(cell, re.escape(self.not_signalled))
        assert said, cell.survivor.tail()

    def test_trial_1_is_a_success_and_trial_2_left_as_expected(self, cell: Cell) -> None:
        assert cell.after_first == {"1": "success", "2": self.state_left}, cell.survivor.tail()

    def test_the_same_command_again_finishes_the_budget_every_trial_a_success(
        self, cell: Cell
    ) -> None:
        assert cell.after_again == {str(i): "success" for i in range(1, TRIALS + 1)}, "\n".join(
            r.tail() for r in cell.again.values()
        )

    def test_the_same_command_again_exits_0_on_both_nodes(self, cell: Cell) -> None:
        assert {n: r.returncode for n, r in cell.again.items()} == {0: 0, 1: 0}

    def test_nothing_of_the_cell_is_left(self, cell: Cell) -> None:
        assert cell.left == []


class TestAFrozenFollowerInAnotherContainerIsHandledAsRemote(ContainerChecks):
    """The leader shuts its connections to the follower (their other ends held by no
    process it can see) and ends as for a lost follower: trial 2 back to ``pending``."""

    victim = 1
    state_left = "pending"
    not_signalled = "its connections shut; in another pid namespace of this host"

    def test_the_leader_shut_the_connections_to_the_follower(self, cell: Cell) -> None:
        shut = [int(m) for line in survivor_lines(cell, r"shut \d+ connection") for m in
                re.findall(r"shut (\d+) connection", line)]  # fmt: skip
        assert shut and shut[0] > 0, cell.survivor.tail()

    def test_the_leader_ended_by_its_follower_lost_error(self, cell: Cell) -> None:
        """Its waits failed once the connections were shut (not the settle wait's exit)."""
        errors = [str(e.get("error")) for e in cell.survivor.of("exit")]
        assert any(e.startswith("FollowerLostError") for e in errors), (
            errors,
            cell.survivor.tail(),
        )


class TestAFrozenLeaderInAnotherContainerIsLeftToItsLease(ContainerChecks):
    """The follower leaves (exit 1) without signalling; trial 2 stays ``evaluating`` under
    the frozen leader's lease, which the same command again finds stale (``GRACE_S``)."""

    victim = 0
    state_left = "evaluating"
    not_signalled = "(not signalled: in another pid namespace of this host"
