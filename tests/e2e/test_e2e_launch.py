"""`neps-bcast launch` end to end: real launcher, real torchrun, real Lightning ddp on gloo.

Each class launches ``tests/scripts/launch_search.py`` once as a user would
(``neps-bcast launch --groups 2 --nproc-per-group 2 SCRIPT``), with the NePS root, the
rank logs and the per-process records under its own folder, and its tests read what the
launch left. Every process of a launch inherits a marker (``NB_LAUNCH_MARKER``): that is
how a test finds what is left. Bounds: the launch's deadline (150 s) < pytest's timeout
(300 s for a class's first test, which runs the launch).
"""

from __future__ import annotations

import errno
import json
import re
import signal
import socket
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import launches
from harness import (
    FAKE_SRUN,
    HANG_S,
    LINGER_S,
    MARKER,
    PYTHON,
    SCRIPTS,
    TIMED_OUT,
    base_env,
    default_sigint,
    marked_pids,
    neps_trials,
)
from neps_bcast.compat import procfs
from neps_bcast.transport import sockets

SCRIPT = SCRIPTS / "launch_search.py"
NEPS_BCAST = str(Path(PYTHON).with_name("neps-bcast"))
DEADLINE_S = 150.0


@dataclass
class Launch:
    """One `neps-bcast launch` in its own process session, with everything it left."""

    proc: subprocess.Popen[bytes]
    folder: Path
    marker: str
    started: float

    @property
    def root(self) -> Path:
        return self.folder / "root"

    @property
    def logs(self) -> Path:
        return self.folder / "logs"

    def events(self) -> list[dict[str, Any]]:
        found = []
        for path in sorted((self.folder / "rec").glob("*.jsonl")):
            found.extend(json.loads(line) for line in path.read_text().splitlines() if line)
        return sorted(found, key=lambda e: e["t"])

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["event"] == event]

    def output(self) -> str:
        return (self.folder / "launcher.out").read_text(errors="replace")

    def tails(self, n: int = 30) -> str:
        parts = [f"--- launcher ---\n{self.output()}"]
        for path in sorted(self.logs.glob("**/group*/*.log")):
            lines = path.read_text(errors="replace").splitlines()[-n:]
            parts.append(f"--- {path.relative_to(self.logs)} ---\n" + "\n".join(lines))
        return "\n".join(parts)

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *marked_pids(self.marker)]:
            procfs.kill(pid)

    def wait_until(self, what: str, found: Callable[[], Any]) -> Any:
        """Poll (bounded by the deadline) until ``found()`` is truthy."""
        while time.monotonic() < self.started + DEADLINE_S:
            value = found()
            if value:
                return value
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)  # a bounded poll of the record files, not synchronization
        value = found()
        if not value:
            self.kill_all()
            raise AssertionError(f"never saw {what}; logs:\n{self.tails()}")
        return value

    def finish(self) -> int:
        try:
            self.proc.wait(timeout=max(self.started + DEADLINE_S - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise AssertionError(f"the launch overran {DEADLINE_S} s:\n{self.tails()}") from None
        return self.proc.returncode

    def left_after(self, seconds: float) -> list[int]:
        """The processes of the launch still alive after waiting (bounded) ``seconds``
        for every one to be gone; killed then."""
        start = time.monotonic()
        while marked_pids(self.marker) and time.monotonic() - start < seconds:
            time.sleep(0.05)  # bounded wait for processes to finish exiting
        left = marked_pids(self.marker)
        if left:
            self.kill_all()
        return left


def launch(
    tmp_path: Path,
    *args: str,
    trials: int = 6,
    groups: int = 2,
    prefix: tuple[str, ...] = (),
    **env: str,
) -> Launch:
    (tmp_path / "rec").mkdir()
    marker = uuid.uuid4().hex
    full_env = base_env(
        LAUNCH_RECORD_DIR=str(tmp_path / "rec"),
        LAUNCH_ROOT=str(tmp_path / "root"),
        LAUNCH_TRIALS=str(trials),
        **env,
    )
    full_env[MARKER] = marker
    cmd = [
        *prefix,
        NEPS_BCAST,
        "launch",
        "--groups",
        str(groups),
        "--nproc-per-group",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        "--status-interval",
        "2",
        *args,
        str(SCRIPT),
    ]
    launches.count("neps-bcast launch")
    with (tmp_path / "launcher.out").open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=default_sigint,  # noqa: PLW1509 - launches start from one thread
        )
    return Launch(proc, tmp_path, marker, time.monotonic())


@dataclass
class Taken:
    """Who held each of torch's default ports while a launch ran."""

    ours: list[int] = field(default_factory=list)
    """Bound and listened on by this test (seen listening when the launch ended)."""
    others: dict[int, str] = field(default_factory=dict)
    """Port -> why this test could not bind it: another process holds it."""


@contextmanager
def default_ports_taken(ports: range) -> Iterator[Taken]:
    """Listens on each of ``ports`` that this test can bind (without SO_REUSEADDR, so
    that nothing else can serve on it meanwhile); a port it cannot bind is another
    process's (a second copy of the suite, another job): just as good for this test,
    and left alone. Which is which is filled in once the block is over."""
    taken = Taken()
    with ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("0.0.0.0", port))
            except OSError as exc:
                taken.others[port] = f"{exc.strerror} ({errno.errorcode.get(exc.errno or 0)})"
                continue
            sock.listen()
        yield taken
        ours = sockets.listening(sockets.tcp_table(), sockets.socket_inodes())
        taken.ours = [port for port in ports if ("0.0.0.0", port) in ours]


