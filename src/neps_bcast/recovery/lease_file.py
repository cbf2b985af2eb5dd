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
        if neps_compat.lock_kind() == "flock":
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_lease(trial_dir: Path, lease: Lease) -> None:
    """Atomically (a reader sees the old lease or the new one, never half of one)."""
    tmp = trial_dir / f"{LEASE_FILE}.{socket.gethostname()}.{os.getpid()}.tmp"
    tmp.write_text(lease.to_json())
    tmp.replace(trial_dir / LEASE_FILE)
