"""Handing a trial back to NePS: an orphan of a dead owner, or a leader's own trial.

Whose trial is orphaned is decided by its lease (``launcher.lease_record.why_dead``); what becomes
of a trial handed back is decided here, the same for both: its interruption is added to
the lease's history, and the trial goes back to ``pending``, or is recorded ``crashed``
once it was interrupted more than ``NEPS_BCAST_MAX_RETRIES`` times (``lease`` says why).
Always under NePS's trial lock (``compat.neps.locked_trials``) and the lease file's.

A hand-back is never fenced (``fence.Fence.refuse``): a trial crashed past the retry
limit is recorded through NePS's own recording, which the fence must let through.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from neps_bcast.compat import neps as neps_compat
from neps_bcast.compat import neps_trials
from neps_bcast.config import Settings
from neps_bcast.launcher import trial_placement
from neps_bcast.log import logger
from neps_bcast.recovery.lease_file import (
    LEASE_FILE,
    Attempt,
    Lease,
    LockBusy,
    Owner,
    lease_lock_within,
    read_lease,
    why_dead,
    write_lease,
)

LOOK_LOCK_WAIT_S = 5.0
"""How long a look for orphans waits for one trial's lease lock (under NePS's trial lock,
which every worker of the root waits for meanwhile): a renewal holds it for one write,
milliseconds even on a loaded NFS server; one held longer is a renewal frozen mid-write,
and that trial is looked at again at the next look."""


Seen = tuple[object, ...]
"""A lease as a look saw it: what a renewal or a takeover changes (``seen``)."""


def seen(lease: Lease | None, trial: neps_trials.EvaluatingTrial) -> Seen:
    """What a renewal or a takeover changes of a trial's lease (or of its absence)."""
    if lease is None:
        return ("no lease", trial.worker_id, trial.time_started)
    return (lease.owner, lease.beats, lease.heartbeat, len(lease.attempts), lease.attempt)


@dataclass(frozen=True)
class Left:
    """A trial a look left evaluating: whose it is, and its lease as seen."""

    trial_id: str
    owner: Owner | None
    """Its lease's owner, else the leader NePS's record names (None: neither)."""
    seen: Seen | None
    """None: not read (its lease lock was held)."""
    alive_here: bool
    """Its owner runs on this machine and is alive (proven, not timed)."""


@dataclass
class Look:
    """What one look for orphans did and left."""

    done: list[str]
    """What became of each trial handed back (``"<id>: <outcome>"``)."""
    put_back: list[str]
    """The trials it put back to pending (the others handed back were crashed)."""
    left: list[Left]


