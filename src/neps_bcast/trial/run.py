"""One trial on one rank, top to bottom.

Every rank, leader and follower alike, evaluates a trial the same way
(``evaluate_once``): it calls the user's function; inside it, ``session()`` meets the
other ranks (``TrialRun.enter_session``: every rank must hold the same trial); if any
rank raises, it publishes its error on the error board and releases the group
(``TrialRun.fail``, with ``trial.failure``), so peers blocked in the user's collectives
fail at once; and at the end every rank reports how its function ended
(``TrialRun.end``), so every rank learns every failure of the trial, root cause first.
Where the trial needs the user's group formed first, ``trial.forming`` forms it.

Ranks may reach different points after a failure (one raised before its session while
the others entered theirs): each exchange carries its ``Phase``, and a rank that sees a
peer already at the trial end takes that exchange as its own trial end.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from neps_bcast import faults
from neps_bcast.compat.neps import INJECTED_ARGUMENTS
from neps_bcast.compat.torch import release_destroyed_groups
from neps_bcast.ddp.teardown import Freed, trial_starts
from neps_bcast.errors import (
    ErrorRecord,
    FollowerLostError,
    NepsBcastError,
    ProtocolError,
    TrialFailedError,
    TrialMismatchError,
    first_line,
    format_message,
    sort_records,
)
from neps_bcast.recovery.signals import indivisible, preemption
from neps_bcast.runtime import Runtime
from neps_bcast.transport import liveness
from neps_bcast.transport.messages import Phase, Report, TrialMessage
from neps_bcast.trial import failure, forming


class TrialRun:
    """This rank's state in one trial; created and ended by ``evaluate_once``."""

    def __init__(self, rt: Runtime, message: TrialMessage) -> None:
        self.rt = rt
        self.message = message
        self.in_session = False
        self.mine: ErrorRecord | None = None
        """This rank's failure in this trial, once it raised."""
        self.formed_group = False
        """neps_bcast formed the default group at this trial's session entry."""
        self._published = False
        self._end_reports: list[Report] | None = None
        """The trial-end exchange, when a peer made it already during session entry."""

    @property
    def config(self) -> dict[str, Any]:
        return {k: v for k, v in self.message.kwargs.items() if k not in INJECTED_ARGUMENTS}

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """While the block runs, ``running(rt)`` is this trial."""
        _RUNNING[self.rt] = self
        try:
            yield
        finally:
            _RUNNING.pop(self.rt, None)

    def _report(self, phase: Phase) -> Report:
        m = self.message
        return Report(
            self.rt.group_rank, phase, m.seq, m.trial_id, self.mine, self.rt.group.exists()
        )

    # -- the group ---------------------------------------------------------------
    def form_group(self, generation: int) -> None:
        """Form the DDP group again (the leader said so), then meet the other ranks.

        No rank runs the function (which may fail and release the group) before every
        rank has formed it: a rank still inside torch's rendezvous when a peer shut the
        new group's connections failed there (seen in CI). A rank whose forming raised
        ends the trial instead of meeting; the others learn it here.
        """
        # The leader's generation, whether or not forming works here: every later step
        # of the trial is signed with it (a rank that raised before forming kept the
        # old one, and its trial-end exchange was refused as forged: the fault sweep).
        self.rt.group.generation = generation
        forming.reform(self.rt, generation)
        reports = self.rt.exchange(self._report(Phase.GROUP_FORMED))
        if reports is not None:
            self._check_meeting(reports, Phase.GROUP_FORMED)

    # -- session entry ---------------------------------------------------------
    def enter_session(self) -> None:
        """Meet the other ranks at ``session()``; raises if they are not all here.

        The meeting and the forming of a group after it are one step for a stop: raised
        between the two (at the meeting's end), a follower left its leader waiting to
        form the group with it (the fault sweep, SIGTERM to the follower as the leader
        formed the group at ``session()`` under torchrun)."""
        with indivisible():
            reports = self.rt.exchange(self._report(Phase.SESSION_ENTER))
            if reports is not None:
                self._check_meeting(reports, Phase.SESSION_ENTER)
                self._form_group_if_none(reports)
        self.rt.observe_group()
        self.in_session = True

    def _form_group_if_none(self, reports: list[Report]) -> None:
        """External launches: form a group now if no rank's code formed one
        (``trial.forming.form_if_none``)."""
        if forming.form_if_none(self.rt, self.message.seq, reports):
            self.formed_group = True

    def _check_meeting(self, reports: list[Report], phase: Phase) -> None:
        if any(r.phase == Phase.TRIAL_END for r in reports):
            # A peer already finished this trial (it failed before its session, or it
            # uses none): this exchange was its trial end, and it is ours too.
            self._end_reports = reports
            records = sort_records([r.error for r in reports if r.error is not None])
            if records:
                raise self.failed_error(records)
            raise ProtocolError(self._mismatch(reports).message)
        if any(r.phase != phase for r in reports):
            raise ProtocolError(self._mismatch(reports).message)
        if len({(r.seq, r.trial_id) for r in reports}) > 1:
            each = ", ".join(f"rank {r.group_rank}: trial {r.trial_id}" for r in reports)
            raise TrialMismatchError(
                format_message(
                    self.rt.tag,
                    f"the ranks hold different trials ({each}).",
                    "this is a bug in neps_bcast or a rank started outside"
                    " it; please report it with every rank's log.",
                )
            )

    # -- failure ---------------------------------------------------------------
    def fail(self, exc: BaseException) -> list[ErrorRecord]:
        """This rank raised: publish it, release the peers, return every known failure."""
        rt = self.rt
        record = failure.record(rt, exc)
        self.mine = record
        rt.log(logging.ERROR, "trial %s raised %s", self.message.trial_id, first_line(exc))
        board = failure.board(rt)
        if board is not None and not self._published:
            self._published = True
            failure.publish(rt, board, self.message.seq, record)
        if (rt.world_size or 0) > 1 or rt.group.exists():
            failure.release_group(rt, exc)
        published = failure.published(rt, self.message.seq)
        others = [r for r in published if r.group_rank != rt.group_rank]
        return sort_records([record, *others])

    # -- trial end -------------------------------------------------------------
    def end(self, error: BaseException | None) -> list[ErrorRecord]:
        """Every rank reports how its function ended; returns every failure, root first."""
        faults.point("exchange")
        if error is not None and self.mine is None:
            self.fail(error)
        if self._end_reports is None:
            self._end_reports = self.rt.exchange(self._report(Phase.TRIAL_END))
        reports = self._end_reports
        records = [self.mine] if self.mine is not None else []
        if reports is not None:
            records = [r.error for r in reports if r.error is not None]
            if not records and any(r.phase != Phase.TRIAL_END for r in reports):
                records = [self._mismatch(reports)]
        if records and (self.rt.world_size or 0) > 1 and not self.rt.group.broken:
            failure.release_group(self.rt)
        return sort_records(records)

    def interrupted(self, exc: BaseException) -> None:
        """Ctrl-C, SIGTERM, sys.exit: report it and keep the ranks in step, then re-raise."""
        if self.mine is None:
            self.fail(exc)
        with contextlib.suppress(NepsBcastError):
            self.end(exc)

    def _mismatch(self, reports: list[Report]) -> ErrorRecord:
        return failure.mismatch(self.rt, self.message.trial_id, reports)

    def failed_error(self, records: list[ErrorRecord]) -> TrialFailedError:
        return TrialFailedError(
            failure.failed_text(self.rt, records, self.message.trial_id), failures=records
        )


