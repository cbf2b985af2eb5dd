"""The pool's wire: how ``neps-bcast launch --pool`` talks to its agents and ranks.

One Unix socket, served by the launcher in a directory only this user can enter (mode
0700, made by the launcher), one connection per process, JSON lines both ways. Nothing
on it is pickled: a trial's arguments and a trial's result travel as base64 bytes that
only the agent and the trial's rank 0 open, after checking their tag (``seal``/
``unseal``: the library's one tag scheme, ``transport.auth``, with the pool's key). Every connection starts with a mutual proof of the pool's key (a random
key the launcher hands its children in their environment): the launcher refuses a
process that cannot prove it, and also checks with ``SO_PEERCRED`` that the peer is
this user; a process refuses a launcher that cannot prove it.

No torch, no NePS here: the launcher imports this module too.
"""

from __future__ import annotations

import base64
import json
import secrets
import socket
from collections.abc import MutableMapping
from typing import Any

from neps_bcast.errors import AuthError
from neps_bcast.transport.auth import Context, Signer

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
SEND_TIMEOUT_S = 60.0
"""A record's send waits this long at most for the other side to read it."""


class WireError(Exception):
    """The other side broke the protocol, failed its proof, or is gone."""


def new_key() -> str:
    return secrets.token_hex(32)


_SEARCH = b"neps_bcast/pool"
"""What the pool's tags bind besides the key: never valid as a search's tag."""


def _signer(key: str) -> Signer:
    """The pool's key in the library's one tag scheme (``transport.auth``)."""
    return Signer(bytes.fromhex(key), _SEARCH)


def proof(key: str, *parts: str) -> str:
    """The tag of ``parts`` with the pool's key: what each side of an opening shows."""
    return _signer(key).sign(Context("pool/opening\0" + "\0".join(parts), 0), b"").hex()


def derive(key: str, what: str, order: str) -> bytes:
    """A secret for ``what`` of ``order`` that only holders of the pool's key can make:
    every rank of a trial derives the same one, nobody else can."""
    return _signer(key).sign(Context(f"pool/derive/{what}/{order}", 0), b"")


def seal(key: str, what: str, order: str, payload: bytes) -> str:
    """``payload`` for the wire: base64 of its tag (bound to ``what`` and ``order``)
    and itself."""
    return base64.b64encode(_signer(key).sign(Context(f"pool/{what}/{order}", 0), payload)).decode()


def unseal(key: str, what: str, order: str, text: object) -> bytes:
    """The payload ``seal`` made, or ``WireError`` if it was not made with the key for
    this ``what`` and ``order`` (nothing of it is used then)."""
    if not isinstance(text, str):
        raise WireError(f"a sealed {what} must be text")
    try:
        raw = base64.b64decode(text.encode(), validate=True)
    except ValueError as exc:
        raise WireError(f"a sealed {what} is not base64") from exc
    try:
        return _signer(key).open(Context(f"pool/{what}/{order}", 0), raw)
    except AuthError:
        raise WireError(f"the {what} of order {order} failed its check: refused") from None


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
