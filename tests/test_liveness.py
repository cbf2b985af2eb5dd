"""Liveness without sockets closing: the heartbeat through the leader's store
(``neps_bcast.transport.liveness``), on a real TCPStore, with real frozen processes.

A frozen process (SIGSTOP) is what a hung node looks like to its peers: its sockets stay
open and its kernel still answers, but nothing more comes. Bounds: the peer bound here
(``BOUND``, 1 s) < each wait for a verdict (``WAIT``) < pytest's timeout.
"""

from __future__ import annotations

import datetime
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed

from neps_bcast.compat import procfs
from neps_bcast.compat.torch import TCPStore
from neps_bcast.config import Settings
from neps_bcast.launcher.search_status import TrialStatus
from neps_bcast.launcher.search_text import _heartbeat as render_heartbeat
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.lease_file import read_lease
from neps_bcast.transport import liveness, sockets, store
from neps_bcast.transport.auth import Signer, new_secret
from verdicts import WAIT, Verdicts, store_process, wait_until

BOUND = 1.0
PYTHON = sys.executable


@pytest.fixture
def leader_store() -> TCPStore:
    return store.serve(datetime.timedelta(seconds=30), loopback=True)


@pytest.fixture
def frozen_leader() -> Iterator[subprocess.Popen[str]]:
    """A process serving a store, as a leader does; the test freezes it."""
    with store_process() as proc:
        yield proc


def test_a_follower_finds_its_frozen_leader_silent_within_the_bound(
    frozen_leader: subprocess.Popen[str], capfd: pytest.CaptureFixture[str]
) -> None:
    assert frozen_leader.stdout is not None
    port = int(frozen_leader.stdout.readline())
    signer = Signer(new_secret())
    verdicts = Verdicts[liveness.Silence]()
    beat = liveness.LeaderBeat(
        f"127.0.0.1:{port}", 1, signer, BOUND, verdicts, lambda: ("here", frozen_leader.pid)
    )
    try:
        client = store.connect(f"127.0.0.1:{port}", datetime.timedelta(seconds=WAIT), WAIT)
        # Positive control: while the leader runs, the beats get through and none is late.
        wait_until(lambda: _count(client, signer, 1) >= 5, "five beats answered")
        assert verdicts.seen == []
        # This rank just met its leader, which froze before a beat told of the meeting.
        liveness.leader_reached("in a meeting of the ranks of trial 3 (#3)")
        frozen_leader.send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        assert verdicts.event.wait(WAIT)
        took = time.monotonic() - frozen
        logged = capfd.readouterr().err
    finally:
        beat.stop()
        liveness.forget()
    # The verdict comes first: a beat's own wait on the frozen leader does not end by
    # torch's timeout (its warning, "... timed out after N ms"), as one of a single peer
    # bound did in the sweep's frozen-leader cells when the leader froze between a beat's
    # write and its read (rarely so here: the freeze lands anywhere in the beat's cycle).
    assert "timed out" not in logged, logged
    assert beat._client.timeout >= datetime.timedelta(seconds=2 * BOUND)
    (silence,) = verdicts.seen
    assert silence.group_rank == 0
    assert silence.doing == "in a meeting of the ranks of trial 3 (#3)"
    assert took > BOUND


class TimingOut:
    """A store client whose every operation gives up waiting, as torch's does on a
    silent leader (its message, for a ``get``)."""

    def __getattr__(self, name: str) -> Callable[..., object]:
        def wait(*_: object, **__: object) -> object:
            raise torch.distributed.DistStoreError("wait timeout after 300ms, keys: /beat/0")

        return wait


def test_a_beat_whose_wait_times_out_still_leaves_the_verdict_to_the_judge(
    frozen_leader: subprocess.Popen[str],
) -> None:
    """A beat's store wait on a silent leader can end by its timeout before the judge
    rules (the kernel's TCP_USER_TIMEOUT at 1.5 bounds, or the store's backstop, when the
    judge was starved): that wait is the silence, so the leader is still named once the
    bound has passed. Before, the beat thread ended as if answered and no verdict came.
    The leader is frozen too: a timed-out beat is tried again on a fresh connection, and
    a leader that answers that one is no longer silent."""
    assert frozen_leader.stdout is not None
    port = int(frozen_leader.stdout.readline())
    verdicts = Verdicts[liveness.Silence]()
    beat = liveness.LeaderBeat(
        f"127.0.0.1:{port}",
        1,
        Signer(new_secret()),
        BOUND,
        verdicts,
        lambda: ("here", frozen_leader.pid),
    )
    try:
        timing_out = time.monotonic()
        beat._client = TimingOut()  # type: ignore[assignment]
        frozen_leader.send_signal(signal.SIGSTOP)
        assert verdicts.event.wait(WAIT), "no verdict on a leader whose waits time out"
        took = time.monotonic() - timing_out
    finally:
        beat.stop()
        liveness.forget()
        # Its retry's fresh connection waits on the frozen leader: the leader resumed,
        # it ends, before the leader is killed (a store client still connecting to a
        # leader gone as the interpreter exits aborts it).
        frozen_leader.send_signal(signal.SIGCONT)
        beat._beat_thread.join(WAIT)
    assert not beat._beat_thread.is_alive()
    (silence,) = verdicts.seen
    assert silence.group_rank == 0
    # The judge ruled once the bound had passed, not at the wait's own end (at once).
    assert took > BOUND