_RUNNING: weakref.WeakKeyDictionary[Runtime, TrialRun] = weakref.WeakKeyDictionary()
"""The trial each ``Runtime`` is evaluating (one per process, but the unit tests run
several ranks' runtimes in threads of one process)."""


def running(rt: Runtime) -> TrialRun | None:
    """The trial ``rt`` is evaluating now (``session()`` and Lightning's observer ask)."""
    return _RUNNING.get(rt)


@dataclass(frozen=True)
class Outcome:
    result: Any
    error: Exception | None
    """The user's function raised this on this rank."""
    failures: list[ErrorRecord]
    """Every rank's failure in this trial, root causes first (empty: success)."""


def evaluate_once(
    rt: Runtime,
    fn: Callable[..., Any],
    message: TrialMessage,
    hand_over: Callable[[], None] | None = None,
    held: contextlib.ExitStack | None = None,
) -> Outcome:
    """Evaluate one trial on this rank and end it together with every other rank.

    The DDP group is formed again first when a failure (or user code) ended it; an
    ``Exception`` there or in the function becomes part of the ``Outcome`` (every rank
    learns it); a ``BaseException`` (Ctrl-C, SIGTERM, ``sys.exit``) is reported, then
    re-raised. ``hand_over`` (the leader's): handing the trial to the followers is the
    trial's first step, so an interrupt that lands right after it still ends the trial
    on every rank (the group released, the followers' meeting answered). ``held`` (a
    follower's): the stop it holds since it received ``message``, handed on to the
    forming here, so the follower too takes the trial's first step before a stop ends it.

    A follower whose step brought the leader's STOP raises ``SearchStopped``.

    Each trial starts clean (``ddp.teardown.trial_starts``): what earlier trials left on
    this rank is freed first, unless the rank did it while it waited (a follower, a pool
    rank). On the leader it is done here, before the hand-over: after the trial the
    leader's time belongs to NePS (recording, sampling).
    """
    log_freed(rt, trial_starts())
    rt.trial_label = f"trial {message.trial_id} (#{message.seq})"
    liveness.doing(f"evaluating {rt.trial_label}")
    run = TrialRun(rt, message)
    with run.running():
        result: Any = None
        error: Exception | None = None
        handed = hand_over is None
        try:
            # The hand-over and the forming of the group are one step for a stop: a
            # SIGTERM that lands between them is raised once the group is formed and
            # met. Raised before its forming, the leader left its follower in torch's
            # rendezvous for the new group, waiting for it, while it waited in the
            # trial's end for that follower: both alive, both blocked (the fault sweep,
            # SIGTERM to every rank as the leader was about to re-form the group).
            with indivisible():
                if held is not None:
                    held.close()  # still held: by this step now
                if hand_over is not None:
                    hand_over()
                    handed = True
                # Part of the trial: once the followers hold it, nothing may end it on
                # one rank only. (Re-forming raised on the leader after the send in CI: a
                # follower that raised before its session had released the new group at
                # once. NePS recorded the error, the follower waited in its trial end,
                # and the next trial's hand-over met that wait: both hung for ever.)
                if message.group_generation is not None:
                    run.form_group(message.group_generation)
            if rt.launch.kind == "external":
                rt.group.name_for_trial()
            result = fn(**message.kwargs)
        except Exception as exc:  # reported to every rank, unless no rank holds the trial
            if not handed and isinstance(exc, FollowerLostError):
                # The group lost a rank before it held the trial (a follower killed or
                # terminated while it waited): not the trial's failure, and no peer is
                # left to tell; the leader puts it back and stops.
                raise
            error = exc
        except BaseException as exc:
            stop = preemption(exc)  # a scheduler's stop, however the user's code exited
            if stop is not None and stop is not exc:
                run.interrupted(stop)
                raise stop from exc
            run.interrupted(exc)
            raise
        rt.check_stopped()  # the leader stopped mid-trial: nothing left to meet
        failures = run.end(error)
        # Every rank's code has returned: the groups it destroyed, kept alive until now
        # (see ``compat.torch.keep_groups_alive``), are freed here.
        release_destroyed_groups()
        return Outcome(result, error, failures)


def log_freed(rt: Runtime, freed: Freed | None) -> None:
    """One line per clean start: what the collection found and what it cost."""
    if freed is not None:
        rt.log(
            logging.INFO,
            "freed what earlier trials left: %d objects collected%s in %.1f ms (CPU %.1f ms)",
            freed.collected,
            f", {freed.froze} frozen" if freed.froze else "",
            1e3 * freed.wall_s,
            1e3 * freed.cpu_s,
        )
