"""Launch real multi-process searches from tests and read back what happened.

A test launches one of the user-shaped scripts in ``tests/scripts`` as users do:
``run(python(LIGHTNING, "--trials", "5"), tmp)``, ``torchrun(2, TORCH_DDP, ...)`` or
``srun(2, ...)`` (simulated SLURM variables); ``fault="..."`` names the fault the script
injects (``NB_FAULT``, tests/scripts/faults.py). Every process of a launch inherits a
unique ``NB_LAUNCH_MARKER``: that is how the harness finds all of them (torch's launcher
starts each torchrun worker in a process session of its own, so a session or process
group would miss them). Every rank logs to a file of its own and records what it did
(tests/scripts/probe.py) under the launch's folder, ``tmp/<name>``; the NePS root is the
script's ``--root`` (``results`` unless given), relative to the launch's cwd (``tmp``).

Bounds are nested: group timeouts a test sets (60 s) < the launch's deadline
(``timeout``, 240 s by default) < pytest's timeout (600 s, pyproject.toml). On the
deadline every marked process is killed and the test fails with each rank's log tail.
After the launch returns, we wait (bounded) for every marked process to be gone.

``LaunchChecks`` and ``CleanLaunch`` are the checks every launch gets, as tests of
their own: a test class inherits them and provides the ``launch`` fixture.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import launches
from exits import ExitWatch
from neps_bcast.compat import procfs
from neps_bcast.ddp.forming import ARRIVAL_CHECK
from neps_bcast.transport import sockets
from scenario import Scenario

SCRIPTS = Path(__file__).parent / "scripts"
LIGHTNING = SCRIPTS / "lightning_search.py"
"""Lightning ``strategy="ddp"`` (or ddp_spawn) trials: the README's quickstart."""
TORCH_DDP = SCRIPTS / "torch_ddp_search.py"
"""A plain torch DDP loop on the group neps_bcast formed (external launchers)."""
FABRIC = SCRIPTS / "fabric_search.py"
"""Lightning Fabric, ``fabric.launch()`` inside the function."""
SINGLE = SCRIPTS / "single_search.py"
"""One process, no DDP: NePS's own quickstart through neps_bcast.run."""
MISMATCHED = SCRIPTS / "mismatched_ranks.py"
"""Rank 1 skips neps_bcast.run, or calls it with other arguments (torchrun)."""
FAKE_SRUN = SCRIPTS / "fake_srun.py"
PYTHON = sys.executable
NEPS_BCAST = str(Path(PYTHON).with_name("neps-bcast"))


def pool_launch(
    tmp: Path,
    script: Path,
    trials: int,
    *script_args: str,
    pool: int = 2,
    name: str = "run",
    options: Sequence[str] = (),
) -> list[str]:
    """``neps-bcast launch --pool`` as every pool test runs it: the launcher's
    ``options``, its logs under ``tmp/name/logs``, then the script with ``script_args``,
    ``--trials`` and the NePS root ``tmp/root`` (``--root``)."""
    return [
        NEPS_BCAST, "launch", "--pool", str(pool), *options,
        "--log-dir", str(tmp / name / "logs"),
        str(script), *script_args, "--trials", str(trials), "--root", str(tmp / "root"),
    ]  # fmt: skip


