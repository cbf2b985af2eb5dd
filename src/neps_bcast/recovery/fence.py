"""Fencing: only the attempt that holds a trial's lease records its result.

Every attempt of a trial has a number (the lease's ``attempt``: 1, or n + 1 after n
interruptions). A leader that comes back after its trial was taken over (its host
frozen, or cut off from the network or from the root past the grace period) must not
replace the result of the attempt that holds the lease now. NePS calls the check while
it records, under its trial lock (``compat.neps_run.fence_recording``), so no takeover
can fall between the check and the write.

A lease that cannot be read proves nothing either way: the result is refused, with the
reason, rather than let through on a guess (the leader then stops, and the look for
orphans hands the trial back once its owner is proven gone).
"""

from __future__ import annotations

from pathlib import Path

from neps_bcast.launcher.lease_record import Lease, Owner, parse_lease
from neps_bcast.recovery import hand_back


class Fence:
    """The trials one leader took, and the attempt it took each as."""

    def __init__(self, me: Owner) -> None:
        self.me = me
        self._mine: dict[str, tuple[Path, int]] = {}
        """Every trial this leader took: its directory and this leader's attempt."""

    def took(self, trial_id: str, trial_dir: Path, attempt: int) -> None:
        self._mine[trial_id] = (trial_dir, attempt)

    def let_go(self, trial_id: str) -> int | None:
        """This leader's last word on ``trial_id`` is its own hand-back: nothing more of
        it is fenced. Returns the attempt it had taken it as (None: not taken here)."""
        mine = self._mine.pop(trial_id, None)
        return None if mine is None else mine[1]

    def clear(self) -> None:
        """The search is over: fence nothing more (one process, one run)."""
        self._mine.clear()

    def refuse(self, trial_id: str) -> str | None:
        """Under NePS's trial lock as NePS records ``trial_id``'s result: why this leader
        may not record it, or None. Only the current attempt's owner records; a trial
        this leader never leased is not ours to judge."""
        mine = self._mine.get(trial_id)
        if mine is None or hand_back.handing_back():
            return None  # not ours to judge, or a hand-back recording it
        trial_dir, attempt = mine
        # No lease lock: NePS's trial lock, held here, already excludes every takeover,
        # and a lease is replaced atomically. Waiting on the lease lock would put a wait
        # bounded only by its holder's death (a renewal frozen mid-write) inside NePS's
        # critical section.
        try:
            on_disk = parse_lease(trial_dir)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return (
                f"trial {trial_id}: this leader's attempt {attempt} cannot prove it still"
                f" holds the trial: its lease cannot be read ({type(exc).__name__}: {exc}),"
                " so its result is dropped rather than let over another attempt's"
            )
        if on_disk is None or (on_disk.owner == self.me and on_disk.attempt in (0, attempt)):
            return None
        return superseded(trial_id, attempt, on_disk)


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