def test_only_a_wait_that_ran_out_counts_as_silence() -> None:
    """A closed or refused connection is no silence: the leader is gone, and the watch of
    the control channel says so (the beat names nobody)."""
    assert not liveness._timed_out(ConnectionResetError("Connection reset by peer"))
    assert liveness._timed_out(TimeoutError())
    assert liveness._timed_out(OSError("Connection timed out"))
    assert liveness._timed_out(torch.distributed.DistStoreError("wait timeout after 300ms"))


@pytest.mark.parametrize(
    ("heard", "proven", "named"),
    [
        # Nothing proven: the last beat heard.
        ("evaluating trial 2 (#2)", None, "evaluating trial 2 (#2)"),
        # The beat heard lags what this rank's own steps prove: the proof.
        (
            "handing trial 2 (#2) over",
            "in a meeting of the ranks of trial 2 (#2)",
            "in a meeting of the ranks of trial 2 (#2)",
        ),
        ("evaluating trial 1 (#1)", "handing trial 2 (#2) over", "handing trial 2 (#2) over"),
        ("starting", "handing trial 1 (#1) over", "handing trial 1 (#1) over"),
        (
            "unknown",
            "in a meeting of the ranks of trial 1 (#1)",
            "in a meeting of the ranks of trial 1 (#1)",
        ),
        # The beat heard is as late or later: the beat.
        (
            "evaluating trial 2 (#2)",
            "in a meeting of the ranks of trial 2 (#2)",
            "evaluating trial 2 (#2)",
        ),
        (
            "handing trial 3 (#3) over",
            "in a meeting of the ranks of trial 2 (#2)",
            "handing trial 3 (#3) over",
        ),
        (
            "stopping its followers",
            "in a meeting of the ranks of trial 4 (#4)",
            "stopping its followers",
        ),
    ],
)
def test_a_silent_leader_is_named_at_the_latest_step_it_is_known_to_have_reached(
    heard: str, proven: str | None, named: str
) -> None:
    try:
        if proven is not None:
            liveness.leader_reached(proven)
        assert liveness.leader_step(heard) == named
    finally:
        liveness.forget()


def test_the_leader_finds_a_follower_whose_beats_stopped_silent_and_names_its_step(
    leader_store: TCPStore,
) -> None:
    signer = Signer(new_secret())
    verdicts = Verdicts[liveness.Silence]()
    address = f"127.0.0.1:{leader_store.port}"
    monitor = liveness.Monitor(address, 2, signer, BOUND, verdicts, lambda r: ("h1", 4242))
    liveness.doing("evaluating trial 7 (#2)")
    beat = liveness.LeaderBeat(
        address, 1, signer, BOUND, Verdicts[liveness.Silence](), lambda: ("h0", 1)
    )
    try:
        wait_until(lambda: monitor.beats_seen(1) >= 5, "five beats of rank 1")
        assert verdicts.seen == []
        beat.stop()  # what a frozen follower does: nothing more
        assert verdicts.event.wait(WAIT)
    finally:
        monitor.stop()
    (silence,) = verdicts.seen
    assert (silence.group_rank, silence.host, silence.pid) == (1, "h1", 4242)
    assert silence.doing == "evaluating trial 7 (#2)"
    assert silence.address == "127.0.0.1"
    assert "rank 1 (pid 4242 on host h1) silent for" in silence.describe()