TORCHRUN = str(Path(PYTHON).with_name("torchrun"))
MARKER = "NB_LAUNCH_MARKER"
HANG_S = 180.0
"""A hang detector, not a measure of speed: a process that ends by its own path ends well
within this on any machine's load; a 30-minute group timeout or a lost wake-up does not."""
TIMED_OUT = re.compile(
    r"did not join within|JoinTimeoutError|within \d+ s; expected ranks"
    r"|for more than \d+ s while starting|timed out|Timed out|Socket Timeout|[Ww]ait timeout"
)
"""A log line that says a wait ended by its timeout: neps_bcast's own (a rank that did not
join its channel, a rendezvous or lock past its bound), torch's store and gloo."""
LIVENESS_SLICE = re.compile(
    r"\[c10d\] waitForInput: .* timed out after "
    rf"{int(ARRIVAL_CHECK.total_seconds() * 1000)}ms"
)
"""torch's warning when one slice of a ``WatchedStore`` wait ends (``ARRIVAL_CHECK``): a rank
waiting for its peers to form a group checks every slice that they live, and a lost peer is
found so. The wait itself goes on (or raises the peer's loss): no bound ran out."""
LINGER_S = 60.0
"""How long, once the launcher exited, the harness waits for the launch's other processes
to be gone (the wait returns as soon as they are): a hang detector too. 15 s was a bound
that a loaded machine broke (an interpreter's exit takes seconds there)."""

LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
)
"""Launcher variables a launch must not inherit from pytest's own environment."""


def python(script: Path, *args: object) -> list[str]:
    """``python script.py ...``: under Lightning ddp (or Fabric) the leader starts the
    other ranks."""
    return [PYTHON, str(script), *map(str, args)]


def torchrun(
    nproc: int, script: Path, *args: object, rendezvous: Sequence[str] = ("--standalone",)
) -> list[str]:
    """``torchrun --standalone --nproc-per-node=N script.py ...`` (or another rendezvous)."""
    return [TORCHRUN, *rendezvous, f"--nproc-per-node={nproc}", str(script), *map(str, args)]


def srun(ntasks: int, script: Path, *args: object) -> list[str]:
    """Simulated SLURM (tests/scripts/fake_srun.py): the caller's env must give
    MASTER_ADDR and MASTER_PORT, as an sbatch script exports them."""
    return [PYTHON, str(FAKE_SRUN), "--ntasks", str(ntasks), "--", *python(script, *args)]


def kind_of(cmd: Sequence[str]) -> str:
    """What a command launches, for the launch counter (tests/launches.py)."""
    if Path(cmd[0]).name == "torchrun":
        return "torchrun"
    if Path(cmd[0]).name == "neps-bcast":
        return "neps-bcast launch"
    if FAKE_SRUN.name in " ".join(cmd):
        return "srun"
    return "python"


def root_of(command: Sequence[str], cwd: Path) -> Path:
    """The NePS root a command's script searches in: its ``--root``, else ``results``,
    relative to the launch's cwd."""
    args = list(command)
    root = Path(args[args.index("--root") + 1]) if "--root" in args else Path("results")
    return root if root.is_absolute() else cwd / root


def base_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "NEPS_BCAST_", "NB_", "PYTEST_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def default_sigint() -> None:
    """In a launch's first process, before exec: SIGINT back to its default.

    A suite started in the background by a script (``make test &``) inherits SIGINT
    ignored, every launch with it, and Python then never installs KeyboardInterrupt:
    the Ctrl-C tests saw their signal do nothing (a fresh-clone run here). Users press
    Ctrl-C in a terminal, where it is not ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def marked_pids(marker: str) -> list[int]:
    return procfs.pids_with_env(MARKER, marker)


def listening_ports(pid: int) -> dict[int, str]:
    """port -> address of every TCP socket the process listens on (/proc/net/tcp)."""
    table = sockets.tcp_table()
    return {port: ip for ip, port in sockets.listening(table, sockets.socket_inodes(pid))}


def read_records(record_dir: Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for path in sorted(record_dir.glob("*.jsonl")):
        events.extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return sorted(events, key=lambda e: e["t"])


def trials_by_rank(events: list[dict[str, Any]]) -> dict[int, list[tuple[str, dict[str, Any]]]]:
    by_rank: dict[int, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for e in sorted((e for e in events if e["event"] == "trial"), key=lambda e: e["t"]):
        by_rank[e["rank"]].append((e["trial_id"], e["kwargs"]))
    return dict(by_rank)


def exits_by_rank(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank's "exit" record (the exit code its script ended with)."""
    found: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["event"] == "exit":
            assert e["proc_rank"] not in found, f"two exits for rank {e['proc_rank']}: {e}"
            found[e["proc_rank"]] = e
    return found


