"""The ways a pool's trial ends without an outcome from its rank 0: a lost rank, a lost
agent, the time limit. Each is told to the trial's agent (so the trial goes back to
pending), and the trial's ranks still in it are stopped."""

from __future__ import annotations

from neps_bcast.launcher import status
from neps_bcast.pool.members import Member, Order, exit_text
from neps_bcast.pool.trials import Trials

LOST_PEER_GRACE_S = 10.0
"""How long the ranks of a trial that lost one of its ranks have to leave it before the
launcher SIGKILLs them. A peer lost in a collective is seen in milliseconds (gloo), and
rank 0 then reports the trial with its reason; one lost before it joined the trial's
group is not: the others wait in the rendezvous for ``NEPS_BCAST_JOIN_TIMEOUT_S``
(300 s), holding their devices (found by the pool's fault sweep: SIGKILL to a rank at
its order). A trial that lost its agent has no grace: its ranks are SIGKILLed at once
(``Endings.stop_ranks_of``)."""


class Endings:
    """A pool's trials that lose a process or run too long."""

    def __init__(self, trials: Trials, display: status.Display) -> None:
        self.trials = trials
        self.display = display

    def rank_lost(self, order: Order, rank: Member, code: int, now: float) -> None:
        """A rank of a running trial exited. Its rank 0 answers for the trial when it can
        (a peer lost in a collective is seen in milliseconds); when rank 0 itself is gone,
        the launcher tells the agent, naming the first rank the trial lost (rank 0's last
        words are read first: an outcome it sent wins). The trial's other ranks have
        ``LOST_PEER_GRACE_S`` to leave it (``end_orphaned``)."""
        order.clean = False
        if order.first_lost is None:
            order.first_lost = (
                f"rank {order.ranks.index(rank.index)} of trial {order.trial} (device"
                f" {rank.index}, pid {rank.proc.pid}) {exit_text(code)}"
            )
        # The trial's own rank 0, not whoever holds its device now: a fresh rank there
        # is idle, and has no last words about this trial.
        head = order.members[0] if order.members else None
        if head is not None and head is not rank:
            self.trials.hear(head)
        if not order.answered and head is rank:
            self.trials.lost(order, order.first_lost)
        order.free.add(rank.index)
        if order.lost_at is None:
            order.lost_at = now
        self.trials.release_if_free(order)

    def stop_ranks_of(self, order: Order, why: str) -> None:
        """A placed trial that runs again elsewhere, in the same directory (its agent is
        gone, or it ran past ``--trial-time-limit``): its ranks are SIGKILLed at once;
        each is then reaped as a lost rank, and a fresh one takes its device."""
        order.lost_at = float("inf")  # no grace to wait for: done here
        order.first_lost = order.first_lost or f"trial {order.trial}: {why}"
        self._kill_ranks(order, f"trial {order.trial}: {why}: SIGKILL to its rank on device")

    def end_orphaned(self, now: float) -> None:
        """A trial that lost a rank: its ranks still in it after ``LOST_PEER_GRACE_S``
        are SIGKILLed (a rank waiting in the trial's rendezvous for the lost one would
        hold its device for the join timeout)."""
        for order in list(self.trials.orders.values()):
            if order.lost_at is None or now < order.lost_at + LOST_PEER_GRACE_S:
                continue
            order.lost_at = float("inf")  # once
            self._kill_ranks(
                order,
                f"trial {order.trial} lost a process {LOST_PEER_GRACE_S:.0f} s ago:"
                " SIGKILL to its rank still in it on device",
            )

    def end_overdue(self, now: float) -> None:
        """``--trial-time-limit``: a trial placed longer ago than the limit and still
        without an outcome (hung in the user's code, or just too long) has its ranks
        SIGKILLed; its agent hears it lost, naming the limit, so the trial goes back to
        pending (``NEPS_BCAST_MAX_RETRIES`` times, then crashed), and fresh ranks take
        its devices. A hung trial would otherwise hold its devices for ever and, wide at
        the head of the queue, stall every trial behind it."""
        limit = self.trials.plan.trial_time_limit_s
        if limit is None:
            return
        for order in list(self.trials.orders.values()):
            if order.placed_at is None or order.answered or order.lost_at is not None:
                continue
            if now - order.placed_at >= limit:
                self.stop_ranks_of(
                    order, f"still running {limit:g} s after it was placed (--trial-time-limit)"
                )

    def _kill_ranks(self, order: Order, what: str) -> None:
        for rank in order.members:
            if rank.index not in order.free and rank.proc.poll() is None:
                self.display.say(
                    f"{what} {rank.index} (pid {rank.proc.pid}); a fresh one takes the device."
                )
                rank.kill()
