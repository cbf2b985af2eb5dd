"""A leader's side of the lease file: its lock, its atomic write, a read that logs.

The data half of ``lease.py``. What a lease says (owner, attempts, ranks) and the rules
that decide an owner is gone live one layer lower, in ``neps_bcast.launcher.lease_record``,
which ``neps-bcast status`` reads too; they are re-exported here for the leader's modules.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from neps_bcast.compat import neps as neps_compat
from neps_bcast.launcher.lease_record import (
    LEASE_FILE,
    OURS_PREFIX,
    WORKER_PREFIX,
    Attempt,
    Lease,
    Owner,
    next_worker_id,
    parse_lease,
    why_dead,
)
from neps_bcast.log import logger

__all__ = [
    "LEASE_FILE",
    "LOCK_FILE",
    "OURS_PREFIX",
    "WORKER_PREFIX",
    "Attempt",
    "Lease",
    "Owner",
    "lease_lock",
    "next_worker_id",
    "read_lease",
    "why_dead",
    "write_lease",
]


def read_lease(trial_dir: Path) -> Lease | None:
    """The trial's lease, or None if it has none (or an unreadable one, logged)."""
    try:
        return parse_lease(trial_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.log(logging.WARNING, "ignoring %s: %s", trial_dir, exc)
        return None


LOCK_FILE = ".neps_bcast_lease.lock"
"""Taken around every read-check-write of a lease: a renewal and a takeover never interleave."""


def _lock(fd: int) -> None:
    if neps_compat.lock_kind() == "flock":
        fcntl.flock(fd, fcntl.LOCK_EX)
    else:
        fcntl.lockf(fd, fcntl.LOCK_EX)


@contextlib.contextmanager
def lease_lock(trial_dir: Path) -> Iterator[None]:
    """Hold the lock of one trial's lease (the kind NePS locks with: it works wherever
    NePS's own locking works).

    Why a lock of its own and not NePS's trial lock: the heartbeat renews from a thread,
    and POSIX locks belong to the process, so a thread taking NePS's lock while NePS's
    worker holds it in the same process would not wait, and closing it would release
    NePS's. Every takeover takes this lock too (inside NePS's trial lock), so a renewal
    can no longer write its owner back over a takeover.
    """
    fd = os.open(trial_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        _lock(fd)
        yield
    finally:
        os.close(fd)  # releases the lock


class LockBusy(TimeoutError):
    """Another process has held a trial's lease lock for longer than a look waits."""


_takers: dict[Path, threading.Thread] = {}
"""Each lease lock a look gave up waiting for, and the thread still waiting for it: a
later look of the same trial gives up at once while it waits (one waiter per lock)."""
_takers_lock = threading.Lock()


@contextlib.contextmanager
def lease_lock_within(trial_dir: Path, wait_s: float) -> Iterator[None]:
    """``lease_lock``, waiting ``wait_s`` at most (``LockBusy`` past it): for a look that
    runs under NePS's trial lock, where one frozen holder (a renewal stopped mid-write: a
    frozen process, a hung mount) must not stop every worker of the root for as long as
    it stays frozen. A renewal holds the lock for one write (milliseconds).

    The lock is asked for by a thread of its own, blocked in the kernel as ``lease_lock``
    is (other processes see a waiter); past ``wait_s`` that thread is left waiting, and
    releases the lock the moment it gets it. Only one is left waiting per lock: a later
    look of that trial gives up at once while it waits."""
    key = trial_dir.resolve()
    with _takers_lock:
        waiting = _takers.get(key)
        if waiting is not None and waiting.is_alive():
            raise LockBusy(f"{trial_dir}: its lease lock is still held by another process")
    fd = os.open(trial_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    taken = threading.Event()
    state = {"abandoned": False}
    guard = threading.Lock()

    def take() -> None:
        try:
            _lock(fd)
        except OSError:
            pass
        with guard:
            if not state["abandoned"]:
                taken.set()
                return
        os.close(fd)  # got it after the look gave up: released at once

    taker = threading.Thread(target=take, name="neps_bcast-lease-lock", daemon=True)
    taker.start()
    if not taken.wait(wait_s):
        with guard:
            if not taken.is_set():
                state["abandoned"] = True
        if state["abandoned"]:
            with _takers_lock:
                _takers[key] = taker
            raise LockBusy(
                f"{trial_dir}: its lease lock has been held by another process for"
                f" {wait_s:g} s (a renewal frozen mid-write: a frozen process or a hung mount)"
            )
    taker.join()
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def write_lease(trial_dir: Path, lease: Lease) -> None:
    """Atomically (a reader sees the old lease or the new one, never half of one)."""
    tmp = trial_dir / f"{LEASE_FILE}.{socket.gethostname()}.{os.getpid()}.tmp"
    tmp.write_text(lease.to_json())
    tmp.replace(trial_dir / LEASE_FILE)