def neps_trials(root: Path) -> dict[str, Any]:
    """NePS's own record of the search, read with NePS's reader."""
    from neps.state.neps_state import NePSState

    if str(SCRIPTS) not in sys.path:
        sys.path.append(str(SCRIPTS))  # a search space may name a script's helpers (space_tools)

    state = NePSState.create_or_load(path=root, load_only=True)
    return state.lock_and_read_trials()


def with_kernel_exits(events: list[dict[str, Any]], watch: ExitWatch) -> dict[int, int | None]:
    """Give each "exit" record the status the kernel reported for its process (``code``;
    what the script predicted becomes ``predicted``); return pid -> that status for every
    rank that started (None: no exit heard, within 5 s, of a process that may be alive)."""
    statuses: dict[int, int | None] = {}
    for e in events:
        if e["event"] == "start":
            heard = watch.wait(e["pid"], since=e["t"], timeout=5.0)
            statuses[e["pid"]] = None if heard is None else heard.status
    for e in events:
        if e["event"] == "exit":
            if e["pid"] not in statuses:  # a script without "start" records
                heard = watch.wait(e["pid"], since=e["t"], timeout=5.0)
                statuses[e["pid"]] = None if heard is None else heard.status
            e["predicted"], e["code"] = e["code"], statuses[e["pid"]]
    return statuses


@dataclass
class Result:
    """A finished launch: what the launcher returned, the logs, the records."""

    name: str
    returncode: int
    log: str
    """The launcher's own output, then every rank's log."""
    rank_logs: dict[str, str]
    left_alive: list[int]
    """Marked processes still alive ``linger`` seconds after the launcher exited."""
    seconds: float
    gone_at: float
    """Wall-clock time (time.time()) at which no process of the launch was left."""
    root: Path
    events: list[dict[str, Any]]
    """Every record of the launch's ranks. An "exit" record's ``code`` is the status the
    kernel reported for that process (``exits.ExitWatch``: the code, or -N for signal N;
    None if none was heard); ``predicted`` is the code the rank's script ended with."""
    os_exits: dict[int, int | None]
    """pid -> the status the kernel reported, for every process that wrote a "start"
    record (a rank killed before its own "exit" record has one too)."""

    def tail(self, n: int = 40) -> str:
        return "\n".join(
            f"--- {name} (last {n} lines) ---\n" + "\n".join(text.splitlines()[-n:])
            for name, text in self.rank_logs.items()
        )

    def timeline(self, since: float) -> str:
        """Every record's time from ``since`` on (and one second before), one a line."""
        return "\n".join(
            f"  {e['t'] - since:+8.2f} s  rank {e.get('proc_rank')} pid {e.get('pid')}:"
            f" {e['event']} {e.get('type') or e.get('kind') or e.get('code', '')}"
            for e in sorted(self.events, key=lambda e: e["t"])
            if e["t"] >= since - 1.0
        )

    def waits_that_timed_out(self) -> list[str]:
        """Every log line that says a wait ended by its timeout (``TIMED_OUT``)."""
        return [
            f"{name}: {line.strip()}"
            for name, text in self.rank_logs.items()
            for line in text.splitlines()
            if TIMED_OUT.search(line) and not LIVENESS_SLICE.search(line)
        ]

    def ended_on_their_own(self, since: float) -> None:
        """Why the launch ended, from ``since`` (a fault's or a signal's record time) on:
        every process of it ended by its own path, not by a bound.

        - none was left for the harness to kill: its wait for the processes to be gone
          (``linger``) returned because they were, not by its timeout (``left_alive``);
        - the kernel heard every process that started end (none was still alive);
        - no log says that a wait of the library's or torch's ended by its timeout
          (``TIMED_OUT``: a rendezvous, a join, a store, a lock);
        - a hang detector only: gone within ``HANG_S`` of ``since``, far above any
          machine's load (the launch's own deadline bounds it anyway).

        Seconds are not the check: on a busy machine a correct exit takes long (once
        117 s for a Ctrl-C, at load 13-20 a follower's interpreter took over 5 s to
        end); what must never happen is a wait ending because its time ran out."""
        context = f"records from {since:.2f} on:\n{self.timeline(since)}\n{self.tail(80)}"
        assert not self.left_alive, (
            f"processes {self.left_alive} were still alive when the harness stopped waiting;"
            f" {context}"
        )
        unheard = sorted(pid for pid, status in self.os_exits.items() if status is None)
        assert not unheard, f"no exit heard for pids {unheard}; {context}"
        timed_out = self.waits_that_timed_out()
        assert not timed_out, f"a wait ended by its timeout: {timed_out}; {context}"
        took = self.gone_at - since
        assert took < HANG_S, (
            f"the launch was gone {took:.1f} s after {since:.2f} (hang detector {HANG_S:g} s);"
            f" {context}"
        )

    @property
    def exits(self) -> dict[int, dict[str, Any]]:
        return exits_by_rank(self.events)

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


