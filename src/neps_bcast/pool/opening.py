"""The opening of a connection to the pool's socket: each side proves the pool's key
(HMAC of the other's nonce), the kernel vouches for the connected process's uid and pid
(``SO_PEERCRED``), and the launcher names why it refuses a process that is not the one
it started. A member's side (``connect``) waits; the launcher's (``Opening``) is driven a
record at a time by its loop, so a silent connection holds up nothing."""

from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
from collections.abc import Callable
from typing import Any

from neps_bcast.pool.wire import Conn, WireError, proof

_HELLO_TIMEOUT_S = 30.0


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The connected process's pid and uid as the kernel saw them at ``connect``
    (``SO_PEERCRED``), not as the process claims them."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def peer_uid(sock: socket.socket) -> int:
    return peer_credentials(sock)[1]


def connect(path: str, key: str, role: str, index: int) -> Conn:
    """A process's side of the opening: prove the key, check the launcher's proof."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(_HELLO_TIMEOUT_S)
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise WireError(f"cannot reach the pool's launcher at {path} ({exc})") from exc
    conn = Conn(sock)
    mine = secrets.token_hex(16)
    conn.send({"op": "hello", "role": role, "index": index, "pid": os.getpid(), "nonce": mine})
    answer = conn.receive(_HELLO_TIMEOUT_S)
    theirs = answer.get("nonce")
    if (
        answer.get("op") != "challenge"
        or not isinstance(theirs, str)
        or not hmac.compare_digest(str(answer.get("proof")), proof(key, "launcher", mine))
    ):
        conn.close()
        raise WireError("the pool's socket did not prove the pool's key: refused")
    conn.send({"op": "proof", "proof": proof(key, "member", theirs, role, str(index))})
    welcome = conn.receive(_HELLO_TIMEOUT_S)
    if welcome.get("op") != "welcome":
        conn.close()
        raise WireError(f"the launcher refused this process: {welcome.get('why')}")
    return conn


class Opening:
    """The launcher's side of one connection's opening, a record at a time: it never
    waits, so a process that connects and says nothing (or a slow one) cannot hold up
    the launcher's loop, which drives every opening from its ``select`` and drops one
    past ``deadline``. ``WireError`` at any step: the connection is refused.

    The steps: the kernel's uid of the connected process must be this user's
    (``SO_PEERCRED``); its hello; the launcher's challenge (its proof of the key and a
    nonce); the process's proof; then ``finish`` with the launcher's verdict."""

    def __init__(self, conn: Conn, key: str, now: float, timeout: float = _HELLO_TIMEOUT_S):
        self.conn = conn
        self.key = key
        self.deadline = now + timeout
        self.pid, uid = peer_credentials(conn.sock)
        if uid != os.geteuid():
            raise WireError(f"a process of uid {uid} connected: refused")
        self.hello: dict[str, Any] | None = None
        self._mine = ""

    def fileno(self) -> int:
        return self.conn.fileno()

    def feed(self) -> dict[str, Any] | None:
        """Read what is there now; the proven hello (its ``pid`` the kernel's) once the
        process proved the key, else None (not yet)."""
        for record in self.conn.feed():
            proven = self.step(record)
            if proven is not None:
                return proven
        return None

    def step(self, record: dict[str, Any]) -> dict[str, Any] | None:
        if self.hello is None:
            nonce = record.get("nonce")
            role, index = record.get("role"), record.get("index")
            if (
                record.get("op") != "hello"
                or not isinstance(nonce, str)
                or role not in ("agent", "rank")
                or not isinstance(index, int)
                or isinstance(index, bool)
            ):
                raise WireError("not a pool member's hello")
            self.hello = record
            self._mine = secrets.token_hex(16)
            self.conn.send(
                {
                    "op": "challenge",
                    "nonce": self._mine,
                    "proof": proof(self.key, "launcher", nonce),
                }
            )
            return None
        role, index = str(self.hello["role"]), str(self.hello["index"])
        expected = proof(self.key, "member", self._mine, role, index)
        if record.get("op") != "proof" or not hmac.compare_digest(
            str(record.get("proof")), expected
        ):
            self.conn.send({"op": "refused", "why": "the pool's key was not proven"})
            raise WireError("a process that did not prove the pool's key: refused")
        return {**self.hello, "pid": self.pid}

    def finish(self, hello: dict[str, Any], why: str | None) -> None:
        """The launcher's verdict on a proven process: welcome (``why`` None), or refused
        with the reason, which the process hears at its ``connect``."""
        if why is not None:
            self.conn.send({"op": "refused", "why": why})
            raise WireError(f"{hello['role']} {hello['index']} (pid {hello['pid']}) refused: {why}")
        self.conn.send({"op": "welcome"})


def accept(
    conn: Conn, key: str, admit: Callable[[dict[str, Any]], str | None] = lambda hello: None
) -> dict[str, Any]:
    """``Opening`` waited through (blocking, each record bounded by the hello timeout):
    the hello of a process that proved the key and is this user; ``WireError``
    otherwise. ``admit(hello)``, last, names why the launcher will not take this process
    (None: welcome)."""
    opening = Opening(conn, key, 0.0)
    proven = None
    while proven is None:
        proven = opening.step(conn.receive(_HELLO_TIMEOUT_S))
    opening.finish(proven, admit(proven))
    return proven
