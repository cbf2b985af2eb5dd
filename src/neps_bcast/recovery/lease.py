"""Leases on running trials: no trial is ever stuck ``evaluating``.

NePS 0.17 hands out only ``pending`` trials and keeps no heartbeat, so a trial whose
worker died (a SIGKILLed leader, a lost node, a preempted job) stays ``evaluating`` for
ever: it is never evaluated again and blocks a hyperband bracket. Here every leader
records who owns the trial it evaluates, in a small JSON file in the trial's own
directory (``<root>/configs/config_<id>/.neps_bcast_lease.json``): host, boot id, pid
namespace, pid, the process's start time (so a reused pid is not taken for the owner)
and a heartbeat that one thread per leader renews every ``NEPS_BCAST_HEARTBEAT_S``.

Any leader can then prove an owner dead, under NePS's own trial lock (so two leaders
never both take one trial, and NePS hands the trial to exactly one worker afterwards):

- same machine (host, boot id and pid namespace): the pid is gone or belongs to a
  process that started at another time; decided at once;
- another machine or container: no heartbeat for ``NEPS_BCAST_LEASE_GRACE_S``;
- no lease at all (a worker killed between NePS's "evaluating" and our first write):
  NePS's own start time is older than the grace period.

Such an orphan goes back to ``pending`` with NePS's own ``Trial.reset`` (same config,
same pipeline directory, same previous pipeline directory; NePS picks the oldest pending
trial first). So does a trial this leader must abandon for an infrastructure reason
(SIGTERM, a lost follower). Every such interruption is appended to the lease's history;
after ``NEPS_BCAST_MAX_RETRIES`` of them the trial is recorded ``crashed`` with that
history instead. An error raised by the user's code is not an interruption: NePS
records it ``crashed`` as always, and it is never retried.

An interrupted trial's next evaluation is told which attempt it is and whether an
earlier attempt left files in the trial's directory (``resumed_from``): the user's code
can then resume from its own checkpoint there.

Leaders look for orphans when they start (holding the root lock, before NePS samples)
and before each trial's lease (NePS has recorded the last trial by then), there at
most once per ``NEPS_BCAST_HEARTBEAT_S``: the look reads NePS's whole trial book under
its lock.

A leader killed after NePS set its trial evaluating and before it wrote the lease is
found through NePS's own record of the worker: each leader runs NePS under a worker id
naming its process (``Owner.worker_id``), so such a trial is proven dead at once on
the same machine too; elsewhere (or under a worker id the user chose) after the grace.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from neps_bcast import faults
from neps_bcast.compat import neps as neps_compat
from neps_bcast.compat import neps_trials
from neps_bcast.config import Settings
from neps_bcast.launcher.lease_record import parse_lease
from neps_bcast.log import logger
from neps_bcast.recovery.hand_back import HandBack
from neps_bcast.recovery.lease_file import (
    OURS_PREFIX,
    Attempt,
    Lease,
    Owner,
    lease_lock,
    read_lease,
    write_lease,
)
from neps_bcast.transport import liveness


class Leases:
    """This leader's lease on the trial it evaluates, and the orphans it hands back."""

    def __init__(self, root_directory: Path, settings: Settings) -> None:
        self.root = Path(root_directory)
        self.heartbeat_s = settings.heartbeat_s
        self.me = Owner.me()
        self._hand_back = HandBack(self.me, settings)
        self._held: tuple[Path, Lease] | None = None
        self._unwritten: tuple[Path, Lease] | None = None
        """The lease ``take`` recorded that the heartbeat thread has not written yet."""
        self._written = threading.Event()
        self._written.set()
        self._lock = threading.Lock()
        self._io = threading.Lock()
        """Held around a write of a taken lease and a hand-back's read-check-write: the
        lease file's own lock does not exclude two threads of one process (a POSIX
        lock belongs to the process)."""
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._silent_said = False
        self.time_limit_s = settings.trial_time_limit_s
        self.on_time_limit: Callable[[str, Path, float], None] | None = None
        """Called on the heartbeat thread when the held trial runs past the limit."""
        self._taken_at: float | None = None
        self._mine: dict[str, tuple[Path, int]] = {}
        """Every trial this leader took: its directory and this leader's attempt."""
        self.on_superseded: Callable[[str], None] | None = None
        """Called on the heartbeat thread with the log line when another leader's
        attempt took the held trial over (this one was silent past the grace period)."""
        self._looked_at: float | None = None
        """When this leader last looked for orphans (``time.monotonic``)."""

    def log(self, level: int, message: str, *args: object) -> None:
        logger.log(level, message, *args)

    # -- this leader's own trial ------------------------------------------------
    def take(self, trial_id: str, trial_dir: Path, ranks: int | None = None) -> int:
        """This leader evaluates ``trial_id`` now: record it and keep it renewed.
        ``ranks``: its group's size where known (``neps-bcast status`` shows it).

        Returns the attempt this is: 1, or n + 1 after n interruptions put it back.

        The lease file is written by the heartbeat thread, at once but off the path to
        the hand-over: a write is a file created and renamed, 0.2 ms on an idle disk and
        5 to 17 ms measured while other jobs wrote to the same disk, all of it added to
        every trial's control steps when the leader waited for it. Nothing waits for it:
        a trial without its lease yet is one whose leader died before it wrote one, and
        NePS's own record of this worker proves that owner dead or alive the same way
        (``lease_file.why_dead``). A hand-back writes it first (``give_back``)."""
        faults.point("lease")
        now = time.time()
        previous = read_lease(trial_dir)
        attempts = previous.attempts if previous is not None else ()
        attempt = len(attempts) + 1
        lease = Lease(trial_id, self.me, now, now, attempts, ranks, attempt=attempt)
        with self._lock:
            self._held = self._unwritten = (trial_dir, lease)
            self._written.clear()
            self._taken_at = time.monotonic()
            self._mine[trial_id] = (trial_dir, attempt)
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="neps_bcast-heartbeat", daemon=True
            )
            self._thread.start()
        self._wake.set()
        faults.point("leased")
        return attempt

    def written(self, timeout: float) -> bool:
        """Wait until the last lease taken is written (or dropped); False on timeout."""
        return self._written.wait(timeout)

    def drop(self) -> None:
        """The trial ended (NePS records it): stop renewing its lease (and never write
        it if the thread has not yet: the trial is over)."""
        with self._lock:
            self._held = None
            self._unwritten = None
            self._written.set()

    def close(self) -> None:
        self._closed = True
        self._mine.clear()  # the search is over: fence nothing more (one process, one run)
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
                self._write_taken(fresh)
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

    def _write_taken(self, fresh: tuple[Path, Lease]) -> None:
        """Write the lease ``take`` recorded, unless it was dropped or replaced since.

        Without the lease file's lock, as ``take`` wrote it before: no other leader
        takes over a trial NePS has just handed to this live one, and this process's
        own hand-back waits on ``_io``."""
        trial_dir, lease = fresh
        try:
            with self._io:
                with self._lock:
                    if self._unwritten is not fresh:
                        return
                write_lease(trial_dir, lease)
        except OSError as exc:
            # Tried again every heartbeat period, as a failed renewal is: until it is
            # written, a leader elsewhere takes the trial over after the grace period.
            self.log(logging.WARNING, "could not write the lease of %s: %s", trial_dir, exc)
            return
        with self._lock:
            if self._unwritten is fresh:
                self._unwritten = None
                self._written.set()

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

    def refuse_record(self, trial_id: str) -> str | None:
        """Fencing, under NePS's trial lock as NePS records ``trial_id``'s result: why this
        leader may not record it (another attempt took the trial over), or None. Only the
        current attempt's owner records; a trial this leader never leased is not ours
        to judge."""
        mine = self._mine.get(trial_id)
        if mine is None or getattr(_HANDING_BACK, "active", False):
            return None  # not ours to judge, or our own hand-back recording it
        trial_dir, attempt = mine
        # No lease lock: NePS's trial lock, held here, already excludes every takeover,
        # and a lease is replaced atomically. Waiting on the lease lock would put a wait
        # bounded only by its holder's death (a renewal frozen mid-write) inside NePS's
        # critical section.
        on_disk = read_lease(trial_dir)
        if on_disk is None or (on_disk.owner == self.me and on_disk.attempt in (0, attempt)):
            return None
        return superseded(trial_id, attempt, on_disk)

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

    def give_back_held(self, how: str) -> str:
        """Put back the trial this leader holds, from any thread (``give_back``)."""
        with self._lock:
            held = self._held
        if held is None:
            return "none held"
        trial_dir, lease = held
        return f"trial {lease.trial_id} {self.give_back(lease.trial_id, trial_dir, how)}"

    def give_back(self, trial_id: str, trial_dir: Path, how: str) -> str:
        """This leader abandons its trial for an infrastructure reason (``how``): back to
        pending, or crashed once it was interrupted more than the retry limit. Returns
        what became of it."""
        # Its own hand-back is this leader's last word on the trial: NePS records it (a
        # crash past the retry limit goes through NePS's own recording), so the fence
        # must not refuse it as another attempt's.
        self._mine.pop(trial_id, None)
        faults.point("settle")
        with self._lock:
            fresh = self._unwritten
        if fresh is not None and fresh[1].trial_id == trial_id:
            self._write_taken(fresh)  # the history names this attempt's own start
        self.drop()
        with self._io, neps_compat.locked_trials(self.root) as book:
            if book is None or book.state_of(trial_id) != "evaluating":
                return "left as NePS has it"
            with lease_lock(trial_dir):
                lease = read_lease(trial_dir) or Lease(trial_id, self.me, time.time(), time.time())
                if lease.owner not in (None, self.me):
                    return f"left to {lease.owner.describe()}, which took it over"
                attempt = Attempt(self.me, lease.started, time.time(), how)
                with _handing_back():
                    return self._hand_back.trial(book, trial_id, trial_dir, lease, attempt)

    # -- orphans ---------------------------------------------------------------
    def recover_orphans(self) -> list[str]:
        """Put back every trial whose owner is provably gone; what was done, per trial."""
        self._looked_at = time.monotonic()
        with _handing_back():
            return self._hand_back.orphans(self.root)

    def recover_orphans_if_due(self) -> list[str]:
        """Before a trial: ``recover_orphans`` unless this leader looked less than a
        heartbeat period ago.

        Why: the look reads every trial NePS holds under NePS's lock, measured 3 to 9 ms
        on 2 cores and growing with the trials, while nothing it finds is urgent. An
        owner elsewhere is dead only after ``NEPS_BCAST_LEASE_GRACE_S``, at least three
        heartbeat periods; an owner on this machine is dead at once, and its trial now
        waits at most one period more, while NePS samples a new one.
        """
        faults.point("orphans")
        if self._looked_at is not None and time.monotonic() - self._looked_at < self.heartbeat_s:
            return []
        return self.recover_orphans()


