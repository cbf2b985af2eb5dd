"""An outsider of another uid attacking a real search, for the end-to-end security tests.

``Attack`` runs one search under attack, in this order: the outsider
(tests/scripts/attacker_outsider.py) becomes ``nobody`` and plants its files; then the
search is launched (``python``, torchrun, or an sbatch job whose srun starts the ranks);
while it runs, a spotter thread here, as root, finds the stores of the launch (the
``LISTEN`` sockets of its processes in /proc/net/tcp that are the launcher's rendezvous
store, on ``MASTER_PORT``, or the leader's store, whose port the leader logs) and lists
them for the outsider; once the last process of the launch is gone, the outsider is told
to stop and reports what it did.

The outsider is started as root and drops to ``nobody`` (no groups, no capabilities)
before its first read, plant or byte sent: so it can load Python and torch from a checkout
that only root can enter (``git clone . "$(mktemp -d)"``), and every step of the attack is
another uid's. ``assert_the_outsider_attacked_from_before_the_start`` asserts the drop
took.

Precondition: the suite runs as root on a host with a ``nobody`` user and a ``nogroup``
group. Without it the tests fail (they never skip): an
attacker of the same uid proves nothing.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import launches
from harness import MARKER, PYTHON, SCRIPTS, base_env, kind_of, marked_pids, neps_trials
from neps_bcast.compat import procfs
from neps_bcast.transport import sockets

OUTSIDER_SCRIPT = SCRIPTS / "attacker_outsider.py"
SEARCH_SCRIPT = SCRIPTS / "attacker_search.py"
TRIALS = 3
FAILING_TRIAL = "2"
SECRET = "3c9a1f7e5b2d8c4a6e0f9b3d7a1c5e8f2b6d0a4c9e3f7b1d5a8c2e6f0b4d9a3c"
"""The NEPS_BCAST_SECRET of the searches run with one (the same for every one of them)."""
LEADER_STORE = re.compile(r"serving the control store on port (\d+)")


def require_another_user() -> tuple[int, int]:
    """The uid and gid the outsider runs as; fails (never skips) when it cannot."""
    assert os.geteuid() == 0, (
        "the security tests start their attacker as another user (nobody), which"
        " needs root: run the suite as root (as `make test` does on the test machine)"
    )
    try:
        return pwd.getpwnam("nobody").pw_uid, grp.getgrnam("nogroup").gr_gid
    except KeyError as exc:
        raise AssertionError(f"no user nobody or group nogroup on this host: {exc}") from None


@dataclass
class Arena:
    """Folders the outsider can reach: its own, and the launch's temporary folder (TMPDIR,
    mode 1777 like /tmp, where a one-host launch keeps its private folder)."""

    base: Path
    uid: int
    gid: int

    @classmethod
    @contextmanager
    def made(cls) -> Iterator[Arena]:
        uid, gid = require_another_user()
        base = Path(tempfile.mkdtemp(prefix="neps_bcast_arena_"))
        base.chmod(0o755)
        arena = cls(base, uid, gid)
        arena.work.mkdir()
        os.chown(arena.work, uid, gid)
        arena.tmp.mkdir()
        arena.tmp.chmod(0o1777)
        try:
            yield arena
        finally:
            shutil.rmtree(base, ignore_errors=True)

    @property
    def work(self) -> Path:
        return self.base / "outsider"

    @property
    def tmp(self) -> Path:
        return self.base / "tmp"

    @property
    def marker(self) -> Path:
        return self.base / "PWNED"

    @property
    def targets(self) -> Path:
        return self.base / "targets.json"

    @property
    def private_dir(self) -> Path:
        """Where a one-host launch with TMPDIR=tmp keeps its secret (root's uid)."""
        return self.tmp / f"neps_bcast-{os.geteuid()}"


class Outsider:
    """The attacker process, as ``nobody``."""

    def __init__(self, arena: Arena, name: str, *options: str) -> None:
        self.arena = arena
        self.name = name
        self.ready = arena.work / f"{name}.ready"
        self.stop_file = arena.work / f"{name}.stop"
        self.recording = arena.work / f"{name}.recorded.json"
        cmd = [
            PYTHON,
            str(OUTSIDER_SCRIPT),
            "--as",
            f"{arena.uid}:{arena.gid}",
            "--work",
            str(arena.work),
            "--targets",
            str(arena.targets),
            "--marker",
            str(arena.marker),
            "--ready",
            str(self.ready),
            "--stop",
            str(self.stop_file),
            "--record",
            str(self.recording),
            *options,
        ]
        env = base_env(HOME=str(arena.work))
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        deadline = time.monotonic() + 120
        while not self.ready.exists():
            assert self.proc.poll() is None, f"the outsider died: {self.proc.communicate()}"
            assert time.monotonic() < deadline, "the outsider never got ready"
            time.sleep(0.05)  # a bounded wait for its imports and plants

    def stop(self) -> dict[str, Any]:
        self.stop_file.touch()
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, f"the outsider failed:\n{err[-3000:]}"
        report: dict[str, Any] = json.loads(out)
        return report

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


class Spotter(threading.Thread):
    """Lists the launch's stores for the outsider while it runs (as root: /proc)."""

    def __init__(self, marker: str, log_dir: Path, targets: Path) -> None:
        super().__init__(daemon=True, name="spotter")
        self.marker = marker
        self.log_dir = log_dir
        self.targets = targets
        self.found: dict[int, str] = {}
        """port -> what it is (the launcher's store, the leader's store)."""
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.05):  # a bounded poll of /proc and the logs
            self.spot()

    def spot(self) -> None:
        pids = marked_pids(self.marker)
        wanted: dict[int, str] = {}
        for pid in pids:
            env = procfs.environ(pid)
            if env.get("MASTER_PORT", "").isdigit():
                wanted[int(env["MASTER_PORT"])] = "launcher's rendezvous store"
            if "NEPS_BCAST_LEADER" in env:
                wanted[int(env["NEPS_BCAST_LEADER"].rpartition(":")[2])] = "leader's store"
        for log in self.log_dir.glob("*.log"):
            for port in LEADER_STORE.findall(log.read_text(errors="replace")):
                wanted[int(port)] = "leader's store"
        table = sockets.tcp_table()
        listening = {
            port for pid in pids for _, port in sockets.listening(table, sockets.socket_inodes(pid))
        }
        fresh = {p: what for p, what in wanted.items() if p in listening and p not in self.found}
        if fresh:
            self.found.update(fresh)
            partial = self.targets.with_suffix(".partial")
            partial.write_text(json.dumps([f"127.0.0.1:{p}" for p in sorted(self.found)]))
            partial.chmod(0o644)
            partial.rename(self.targets)


