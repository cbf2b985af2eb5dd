"""One identity for a process (``procfs.Process``: host, boot id, pid namespace, pid,
start time): a peer is here only on this host, boot and pid namespace, and a process is
signalled only while its start time still matches.

Real processes throughout: a ``sleep`` is the decoy that holds the pid number a peer's
record names, and a second pid namespace is a real one (``unshare --pid --fork
--mount-proc``, what a container gives). Each "never signalled" test has its positive
control: the same process, named by its own identity, is signalled.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from neps_bcast import runtime
from neps_bcast.compat import procfs
from neps_bcast.compat.torch import TCPStore
from neps_bcast.config import Settings
from neps_bcast.transport import liveness, peers, sockets, store
from neps_bcast.transport.auth import Signer, new_secret
from verdicts import WAIT, Verdicts, wait_until

BOUND = 1.0
CONTAINER = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"]
"""A pid namespace of its own, with its own /proc: what a container gives."""


@pytest.fixture
def sleeper() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start a ``sleep`` (a decoy, or a peer to signal); every one killed afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "600"])
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.kill()
            proc.wait(WAIT)


def _child_of(pid: int) -> int:
    """The one child of ``pid`` (waited for: ``unshare --fork`` starts it at once)."""
    found: list[int] = []

    def child() -> bool:
        found[:] = [p for p in procfs.all_pids() if (st := procfs.read_stat(p)) and st.ppid == pid]
        return len(found) == 1

    wait_until(child, f"the child of pid {pid}")
    return found[0]


@pytest.fixture(scope="module")
def other_namespace() -> Iterator[str]:
    """A second pid namespace (a container's), as ``readlink /proc/PID/ns/pid`` names it."""
    container = subprocess.Popen([*CONTAINER, "sleep", "600"])
    try:
        inside = _child_of(container.pid)
        namespace = str(Path(f"/proc/{inside}/ns/pid").readlink())
        assert namespace != procfs.pid_namespace()  # the positive control of the namespace
        yield namespace
    finally:
        container.kill()  # its pid 1 ends with it, and the kernel ends the rest
        container.wait(WAIT)


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


# ------------------------------------------------------------------ the identity itself


def test_this_process_is_named_by_host_boot_namespace_pid_and_start_time() -> None:
    me = procfs.Process.me()
    assert (me.host, me.boot_id, me.pid_namespace, me.pid) == (
        socket.gethostname(),
        Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        str(Path("/proc/self/ns/pid").readlink()),
        os.getpid(),
    )
    assert me.start_ticks == procfs.start_ticks(os.getpid())
    assert me.is_here and me.is_running()
    assert procfs.Process.from_json(me.to_json()) == me


def test_the_real_process_is_signalled_through_its_identity(
    sleeper: Callable[[], subprocess.Popen[bytes]],
) -> None:
    """The positive control of every "never signalled" below."""
    peer = sleeper()
    process = procfs.Process.of(peer.pid)
    assert process is not None
    assert liveness.kill_if_here(process) is True
    assert peer.wait(WAIT) == -signal.SIGKILL


def test_a_process_whose_start_time_changed_is_never_signalled(
    sleeper: Callable[[], subprocess.Popen[bytes]],
) -> None:
    """The record of a process that had this pid before (it exited, and the pid was
    handed on): the pid is alive, its start time is not the record's."""
    decoy = sleeper()
    now = procfs.Process.of(decoy.pid)
    assert now is not None
    before = replace(now, start_ticks=now.start_ticks - 1)
    assert before.is_here and not before.is_running()
    assert procfs.send(before, signal.SIGKILL) is False
    assert liveness.kill_if_here(before) is False
    assert _alive(decoy)


def test_a_process_of_another_pid_namespace_with_this_pid_is_never_signalled(
    sleeper: Callable[[], subprocess.Popen[bytes]], other_namespace: str
) -> None:
    """Same host, same boot, same pid number (and start time): a container's process."""
    decoy = sleeper()
    here = procfs.Process.of(decoy.pid)
    assert here is not None
    there = replace(here, pid_namespace=other_namespace)
    assert not there.is_here
    assert "another pid namespace of this host" in there.where()
    assert liveness.kill_if_here(there) is False
    assert procfs.send(there, signal.SIGKILL) is False
    assert _alive(decoy)


def test_a_process_of_another_boot_with_this_pid_is_never_signalled(
    sleeper: Callable[[], subprocess.Popen[bytes]],
) -> None:
    """Same hostname and pid number, another machine (or this one before a reboot)."""
    decoy = sleeper()
    here = procfs.Process.of(decoy.pid)
    assert here is not None
    elsewhere = replace(here, boot_id="00000000-0000-0000-0000-000000000000")
    assert not elsewhere.is_here
    assert liveness.kill_if_here(elsewhere) is False
    assert _alive(decoy)


# ------------------------------------------------------------------------ peer records


def _record(process: procfs.Process) -> dict[str, object]:
    return {**process.to_json(), "listen": []}


def test_a_peer_record_of_another_pid_namespace_is_not_here(
    sleeper: Callable[[], subprocess.Popen[bytes]], other_namespace: str
) -> None:
    decoy = sleeper()
    here = procfs.Process.of(decoy.pid)
    assert here is not None
    mine = peers.Peer.from_json(1, _record(here))
    theirs = peers.Peer.from_json(1, _record(replace(here, pid_namespace=other_namespace)))
    assert mine is not None and theirs is not None
    assert (mine.is_here, theirs.is_here) == (True, False)
    assert theirs.process == replace(here, pid_namespace=other_namespace)


def test_a_peer_record_that_names_no_process_is_refused() -> None:
    """Host and pid alone name no process: such a record is no peer's."""
    assert peers.Peer.from_json(1, {"host": socket.gethostname(), "pid": 1, "listen": []}) is None


def test_a_lost_peer_whose_pid_is_another_process_now_is_named_gone(
    sleeper: Callable[[], subprocess.Popen[bytes]],
) -> None:
    decoy = sleeper()
    here = procfs.Process.of(decoy.pid)
    assert here is not None
    table = peers.Peers(0, Signer(b"s" * 32))
    gone = peers.Peer.from_json(1, _record(replace(here, start_ticks=here.start_ticks - 1)))
    assert gone is not None
    table._known[1] = gone
    assert "its process is gone (its pid is another process's now)" in table.describe_lost(None, 2)
    table._known[1] = peers.Peer.from_json(1, _record(here))  # type: ignore[assignment]
    assert table.describe_lost(None, 2) == ""  # alive: not lost (the positive control)


# ------------------------------------------------------------------- silence verdicts


def _leader(peer: peers.Peer | None = None) -> SimpleNamespace:
    """What ``runtime._on_silent`` reads of a search leader's runtime (no trial held)."""
    known = {} if peer is None else {peer.group_rank: peer}
    return SimpleNamespace(
        link=SimpleNamespace(stopping=False, peers=SimpleNamespace(known=known.get)),
        group_rank=0,
        settings=Settings(peer_timeout_s=BOUND),
        abandon_trial=None,
        group=SimpleNamespace(backend="gloo"),
    )


@pytest.fixture(autouse=True)
def _no_verdicts_left() -> Iterator[None]:
    liveness.forget()
    yield
    liveness.forget()


def test_a_silent_follower_named_by_host_and_pid_alone_is_never_signalled(
    sleeper: Callable[[], subprocess.Popen[bytes]],
) -> None:
    """A verdict without the process's identity: its pid is not enough to kill."""
    decoy = sleeper()
    silence = liveness.Silence(1, socket.gethostname(), decoy.pid, None, 5.0, "training")
    runtime._on_silent(_leader(), silence)  # type: ignore[arg-type]
    assert _alive(decoy)
    marked = liveness.silenced(1)
    assert marked is not None and marked[1].startswith("its connections shut")


def test_a_silent_follower_in_another_container_is_handled_as_remote(
    sleeper: Callable[[], subprocess.Popen[bytes]], other_namespace: str
) -> None:
    """Its pid number is the decoy's here; it is not killed, its connections are shut."""
    decoy = sleeper()
    here = procfs.Process.of(decoy.pid)
    assert here is not None
    there = replace(here, pid_namespace=other_namespace)
    silence = liveness.Silence(1, there.host, there.pid, None, 5.0, "training", there)
    runtime._on_silent(_leader(), silence)  # type: ignore[arg-type]
    assert _alive(decoy)
    marked = liveness.silenced(1)
    assert marked is not None
    assert marked[1].startswith("its connections shut; in another pid namespace"), marked


def test_a_silent_follower_here_is_killed(sleeper: Callable[[], subprocess.Popen[bytes]]) -> None:
    """The positive control of the two above: the same verdict, the process here."""
    peer = sleeper()
    process = procfs.Process.of(peer.pid)
    assert process is not None
    silence = liveness.Silence(1, process.host, process.pid, None, 5.0, "training", process)
    runtime._on_silent(_leader(), silence)  # type: ignore[arg-type]
    assert peer.wait(WAIT) == -signal.SIGKILL
    marked = liveness.silenced(1)
    assert marked is not None and marked[1] == "killed by the leader (SIGKILL)"


# ------------------------------------------------------------------------------- beats


@pytest.fixture
def leader_store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _beat(client: TCPStore, signer: Signer, n: int, who: procfs.Process) -> None:
    record = {"n": n, "doing": "training", "addr": None, "who": who.to_json()}
    store.put(client, signer, liveness.beat_key(1), json.dumps(record).encode(), sender=1)


def test_a_beat_from_another_process_than_the_ranks_record_is_refused(
    leader_store: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 1's record names one process; beats under its key from another (same pid
    number, another start time) do not count, and the verdict names the record's."""
    signer = Signer(new_secret())
    address = f"127.0.0.1:{leader_store.port}"
    rank1 = replace(procfs.Process.me(), pid=4242, start_ticks=7)
    impostor = replace(rank1, start_ticks=8)
    verdicts = Verdicts[liveness.Silence]()
    client = store.connect(address, datetime.timedelta(seconds=WAIT), WAIT)
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        monitor = liveness.Monitor(
            address, 2, signer, BOUND, verdicts, lambda r: ("h1", 4242), lambda r: rank1
        )
        try:
            _beat(client, signer, 1, rank1)
            wait_until(lambda: monitor.beats_seen(1) == 1, "the record's process's beat")
            for n in range(2, 30):
                _beat(client, signer, n, impostor)
                if verdicts.event.is_set():
                    break
            assert verdicts.event.wait(WAIT)
        finally:
            monitor.stop()
    assert monitor.beats_seen(1) == 1
    (silence,) = verdicts.seen
    assert silence.process == rank1
    refused = [
        r.getMessage() for r in caplog.records if "refused a beat of rank 1" in r.getMessage()
    ]
    assert refused and "not from rank 1's process" in refused[0], refused


# ------------------------------------------------------- connections to another container

OUT_OF_SIGHT = textwrap.dedent(
    """
    import json, socket, sys
    from neps_bcast.transport import sockets
    outside = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    outside.recv(1)  # the server took it off its accept queue: its end is a file now
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    inside = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    found = sockets.connections_out_of_sight({"127.0.0.1"})
    mine = sockets.socket_inodes()
    by_fd = {fd: inode for inode, fd in mine.items()}
    print(json.dumps({
        "outside": by_fd[outside.fileno()] in found,
        "inside": by_fd[inside.fileno()] in found,
        "accepted": by_fd[accepted.fileno()] in found,
    }), flush=True)
    """
)


def _serve_one(server: socket.socket, held: list[socket.socket]) -> threading.Thread:
    """Accept one connection on ``server`` (a thread), hold it and say so (one byte): a
    socket still in the accept queue has no file yet (inode 0 in ``/proc/net/tcp``), so no
    process holds it and its connection cannot be told apart until it is accepted."""

    def serve() -> None:
        conn = server.accept()[0]
        held.append(conn)
        conn.sendall(b"!")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_connections_to_a_process_of_another_container_are_told_apart() -> None:
    """In a container (its own pid namespace, this host's network), a connection to a
    process outside it is out of sight; one between two of its own sockets is not."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    held: list[socket.socket] = []
    _serve_one(server, held)
    try:
        done = subprocess.run(
            [*CONTAINER, sys.executable, "-c", OUT_OF_SIGHT, str(server.getsockname()[1])],
            capture_output=True,
            text=True,
            timeout=WAIT,
            check=False,
        )
    finally:
        for s in [server, *held]:
            s.close()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"outside": True, "inside": False, "accepted": False}


def test_connections_between_processes_in_one_namespace_are_in_sight() -> None:
    """Seen from this pid namespace, a connection to another process here (a child of
    this one) is never out of sight (the control of the test above)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    peer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket, sys; c = socket.create_connection(('127.0.0.1',"
            f" {server.getsockname()[1]})); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
    )
    try:
        accepted, _ = server.accept()
        inode = next(i for i, fd in sockets.socket_inodes().items() if fd == accepted.fileno())
        assert inode not in sockets.connections_out_of_sight({"127.0.0.1"})
        accepted.close()
    finally:
        peer.kill()
        peer.wait(WAIT)
        server.close()
