"""The lease on the trial this leader evaluates: its first write and its renewals.

One thread per leader writes each lease ``take`` records and renews the held one every
``NEPS_BCAST_HEARTBEAT_S``, each time under the lease file's lock, after checking that
the trial is still this attempt's: a write that comes late (a mount that hung at the
trial's start, a host frozen past the grace period) may find the trial taken over by
another host, and must then not replace that attempt's lease. It stops renewing where
the truth is that the trial is stuck (a silent rank of its group), and ends a trial
past ``NEPS_BCAST_TRIAL_TIME_LIMIT_S``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from neps_bcast.compat import neps_trials
from neps_bcast.launcher.lease_record import parse_lease
from neps_bcast.log import logger
from neps_bcast.recovery.fence import superseded
from neps_bcast.recovery.lease_file import Lease, Owner, lease_lock, read_lease, write_lease
from neps_bcast.transport import liveness

FINISHED = ("success", "crashed")
"""NePS's states of a trial that has its result."""
ENDED_HERE = "the trial ended here: NePS holds its result, recorded by this leader"
"""Why a first write is not made though no other attempt holds the trial (``_not_ours``)."""


class HeldLease:
    """This leader's lease on the trial it evaluates, kept by a thread of its own."""

    def __init__(self, me: Owner, heartbeat_s: float, time_limit_s: float | None) -> None:
        self.me = me
        self.heartbeat_s = heartbeat_s
        self.time_limit_s = time_limit_s
        self.on_time_limit: Callable[[str, Path, float], None] | None = None
        """Called on the heartbeat thread when the held trial runs past the limit."""
        self.on_superseded: Callable[[str], None] | None = None
        """Called on the heartbeat thread with the log line when another leader's
        attempt took the held trial over (this one was silent past the grace period)."""
        self._held: tuple[Path, Lease] | None = None
        self._unwritten: tuple[Path, Lease] | None = None
        """The lease ``take`` recorded that the heartbeat thread has not written yet."""
        self._written = threading.Event()
        self._written.set()
        self._lock = threading.Lock()
        self.io = threading.Lock()
        """Held around a write of a taken lease and a hand-back's read-check-write: the
        lease file's own lock does not exclude two threads of one process (a POSIX
        lock belongs to the process)."""
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._silent_said = False
        self._taken_at: float | None = None

    def take(self, trial_dir: Path, lease: Lease) -> None:
        """Hold ``lease`` from now on: written at once by the thread, renewed after."""
        with self._lock:
            self._held = self._unwritten = (trial_dir, lease)
            self._written.clear()
            self._taken_at = time.monotonic()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="neps_bcast-heartbeat", daemon=True
            )
            self._thread.start()
        self._wake.set()

    def held(self) -> tuple[Path, Lease] | None:
        with self._lock:
            return self._held

    def unwritten(self) -> tuple[Path, Lease] | None:
        with self._lock:
            return self._unwritten

    def written(self, timeout: float) -> bool:
        """Wait until the last lease taken is written (or dropped); False on timeout."""
        return self._written.wait(timeout)

    def drop(self) -> None:
        """The trial ended: stop renewing its lease (and never write it if the thread
        has not yet: the trial is over)."""
        with self._lock:
            self._held = None
            self._unwritten = None
            self._written.set()

    def close(self) -> None:
        self._closed = True
        self.drop()
        self._wake.set()

    def _run(self) -> None:
        """The heartbeat thread: writes each lease taken, renews the held one every
        heartbeat period."""
        while True:
            woken = self._wake.wait(self._next_wait())
            self._wake.clear()
            if self._closed:
                return
            self._check_time_limit()
            with self._lock:
                fresh = self._unwritten
            if fresh is not None:
                self.write_taken(fresh, tell=True)
            elif not woken:
                self._renew()

    def _next_wait(self) -> float:
        """Until the next heartbeat, or the held trial's time limit if that is sooner."""
        with self._lock:
            taken_at = self._taken_at if self._held is not None else None
        if taken_at is None or self.time_limit_s is None:
            return self.heartbeat_s
        left = taken_at + self.time_limit_s - time.monotonic()
        return max(0.0, min(self.heartbeat_s, left))

    def _check_time_limit(self) -> None:
        """``NEPS_BCAST_TRIAL_TIME_LIMIT_S``: hand the held trial to ``on_time_limit``
        once it has run that long (once per trial)."""
        with self._lock:
            held, taken_at = self._held, self._taken_at
            limit = self.time_limit_s
            if held is None or taken_at is None or limit is None:
                return
            if time.monotonic() - taken_at < limit or self.on_time_limit is None:
                return
            self._taken_at = None
        self.on_time_limit(held[1].trial_id, held[0], limit)

    def write_taken(self, fresh: tuple[Path, Lease], *, tell: bool) -> None:
        """Write the lease ``take`` recorded, unless it was dropped or replaced since, or
        the trial is no longer this attempt's (then the attempt is dropped, and with
        ``tell`` ``on_superseded`` is told). Under the lease file's lock, as every
        renewal and takeover is: a takeover cannot land between the check and the
        write."""
        trial_dir, lease = fresh
        try:
            with self.io, lease_lock(trial_dir):
                why_not = self._not_ours(trial_dir, lease)
                with self._lock:
                    if self._unwritten is not fresh:
                        return  # dropped meanwhile: the trial ended here
                    if why_not is not None:
                        self._held = self._unwritten = None
                if why_not is None:
                    write_lease(trial_dir, lease)
        except OSError as exc:
            # Tried again every heartbeat period, as a failed renewal is: until it is
            # written, a leader elsewhere takes the trial over after the grace period.
            self.log(logging.WARNING, "could not write the lease of %s: %s", trial_dir, exc)
            return
        if why_not is ENDED_HERE:
            # This leader settled the trial itself before the thread wrote its lease (a
            # step of its own raised at once, and the trial was recorded crashed): the
            # attempt is over, nobody else's.
            with self._lock:
                if self._unwritten is None:
                    self._written.set()
            return
        if why_not is not None:
            try:
                self.log(logging.ERROR, "%s; its lease is not written", why_not)
                if tell and self.on_superseded is not None:
                    self.on_superseded(why_not)
            finally:
                with self._lock:
                    if self._unwritten is None:  # unless a later trial was taken since
                        self._written.set()  # this attempt is over: nothing to write
            return
        with self._lock:
            if self._unwritten is fresh:
                self._unwritten = None
                self._written.set()

    def _not_ours(self, trial_dir: Path, lease: Lease) -> str | None:
        """Under the lease lock, before the first write: why the trial is no longer this
        attempt's (another attempt's lease, or NePS no longer holds it evaluating for
        this leader), or None. ``OSError`` where either cannot be read yet."""
        try:
            on_disk = parse_lease(trial_dir)
        except (ValueError, KeyError, TypeError) as exc:
            raise OSError(f"cannot read the lease there: {exc}") from exc
        if on_disk is not None and (
            on_disk.owner not in (None, self.me) or len(on_disk.attempts) > len(lease.attempts)
        ):
            return superseded(lease.trial_id, lease.attempt, on_disk)
        try:
            holder = neps_trials.holder(trial_dir)
        except ValueError as exc:
            raise OSError(f"cannot read NePS's record there: {exc}") from exc
        if holder is None:
            return None  # no NePS record there: the lease alone decides
        state, worker_id = holder
        worker = Owner.from_worker_id(worker_id)
        if state == "evaluating" and (worker is None or worker == self.me):
            return None
        if state in FINISHED and worker == self.me:
            return ENDED_HERE
        by = f"worker {worker_id}" if state == "evaluating" else "nobody"
        return (
            f"{superseded(lease.trial_id, lease.attempt, on_disk)} (NePS holds it"
            f" {state}, evaluated by {by})"
        )

    def _renew(self) -> None:
        with self._lock:
            held = self._held
            if held is None:
                return
            if liveness.any_silent():
                # The lease tells the truth: a leader whose group has a silent rank is
                # stuck behind it, and its trial must be free to be taken over.
                if not self._silent_said:
                    self._silent_said = True
                    self.log(
                        logging.ERROR,
                        "not renewing the lease of trial %s: a rank of its group is silent",
                        held[1].trial_id,
                    )
                    self._say_silent(*held)
                return
            trial_dir, lease = held
            try:
                with lease_lock(trial_dir):
                    try:
                        on_disk = parse_lease(trial_dir)
                    except (ValueError, KeyError, TypeError) as exc:
                        # Unreadable is not taken over (a flaky mount, a torn read):
                        # tried again at the next heartbeat.
                        raise OSError(f"cannot read it: {exc}") from exc
                    if on_disk is None or on_disk.owner != self.me:
                        line = superseded(lease.trial_id, lease.attempt, on_disk)
                        self.log(logging.ERROR, "%s; no longer renewing its lease", line)
                        self._held = None
                        if self.on_superseded is not None:
                            self.on_superseded(line)
                        return
                    # The history on disk is the truth (a takeover may have added to it).
                    renewed = replace(on_disk, heartbeat=time.time(), beats=on_disk.beats + 1)
                    write_lease(trial_dir, renewed)
                self._held = (trial_dir, renewed)
            except OSError as exc:
                self.log(logging.WARNING, "could not renew the lease of %s: %s", trial_dir, exc)

    def _say_silent(self, trial_dir: Path, lease: Lease) -> None:
        """Record in the lease which rank went silent (``neps-bcast status`` shows it);
        the heartbeat stays as it was."""
        text = "; ".join(silence.describe() for silence in liveness.silent_ones())
        try:
            with lease_lock(trial_dir):
                on_disk = read_lease(trial_dir)
                if on_disk is not None and on_disk.owner == self.me:
                    write_lease(trial_dir, replace(on_disk, silent=text))
        except OSError as exc:
            self.log(logging.WARNING, "could not mark the lease of %s: %s", trial_dir, exc)

    def log(self, level: int, message: str, *args: object) -> None:
        logger.log(level, message, *args)