def trials_by_group(events: list[dict[str, Any]]) -> dict[str, dict[int, list[tuple[str, Any]]]]:
    """group -> rank -> [(trial id, kwargs)] in the order each rank evaluated them."""
    found: dict[str, dict[int, list[tuple[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e["event"] == "trial":
            found[e["group"]][e["rank"]].append((e["trial_id"], e["kwargs"]))
    return {g: dict(ranks) for g, ranks in found.items()}


def assert_each_trial_in_one_group(events: list[dict[str, Any]]) -> dict[str, str]:
    """Every trial evaluated by one group only, by all its ranks with its leader's
    arguments; returns trial id -> group."""
    by_group = trials_by_group(events)
    owner: dict[str, str] = {}
    for group, ranks in by_group.items():
        assert set(ranks) == {0, 1}, f"group {group} ranks {sorted(ranks)}"
        assert ranks[1] == ranks[0], f"group {group}: follower {ranks[1]} vs leader {ranks[0]}"
        for trial_id, _ in ranks[0]:
            assert trial_id not in owner, f"trial {trial_id} in groups {owner[trial_id]}, {group}"
            owner[trial_id] = group
    return owner


def states(root: Path) -> dict[str, str]:
    return {tid: t.metadata.state.value for tid, t in neps_trials(root).items()}


@dataclass
class Finished:
    """A launch that ended: its exit code, and what was left of it (killed then)."""

    run: Launch
    returncode: int
    left: list[int]

    def events(self) -> list[dict[str, Any]]:
        return self.run.events()


def finish(run: Launch, linger: float = 15.0) -> Finished:
    rc = run.finish()
    return Finished(run, rc, run.left_after(linger))


class EndsWithZero:
    """A launch that succeeds: exit code 0, and nothing of it left within 15 s.
    A class provides ``done``."""

    def test_the_launcher_exits_with_0(self, done: Finished) -> None:
        assert done.returncode == 0, done.run.tails()

    def test_no_process_of_the_launch_is_left(self, done: Finished) -> None:
        assert not done.left, f"processes {done.left} still alive; logs:\n{done.run.tails()}"


class SharesOneSearch(EndsWithZero):
    """Every trial evaluated by one group only (all its ranks, its leader's arguments);
    NePS holds exactly those trials, each a success, at least the budget of 6."""

    @classmethod
    def owner(cls, done: Finished) -> dict[str, str]:
        return assert_each_trial_in_one_group(done.events())

    def test_each_trial_was_evaluated_by_all_ranks_of_one_group_only(self, done: Finished) -> None:
        assert self.owner(done)

    def test_neps_holds_exactly_the_trials_the_groups_evaluated(self, done: Finished) -> None:
        assert set(states(done.run.root)) == set(self.owner(done))

    def test_neps_recorded_every_trial_as_a_success(self, done: Finished) -> None:
        recorded = states(done.run.root)
        assert set(recorded.values()) == {"success"}, recorded

    def test_the_groups_spent_the_budget(self, done: Finished) -> None:
        assert len(states(done.run.root)) >= 6


DEFAULT_PORTS = range(29500, 29506)
"""torch's default MASTER_PORT and its neighbours."""


@pytest.mark.timeout(300)
class TestTwoGroupsShareOneSearchWhileDefaultPortsAreTaken(SharesOneSearch):
    @dataclass
    class Held(Finished):
        taken: Taken

    @pytest.fixture(scope="class")
    def done(self, tmp_path_factory: pytest.TempPathFactory) -> Held:
        tmp = tmp_path_factory.mktemp("two_groups")
        with default_ports_taken(DEFAULT_PORTS) as taken:
            run = launch(tmp, "--devices", "0-3", trials=6)
            rc = run.finish()
        return self.Held(run, rc, run.left_after(15), taken)

    def test_each_default_port_was_taken_by_the_test_or_by_another_process(
        self, done: Held
    ) -> None:
        """Without it the test tests less. A port this test could bind it listened on
        until the launch ended; one it could not was in use (EADDRINUSE) by another."""
        ours, others = done.taken.ours, done.taken.others
        assert sorted([*ours, *others]) == list(DEFAULT_PORTS), f"ours {ours}, others {others}"
        in_use = {port: why for port, why in others.items() if "EADDRINUSE" in why}
        assert in_use == others, f"not bound for another reason than being in use: {others}"

    def test_no_group_rendezvoused_on_a_port_the_test_held(self, done: Held) -> None:
        starts = [e for e in done.events() if e["event"] == "start"]
        ports = {(e["group"], e["rank"]): e["master_port"] for e in starts}
        assert len(ports) == 4, starts
        assert all(port and int(port) not in done.taken.ours for port in ports.values()), (
            f"the ranks' MASTER_PORTs {ports}, the test's {done.taken.ours}"
        )

    def test_every_rank_that_started_exited_with_0(self, done: Finished) -> None:
        events = done.events()
        exits = {e["pid"]: e["code"] for e in events if e["event"] == "exit"}
        assert exits == dict.fromkeys({e["pid"] for e in events if e["event"] == "start"}, 0)

    def test_every_rank_started_on_its_groups_slice_of_the_devices(self, done: Finished) -> None:
        events = done.events()
        starts = {
            (e["group"], e["rank"]): e["cuda_visible"] for e in events if e["event"] == "start"
        }
        assert starts == {("0", 0): "0,1", ("0", 1): "0,1", ("1", 0): "2,3", ("1", 1): "2,3"}

    @pytest.mark.parametrize("group", ["group0", "group1"])
    @pytest.mark.parametrize("rank", ["rank0", "rank1"])
    def test_each_rank_has_a_log_of_its_own(self, done: Finished, group: str, rank: str) -> None:
        assert "attempt 0" in (done.run.logs / group / f"{rank}.log").read_text()

    def test_the_launcher_printed_each_groups_status(self, done: Finished) -> None:
        out = done.run.output()
        assert "group 0 [0,1]: finished" in out and "group 1 [2,3]: finished" in out, out

    def test_the_status_lines_count_every_trial(self, done: Finished) -> None:
        out = done.run.output()
        finished = sum(
            int(line.rsplit("finished ", 1)[1].split()[0])
            for line in out.splitlines()[-2:]
            if line.startswith("group ")
        )
        assert finished == len(states(done.run.root)), out


@pytest.mark.timeout(300)
class TestOneLauncherPerNodeUnderSrunShareOneSearch(SharesOneSearch):
    """`srun --ntasks-per-node=1 neps-bcast launch --groups 1 ...` on two nodes, simulated:
    two SLURM tasks on this host (tests/scripts/fake_srun.py sets SLURM's variables), each
    a launcher of one group of 2 ranks, on one NePS root and one --log-dir."""

    @pytest.fixture(scope="class")
    def done(self, tmp_path_factory: pytest.TempPathFactory) -> Finished:
        tmp = tmp_path_factory.mktemp("srun")
        meet = tmp / "meet"
        meet.mkdir()
        run = launch(
            tmp,
            trials=6,
            groups=1,
            prefix=(PYTHON, str(FAKE_SRUN), "--ntasks", "2", "--"),
            LAUNCH_MEET=f"{meet},2",  # both nodes in their first trial before either goes on
        )
        return finish(run)

    @staticmethod
    def by_node(done: Finished) -> list[dict[str, Any]]:
        """One group per launcher: the (launcher, group) pair is the DDP group."""
        events = done.events()
        launches = sorted({e["launch"] for e in events if e["event"] == "start"})
        return [{**e, "group": f"{launches.index(e['launch'])}/{e['group']}"} for e in events]

    @classmethod
    def owner(cls, done: Finished) -> dict[str, str]:
        return assert_each_trial_in_one_group(cls.by_node(done))

    def test_each_task_ran_a_launcher_of_its_own(self, done: Finished) -> None:
        launches = {e["launch"] for e in done.events() if e["event"] == "start"}
        assert len(launches) == 2, f"want one launcher per task, got {launches}"

    def test_both_nodes_evaluated_trials(self, done: Finished) -> None:
        owner = self.owner(done)
        assert set(owner.values()) == {"0/0", "1/0"}, f"a node evaluated nothing: {owner}"

    def test_both_nodes_met_in_their_first_trial(self, done: Finished) -> None:
        assert {e["launches"] for e in done.events() if e["event"] == "met"} == {2}

    def test_every_rank_of_each_nodes_group_started(self, done: Finished) -> None:
        starts = [e for e in self.by_node(done) if e["event"] == "start"]
        assert {(e["group"], e["rank"]) for e in starts} == {
            ("0/0", 0),
            ("0/0", 1),
            ("1/0", 0),
            ("1/0", 1),
        }

    def test_no_rank_saw_the_nodes_slurm_task_variables(self, done: Finished) -> None:
        """The groups are torchrun launches."""
        starts = [e for e in done.events() if e["event"] == "start"]
        assert {e["slurm_procid"] for e in starts} == {None}

    @pytest.mark.parametrize("task", ["task0", "task1"])
    @pytest.mark.parametrize("rank", ["rank0", "rank1"])
    def test_each_task_keeps_its_own_logs_under_the_shared_log_dir(
        self, done: Finished, task: str, rank: str
    ) -> None:
        assert "attempt 0" in (done.run.logs / task / "group0" / f"{rank}.log").read_text()


def kills_trial(events: list[dict[str, Any]]) -> str:
    """The trial the killed rank was in (its group's leader's trial at that seq)."""
    kill = next(e for e in events if e["event"] == "kill")
    return next(
        e["trial_id"]
        for e in events
        if e["event"] == "trial" and e["pid"] == kill["pid"] and e["seq"] == kill["seq"]
    )


@pytest.mark.timeout(300)
class TestASigkilledRankRestartsItsGroupWhileTheOtherGoesOn(EndsWithZero):
    """Rank 1 of group 1 SIGKILLs itself in its first trial; group 0's trials wait until
    group 1 is back (a file its restarted ranks create), so both evaluate afterwards."""

    @pytest.fixture(scope="class")
    def done(self, tmp_path_factory: pytest.TempPathFactory) -> Finished:
        tmp = tmp_path_factory.mktemp("restart")
        run = launch(
            tmp,
            "--max-restarts",
            "1",
            trials=8,
            LAUNCH_KILL=f"1,1,1,{tmp / 'killed'}",
            LAUNCH_RESTARTED=str(tmp / "restarted"),
            LAUNCH_WAIT_RESTART="0",
        )
        return finish(run)

    @staticmethod
    def restarted(done: Finished) -> list[dict[str, Any]]:
        return [e for e in done.events() if e["group"] == "1" and e["restart"] == 1]

    @staticmethod
    def killed_at(done: Finished) -> float:
        return float(next(e["t"] for e in done.events() if e["event"] == "kill"))

    def test_the_rank_was_killed_once(self, done: Finished) -> None:
        assert len([e for e in done.events() if e["event"] == "kill"]) == 1, done.run.tails()

    def test_group_0_waited_until_group_1_was_back(self, done: Finished) -> None:
        assert all(e["restarted"] for e in done.events() if e["event"] == "waited")

    def test_group_1_restarted_both_ranks_in_new_processes(self, done: Finished) -> None:
        assert {e["rank"] for e in self.restarted(done) if e["event"] == "start"} == {0, 1}

    def test_group_0_never_restarted(self, done: Finished) -> None:
        """One process per rank from start to end, each exiting with 0."""
        group0 = [e for e in done.events() if e["group"] == "0"]
        assert {e["restart"] for e in group0} == {0}
        assert len({e["pid"] for e in group0}) == 2
        assert {e["rank"] for e in group0 if e["event"] == "exit" and e["code"] == 0} == {0, 1}

    def test_group_0_kept_evaluating_after_the_kill(self, done: Finished) -> None:
        """The positive control for "never restarted": it was running all along."""
        group0 = [e for e in done.events() if e["group"] == "0"]
        assert any(e["event"] == "trial" and e["t"] > self.killed_at(done) for e in group0)

    def test_group_1_evaluated_a_trial_after_its_restart(self, done: Finished) -> None:
        after_restart = [e for e in self.restarted(done) if e["event"] == "trial"]
        assert after_restart, (
            f"group 1 never evaluated a trial after its restart:\n{done.run.tails()}"
        )
        first_start = min(e["t"] for e in self.restarted(done) if e["event"] == "start")
        print(
            f"kill -> restarted ranks start: {first_start - self.killed_at(done):.1f} s;"
            f" -> first trial after restart: {after_restart[0]['t'] - self.killed_at(done):.1f} s"
        )

    def test_each_other_trial_was_evaluated_by_one_group(self, done: Finished) -> None:
        """The interrupted one aside: NePS may hand it out again."""
        events = done.events()
        interrupted = kills_trial(events)
        owner = assert_each_trial_in_one_group(
            [e for e in events if e["event"] != "trial" or e["trial_id"] != interrupted]
        )
        assert set(owner) <= set(states(done.run.root))

    def test_neps_holds_the_interrupted_trial_and_none_is_left_unfinished(
        self, done: Finished
    ) -> None:
        recorded = states(done.run.root)
        assert kills_trial(done.events()) in recorded, recorded
        assert "evaluating" not in recorded.values() and "pending" not in recorded.values()

    def test_the_budget_was_spent(self, done: Finished) -> None:
        recorded = states(done.run.root)
        assert sum(state in ("success", "crashed") for state in recorded.values()) >= 8, recorded


@pytest.mark.timeout(300)
class TestCtrlCStopsEveryGroupAndLeavesNoTrialEvaluating:
    @dataclass
    class Interrupted(Finished):
        gone_s: float

    @pytest.fixture(scope="class")
    def done(self, tmp_path_factory: pytest.TempPathFactory) -> Interrupted:
        run = launch(tmp_path_factory.mktemp("ctrl_c"), trials=6, LAUNCH_HOLD_S="90")
        run.wait_until(
            "every rank of both groups inside a trial",
            lambda: (
                {(e["group"], e["rank"]) for e in run.of("training")}
                == {("0", 0), ("0", 1), ("1", 0), ("1", 1)}
            ),
        )
        sent = time.monotonic()
        run.proc.send_signal(signal.SIGINT)
        rc = run.finish()
        exited = time.monotonic() - sent
        left = run.left_after(LINGER_S)
        gone = time.monotonic() - sent
        print(
            f"Ctrl-C -> launcher exited ({rc}) after {exited:.1f} s;"
            f" every process gone after {gone:.1f} s"
        )
        return self.Interrupted(run, rc, left, gone)

    def test_every_process_ended_on_its_own_and_no_wait_timed_out(self, done: Interrupted) -> None:
        """Why the launch ended, not how fast (a loaded machine stretches it): nothing
        was left for the test to kill and no log says a wait ran out of time; HANG_S
        after the signal only detects a hang."""
        assert not done.left, f"processes {done.left} still alive; logs:\n{done.run.tails()}"
        text = done.run.tails(10_000)
        timed_out = [line for line in text.splitlines() if TIMED_OUT.search(line)]
        assert not timed_out, timed_out
        assert done.gone_s < HANG_S, (done.gone_s, done.run.tails())

    def test_the_launcher_exits_with_130(self, done: Finished) -> None:
        assert done.returncode == 128 + signal.SIGINT, done.run.tails()

    def test_the_launcher_said_it_stops_every_group(self, done: Finished) -> None:
        assert "SIGINT received: stopping every group" in done.run.output()

    def test_neps_recorded_the_trials_and_none_is_left_evaluating(self, done: Finished) -> None:
        recorded = states(done.run.root)
        assert recorded, "NePS recorded nothing"
        assert "evaluating" not in recorded.values(), (recorded, done.run.tails())

    def test_neps_holds_every_trial_a_rank_evaluated(self, done: Finished) -> None:
        held = {e["trial_id"] for e in done.run.of("trial")}
        assert held <= set(states(done.run.root))


REFUSED = {
    "nproc_per_group_0": (
        ["--groups", "2", "--nproc-per-group", "0", str(SCRIPT)],
        r"--nproc-per-group 0: .*HINT: pass --nproc-per-group 1 or more",
    ),
    "groups_0": (
        ["--groups", "0", "--nproc-per-group", "2", str(SCRIPT)],
        r"--groups 0: .*HINT: pass --groups 1 or more",
    ),
    "more_ranks_than_devices": (
        ["--groups", "2", "--nproc-per-group", "2", "--devices", "0,1,2", str(SCRIPT)],
        r"= 4 ranks, but there are only 3 devices \(0,1,2\).*HINT: lower --groups or --nproc-per-group",
    ),
    "a_device_twice": (
        ["--groups", "2", "--nproc-per-group", "1", "--devices", "0,1,1", str(SCRIPT)],
        r"lists device 1 twice.*HINT: list every device once",
    ),
    "a_missing_script": (
        ["--groups", "2", "--nproc-per-group", "2", "nothere.py"],
        r"the script 'nothere.py' does not exist \(relative to .*\)\. HINT: pass the path of the Python script",
    ),
}


@dataclass
class Refused:
    done: subprocess.CompletedProcess[str]
    message: str
    folder: Path
    left: list[int]


class TestBadArgumentsFailBeforeAnyProcessStarts:
    @pytest.fixture(scope="class", params=list(REFUSED))
    def refused(
        self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Refused:
        args, message = REFUSED[request.param]
        tmp = tmp_path_factory.mktemp("refused")
        marker = uuid.uuid4().hex
        env = base_env(LAUNCH_RECORD_DIR=str(tmp), LAUNCH_ROOT=str(tmp / "root"))
        env[MARKER] = marker
        done = subprocess.run(
            [NEPS_BCAST, "launch", "--log-dir", str(tmp / "logs"), *args],
            cwd=tmp,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        return Refused(done, message, tmp, marked_pids(marker))

    def test_the_launcher_exits_with_2(self, refused: Refused) -> None:
        assert refused.done.returncode == 2, (refused.done.stdout, refused.done.stderr)

    def test_the_launcher_names_the_problem_and_what_to_do(self, refused: Refused) -> None:
        pattern = r"^\[neps_bcast launch\] .*" + refused.message
        assert re.search(pattern, refused.done.stderr, re.MULTILINE), refused.done.stderr

    def test_no_log_folder_was_made(self, refused: Refused) -> None:
        assert not (refused.folder / "logs").exists()

    def test_no_rank_recorded_anything(self, refused: Refused) -> None:
        assert not list(refused.folder.glob("*.jsonl"))

    def test_no_process_of_the_launch_exists(self, refused: Refused) -> None:
        assert not refused.left
