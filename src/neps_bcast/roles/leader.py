"""The leader: rank 0 of a group, the only process that talks to NePS.

The leader's orchestration of the search is here: the root lock and the leases around
``neps.run`` (``lead``), entered again after a pool's trial was put back, and the STOP
that ends the followers. The function NePS calls in place of the user's (``wrap``),
which hands each trial to the group, evaluates it here and settles it in NePS however
it ended, is the leader's too, in ``leader_trial``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neps_bcast import faults
from neps_bcast.compat import lightning as lightning_compat
from neps_bcast.compat import neps as neps_compat
from neps_bcast.compat import neps_run
from neps_bcast.errors import NepsBcastError, first_line
from neps_bcast.log import exit_now
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.lease_file import next_worker_id
from neps_bcast.recovery.root_lock import RootGuard
from neps_bcast.recovery.signals import raise_waiting_sigterm, stop_signals, wait_with_sigterm
from neps_bcast.roles.leader_trial import RunTrial, SearchAborted, TrialPutBack, wrap
from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import TrialMessage
from neps_bcast.trial.run import Outcome, running

RECORD_GRACE_S = 10.0
"""How long Lightning's observer waits for the leader to record a trial before killing."""


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
    leases = _leases(rt, root)
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
            _acquire(guard)
            try:
                overwrite = bool(kwargs.get("overwrite_root_directory"))
                space = guard.prepare(pipeline_space, overwrite)
                if not overwrite:
                    # Before NePS samples: trials whose leader died go back to pending,
                    # and NePS hands out pending trials before sampling new ones.
                    leases.recover_orphans()
                _run_neps(neps.run, wrapped, space, kwargs, leases)
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


def _leases(rt: Runtime, root: Path) -> Leases:
    """This leader's leases, which also end a trial past its time limit."""
    leases = Leases(root, rt.settings)
    leases.held.on_time_limit = functools.partial(_past_time_limit, rt, leases)
    rt.abandon_trial = leases.give_back_held
    leases.held.on_superseded = functools.partial(_superseded, rt)
    # Fencing: NePS records a result only for the attempt that holds the trial's lease.
    neps_run.fence_recording(functools.partial(_refuse_record, rt, leases))
    return leases


def _refuse_record(rt: Runtime, leases: Leases, trial_id: str) -> str | None:
    """NePS records ``trial_id`` (under its trial lock): refused, with one line, when
    another attempt took the trial over."""
    why = leases.refuse_record(trial_id)
    if why is not None:
        rt.log(logging.ERROR, "%s: not recorded", why)
        _superseded(rt, why)  # this group trained a trial that another attempt holds
    return why


def _superseded(rt: Runtime, line: str) -> None:
    """The lease thread found the trial taken over (this host was silent past the
    grace period, e.g. frozen or cut off from the filesystem, and came back): this
    group stops that trial at once instead of training on. This process exits 1 (the
    fence drops its result if it got that far), and every follower's leader watch then
    ends its own."""
    rt.log(logging.ERROR, "%s; this worker stops now (exit code 1)", line)
    exit_now(1)


def _acquire(guard: RootGuard) -> None:
    """The root, once another worker finished starting on it; from then on a stop
    waits. Up to the first trial NePS writes its state (the root, this worker's id, the
    first sampling), each file in place: a stop raised in the middle of one left it
    empty, and every worker of the root then failed to read it (seen: a pool stopped
    while an agent started). The stop is raised when NePS hands over the first trial
    (it goes back to pending), or once ``neps.run`` returns, as between two trials."""
    guard.acquire()
    wait_with_sigterm()


def _past_time_limit(
    rt: Runtime, leases: Leases, trial_id: str, trial_dir: Path, limit: float
) -> None:
    """``NEPS_BCAST_TRIAL_TIME_LIMIT_S`` (on the lease's thread): a trial still running
    after the limit hangs though every rank may be alive (a deadlock in the user's code),
    and nothing can unblock a thread stuck in it. The trial goes back to pending (an
    infrastructure row: crashed past the retry limit), then this process exits with code 1
    at once; each follower's leader watch then ends its own process."""
    how = f"still running {limit:g} s after it started (NEPS_BCAST_TRIAL_TIME_LIMIT_S)"
    try:
        became = leases.give_back(trial_id, trial_dir, how)
    except Exception as exc:  # noqa: BLE001 - the exit below must happen: say what failed
        became = f"not settled ({type(exc).__name__}: {exc}); a leader's look hands it back"
    rt.log(
        logging.ERROR,
        "trial %s is %s: %s. This process exits with code 1 and its followers follow."
        " HINT: look for a deadlock or a collective only some ranks call in the trial's"
        " code (py-spy dump on each rank), or raise NEPS_BCAST_TRIAL_TIME_LIMIT_S.",
        trial_id,
        how,
        became,
    )
    exit_now(1)


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
    run: Callable[..., Any],
    wrapped: Callable[..., Any],
    space: Any,
    kwargs: dict[str, Any],
    leases: Leases,
) -> None:
    """``neps.run``, entered again after a pool's trial was put back (``TrialPutBack``):
    NePS then hands out that pending trial (or another) as it would at a start; and
    again after it returned, while a trial in doubt was taken over (``_before_the_end``)."""
    neps_run.run_entering_again(
        lambda options: run(wrapped, space, **options),
        kwargs,
        TrialPutBack,
        next_worker_id,
        functools.partial(_before_the_end, leases),
    )


def _before_the_end(leases: Leases) -> int:
    """NePS's budget is reached, or it has nothing left to sample: before this worker
    ends, each trial still evaluating under a lease it can prove neither alive nor dead
    is waited for (``recovery.in_doubt``), never longer than the grace period and a
    heartbeat. Returns how many it took over, for ``neps.run`` to run now.

    The wait is no step of NePS's: a stop (SIGTERM, Ctrl-C) that comes then, or came
    while NePS recorded the last trial, is raised at once (this worker holds no trial);
    the stops wait again from its end on, as between two trials."""
    doubts = leases.in_doubt()
    in_doubt = doubts.look()
    if doubts.put_back or not in_doubt:
        return len(doubts.put_back)
    raise_waiting_sigterm()
    try:
        return doubts.wait(in_doubt)
    finally:
        wait_with_sigterm()
