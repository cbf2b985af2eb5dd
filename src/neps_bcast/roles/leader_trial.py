"""The leader's side of each trial NePS hands it: lease, hand-over, evaluation, settling.

NePS calls the function ``wrap`` makes in place of the user's, once per trial. It
first hands back other leaders' orphans when a look is due (``recovery.lease``), takes
the trial's lease, hands the trial to the group and evaluates it here (or hands it to
where it runs, a pool's ranks: ``RunTrial``), and settles the trial in NePS however it
ended. A lost rank ends ``neps.run`` (``SearchAborted``), or only this trial for a
pool's agent (``TrialPutBack``); ``leader.lead`` handles both.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from neps_bcast import faults
from neps_bcast.compat import neps as neps_compat
from neps_bcast.errors import (
    ErrorRecord,
    FollowerLostError,
    TrialFailedError,
    failure_text,
    format_message,
)
from neps_bcast.recovery import settle
from neps_bcast.recovery.lease import Leases, left_by_earlier_attempts
from neps_bcast.recovery.signals import indivisible, raise_waiting_sigterm, wait_with_sigterm
from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import TrialMessage
from neps_bcast.trial.run import Outcome, evaluate_once

RunTrial = Callable[[Runtime, TrialMessage], Outcome]
"""Where a trial runs when not here: a pool's agent hands it to the ranks it is given
(``pool.agent.Remote``) and returns their outcome."""


class TrialPutBack(BaseException):
    """A pool's agent: the ranks of its trial were lost, and the trial is back to
    pending; ``neps.run`` is left and entered again (NePS hands out pending trials
    first). A ``BaseException`` for the reason ``SearchAborted`` is one: NePS would
    record an ``Exception`` as the trial's failure, over the pending state."""


class SearchAborted(BaseException):
    """Stops ``neps.run`` after the current trial was recorded (the group is gone).

    A ``BaseException`` because NePS records and swallows every ``Exception`` of the
    evaluation and goes on sampling; with a follower lost, every later trial would fail.
    """

    def __init__(self, error: FollowerLostError) -> None:
        super().__init__(str(error))
        self.error = error


def wrap(
    rt: Runtime,
    fn: Callable[..., Any],
    root_directory: Path,
    leases: Leases | None = None,
    run_trial: RunTrial | None = None,
) -> Callable[..., Any]:
    """The function handed to ``neps.run`` in place of the user's.

    ``functools.wraps`` keeps the user's signature visible to NePS, so NePS injects
    ``pipeline_directory`` & co. exactly when the user's function asks for them, and
    for a ``PipelineSpace`` NePS's own wrapper calls this one with the resolved
    arguments: what this function receives is exactly what the followers must get.
    """

    @functools.wraps(fn)
    def evaluate(**kwargs: Any) -> Any:
        return evaluate_on_group(rt, fn, kwargs, root_directory, leases, run_trial)

    return evaluate


def evaluate_on_group(
    rt: Runtime,
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    root_directory: Path,
    leases: Leases | None = None,
    run_trial: RunTrial | None = None,
) -> Any:
    """Hand the trial NePS is evaluating to the group, evaluate it here, end it
    (``run_trial``: hand it to where it runs, a pool's ranks, and wait for its outcome).

    With ``leases``, the trial is leased while it runs; an infrastructure failure
    (SIGTERM, a lost or terminated follower) puts it back to pending instead of
    recording it crashed; and, before its lease, orphans of other leaders are handed
    back (NePS has recorded the trial before). However the trial ends, it is settled in NePS
    before this returns or raises: a SIGTERM from the lease on to the hand-back counts
    as an interrupt of this trial, and from its end until NePS hands over the next one
    it waits (``signals.wait_with_sigterm``) so that NePS records the result first.
    """
    info = neps_compat.current_trial()
    faults.point("evaluate", trial_id=info.trial_id)
    attempt = 1
    try:
        raise_waiting_sigterm()  # one that came while NePS sampled: this trial goes back
        if leases is not None:
            # NePS has recorded the last trial (looking before it did, a leader killed
            # in the look lost that result) and holds this one evaluating.
            _recover_orphans(rt, leases)
            if info.pipeline_directory is not None:
                attempt = leases.take(info.trial_id, info.pipeline_directory, ranks=rt.world_size)
        outcome = _hand_and_evaluate(rt, fn, kwargs, leases, info, attempt, run_trial)
    except FollowerLostError as exc:
        _abort(rt, info, root_directory, leases, exc, go_on=run_trial is not None)
    except BaseException as exc:
        try:
            settle.trial(info, root_directory, leases, exc)
        finally:
            rt.settled.set()
        raise
    finally:
        if leases is not None:
            leases.drop()
    wait_with_sigterm()  # until NePS recorded this trial and hands over the next
    if outcome.failures:
        raise TrialFailedError(
            format_message(rt.tag, failure_text(outcome.failures, info.trial_id)),
            failures=outcome.failures,
        ) from outcome.error
    if outcome.error is not None:
        raise outcome.error
    return outcome.result