def test_a_forged_or_replayed_beat_keeps_no_silent_follower_alive(
    leader_store: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    signer = Signer(new_secret())
    verdicts = Verdicts[liveness.Silence]()
    address = f"127.0.0.1:{leader_store.port}"
    monitor = liveness.Monitor(address, 2, signer, BOUND, verdicts, lambda r: ("h1", None))
    outsider = store.connect(address, datetime.timedelta(seconds=WAIT), WAIT)
    record = json.dumps({"n": 1, "doing": "x", "addr": None}).encode()
    store.put(outsider, signer, liveness.beat_key(1), record, sender=1)
    try:
        wait_until(lambda: monitor.beats_seen(1) == 1, "the first beat")
        stop = threading.Event()

        def replay_and_forge() -> None:
            while not stop.wait(BOUND / 20):
                # the same (authentic) record again, and one no secret signed
                store.put(outsider, signer, liveness.beat_key(1), record, sender=1)
                outsider.set(liveness.beat_key(1), b'{"n": 99}')

        attacker = threading.Thread(target=replay_and_forge, daemon=True)
        attacker.start()
        assert verdicts.event.wait(WAIT)
        stop.set()
        attacker.join(WAIT)
    finally:
        monitor.stop()
    assert verdicts.seen[0].group_rank == 1
    assert "refused a beat of rank 1" in caplog.text


HELD_BOUND = 2.0
"""The peer bound of the tests that hold or freeze a rank for part of a bound: 2 s, so that
a beat delayed by a loaded machine's scheduling (a few tenths of a second) stays far from it."""

GIL_HOLDER = """
import ctypes, sys
from neps_bcast.transport import liveness
from neps_bcast.transport.auth import Signer
address, bound = sys.argv[1], float(sys.argv[2])
secret = bytes.fromhex(sys.stdin.readline())
said = lambda s: print("silent", s.group_rank, flush=True)
beat = liveness.LeaderBeat(address, 1, Signer(secret), bound, said, lambda: ("h0", None))
liveness.doing("evaluating trial 4 (#4)")
libc = ctypes.PyDLL(None)  # PyDLL: the call keeps the GIL, as a long C call does
print("ready", flush=True)
for line in sys.stdin:
    assert libc.usleep(int(float(line) * 1_000_000)) == 0  # one C call: the hold
    print("held", flush=True)
"""


def test_a_main_thread_that_holds_the_gil_for_half_the_bound_is_never_silent(
    leader_store: TCPStore,
) -> None:
    """The judge (the leader's monitor, here) runs freely in one process; the follower's
    beat runs in another, whose main thread holds that process's GIL in one C call. A
    hold of half the bound, several times, delays its beats by at most that much: no
    verdict. A hold of 1.5 bounds: the judge names the rank (which shows that a hold
    does stop the beats, so the first half could fail)."""
    secret = new_secret()
    signer = Signer(secret)
    verdicts = Verdicts[liveness.Silence]()
    address = f"127.0.0.1:{leader_store.port}"
    proc = subprocess.Popen(
        [PYTHON, "-c", GIL_HOLDER, address, f"{HELD_BOUND:g}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None

    def hold(bounds: float) -> None:
        assert proc.stdin is not None
        proc.stdin.write(f"{bounds * HELD_BOUND}\n")
        proc.stdin.flush()

    monitor: liveness.Monitor | None = None
    try:
        monitor = liveness.Monitor(address, 2, signer, HELD_BOUND, verdicts, lambda r: ("h1", None))
        proc.stdin.write(secret.hex() + "\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ready"
        beats = monitor.beats_seen
        wait_until(lambda: beats(1) >= 3, "the held rank's first beats")
        for _ in range(3):
            hold(0.5)
            assert proc.stdout.readline().strip() == "held"
            after = beats(1)
            # The judge has accepted a beat sent after the hold (or has ruled).
            wait_until(lambda a=after: beats(1) > a or verdicts.event.is_set(), "a beat")
            assert verdicts.seen == []
        hold(1.5)
        assert verdicts.event.wait(WAIT), "no verdict on a rank held for 1.5 bounds"
        assert proc.stdout.readline().strip() == "held"
    finally:
        if monitor is not None:
            monitor.stop()
        proc.kill()
        out, _ = proc.communicate(timeout=WAIT)
    (silence,) = verdicts.seen
    # The rank held, at the step its last beat named.
    assert (silence.group_rank, silence.doing) == (1, "evaluating trial 4 (#4)")
    # The held rank's own judge blamed its leader for nothing: its gap was its own.
    assert "silent" not in out, out


RESUMED_MONITOR = """
import sys, time
from neps_bcast.transport import liveness
from neps_bcast.transport.auth import Signer
address, bound = sys.argv[1], float(sys.argv[2])
secret = bytes.fromhex(sys.stdin.readline())
def said(silence):  # marked: its last beat says so
    liveness.mark(silence, "named")
    print("silent", silence.group_rank, flush=True)
monitor = liveness.Monitor(address, 2, Signer(secret), bound, said, lambda r: ("h1", None))
while monitor.beats_seen(1) < 3:
    time.sleep(0.02)
print("ready", flush=True)
sys.stdin.readline()  # its follower resumed too: let it look at the follower's next beats
n = monitor.beats_seen(1)
while monitor.beats_seen(1) < n + 3 and not liveness.any_silent():
    time.sleep(0.02)
print("done", flush=True)
"""


def test_a_leader_frozen_and_resumed_blames_no_peer_for_its_own_gap(
    leader_store: TCPStore,
) -> None:
    """A monitor counts silence only while its own process ran: a leader frozen for 1.5
    bounds with its follower (a whole host frozen) and resumed a moment before it looks
    at the follower's last beat, as old as the freeze, before the next one comes, and
    blames the follower for nothing. The monitor, the follower's beat and the store each
    run in a process of their own; the follower is resumed only once the monitor has
    beaten twice since its own resumption (it looked at least once in between)."""
    secret = new_secret()
    signer = Signer(secret)
    address = f"127.0.0.1:{leader_store.port}"
    procs = {
        name: subprocess.Popen(
            [PYTHON, "-c", script, address, f"{HELD_BOUND:g}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, script in (("leader", RESUMED_MONITOR), ("follower", GIL_HOLDER))
    }
    leader, follower = procs["leader"], procs["follower"]
    client = store.connect(address, datetime.timedelta(seconds=WAIT), WAIT)
    try:
        for proc in procs.values():
            assert proc.stdin is not None
            proc.stdin.write(secret.hex() + "\n")
            proc.stdin.flush()
        assert follower.stdout is not None
        assert follower.stdout.readline().strip() == "ready"
        assert leader.stdout is not None
        assert leader.stdout.readline().strip() == "ready"  # it has seen the follower beat
        for proc in procs.values():
            proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while time.monotonic() - stopped < 1.5 * HELD_BOUND:
            time.sleep(0.05)  # the fault itself: the host stays frozen this long
        assert procfs.read_stat(leader.pid) is not None
        beaten = _record(client, signer, 0)["n"]
        leader.send_signal(signal.SIGCONT)

        def looked() -> bool:
            record = _record(client, signer, 0)
            return record["n"] >= beaten + 2 or "silent" in record  # its last beat

        wait_until(looked, "the leader's beats since it resumed")
        follower.send_signal(signal.SIGCONT)
        out, _ = leader.communicate("go\n", timeout=WAIT)
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait(WAIT)
    assert out.split() == ["done"]


def test_a_leader_does_not_renew_its_lease_while_a_rank_of_its_group_is_silent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    leases = Leases(tmp_path, Settings(heartbeat_s=0.05))
    liveness.forget()
    try:
        leases.take("7", tmp_path)
        assert leases.written(WAIT)
        first = read_lease(tmp_path)
        assert first is not None
        wait_until(lambda: (read_lease(tmp_path) or first).heartbeat > first.heartbeat, "renewal")
        liveness.mark(liveness.Silence(1, "h1", 4242, None, 31.0, "training"), "shut")
        # The refusal is logged, then the lease is marked with the silent rank, once.
        wait_until(lambda: (read_lease(tmp_path) or first).silent is not None, "the mark")
        assert "not renewing the lease of trial 7" in caplog.text
        frozen = read_lease(tmp_path)
        time.sleep(0.2)  # four heartbeat periods: none may renew it
        assert read_lease(tmp_path) == frozen
        assert frozen is not None
        assert frozen.silent == "rank 1 (pid 4242 on host h1) silent for 31 s while training"
    finally:
        leases.close()
        liveness.forget()


def test_kernel_detection_is_set_on_the_connections_named_and_no_other() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b = socket.create_connection(server.getsockname())
        try:
            inode = {fd: i for i, fd in sockets.socket_inodes().items()}[a.fileno()]
            assert sockets.set_liveness_options({inode}, 6.0, 0.6) == 1
            assert a.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 6000
            assert a.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert b.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
        finally:
            a.close()
            b.close()


def test_connections_to_a_lost_node_never_include_loopback() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        try:
            assert sockets.connections_to({"127.0.0.1"}) == set()
        finally:
            a.close()


def _record(client: TCPStore, signer: Signer, group_rank: int) -> dict[str, Any]:
    """A rank's last beat record ({"n": 0} before its first)."""
    key = liveness.beat_key(group_rank)
    if not client.check([key]):
        return {"n": 0}
    record = json.loads(store.take(client, signer, key, sender=group_rank))
    assert isinstance(record, dict)
    return record


def _count(client: TCPStore, signer: Signer, group_rank: int) -> int:
    return int(_record(client, signer, group_rank)["n"])


def test_status_shows_a_trial_whose_leader_found_a_rank_silent_as_suspect() -> None:
    trial = TrialStatus(
        "7", "evaluating", 1, heartbeat_age_s=40.0, silent="rank 1 (pid 9 on host h1) silent"
    )
    line = render_heartbeat(trial)
    assert line == "SUSPECT: rank 1 (pid 9 on host h1) silent"