class HandBack:
    """Trials handed back under NePS's trial lock, by the leader ``me``."""

    def __init__(self, me: Owner, settings: Settings) -> None:
        self.me = me
        self.heartbeat_s = settings.heartbeat_s
        self.grace_s = settings.lease_grace_s
        self.max_retries = settings.max_retries
        self._seen: dict[str, tuple[object, float]] = {}
        """trial id -> (its lease as last seen, when first seen so: ``time.monotonic``)."""

    def orphans(self, root: Path) -> list[str]:
        """Put back every trial of ``root`` whose owner is provably gone; what was done,
        per trial."""
        return self.look(root).done

    def look(self, root: Path) -> Look:
        """``orphans``, and the trials left evaluating, each as seen."""
        look = Look([], [], [])
        with neps_compat.locked_trials(root) as book:
            if book is None:
                return look
            now = time.time()
            fs_now = filesystem_now(root)
            for trial in book.evaluating():
                try:
                    with lease_lock_within(trial.location, LOOK_LOCK_WAIT_S):
                        lease = read_lease(trial.location)
                        outcome = self._orphan(book, trial, lease, now, fs_now)
                except LockBusy as exc:
                    # Its owner is mid-renewal, or frozen in one: it is looked at again
                    # at the next look; the other trials, and NePS, go on meanwhile.
                    logger.log(logging.WARNING, "trial %s not looked at: %s", trial.trial_id, exc)
                    look.left.append(Left(trial.trial_id, None, None, alive_here=False))
                    continue
                if outcome is None:
                    owner = lease.owner if lease is not None else None
                    owner = owner or Owner.from_worker_id(trial.worker_id)
                    here = owner is not None and self.me.shares_machine_with(owner)
                    look.left.append(Left(trial.trial_id, owner, seen(lease, trial), here))
                    continue
                look.done.append(f"{trial.trial_id}: {outcome}")
                if book.state_of(trial.trial_id) == "pending":
                    look.put_back.append(trial.trial_id)
        return look

    def _orphan(
        self,
        book: neps_trials.TrialBook,
        trial: neps_trials.EvaluatingTrial,
        lease: Lease | None,
        now: float,
        fs_now: float | None = None,
    ) -> str | None:
        """Under NePS's trial lock and the lease's: hand ``trial`` back if its owner is gone."""
        reason = why_dead(
            lease,
            trial.time_started,
            self.me,
            now,
            self.grace_s,
            trial.worker_id,
            fs_age_s=_age_by_filesystem(trial.location, fs_now),
            unchanged_s=self._unchanged_s(trial.trial_id, lease, trial),
        )
        if reason is None:
            if lease is not None and lease.owner is not None:
                age = now - lease.heartbeat
                if age > 2 * self.heartbeat_s and not self.me.shares_machine_with(lease.owner):
                    logger.log(
                        logging.INFO,
                        "trial %s: no heartbeat from %s for %.0f s; taken over after %.0f s",
                        trial.trial_id,
                        lease.owner.describe(),
                        age,
                        self.grace_s,
                    )
            return None
        if lease is None or lease.owner is None:
            started = trial.time_started or now
            lease = Lease(
                trial.trial_id,
                None,
                started,
                started,
                lease.attempts if lease is not None else (),
            )
        # A leader killed before its lease was written is still named, from NePS's
        # record of the worker (the history then says whose attempt it was).
        owner = (
            lease.owner or Owner.from_worker_id(trial.worker_id) or Owner("unknown", "", "", 0, 0)
        )
        attempt = Attempt(owner, lease.started, lease.heartbeat, reason)
        outcome = self.trial(book, trial.trial_id, trial.location, lease, attempt)
        logger.log(logging.WARNING, "orphaned trial %s (%s): %s", trial.trial_id, reason, outcome)
        return outcome

    def _unchanged_s(
        self, trial_id: str, lease: Lease | None, trial: neps_trials.EvaluatingTrial
    ) -> float:
        """How long this leader has seen the trial's lease as it is now (its monotonic
        clock: no other host's clock is read)."""
        now_seen = seen(lease, trial)
        now = time.monotonic()
        before = self._seen.get(trial_id)
        if before is None or before[0] != now_seen:
            self._seen[trial_id] = (now_seen, now)
            return 0.0
        return now - before[1]

    def trial(
        self,
        book: neps_trials.TrialBook,
        trial_id: str,
        trial_dir: Path,
        lease: Lease,
        attempt: Attempt,
    ) -> str:
        """Under NePS's lock: record ``attempt``; pending, or crashed past the limit."""
        with _handing_back():
            return self._trial(book, trial_id, trial_dir, lease, attempt)

    def _trial(
        self,
        book: neps_trials.TrialBook,
        trial_id: str,
        trial_dir: Path,
        lease: Lease,
        attempt: Attempt,
    ) -> str:
        attempt = where_it_ran(attempt, lease, trial_dir)
        now = time.time()
        released = Lease(trial_id, None, lease.started, now, (*lease.attempts, attempt))
        write_lease(trial_dir, released)
        count = len(released.attempts)
        if count > self.max_retries:
            error = RuntimeError(
                f"neps_bcast: trial {trial_id} was interrupted {count} times by"
                f" infrastructure failures (NEPS_BCAST_MAX_RETRIES={self.max_retries}):"
                f" {released.history()}"
            )
            book.set_crashed(trial_id, error)
            return f"recorded crashed after {count} interruptions"
        book.set_pending(trial_id)
        return f"back to pending (interruption {count} of at most {self.max_retries} retried)"


def where_it_ran(attempt: Attempt, lease: Lease, trial_dir: Path) -> Attempt:
    """``attempt`` with its group's size (the lease's) and, in a pool, the devices the
    launcher placed it on (the trial's placement, if written since the attempt started):
    ``neps-bcast status --plot`` draws each attempt on its row."""
    placement = trial_placement.read(trial_dir)
    if placement is not None and placement.placed >= lease.started:
        return replace(
            attempt,
            ranks=len(placement.devices),
            devices=placement.devices,
            launch_id=placement.launch_id,
        )
    return replace(attempt, ranks=lease.ranks)


CLOCK_FILE = ".neps_bcast_clock"
"""A file in the root each leader rewrites to read the shared filesystem's clock."""


def filesystem_now(root: Path) -> float | None:
    """The shared filesystem's clock: the mtime of a file just written in ``root`` (None
    where it cannot be written). Compared with a lease file's mtime, it ages a lease by
    one clock, the filesystem's, whoever wrote it."""
    path = root / CLOCK_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"1")
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
    except OSError:
        return None


def _age_by_filesystem(trial_dir: Path, fs_now: float | None) -> float | None:
    """The lease's age (else the trial directory's) by the filesystem's clock."""
    if fs_now is None:
        return None
    for path in (trial_dir / LEASE_FILE, trial_dir):
        try:
            return fs_now - path.lstat().st_mtime
        except OSError:
            continue
    return None


_HANDING_BACK = threading.local()
"""Set on a thread while it hands a trial back: a crash past the retry limit is recorded
through NePS's own recording, which the fence must let through."""


def handing_back() -> bool:
    """This thread is handing a trial back (``HandBack.trial``)."""
    return bool(getattr(_HANDING_BACK, "active", False))


@contextlib.contextmanager
def _handing_back() -> Iterator[None]:
    _HANDING_BACK.active = True
    try:
        yield
    finally:
        _HANDING_BACK.active = False
