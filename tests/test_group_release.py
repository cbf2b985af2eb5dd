"""Which connections a failing rank shuts: exactly those to its peers' processes.

Real processes and real TCP connections on loopback: a "peer" process stands for
another rank of the group, an "outsider" for the user's database or tracker. The
rank under test (this pytest process) holds connections to both, in both directions.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from neps_bcast.ddp.group import group_connections
from neps_bcast.ddp.teardown import drop_finished_frames
from neps_bcast.transport import peers, sockets
from neps_bcast.transport.auth import Signer

ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys, threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    print(listener.getsockname()[1], flush=True)
    if len(sys.argv) > 1:  # also connect back to the test's own listener
        back = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
        back.sendall(b"hello")
    def serve(conn):
        while data := conn.recv(1024):
            conn.sendall(data)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    """
)


@contextmanager
def echo_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ECHO_SERVER, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, port
    finally:
        proc.kill()
        proc.wait(timeout=10)


def works(conn: socket.socket) -> bool:
    try:
        conn.settimeout(5)
        conn.sendall(b"ping")
        return conn.recv(4) == b"ping"
    except OSError:
        return False


def inode_of(conn: socket.socket) -> int:
    return {fd: inode for inode, fd in sockets.socket_inodes().items()}[conn.fileno()]


def test_only_connections_to_peer_processes_are_shut() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    my_port = listener.getsockname()[1]
    with echo_process(str(my_port)) as (peer, peer_port), echo_process() as (_, outsider_port):
        to_peer = socket.create_connection(("127.0.0.1", peer_port))
        accepted_from_peer, _ = listener.accept()
        assert accepted_from_peer.recv(5) == b"hello"
        before = socket.create_connection(("127.0.0.1", outsider_port))  # the user's own
        own = socket.create_connection(("127.0.0.1", peer_port))  # neps_bcast's own
        unix_a, unix_b = socket.socketpair()
        me = peers.Peer(1, socket.gethostname(), peer.pid)

        found = group_connections([me], own={inode_of(own)}, exclude_local_ports=set())

        assert found == {inode_of(to_peer), inode_of(accepted_from_peer)}
        assert sockets.shutdown(found) == 2
        assert not works(to_peer)
        assert accepted_from_peer.recv(1) == b""  # shut: reads end at once
        # Positive control above; everything else still works.
        assert works(before)
        assert works(own)
        unix_a.sendall(b"x")
        assert unix_b.recv(1) == b"x"
        for s in (to_peer, accepted_from_peer, before, own, unix_a, unix_b):
            s.close()
    listener.close()


def test_no_peer_known_shuts_nothing() -> None:
    with echo_process() as (_, port):
        conn = socket.create_connection(("127.0.0.1", port))
        assert group_connections([], own=set(), exclude_local_ports=set()) == set()
        assert works(conn)
        conn.close()


def test_a_peer_on_another_host_is_matched_by_its_published_listening_endpoint() -> None:
    with echo_process() as (_, peer_port), echo_process() as (_, outsider_port):
        to_peer = socket.create_connection(("127.0.0.1", peer_port))
        other = socket.create_connection(("127.0.0.1", outsider_port))
        remote = peers.Peer(1, "another-host", 1, listen=(("127.0.0.1", peer_port),))
        found = group_connections([remote], own=set(), exclude_local_ports=set())
        assert found == {inode_of(to_peer)}
        to_peer.close()
        other.close()


def test_endpoints_are_parsed_from_proc_net_tcp() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    table = sockets.tcp_table()
    assert sockets.listening(table, sockets.socket_inodes()) >= {("127.0.0.1", port)}
    listener.close()


def test_own_listening_endpoints_are_the_ones_proc_net_tcp_lists() -> None:
    """Asked of each socket (``own_listening``) or read from the host's tables: the same
    endpoints, IPv4, IPv6 and IPv4 on every interface; a connection and a datagram or
    Unix socket are not listening."""
    listeners = []
    for family, host in (
        (socket.AF_INET, "127.0.0.1"),
        (socket.AF_INET, "0.0.0.0"),
        (socket.AF_INET6, "::"),
    ):
        s = socket.socket(family)
        s.bind((host, 0))
        s.listen()
        listeners.append(s)
    connected = socket.create_connection(("127.0.0.1", listeners[0].getsockname()[1]))
    others = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM), socket.socket(socket.AF_UNIX)]
    try:
        mine = sockets.own_listening()
        assert mine == sockets.listening(sockets.tcp_table(), sockets.socket_inodes())
        assert {(str(s.getsockname()[0]), s.getsockname()[1]) for s in listeners} <= mine
        assert ("127.0.0.1", connected.getsockname()[1]) not in mine
    finally:
        for s in [*listeners, connected, *others]:
            s.close()


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import os; os.kill(os.getpid(), 9)", "signal 9 (SIGKILL)"),
        ("raise SystemExit(3)", "exit code 3"),
    ],
)
def test_a_lost_child_is_described_and_left_for_its_owner_to_reap(code: str, expected: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", code])
    table = peers.Peers(0, Signer(b"s" * 32))
    table._known[1] = peers.Peer(1, socket.gethostname(), child.pid)
    text = table.describe_lost(None, 2)
    assert text == f"rank 1 lost: {expected} (pid {child.pid})"
    # waitid(WNOWAIT) read the status without reaping: Lightning's Popen still can.
    returncode = child.wait(timeout=10)
    assert returncode == (-signal.SIGKILL if "SIGKILL" in expected else 3)


def test_a_lost_process_that_is_not_a_child_is_named_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    table = peers.Peers(0, Signer(b"s" * 32))
    table._known[1] = peers.Peer(1, socket.gethostname(), child.pid)
    assert table.describe_lost(None, 2) == f"rank 1 lost: its process is gone (pid {child.pid})"
    table._known[1] = peers.Peer(1, socket.gethostname(), os.getpid())  # alive: not lost
    assert table.describe_lost(None, 2) == ""


class _Trainer:
    """Stands for a Trainer: what a failed trial's frames must not keep alive."""


def _fit(trainer: _Trainer) -> None:
    raise KeyboardInterrupt


def _interrupted_fit(trainer: _Trainer) -> SystemExit:
    """What Lightning does with Ctrl-C: ``sys.exit(1)`` inside its
    ``except KeyboardInterrupt``, so the training frames hang off ``__context__``."""
    try:
        try:
            _fit(trainer)
        except KeyboardInterrupt:
            raise SystemExit(1)  # noqa: B904 - chained implicitly, as Lightning does
    except SystemExit as exc:
        return exc
    raise AssertionError("unreachable")


def test_releasing_drops_the_frames_of_every_chained_error() -> None:
    trainer = _Trainer()
    ref = weakref.ref(trainer)
    exc = _interrupted_fit(trainer)
    del trainer
    assert ref() is not None  # the chained KeyboardInterrupt's frames hold it
    drop_finished_frames(exc)
    assert ref() is None
    # The error still prints whole: its traceback keeps files and line numbers.
    text = "".join(traceback.format_exception(exc))
    assert "_fit" in text and "KeyboardInterrupt" in text and "SystemExit: 1" in text