def _hand_and_evaluate(
    rt: Runtime,
    fn: Callable[..., Any],
    kwargs: dict[str, Any],
    leases: Leases | None,
    info: neps_compat.NepsTrialInfo,
    attempt: int = 1,
    run_trial: RunTrial | None = None,
) -> Outcome:
    rt.seq += 1
    directory = info.pipeline_directory
    message = TrialMessage(
        seq=rt.seq,
        trial_id=info.trial_id,
        kwargs=dict(kwargs),
        pipeline_directory=directory,
        previous_pipeline_directory=info.previous_pipeline_directory,
        group_generation=rt.next_generation(),
        attempt=attempt,
        resumed_from=left_by_earlier_attempts(directory, attempt) if directory else None,
    )

    def hand_over() -> None:
        rt.send(message)
        rt.log(
            logging.INFO,
            "trial %s (#%d) handed to the group%s",
            message.trial_id,
            message.seq,
            f" (attempt {attempt}, resumed from {message.resumed_from})" if attempt > 1 else "",
        )

    outcome = run_trial(rt, message) if run_trial else evaluate_once(rt, fn, message, hand_over)
    terminated = _terminated_followers(outcome.failures)
    if terminated and leases is not None:
        # A follower got SIGTERM (and is leaving): the group is broken, and the trial
        # was preempted, not failed by its config.
        raise _infrastructure_fault(
            rt,
            [
                f"rank {r.group_rank} was terminated ({r.type_name}: {r.message})"
                for r in terminated
            ],
            f"in trial {info.trial_id}.",
            "the search stops here (its group lost a rank); the trial goes back to pending,"
            " and running the same command again evaluates it.",
            pool=run_trial is not None,
            pool_fix="the trial goes back to pending and runs again on fresh ranks (a pool goes on).",
        )
    timed_out = _timed_out(outcome.failures)
    if timed_out and leases is not None:
        # A collective or the launcher's store timed out: a peer stopped answering (it is
        # silent, or the network is), which is the infrastructure's fault, not the config's.
        raise _infrastructure_fault(
            rt,
            [
                f"rank {r.group_rank} timed out waiting for its peers ({r.type_name}:"
                f" {first_line_of(r.message)})"
                for r in timed_out
            ],
            f"in trial {info.trial_id}: an infrastructure fault, not the trial's own.",
            "the trial goes back to pending (retried up to NEPS_BCAST_MAX_RETRIES); if"
            " your collectives legitimately take longer, raise the group's timeout"
            " (init_process_group(timeout=...)).",
            pool=run_trial is not None,
            pool_fix="the trial goes back to pending and runs again on fresh ranks.",
        )
    return outcome


def _infrastructure_fault(
    rt: Runtime, ranks: list[str], what: str, fix: str, *, pool: bool, pool_fix: str
) -> FollowerLostError:
    """A trial lost to the infrastructure (a rank terminated, a peer that stopped
    answering): the ranks named, the trial put back, not recorded crashed."""
    return FollowerLostError(
        format_message(rt.tag, "; ".join(ranks) + f" {what}", pool_fix if pool else fix)
    )


_TIMEOUT = re.compile(
    r"gloo/transport/.*Timed out waiting|Watchdog caught collective operation timeout"
    r"|Socket Timeout|wait timeout after"
)
"""What torch's gloo and NCCL collectives and its stores say when they time out."""


def _timed_out(failures: list[ErrorRecord]) -> list[ErrorRecord]:
    """Root causes that are a collective's or a store's timeout (torch's own texts)."""
    return [
        r
        for r in failures
        if not r.secondary
        and (
            _TIMEOUT.search(r.message) is not None
            or (r.type_name.startswith("Dist") and "timeout" in r.message.lower())
        )
    ]


def first_line_of(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text


def _terminated_followers(failures: list[ErrorRecord]) -> list[ErrorRecord]:
    """Followers whose own failure was a SIGTERM (``Terminated``), root causes only."""
    return [r for r in failures if r.group_rank != 0 and not r.secondary and r.preempted]


def _recover_orphans(rt: Runtime, leases: Leases) -> None:
    """Before a trial's lease: hand back other leaders' orphans (never fails the search).

    Whole or not at all for a stop (a few ms, under NePS's lock): a SIGTERM that lands
    in it is raised once it is done, and this trial goes back as one before its lease."""
    try:
        with indivisible():
            leases.recover_orphans_if_due()
    except Exception as exc:  # noqa: BLE001 - a failed check is retried when the next is due
        rt.log(logging.WARNING, "could not check for orphaned trials: %s", exc)


def _abort(
    rt: Runtime,
    info: neps_compat.NepsTrialInfo,
    root_directory: Path,
    leases: Leases | None,
    exc: FollowerLostError,
    *,
    go_on: bool = False,
) -> NoReturn:
    """The group lost a rank: settle the trial, then stop ``neps.run`` (never sample
    again on a broken group, whatever happens while settling). ``go_on``: a pool's
    agent, whose next trial gets other ranks: only this trial ends."""
    try:
        settle.trial(info, root_directory, leases, exc)
    finally:
        rt.settled.set()
    rt.log(logging.ERROR, "%s", exc)  # after: a stop in the log call cannot skip the settling
    if go_on:
        raise TrialPutBack(str(exc)) from exc
    raise SearchAborted(exc) from exc
