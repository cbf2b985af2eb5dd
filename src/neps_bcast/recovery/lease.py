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

``Leases`` is the leader's one handle on all of it; each concern lives with its state:
the held lease and its thread (``held_lease``), the fence over NePS's recording
(``fence``), handing trials back (``hand_back``), and what a worker about to end waits
for (``in_doubt``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from neps_bcast import faults
from neps_bcast.compat import neps as neps_compat
from neps_bcast.compat import neps_trials
from neps_bcast.config import Settings
from neps_bcast.launcher.lease_record import parse_lease
from neps_bcast.log import logger
from neps_bcast.recovery.fence import Fence
from neps_bcast.recovery.hand_back import HandBack
from neps_bcast.recovery.held_lease import HeldLease
from neps_bcast.recovery.in_doubt import InDoubt
from neps_bcast.recovery.lease_file import (
    OURS_PREFIX,
    Attempt,
    Lease,
    Owner,
    lease_lock,
    read_lease,
)


class Leases:
    """This leader's lease on the trial it evaluates, and the orphans it hands back."""

    def __init__(self, root_directory: Path, settings: Settings) -> None:
        self.root = Path(root_directory)
        self.heartbeat_s = settings.heartbeat_s
        self.grace_s = settings.lease_grace_s
        self.me = Owner.me()
        self.held = HeldLease(self.me, settings.heartbeat_s, settings.trial_time_limit_s)
        """The lease on the trial this leader evaluates, and its thread (``on_superseded``,
        ``on_time_limit``: what the leader does when it is taken over or runs too long)."""
        self.fence = Fence(self.me)
        self._hand_back = HandBack(self.me, settings)
        self._looked_at: float | None = None
        """When this leader last looked for orphans (``time.monotonic``)."""

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
        self.fence.took(trial_id, trial_dir, attempt)
        self.held.take(
            trial_dir, Lease(trial_id, self.me, now, now, attempts, ranks, attempt=attempt)
        )
        faults.point("leased")
        return attempt

    def written(self, timeout: float) -> bool:
        """Wait until the last lease taken is written (or dropped); False on timeout."""
        return self.held.written(timeout)

    def drop(self) -> None:
        """The trial ended (NePS records it): stop renewing its lease."""
        self.held.drop()

    def close(self) -> None:
        self.fence.clear()  # the search is over: fence nothing more (one process, one run)
        self.held.close()

    def refuse_record(self, trial_id: str) -> str | None:
        """Fencing, under NePS's trial lock as NePS records ``trial_id``'s result: why this
        leader may not record it (another attempt took the trial over, or its lease
        cannot be read), or None (``fence.Fence.refuse``)."""
        return self.fence.refuse(trial_id)

    def give_back_held(self, how: str) -> str:
        """Put back the trial this leader holds, from any thread (``give_back``)."""
        held = self.held.held()
        if held is None:
            return "none held"
        trial_dir, lease = held
        return f"trial {lease.trial_id} {self.give_back(lease.trial_id, trial_dir, how)}"

    def give_back(self, trial_id: str, trial_dir: Path, how: str) -> str:
        """This leader abandons its trial for an infrastructure reason (``how``): back to
        pending, or crashed once it was interrupted more than the retry limit. Returns
        what became of it. Only the attempt this leader took: one another leader (or
        another attempt of this one) holds now is left to it."""
        # Its own hand-back is this leader's last word on the trial: NePS records it (a
        # crash past the retry limit goes through NePS's own recording), so the fence
        # must not refuse it as another attempt's.
        attempt = self.fence.let_go(trial_id)
        faults.point("settle")
        fresh = self.held.unwritten()
        if fresh is not None and fresh[1].trial_id == trial_id:
            self.held.write_taken(fresh, tell=False)  # the history names this attempt's start
        self.held.drop()
        with self.held.io, neps_compat.locked_trials(self.root) as book:
            if book is None or book.state_of(trial_id) != "evaluating":
                return "left as NePS has it"
            with lease_lock(trial_dir):
                try:
                    lease = own_lease(trial_dir, trial_id, self.me)
                except ValueError as exc:
                    logger.log(logging.ERROR, "trial %s: %s", trial_id, exc)
                    return f"left evaluating: {exc}"
                taken_over = taken_over_from(lease, self.me, attempt)
                if taken_over is not None:
                    return taken_over
                ended = Attempt(self.me, lease.started, time.time(), how)
                return self._hand_back.trial(book, trial_id, trial_dir, lease, ended)

    # -- orphans ---------------------------------------------------------------
    def recover_orphans(self) -> list[str]:
        """Put back every trial whose owner is provably gone; what was done, per trial."""
        self._looked_at = time.monotonic()
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

    def in_doubt(self) -> InDoubt:
        """What this worker, about to end, waits for: the trials still evaluating under
        leases it cannot prove alive or dead yet (``in_doubt``)."""
        return InDoubt(self.root, self._hand_back, self.heartbeat_s, self.grace_s)


def own_lease(trial_dir: Path, trial_id: str, me: Owner) -> Lease:
    """The trial's lease for a hand-back of this leader's own trial: one this leader
    never wrote (its first write failed) is its own; one that cannot be read proves
    nothing, ``ValueError`` saying why (the trial is left to a look for orphans)."""
    try:
        lease = parse_lease(trial_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"its lease cannot be read ({type(exc).__name__}: {exc}): not handed back on a"
            " guess; a look for orphans hands it back once its owner is proven gone"
        ) from exc
    now = time.time()
    return lease if lease is not None else Lease(trial_id, me, now, now)


def taken_over_from(lease: Lease, me: Owner, attempt: int | None) -> str | None:
    """Why a hand-back of ``attempt`` (None: not known) must leave the trial: another
    owner, or another attempt, holds it now; None when it is this attempt's."""
    if lease.owner not in (None, me):
        return f"left to {lease.owner.describe()}, which took it over"
    if attempt is None:
        return None
    if lease.owner == me and lease.attempt not in (0, attempt):
        return f"left to attempt {lease.attempt} (this leader's attempt {attempt} is over)"
    if lease.owner is None and len(lease.attempts) >= attempt:
        return f"left as it is: attempt {attempt} was already handed back ({lease.history()})"
    return None


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
