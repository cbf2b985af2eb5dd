"""The leader: rank 0 of a group, the only process that talks to NePS.

All of the leader's orchestration is here: the root lock and the leases around
``neps.run`` (``lead``), the function NePS calls in place of the user's (``wrap``),
which hands each trial to the group, evaluates it here and settles it in NePS however
it ended, and the STOP that ends the followers.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from neps_bcast import faults
from neps_bcast.compat import lightning as lightning_compat
from neps_bcast.compat import neps as neps_compat
from neps_bcast.compat import neps_run
from neps_bcast.errors import (
    ErrorRecord,
    FollowerLostError,
    NepsBcastError,
    TrialFailedError,
    failure_text,
    first_line,
    format_message,
)
from neps_bcast.recovery import settle
from neps_bcast.recovery.lease import Leases, left_by_earlier_attempts
from neps_bcast.recovery.lease_file import next_worker_id
from neps_bcast.recovery.root_lock import RootGuard
from neps_bcast.recovery.signals import (
    indivisible,
    raise_waiting_sigterm,
    stop_signals,
    wait_with_sigterm,
)
from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import TrialMessage
from neps_bcast.trial import Outcome, evaluate_once, running

RunTrial = Callable[[Runtime, TrialMessage], Outcome]
"""Where a trial runs when not here: a pool's agent hands it to the ranks it is given
(``pool.agent.Remote``) and returns their outcome."""

RECORD_GRACE_S = 10.0
"""How long Lightning's observer waits for the leader to record a trial before killing."""


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
        raise FollowerLostError(
            format_message(
                rt.tag,
                "; ".join(
                    f"rank {r.group_rank} was terminated ({r.type_name}: {r.message})"
                    for r in terminated
                )
                + f" in trial {info.trial_id}.",
                "the trial goes back to pending and runs again on fresh ranks (a pool goes on)."
                if run_trial
                else "the search stops here (its group lost a rank); the trial goes back to"
                " pending, and running the same command again evaluates it.",
            )
        )
    return outcome


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


def let_leader_record(rt: Runtime, root_directory: Path, leases: Leases | None = None) -> None:
    """Lightning's observer is about to SIGKILL this launch (a child exited non-zero):
    give the leader time to settle the running trial and leave by itself; if it is
    stuck, settle the trial here, so it is never left "evaluating"."""
    if rt.settled.wait(RECORD_GRACE_S):
        time.sleep(RECORD_GRACE_S)  # settled: it is leaving; kill only if it hangs
        return
    run = running(rt)
    if run is None:
        return
    error = rt.lost(RuntimeError("Lightning's process observer is ending the launch"))
    rt.log(logging.ERROR, "%s", error)
    with contextlib.suppress(Exception):
        directory = run.message.pipeline_directory
        if leases is not None and directory is not None:
            leases.give_back(run.message.trial_id, Path(directory), first_line(error))
        else:
            neps_compat.record_crashed(run.message.trial_id, root_directory, error)


def lead(
    rt: Runtime,
    fn: Callable[..., Any],
    pipeline_space: Any,
    kwargs: dict[str, Any],
    run_trial: RunTrial | None = None,
) -> None:
    """Rank 0: run ``neps.run`` with ``fn`` handed to the group, then stop the followers.
    A pool's agent (``run_trial``): each trial runs where ``run_trial`` hands it."""
    import neps

    # Absolute from the start: the user's function may chdir, and the trial is recorded
    # (by NePS, or by us after an interrupt) in the root the search started in.
    root = Path(kwargs.get("root_directory", neps_compat.ROOT_DIRECTORY_DEFAULT)).resolve()
    kwargs = {**kwargs, "root_directory": root}
    # Every NePS lock taken in this process, by us or by NePS before neps.run sets it, is
    # the kind neps.run uses (a flock does not exclude another worker's lockf).
    neps_compat.use_neps_locking()
    _fault_points_in_neps()
    guard = RootGuard(root, rt.settings.root_lock_timeout_s)
    leases = Leases(root, rt.settings)
    if kwargs.get("worker_id") is None and neps_run.takes_worker_id():
        # NePS records it in each trial it sets evaluating: a leader killed before its
        # lease is then still proven dead at once on this machine (see ``lease``).
        kwargs["worker_id"] = leases.me.worker_id()

    @functools.wraps(fn)
    def first_trial_releases(*args: Any, **fn_kwargs: Any) -> Any:
        guard.release()  # NePS gave us a trial: the state on disk is complete
        return fn(*args, **fn_kwargs)

    wrapped = wrap(rt, first_trial_releases, root, leases, _releasing(guard, run_trial))
    stopped = False
    if rt.launch.kind == "single":  # Lightning may spawn children, watched by its observer
        lightning_compat.before_observer_kills(lambda: let_leader_record(rt, root, leases))
    try:
        with stop_signals():
            guard.acquire()
            try:
                overwrite = bool(kwargs.get("overwrite_root_directory"))
                space = guard.prepare(pipeline_space, overwrite)
                if not overwrite:
                    # Before NePS samples: trials whose leader died go back to pending,
                    # and NePS hands out pending trials before sampling new ones.
                    leases.recover_orphans()
                _run_neps(neps.run, wrapped, space, kwargs)
            finally:
                leases.close()
                guard.release()
                rt.settled.set()
            # Every trial is recorded; a stop that came while NePS recorded the last one,
            # or comes while the followers are stopped, is raised once they are: a
            # follower that a half-sent STOP left waiting would wait for its leader's
            # exit instead (and exit 1).
            wait_with_sigterm()
            stopped = True  # once: a failed stop is not tried again below
            try:
                rt.shutdown("the search is over (the leader's neps.run returned)")
            finally:
                raise_waiting_sigterm()
    except SearchAborted as aborted:
        with contextlib.suppress(Exception):
            rt.close()
        raise aborted.error from None
    except BaseException as exc:
        if not stopped:
            try:
                rt.shutdown(f"the leader's neps.run raised {type(exc).__name__}: {exc}")
            except NepsBcastError as stop_error:
                rt.log(logging.ERROR, "could not stop the followers: %s", stop_error)
        raise
    rt.log(logging.INFO, "done")


def _fault_points_in_neps() -> None:
    """The fault points ``sample`` and ``record`` lie inside NePS: hooked only when a
    test armed one (``neps_bcast.faults``), never otherwise."""
    if faults.armed("sample") or faults.armed("record"):
        neps_run.call_before_sampling_and_recording(
            lambda: faults.point("sample"),
            lambda trial_id: faults.point("record", trial_id=trial_id),
        )


def _releasing(guard: RootGuard, run_trial: RunTrial | None) -> RunTrial | None:
    """A pool's agent never calls the user's function (its trials run elsewhere): its
    first trial releases the root lock as ``first_trial_releases`` does otherwise."""
    if run_trial is None:
        return None
    remote = run_trial

    def releasing(rt: Runtime, message: TrialMessage) -> Outcome:
        guard.release()
        return remote(rt, message)

    return releasing


def _run_neps(
    run: Callable[..., Any], wrapped: Callable[..., Any], space: Any, kwargs: dict[str, Any]
) -> None:
    """``neps.run``, entered again after a pool's trial was put back (``TrialPutBack``):
    NePS then hands out that pending trial (or another) as it would at a start."""
    neps_run.run_entering_again(
        lambda options: run(wrapped, space, **options),
        kwargs,
        TrialPutBack,
        next_worker_id,
    )