def left_by_earlier_attempts(trial_dir: Path, attempt: int) -> Path | None:
    """On a retry (``attempt`` > 1): ``trial_dir`` when an earlier attempt wrote anything
    there besides NePS's and neps_bcast's own files (a checkpoint), else None."""
    if attempt <= 1:
        return None
    ours = neps_trials.trial_files()
    try:
        for entry in trial_dir.iterdir():
            if entry.name not in ours and not entry.name.startswith(OURS_PREFIX):
                return trial_dir
    except OSError as exc:
        logger.log(logging.WARNING, "could not look into %s: %s", trial_dir, exc)
    return None


def superseded(trial_id: str, attempt: int, on_disk: Lease | None) -> str:
    """The one line a leader whose attempt was taken over logs."""
    if on_disk is not None and on_disk.owner is not None:
        by = f"attempt {on_disk.attempt or len(on_disk.attempts) + 1} on {on_disk.owner.describe()}"
    else:
        by = "a leader's look for orphans, which put it back to pending"
    return (
        f"trial {trial_id}: this leader's attempt {attempt} was superseded by {by} (this"
        " host was silent past NEPS_BCAST_LEASE_GRACE_S): its result is dropped"
    )


_HANDING_BACK = threading.local()
"""Set on a thread while it hands a trial back: a crash past the retry limit is recorded
through NePS's own recording, which the fence must let through."""


@contextlib.contextmanager
def _handing_back() -> Iterator[None]:
    _HANDING_BACK.active = True
    try:
        yield
    finally:
        _HANDING_BACK.active = False
