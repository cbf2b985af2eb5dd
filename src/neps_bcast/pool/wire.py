"""The pool's wire: how ``neps-bcast launch --pool`` talks to its agents and ranks.

One Unix socket, served by the launcher in a directory only this user can enter (mode
0700, made by the launcher), one connection per process, JSON lines both ways. Nothing
on it is pickled: a trial's arguments and a trial's result travel as base64 bytes that
only the agent and the trial's rank 0 open, after checking their HMAC (``seal``/
``unseal``). Every connection starts with a mutual proof of the pool's key (a random
key the launcher hands its children in their environment): the launcher refuses a
process that cannot prove it, and also checks with ``SO_PEERCRED`` that the peer is
this user; a process refuses a launcher that cannot prove it.

No torch, no NePS here: the launcher imports this module too.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import secrets
import socket
import struct
from collections.abc import Callable, MutableMapping
from typing import Any

ENV_POOL = "NEPS_BCAST_POOL"
"""The launcher's socket, set for every agent and rank of a pool."""
ENV_POOL_ROLE = "NEPS_BCAST_POOL_ROLE"
"""``agent`` (a NePS worker without a device) or ``rank`` (a warm rank of one device)."""
ENV_POOL_INDEX = "NEPS_BCAST_POOL_INDEX"
"""The agent's number, or the rank's device index."""
ENV_POOL_SIZE = "NEPS_BCAST_POOL_SIZE"
"""D, the devices of the pool (the largest trial)."""
ENV_POOL_KEY = "NEPS_BCAST_POOL_KEY"
"""The pool's key, hex (proves a connection, seals payloads)."""
POOL_VARIABLES = (ENV_POOL, ENV_POOL_ROLE, ENV_POOL_INDEX, ENV_POOL_SIZE, ENV_POOL_KEY)


def take_key(environ: MutableMapping[str, str]) -> str:
    """The pool's key, taken out of the environment as it is read: nothing the user's
    code starts (a subprocess, a data loader's worker, a shell) inherits it."""
    key = environ.pop(ENV_POOL_KEY, None)
    if not key:
        raise WireError(
            f"{ENV_POOL_KEY} is not set: this process was not started by neps-bcast launch"
            " --pool (or read the key already)"
        )
    return key


MAX_LINE = 256 * 1024 * 1024
"""Largest line read: a trial's sealed arguments or result, base64."""
MAX_PAYLOAD = (MAX_LINE - 64 * 1024) // 4 * 3 - 32
"""Largest payload ``seal`` can put on one line (base64 of its MAC and itself), with
room for the record around it: a trial's pickled result must fit (~192 MB)."""
_HELLO_TIMEOUT_S = 30.0
SEND_TIMEOUT_S = 60.0
"""A record's send waits this long at most for the other side to read it."""


class WireError(Exception):
    """The other side broke the protocol, failed its proof, or is gone."""


def new_key() -> str:
    return secrets.token_hex(32)


def _proof(key: str, *parts: str) -> str:
    return hmac.new(bytes.fromhex(key), "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def derive(key: str, what: str, order: str) -> bytes:
    """A secret for ``what`` of ``order`` that only holders of the pool's key can make
    (HMAC-SHA256): every rank of a trial derives the same one, nobody else can."""
    return hmac.new(
        bytes.fromhex(key), f"derive\0{what}\0{order}".encode(), hashlib.sha256
    ).digest()


def seal(key: str, what: str, order: str, payload: bytes) -> str:
    """``payload`` for the wire: base64 of its MAC (bound to ``what`` and ``order``)
    and itself."""
    mac = hmac.new(bytes.fromhex(key), f"{what}\0{order}\0".encode(), hashlib.sha256)
    mac.update(payload)
    return base64.b64encode(mac.digest() + payload).decode()


def unseal(key: str, what: str, order: str, text: object) -> bytes:
    """The payload ``seal`` made, or ``WireError`` if it was not made with the key for
    this ``what`` and ``order`` (nothing of it is used then)."""
    if not isinstance(text, str):
        raise WireError(f"a sealed {what} must be text")
    try:
        raw = base64.b64decode(text.encode(), validate=True)
    except ValueError as exc:
        raise WireError(f"a sealed {what} is not base64") from exc
    mac, payload = raw[:32], raw[32:]
    expected = hmac.new(bytes.fromhex(key), f"{what}\0{order}\0".encode(), hashlib.sha256)
    expected.update(payload)
    if not hmac.compare_digest(mac, expected.digest()):
        raise WireError(f"the {what} of order {order} failed its check: refused")
    return payload


class Conn:
    """One end of a connection: ``send`` a dict, ``receive`` the next one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buffer = b""

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, record: dict[str, Any]) -> None:
        """The record, whole (bounded by ``SEND_TIMEOUT_S``: a record longer than the
        socket's buffer, a trial's result relayed to its agent, waits for the reader)."""
        # ``feed`` leaves the socket non-blocking; a send must not fail half-way on a
        # full buffer (which would cut the stream and lose the connection).
        self.sock.settimeout(SEND_TIMEOUT_S)
        try:
            self.sock.sendall(json.dumps(record).encode() + b"\n")
        except OSError as exc:
            raise WireError(f"the other side is gone ({exc})") from exc

    def receive(self, timeout: float | None = None) -> dict[str, Any]:
        """The next record; ``WireError`` when the other side closed or sent garbage,
        ``TimeoutError`` after ``timeout`` seconds (None: wait)."""
        self.sock.settimeout(timeout)
        while b"\n" not in self._buffer:
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                raise
            except OSError as exc:
                raise WireError(f"the other side is gone ({exc})") from exc
            if not chunk:
                raise WireError("the other side closed the connection")
            self._buffer += chunk
            if len(self._buffer) > MAX_LINE:
                raise WireError("a line longer than the wire allows")
        line, _, self._buffer = self._buffer.partition(b"\n")
        return parse(line)

    def pending(self) -> bool:
        """A whole record is already buffered (``receive`` will not block)."""
        return b"\n" in self._buffer

    def feed(self) -> list[dict[str, Any]]:
        """The launcher's side: read what is there now (the socket is readable) and
        return every whole record; ``WireError`` when the other side closed."""
        # Never blocks, whatever timeout the socket holds from its opening: a member read
        # without select's word (a trial's rank 0 asked for its last words) may have
        # nothing to say, and the launcher's loop must not wait for it.
        self.sock.setblocking(False)
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            chunk = None
        except OSError as exc:
            raise WireError(f"the other side is gone ({exc})") from exc
        if chunk == b"":
            raise WireError("the other side closed the connection")
        self._buffer += chunk or b""
        if len(self._buffer) > MAX_LINE:
            raise WireError("a line longer than the wire allows")
        records = []
        while b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            records.append(parse(line))
        return records

    def close(self) -> None:
        self.sock.close()


def parse(line: bytes) -> dict[str, Any]:
    try:
        record = json.loads(line.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise WireError(f"not a JSON record: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("op"), str):
        raise WireError("a record must be an object with an 'op'")
    return record


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
        or not hmac.compare_digest(str(answer.get("proof")), _proof(key, "launcher", mine))
    ):
        conn.close()
        raise WireError("the pool's socket did not prove the pool's key: refused")
    conn.send({"op": "proof", "proof": _proof(key, "member", theirs, role, str(index))})
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
                    "proof": _proof(self.key, "launcher", nonce),
                }
            )
            return None
        role, index = str(self.hello["role"]), str(self.hello["index"])
        expected = _proof(self.key, "member", self._mine, role, index)
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
