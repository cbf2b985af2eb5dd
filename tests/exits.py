"""Every process's real exit status, from the kernel: the tests read exit codes here.

A rank's own "exit" record says the code its script *meant* to end with; what the process
then did (an abort in the interpreter's finalization, a signal after the record, a
``os._exit``) only the kernel knows. Most ranks are not the test's children (Lightning's
rank 1 is rank 0's child, torchrun's workers are its agent's), so ``waitpid`` cannot
see them. The kernel's process-events connector (netlink, ``NETLINK_CONNECTOR`` /
``CN_IDX_PROC``, root only) reports every process's exit with its status, whoever reaps
it: ``ExitWatch`` listens from before a launch starts and keeps each exit it hears.

Statuses use ``subprocess``'s convention: the exit code, or ``-N`` for death by signal N.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

_NETLINK_CONNECTOR = 11
_CN_IDX_PROC = 1
_CN_VAL_PROC = 1
_PROC_CN_MCAST_LISTEN = 1
_PROC_EVENT_EXIT = 0x80000000
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT = struct.Struct("=IIII")  # pid, tgid, exit_code, exit_signal


def decode(raw: int) -> int:
    """A wait status (``exit_code`` of the event) as ``subprocess`` gives it."""
    return -(raw & 0x7F) if raw & 0x7F else (raw >> 8) & 0xFF


@dataclass(frozen=True)
class Exit:
    pid: int
    status: int
    t: float
    """time.time() when it was heard (just after the process ended)."""


class ExitWatch:
    """The one listener of this test process (``ExitWatch.get()``), started on first use."""

    _instance: ExitWatch | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.exits: dict[int, list[Exit]] = {}
        self.lost = 0
        """Times the kernel dropped events because this socket's buffer was full."""
        self.error: str | None = None
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_CONNECTOR)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root)
        except OSError:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 20)
        self._sock.bind((0, _CN_IDX_PROC))
        op = struct.pack("=I", _PROC_CN_MCAST_LISTEN)
        cn = _CN_MSG.pack(_CN_IDX_PROC, _CN_VAL_PROC, 0, 0, len(op), 0) + op
        self._sock.send(_NLMSG.pack(_NLMSG.size + len(cn), 3, 0, 0, 0) + cn)  # NLMSG_DONE
        self._changed = threading.Condition()
        threading.Thread(target=self._listen, name="exit-watch", daemon=True).start()
        self._prove_it_hears()

    @classmethod
    def get(cls) -> ExitWatch:
        """The listener; fails (never skips) where the kernel's connector is not there."""
        with cls._lock:
            if cls._instance is None:
                try:
                    cls._instance = cls()
                except OSError as exc:
                    raise AssertionError(
                        "the tests read every process's exit status from the kernel's"
                        f" process-events connector (netlink, as root), which failed: {exc}"
                    ) from exc
            return cls._instance

    def _listen(self) -> None:
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self.lost += 1
                    continue
                self.error = str(exc)
                return
            self._parse(data)

    def _parse(self, data: bytes) -> None:
        offset = 0
        heard = time.time()
        while offset + _NLMSG.size <= len(data):
            length = _NLMSG.unpack_from(data, offset)[0]
            if length < _NLMSG.size:
                return
            body = offset + _NLMSG.size + _CN_MSG.size
            if body + _EVENT.size + _EXIT.size <= offset + length:
                what = _EVENT.unpack_from(data, body)[0]
                if what == _PROC_EVENT_EXIT:
                    pid, tgid, raw, _ = _EXIT.unpack_from(data, body + _EVENT.size)
                    if pid == tgid:  # the process, not one of its threads
                        with self._changed:
                            self.exits.setdefault(pid, []).append(Exit(pid, decode(raw), heard))
                            self._changed.notify_all()
            offset += (length + 3) & ~3

    def _prove_it_hears(self) -> None:
        """A child that exits 7 must be heard with 7: else the listener hears nothing."""
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        os.waitpid(pid, 0)
        heard = self.wait(pid, since=0.0, timeout=10.0)
        if heard is None or heard.status != 7:
            raise OSError(f"a child that exited 7 was heard as {heard} (no exit events)")

    def wait(self, pid: int, since: float, timeout: float = 5.0) -> Exit | None:
        """The first exit of ``pid`` heard at or after ``since`` (time.time()), waiting up to
        ``timeout`` s for it; None if none came (it is alive, or an event was lost)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((e for e in self.exits.get(pid, []) if e.t >= since), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._changed.wait(left)
