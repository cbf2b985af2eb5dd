"""What a worker about to end waits for: no search ends with a trial in doubt.

NePS's run returns when its budget is reached or nothing is left to sample, and it
counts a trial that is ``evaluating`` as spent. A trial evaluating under the lease of
another machine, whose owner this worker can prove neither alive nor dead yet, may be an
orphan nobody will look at again once every worker has ended: a host died, the same
command was run again at once, ran the other trials and ended before the grace period
(300 s by default) had passed, and the search ended with that trial ``evaluating`` for
ever. So before it ends, a worker waits for each such trial, with one log line naming
them and the longest it waits, until

- it sees the trial's lease renewed (or taken by another attempt): its owner lives and
  will finish it, and this worker ends as it would have; or
- it has seen the lease unchanged for the grace period, timed on its own monotonic
  clock (no other host's clock is read): the look for orphans takes the trial over,
  back to ``pending``, and this worker runs it (``neps.run`` entered again).

Never longer than the grace period and a heartbeat period. An owner on this machine is
judged at once (its process is alive or it is not), and so is a trial nobody holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from neps_bcast.log import logger
from neps_bcast.recovery.hand_back import HandBack, Left, Seen
from neps_bcast.recovery.signals import indivisible

SHORTEST_POLL_S = 0.1
"""A look at most this often, whatever the heartbeat period (it reads NePS's trials)."""


class InDoubt:
    """The trials a worker about to end waits for, each as it first saw its lease."""

    def __init__(
        self,
        root: Path,
        hand_back: HandBack,
        heartbeat_s: float,
        grace_s: float,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.root = root
        self._hand_back = hand_back
        """The leader's own look for orphans: it times each lease since it first saw it."""
        self.heartbeat_s = heartbeat_s
        self.grace_s = grace_s
        self._sleep = sleep
        self.put_back: list[str] = []
        """Trials the looks put back to pending: this worker runs them before it ends."""
        self._first: dict[str, Seen] = {}
        self._judged: set[str] = set()
        """Trials whose lease was seen renewed: their owner lives."""

    def look(self) -> dict[str, str]:
        """One look for orphans (whole, for a stop): those provably gone are put back
        (``put_back``); returns the trials still in doubt, each with whose lease it is."""
        with indivisible():
            look = self._hand_back.look(self.root)
        self.put_back.extend(look.put_back)
        doubts: dict[str, str] = {}
        for left in look.left:
            if left.alive_here or left.trial_id in self._judged:
                continue
            if left.seen is not None:
                first = self._first.setdefault(left.trial_id, left.seen)
                if left.seen != first:
                    self._judged.add(left.trial_id)
                    logger.info(
                        "trial %s: its lease changed (%s): its owner lives and will finish it",
                        left.trial_id,
                        _whose(left),
                    )
                    continue
            doubts[left.trial_id] = _whose(left)
        return doubts

    def wait(self, doubts: dict[str, str]) -> int:
        """Wait for ``doubts`` (from ``look``) as the module says; returns how many trials
        were put back for this worker to run (0: it ends)."""
        longest = self.grace_s + self.heartbeat_s
        logger.warning(
            "this worker's search is over, but %s evaluating under %s, which it can prove"
            " neither alive nor dead yet: waiting until %s renewed, or at most %.1f s"
            " (NEPS_BCAST_LEASE_GRACE_S + NEPS_BCAST_HEARTBEAT_S), then taking %s over",
            _trials(doubts),
            ", ".join(f"the lease of {whose}" for whose in doubts.values()),
            "it is" if len(doubts) == 1 else "each is",
            longest,
            "it" if len(doubts) == 1 else "them",
        )
        deadline = time.monotonic() + longest
        while doubts and not self.put_back:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                break
            self._sleep(min(max(self.heartbeat_s, SHORTEST_POLL_S), left_s))
            doubts = self.look()
        if self.put_back:
            logger.warning(
                "trial(s) %s taken over: this worker runs them before it ends",
                ", ".join(self.put_back),
            )
        elif doubts:
            logger.warning(
                "%s still in doubt after %.1f s (not readable, or its lease lock held):"
                " this worker ends; a later worker's look hands it back",
                _trials(doubts),
                longest,
            )
        return len(self.put_back)


def _whose(left: Left) -> str:
    if left.owner is not None:
        return left.owner.describe()
    return "nobody yet (no lease)" if left.seen is not None else "a lease whose lock is held"


def _trials(doubts: dict[str, str]) -> str:
    ids = ", ".join(doubts)
    return f"trial {ids} is" if len(doubts) == 1 else f"trials {ids} are"
