"""`neps-bcast launch` end to end: real launcher, real torchrun, real Lightning ddp on gloo.

Each test launches ``tests/scripts/launch_search.py`` as a user would
(``neps-bcast launch --groups 2 --nproc-per-group 2 SCRIPT``), with the NePS root, the
rank logs and the per-process records under ``tmp_path``. Every process of a launch
inherits a marker (``NB_LAUNCH_MARKER``): that is how a test finds what is left.
Bounds: the launch's deadline (150 s) < pytest's timeout (600 s).
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import FAKE_SRUN, MARKER, PYTHON, base_env, default_sigint, marked_pids, neps_trials
from neps_bcast.compat import procfs
from neps_bcast.transport import sockets

SCRIPT = Path(__file__).parent / "scripts" / "launch_search.py"
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

    def gone_within(self, seconds: float) -> float:
        """Seconds until no process of the launch is left (fails after ``seconds``)."""
        start = time.monotonic()
        while marked_pids(self.marker) and time.monotonic() - start < seconds:
            time.sleep(0.05)  # bounded wait for processes to finish exiting
        left = marked_pids(self.marker)
        if left:
            self.kill_all()
            raise AssertionError(f"processes {left} still alive; logs:\n{self.tails()}")
        return time.monotonic() - start


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


def taken(port: int) -> bool:
    """Does some process (this one or another) listen on ``port``?"""
    table = sockets.tcp_table()
    return any(s.state == sockets.LISTEN and s.local[1] == port for s in table.values())


@contextmanager
def listening_on(ports: range) -> Iterator[list[int]]:
    """Servers on torch's default port and its neighbours: ours, or another process's
    (a second copy of the suite holds them too); yields the ports that are taken."""
    with ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue  # already taken by someone else: just as good for this test
            sock.listen()
        yield [port for port in ports if taken(port)]


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


@pytest.mark.timeout(300)
def test_two_groups_share_one_search_while_default_ports_are_taken(tmp_path: Path) -> None:
    with listening_on(range(29500, 29506)) as held:
        run = launch(tmp_path, "--devices", "0-3", trials=6)
        rc = run.finish()
    assert held == list(range(29500, 29506)), f"only {held} were taken: the test tested less"
    assert rc == 0, run.tails()
    run.gone_within(15)
    events = run.events()
    owner = assert_each_trial_in_one_group(events)
    recorded = states(run.root)
    assert len(recorded) >= 6
    assert set(recorded) == set(owner), (recorded, owner)
    assert set(recorded.values()) == {"success"}, recorded
    # Every rank of both groups started, on its own slice of the devices given.
    starts = {(e["group"], e["rank"]): e["cuda_visible"] for e in events if e["event"] == "start"}
    assert starts == {("0", 0): "0,1", ("0", 1): "0,1", ("1", 0): "2,3", ("1", 1): "2,3"}
    exits = {e["pid"]: e["code"] for e in events if e["event"] == "exit"}
    assert exits == dict.fromkeys({e["pid"] for e in events if e["event"] == "start"}, 0)
    # One log per rank, and a status line per group on the launcher's output.
    for group in ("group0", "group1"):
        for rank in ("rank0", "rank1"):
            assert "attempt 0" in (run.logs / group / f"{rank}.log").read_text()
    out = run.output()
    assert "group 0 [0,1]: finished" in out and "group 1 [2,3]: finished" in out, out
    finished = sum(
        int(line.rsplit("finished ", 1)[1].split()[0])
        for line in out.splitlines()[-2:]
        if line.startswith("group ")
    )
    assert finished == len(recorded), out


@pytest.mark.timeout(300)
def test_one_launcher_per_node_under_srun_share_one_search(tmp_path: Path) -> None:
    """`srun --ntasks-per-node=1 neps-bcast launch --groups 1 ...` on two nodes, simulated:
    two SLURM tasks on this host (tests/scripts/fake_srun.py sets SLURM's variables), each
    a launcher of one group of 2 ranks, on one NePS root and one --log-dir."""
    meet = tmp_path / "meet"
    meet.mkdir()
    run = launch(
        tmp_path,
        trials=6,
        groups=1,
        prefix=(PYTHON, str(FAKE_SRUN), "--ntasks", "2", "--"),
        LAUNCH_MEET=f"{meet},2",  # both nodes in their first trial before either goes on
    )
    rc = run.finish()
    assert rc == 0, run.tails()
    run.gone_within(15)
    events = run.events()
    launches = sorted({e["launch"] for e in events if e["event"] == "start"})
    assert len(launches) == 2, f"want one launcher per task, got {launches}:\n{run.tails()}"
    # One group per launcher: the (launcher, group) pair is the DDP group.
    by_node = [{**e, "group": f"{launches.index(e['launch'])}/{e['group']}"} for e in events]
    owner = assert_each_trial_in_one_group(by_node)
    assert set(owner.values()) == {"0/0", "1/0"}, f"a node evaluated nothing: {owner}"
    assert {e["launches"] for e in events if e["event"] == "met"} == {2}, run.tails()
    recorded = states(run.root)
    assert len(recorded) >= 6
    assert set(recorded) == set(owner), (recorded, owner)
    assert set(recorded.values()) == {"success"}, recorded
    # The groups are torchrun launches: no rank saw the node's SLURM task variables.
    starts = [e for e in by_node if e["event"] == "start"]
    assert {(e["group"], e["rank"]) for e in starts} == {
        ("0/0", 0),
        ("0/0", 1),
        ("1/0", 0),
        ("1/0", 1),
    }
    assert {e["slurm_procid"] for e in starts} == {None}
    # Each task keeps its own logs under the shared --log-dir.
    for task in ("task0", "task1"):
        for rank in ("rank0", "rank1"):
            assert "attempt 0" in (run.logs / task / "group0" / f"{rank}.log").read_text()


@pytest.mark.timeout(300)
def test_a_sigkilled_rank_restarts_its_group_while_the_other_goes_on(tmp_path: Path) -> None:
    flag = tmp_path / "killed"
    # Rank 1 of group 1 SIGKILLs itself in its first trial; group 0's trials wait until
    # group 1 is back (a file its restarted ranks create), so both evaluate afterwards.
    run = launch(
        tmp_path,
        "--max-restarts",
        "1",
        trials=8,
        LAUNCH_KILL=f"1,1,1,{flag}",
        LAUNCH_RESTARTED=str(tmp_path / "restarted"),
        LAUNCH_WAIT_RESTART="0",
    )
    rc = run.finish()
    assert rc == 0, run.tails()
    run.gone_within(15)
    events = run.events()
    kills = [e for e in events if e["event"] == "kill"]
    assert len(kills) == 1, run.tails()
    killed_at = kills[0]["t"]
    assert all(e["restarted"] for e in events if e["event"] == "waited"), run.tails()
    # Group 1 restarted: its ranks ran again, in new processes.
    restarted = [e for e in events if e["group"] == "1" and e["restart"] == 1]
    assert {e["rank"] for e in restarted if e["event"] == "start"} == {0, 1}, run.tails()
    # Group 0 never stopped: one process per rank from start to end, never restarted,
    # and it kept evaluating trials after the kill.
    group0 = [e for e in events if e["group"] == "0"]
    assert {e["restart"] for e in group0} == {0}
    assert len({e["pid"] for e in group0}) == 2
    assert {e["rank"] for e in group0 if e["event"] == "exit" and e["code"] == 0} == {0, 1}
    # Each trial in one group (the interrupted one aside: NePS may hand it out again);
    # NePS holds every trial once, none left evaluating, and the budget was reached.
    interrupted = kills_trial(events)
    owner = assert_each_trial_in_one_group(
        [e for e in events if e["event"] != "trial" or e["trial_id"] != interrupted]
    )
    recorded = states(run.root)
    assert interrupted in recorded, recorded
    assert "evaluating" not in recorded.values() and "pending" not in recorded.values(), recorded
    assert set(owner) <= set(recorded)
    assert sum(state in ("success", "crashed") for state in recorded.values()) >= 8, recorded
    after_restart = [e for e in restarted if e["event"] == "trial"]
    assert after_restart, f"group 1 never evaluated a trial after its restart:\n{run.tails()}"
    assert any(e["event"] == "trial" and e["t"] > killed_at for e in group0), (
        "group 0 evaluated nothing after the kill (positive control for 'never stopped')"
    )
    first_start = min(e["t"] for e in restarted if e["event"] == "start")
    first_trial = min(e["t"] for e in restarted if e["event"] == "trial")
    print(
        f"kill -> restarted ranks start: {first_start - killed_at:.1f} s;"
        f" -> first trial after restart: {first_trial - killed_at:.1f} s"
    )


def kills_trial(events: list[dict[str, Any]]) -> str:
    """The trial the killed rank was in (its group's leader's trial at that seq)."""
    kill = next(e for e in events if e["event"] == "kill")
    return next(
        e["trial_id"]
        for e in events
        if e["event"] == "trial" and e["pid"] == kill["pid"] and e["seq"] == kill["seq"]
    )


@pytest.mark.timeout(300)
def test_ctrl_c_stops_every_group_and_leaves_no_trial_evaluating(tmp_path: Path) -> None:
    run = launch(tmp_path, trials=6, LAUNCH_HOLD_S="90")
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
    run.gone_within(30)
    gone = time.monotonic() - sent
    print(
        f"Ctrl-C -> launcher exited ({rc}) after {exited:.1f} s; every process gone after {gone:.1f} s"
    )
    assert gone < 30
    assert rc == 128 + signal.SIGINT, run.tails()
    assert "SIGINT received: stopping every group" in run.output()
    recorded = states(run.root)
    assert recorded, "NePS recorded nothing"
    assert "evaluating" not in recorded.values(), (recorded, run.tails())
    held = {e["trial_id"] for e in run.of("trial")}
    assert held <= set(recorded)


BAD = [
    (
        ["--groups", "2", "--nproc-per-group", "0"],
        r"--nproc-per-group 0: .*HINT: pass --nproc-per-group 1 or more",
    ),
    (["--groups", "0", "--nproc-per-group", "2"], r"--groups 0: .*HINT: pass --groups 1 or more"),
    (
        ["--groups", "2", "--nproc-per-group", "2", "--devices", "0,1,2"],
        r"= 4 ranks, but there are only 3 devices \(0,1,2\).*HINT: lower --groups or --nproc-per-group",
    ),
    (
        ["--groups", "2", "--nproc-per-group", "1", "--devices", "0,1,1"],
        r"lists device 1 twice.*HINT: list every device once",
    ),
]


@pytest.mark.parametrize(("args", "message"), BAD)
def test_bad_arguments_fail_before_any_process_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    check_refused(tmp_path, [*args, str(SCRIPT)], message)


def test_a_missing_script_fails_before_any_process_starts(tmp_path: Path) -> None:
    check_refused(
        tmp_path,
        ["--groups", "2", "--nproc-per-group", "2", "nothere.py"],
        r"the script 'nothere.py' does not exist \(relative to .*\)\. HINT: pass the path of the Python script",
    )


def check_refused(tmp_path: Path, args: list[str], message: str) -> None:
    marker = uuid.uuid4().hex
    env = base_env(LAUNCH_RECORD_DIR=str(tmp_path), LAUNCH_ROOT=str(tmp_path / "root"))
    env[MARKER] = marker
    done = subprocess.run(
        [NEPS_BCAST, "launch", "--log-dir", str(tmp_path / "logs"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert re.search(r"^\[neps_bcast launch\] .*" + message, done.stderr, re.MULTILINE), done.stderr
    # Nothing started: no log folder, no record of any rank, no process of the launch.
    assert not (tmp_path / "logs").exists()
    assert not list(tmp_path.glob("*.jsonl"))
    assert not marked_pids(marker)