class Running:
    """A launch in progress: records can be read (and polled for) while it runs."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        *,
        env: dict[str, str],
        cwd: Path,
        folder: Path,
        root: Path,
        timeout: float,
    ) -> None:
        self.name = name
        self.marker = env[MARKER]
        self.folder = folder
        self.root = root
        self.cmd = cmd
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.started = time.monotonic()
        self._log = (folder / "launcher.log").open("wb")
        launches.count(kind_of(cmd))
        self.watch = ExitWatch.get()  # listening before the first process of the launch
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=default_sigint,  # noqa: PLW1509 - launches start from one thread
        )

    @property
    def record_dir(self) -> Path:
        return self.folder / "rec"

    def events(self) -> list[dict[str, Any]]:
        return read_records(self.record_dir)

    def rank_logs(self) -> dict[str, str]:
        logs = {"launcher": (self.folder / "launcher.log").read_text(errors="replace")}
        for path in sorted((self.folder / "logs").glob("*.log")):
            logs[path.stem] = path.read_text(errors="replace")
        return logs

    def tails(self, n: int = 40) -> str:
        return "\n".join(
            f"--- {name} (last {n} lines) ---\n" + "\n".join(text.splitlines()[-n:])
            for name, text in self.rank_logs().items()
        )

    def dump_stacks(self) -> None:
        """A launch that overran: every rank writes its threads' stacks to its log
        (faulthandler on SIGUSR1, tests/scripts/probe.py), so a hang shows where it is."""
        pids = marked_pids(self.marker)
        for pid in pids:
            procfs.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            logs = self.rank_logs().values()
            if sum(log.count("Current thread") for log in logs) >= len(pids):
                break
            time.sleep(0.05)  # bounded wait for the dumps: diagnostics only

    def kill_all(self) -> None:
        for pid in [self.proc.pid, *marked_pids(self.marker)]:
            procfs.kill(pid)

    def wait_for(
        self, what: str, found: Callable[[list[dict[str, Any]]], Any], timeout: float = 120.0
    ) -> Any:
        """Poll the records (bounded) until ``found(events)`` is truthy; return it."""
        return self._poll(what, lambda: found(self.events()), timeout)

    def wait_for_log(self, text: str, timeout: float = 120.0) -> str:
        """Poll the logs (bounded) until one of them holds ``text``; return that log's name."""
        return str(
            self._poll(
                f"{text!r} in a log",
                lambda: next((n for n, log in self.rank_logs().items() if text in log), None),
                timeout,
            )
        )

    def _poll(self, what: str, probe: Callable[[], Any], timeout: float) -> Any:
        limit = min(time.monotonic() + timeout, self.deadline)
        while time.monotonic() < limit:
            value = probe()
            if value:
                return value
            if self.proc.poll() is not None and not marked_pids(self.marker):
                break
            time.sleep(0.02)  # a bounded poll for a record or log file, not synchronization
        value = probe()
        if value:
            return value
        self.dump_stacks()
        self.kill_all()
        self.proc.wait()
        raise AssertionError(f"launch {self.name}: never saw {what}; logs:\n{self.tails()}")

    def finish(self, linger: float = LINGER_S) -> Result:
        """Wait for the launcher (bounded by the deadline), then for every marked
        process to be gone (bounded by ``linger``)."""
        try:
            self.proc.wait(timeout=max(self.deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.kill_all()
            self.proc.wait()
            self._log.close()
            raise AssertionError(
                f"launch {self.name} {self.cmd} overran {self.timeout} s; every process"
                f" killed; logs (each rank's stacks at the end):\n{self.tails(80)}"
            ) from None
        self._log.close()
        seconds = time.monotonic() - self.started
        until = time.monotonic() + linger
        left = marked_pids(self.marker)
        while left and time.monotonic() < until:
            time.sleep(0.05)  # bounded wait for processes to finish exiting
            left = marked_pids(self.marker)
        gone_at = time.time()
        if left:
            self.kill_all()
        logs = self.rank_logs()
        events = self.events()
        os_exits = with_kernel_exits(events, self.watch)
        return Result(
            name=self.name,
            returncode=self.proc.returncode,
            log="\n".join(logs.values()),
            rank_logs=logs,
            left_alive=left,
            seconds=seconds,
            gone_at=gone_at,
            root=self.root,
            events=events,
            os_exits=os_exits,
        )


def start(
    command: Sequence[str] | Scenario,
    tmp_path: Path,
    *,
    name: str = "run",
    fault: str = "",
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 240.0,
) -> Running:
    """Start one launch of ``command`` (a ``Scenario`` stands for its command line) with
    ``fault`` in its ``NB_FAULT``; logs and records go to ``tmp_path/name``; the cwd is
    ``tmp_path`` unless given."""
    cmd = command.command() if isinstance(command, Scenario) else list(command)
    folder = tmp_path / name
    folder.mkdir(parents=True)
    cwd = cwd or tmp_path
    full_env = base_env(
        **(env or {}),
        NB_FAULT=fault,
        NB_RECORD_DIR=str(folder / "rec"),
        NB_LOG_DIR=str(folder / "logs"),
    )
    full_env[MARKER] = uuid.uuid4().hex
    return Running(
        name, cmd, env=full_env, cwd=cwd, folder=folder, root=root_of(cmd, cwd), timeout=timeout
    )


def run(command: Sequence[str] | Scenario, tmp_path: Path, **kwargs: Any) -> Result:
    """``start`` one launch and ``finish`` it."""
    return start(command, tmp_path, **kwargs).finish()


def assert_clean_launch(result: Result, *, expect_rc: int = 0) -> None:
    """All of a launch's checks at once (``LaunchChecks`` / ``CleanLaunch`` split them
    into tests): the launcher's exit code is ``expect_rc`` and nothing of the launch is
    left; for a successful launch, every process that started recorded exit code 0 and
    left nothing of its trials to the interpreter's finalization."""
    assert result.returncode == expect_rc, (
        f"exit code {result.returncode} (want {expect_rc}); logs:\n{result.tail()}"
    )
    assert_nothing_left(result)
    assert_every_exit_was_heard_as_recorded(result)
    if expect_rc == 0:
        assert_every_process_exited_0(result)
        assert_trials_freed_before_finalization(result)


def assert_nothing_left(result: Result) -> None:
    assert not result.left_alive, (
        f"processes {result.left_alive} still alive after the launch; logs:\n{result.tail()}"
    )


def closed_by_torchrun(result: Result, pid: int) -> bool:
    """torchrun sent ``pid`` its closing SIGTERM: once one worker exits non-zero it
    SIGTERMs every worker still alive ("Sending process N closing signal SIGTERM")."""
    return f"Sending process {pid} closing signal SIGTERM" in result.log


def assert_every_exit_was_heard_as_recorded(result: Result) -> None:
    """The kernel heard every process that started end, each with the code its own "exit"
    record predicted: nothing changed it after the record (an abort in the interpreter's
    finalization, a signal, an ``os._exit``). One exception, torchrun's own: once a
    worker fails it SIGTERMs the others ("Sending process N closing signal SIGTERM"), so
    when every rank fails (different arguments) the one still finalizing ends with -15
    though its record, already a failure, said 1; which one is a race of their exits.
    So does a leader whose follower was SIGTERMed at STOP: its search over and its
    record 0, torchrun's signal comes after ``neps_bcast.run`` returned."""
    unheard = sorted(pid for pid, status in result.os_exits.items() if status is None)
    assert not unheard, (
        f"no exit heard for pids {unheard} (lost events: {ExitWatch.get().lost});"
        f" logs:\n{result.tail()}"
    )
    differ = {
        e["pid"]: f"recorded {e['predicted']}, kernel {e['code']}"
        for e in result.of("exit")
        if e["predicted"] != e["code"]
        and not (e["code"] == -15 and closed_by_torchrun(result, e["pid"]))
    }
    assert not differ, f"exit codes changed after the record: {differ}; logs:\n{result.tail()}"


def assert_every_process_exited_0(result: Result) -> None:
    started = {e["pid"] for e in result.of("start")}
    exited = {e["pid"]: e["code"] for e in result.of("exit")}
    assert started, f"no rank started; logs:\n{result.tail()}"
    assert exited == dict.fromkeys(started, 0), (
        f"exit codes by pid {exited}, started {sorted(started)}; logs:\n{result.tail()}"
    )


def assert_trials_freed_before_finalization(result: Result) -> None:
    """No process left its trials' models or process groups to the interpreter's
    finalization (freed there, a gloo group aborts the process: "terminate called
    without an active exception"). Each "at_exit" record is written by the last atexit
    handler of a process whose trials trained."""
    for e in result.of("at_exit"):
        assert e["trial_objects_alive"] == [], (e, result.tail())


class LaunchChecks:
    """Every launch's own tests: the launcher's exit code (``returncode``), and no
    process of the launch left once it ended. A test class inherits them and provides a
    ``launch`` fixture (a ``Result``)."""

    returncode = 0

    def test_the_launcher_exits_with_its_expected_code(self, launch: Result) -> None:
        assert launch.returncode == self.returncode, (
            f"exit code {launch.returncode} (want {self.returncode}); logs:\n{launch.tail()}"
        )

    def test_no_process_of_the_launch_is_left(self, launch: Result) -> None:
        assert_nothing_left(launch)

    def test_every_exit_the_kernel_reported_is_the_one_recorded(self, launch: Result) -> None:
        assert_every_exit_was_heard_as_recorded(launch)


class CleanLaunch(LaunchChecks):
    """A launch that succeeds: also every process that started exited with 0, and none
    left its trials' objects to the interpreter's finalization."""

    def test_every_process_that_started_exited_with_0(self, launch: Result) -> None:
        assert_every_process_exited_0(launch)

    def test_no_trial_object_is_left_to_the_interpreters_finalization(self, launch: Result) -> None:
        assert_trials_freed_before_finalization(launch)


def identical_on_every_rank(result: Result | list[dict[str, Any]], world: int) -> list[str]:
    """Every rank evaluated exactly the leader's trials, with the same keyword
    arguments, in the same order; returns the leader's trial ids."""
    events = result.events if isinstance(result, Result) else result
    by_rank = trials_by_rank(events)
    assert sorted(by_rank) == list(range(world)), by_rank
    for rank in range(1, world):
        assert json.dumps(by_rank[rank], sort_keys=True) == json.dumps(by_rank[0], sort_keys=True)
    return [tid for tid, _ in by_rank[0]]


def states(root: Path) -> dict[str, str]:
    """trial id -> the state NePS holds it in (success, crashed, pending, evaluating)."""
    return {
        tid: str(getattr(t.metadata.state, "value", t.metadata.state))
        for tid, t in neps_trials(root).items()
    }


def raised(result: Result, seq: int) -> dict[int, dict[str, Any]]:
    """What each rank's evaluation raised in its seq-th trial, by rank."""
    return {e["rank"]: e for e in result.of("raised") if e["seq"] == seq}


def assert_followers_never_touch_neps(exits: dict[int, dict[str, Any]]) -> None:
    """Followers never call neps.run, never open NePS's state, never make a path call
    under the root (the probe's audit hook: open, listdir, scandir, mkdir, rename,
    remove, rmdir, utime, chmod, glob, shutil's... ``probe.PATH_ARGS``) and are never
    seen holding a file under it open (its fd watch: C-level opens too); the leader's
    own counts show that the counters count. ``exits``: one group's exit records by
    rank. (``os.stat`` and ``os.path.exists`` raise no audit event and hold no file: not
    seen.)"""
    assert_the_leader_touched_neps(exits)
    followers = {r: e for r, e in exits.items() if r != 0}
    assert followers, "no follower exited: nothing was checked"
    for rank, e in followers.items():
        assert e["calls"] == {"neps.run": 0, "NePSState.create_or_load": 0}, (rank, e)
        untouched = {"count": 0, "paths": [], "fd_count": 0, "fd_paths": []}
        assert e["root_access"] == untouched, (rank, e)  # probe.py ROOT_ACCESS


def assert_the_leader_touched_neps(exits: dict[int, dict[str, Any]]) -> None:
    """The positive control of ``assert_followers_never_touch_neps``: the same counters
    count the leader's calls and accesses: the audit hook's (NePS's state files) and the
    fd watch's (NePS's lock and state files, and neps_bcast's lease lock, seen held open
    while the leader reads or writes them: measured, 27 to 30 in a search of 3 trials;
    2 to 11 before the hook woke the watch at each of the leader's calls)."""
    assert 0 in exits, f"the leader recorded no exit: {exits}"
    leader = exits[0]
    assert leader["calls"]["neps.run"] == 1, leader
    assert leader["calls"]["NePSState.create_or_load"] >= 1, leader
    assert leader["root_access"]["count"] > 0, leader
    assert leader["root_access"]["fd_count"] > 0, leader


def evaluated(result: Result, trial_id: str) -> list[dict[str, Any]]:
    """Every rank's "trial" record of ``trial_id`` in this launch."""
    return [e for e in result.of("trial") if e["trial_id"] == trial_id]


def first_fault(launch: Result) -> float:
    """The time of the launch's first fault record (a test whose fault never fired
    tested nothing: it fails here)."""
    faults = launch.of("fault")
    assert faults, f"no fault fired: the test did not test; logs:\n{launch.tail()}"
    return min(e["t"] for e in faults)


def reports(root: Path) -> dict[int, tuple[str, str, str]]:
    """trial number -> (state, reported_as, error text) as NePS recorded it."""

    def state(trial: Any) -> str:
        s = trial.metadata.state
        return str(getattr(s, "value", s))

    return {
        int(tid): (
            state(t),
            t.report.reported_as if t.report else "",
            str(t.report.err) if t.report and t.report.err else "",
        )
        for tid, t in neps_trials(root).items()
    }


@dataclass
class Rerun:
    """A launch that was interrupted, NePS's states after it, and the same command again."""

    first: Result
    after_first: dict[str, str]
    again: Result


class RerunChecks(CleanLaunch):
    """The rerun (``launch``) is a clean launch; the first launch left nothing alive."""

    @pytest.fixture(scope="class")
    def launch(self, rerun: Rerun) -> Result:
        return rerun.again

    def test_the_first_launch_left_no_process(self, rerun: Rerun) -> None:
        assert_nothing_left(rerun.first)