@dataclass
class Launched:
    """One finished launch: exit code, every process's records and logs."""

    returncode: int
    events: list[dict[str, Any]]
    logs: str
    left_alive: list[int]
    root: Path
    stores: dict[int, str] = field(default_factory=dict)
    """What the spotter found: port -> which store."""

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.logs.splitlines()[-n:])


def read_events(folder: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(folder.glob("*.jsonl")):
        events += [json.loads(line) for line in path.read_text().splitlines() if line]
    return sorted(events, key=lambda e: e["t"])


@dataclass
class Attack:
    """One search under attack: the arena, the folder of this launch, the outsider's options."""

    arena: Arena
    folder: Path
    secret: str | None
    outsider_options: tuple[str, ...] = ()
    launched: Launched | None = None
    report: dict[str, Any] = field(default_factory=dict)
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def log_dir(self) -> Path:
        return self.folder / "logs"

    @property
    def record_dir(self) -> Path:
        return self.folder / "records"

    @property
    def root(self) -> Path:
        return self.folder / "root"

    def env(self) -> dict[str, str]:
        env = base_env(
            NB_RECORD_DIR=str(self.record_dir),
            NB_LOG_DIR=str(self.log_dir),
            NB_ROOT=str(self.root),
            TMPDIR=str(self.arena.tmp),
            NEPS_BCAST_JOIN_TIMEOUT_S="60",
        )
        env.pop("XDG_RUNTIME_DIR", None)
        if self.secret is not None:
            env["NEPS_BCAST_SECRET"] = self.secret
        env[MARKER] = self.marker
        return env

    def run(self, start: Callable[[Attack], Callable[[], int]]) -> Attack:
        """Start the outsider, then the launch (``start`` starts it and returns how to wait
        for its exit code), then wait for both, in that order."""
        self.folder.mkdir(parents=True)
        self.log_dir.mkdir()
        self.record_dir.mkdir()
        self.arena.targets.unlink(missing_ok=True)
        outsider = Outsider(self.arena, self.folder.name, *self.outsider_options)
        spotter = Spotter(self.marker, self.log_dir, self.arena.targets)
        try:
            spotter.start()
            returncode = start(self)()
            deadline = time.monotonic() + 30
            left = marked_pids(self.marker)
            while left and time.monotonic() < deadline:
                time.sleep(0.05)  # a bounded wait for the last processes to finish exiting
                left = marked_pids(self.marker)
            for pid in left:
                procfs.kill(pid)
            spotter.done.set()
            spotter.join(timeout=10)
            self.report = outsider.stop()  # after the last process of the launch exited
        finally:
            spotter.done.set()
            outsider.kill()
            for pid in marked_pids(self.marker):
                procfs.kill(pid)
        logs = "\n".join(
            f"--- {p.name} ---\n{p.read_text(errors='replace')}"
            for p in sorted(self.log_dir.glob("*"))
        )
        events = read_events(self.record_dir)
        self.launched = Launched(returncode, events, logs, left, self.root, dict(spotter.found))
        return self

    @property
    def result(self) -> Launched:
        assert self.launched is not None
        return self.launched


def popen(cmd: list[str], timeout: float = 300.0) -> Callable[[Attack], Callable[[], int]]:
    """Start ``cmd`` in the launch's folder, in a session of its own (bounded by ``timeout``)."""

    def start(attack: Attack) -> Callable[[], int]:
        out = (attack.log_dir / "launcher.out").open("wb")
        launches.count(kind_of(cmd))
        proc = subprocess.Popen(
            cmd,
            cwd=attack.folder,
            env=attack.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

        def wait() -> int:
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for pid in [proc.pid, *marked_pids(attack.marker)]:
                    procfs.kill(pid, signal.SIGKILL)
                proc.wait()
                logs = "\n".join(
                    p.read_text(errors="replace")[-3000:] for p in attack.log_dir.glob("*")
                )
                raise AssertionError(f"{cmd} overran {timeout} s; killed; logs:\n{logs}") from None
            finally:
                out.close()

        return wait

    return start


# -- what each attacked search must show ------------------------------------------------


def assert_the_outsider_attacked_from_before_the_start(attack: Attack) -> None:
    report = attack.report
    assert report["uid"] == attack.arena.uid != os.geteuid(), report
    uid, gid = attack.arena.uid, attack.arena.gid
    assert report["became"] == {
        "uids": [uid, uid, uid],
        "gids": [gid, gid, gid],
        "groups": [],
        "regained_root": False,
        "capabilities": {"CapPrm": 0, "CapEff": 0},
    }, report["became"]
    # It was running (rounds without a target) before any store of the launch existed.
    assert report["rounds_before_a_target"] > 0, report


def assert_it_reached_both_stores(attack: Attack) -> None:
    """The positive control of "nothing ran": its writes reached the launcher's store and
    the leader's store (or, replaying, its replays did)."""
    stores = attack.result.stores
    kinds = sorted(set(stores.values()))
    assert kinds == ["launcher's rendezvous store", "leader's store"], stores
    if "--replay" in attack.outsider_options:
        assert attack.report["replays"] > 0, attack.report
        return
    written = {int(a.rpartition(":")[2]): n for a, n in attack.report["writes"].items()}
    assert all(written.get(port, 0) > 0 for port in stores), (written, stores)
    assert any(k.startswith("neps_bcast/rank/") for k in attack.report["keys_seen"]), attack.report


def assert_no_pickle_of_the_outsider_ran(attack: Attack) -> None:
    assert not attack.arena.marker.exists(), "an outsider's pickle ran in a rank"


def assert_nothing_left_running(attack: Attack) -> None:
    assert attack.result.left_alive == [], attack.result.tail()


def assert_completed_with_every_real_result(attack: Attack) -> None:
    result = attack.result
    assert result.returncode == 0, result.tail()
    exits = result.of("exit")
    assert exits and all(e["code"] == 0 for e in exits), (exits, result.tail())
    trials = neps_trials(result.root)
    assert len(trials) == TRIALS, result.tail()
    returned = {e["trial_id"]: e["result"] for e in result.of("trial") if e["rank"] == 0}
    for trial_id, trial in trials.items():
        assert trial.report is not None, trial_id
        if trial_id == FAILING_TRIAL:
            assert trial.report.reported_as == "crashed", trial
            assert "injected failure on rank 1" in str(trial.report.err), trial.report.err
        else:
            assert trial.report.reported_as == "success", (trial_id, trial.report.err)
            assert trial.report.objective_to_minimize == returned[trial_id], (trial_id, returned)
    # Both ranks evaluated every trial that did not fail, with the same configuration.
    by_trial: dict[str, list[dict[str, Any]]] = {}
    for e in result.of("trial"):
        by_trial.setdefault(e["trial_id"], []).append(e)
    for trial_id, seen in by_trial.items():
        assert sorted(e["rank"] for e in seen) == [0, 1], (trial_id, seen)
        assert seen[0]["config"] == seen[1]["config"]


def assert_a_rank_refused_a_forged_value(attack: Attack) -> None:
    """The forged (or replayed) values reached a rank, which refused them, naming the key."""
    assert "refused the value under 'neps_bcast/" in attack.result.logs, attack.result.tail()


def assert_stopped_before_trial_1(attack: Attack, refused: str) -> None:
    result = attack.result
    assert result.returncode != 0, result.tail()
    assert result.of("trial") == [], "a trial ran"
    exits = result.of("exit")
    assert len(exits) == 2 and all(e["code"] == 1 for e in exits), (exits, result.tail())
    for e in exits:
        assert refused in str(e["error"]), e
    assert not result.root.exists() or not neps_trials(result.root)


def the_bomb_creates_the_marker(arena: Arena) -> bool:
    """The positive control of "no pickle ran": the outsider's pickle, unpickled here in a
    separate process, does create the marker."""
    marker = arena.marker
    code = (
        "import pickle, sys; sys.path.insert(0, sys.argv[2]);"
        " pickle.loads(open(sys.argv[1], 'rb').read())"
    )
    subprocess.run(
        [PYTHON, "-c", code, str(arena.work / "bomb.pickle"), str(SCRIPTS)],
        check=True,
        timeout=60,
    )
    made = marker.exists()
    marker.unlink(missing_ok=True)
    return made
