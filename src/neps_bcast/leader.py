"""The leader: rank 0 of a group, the only process that talks to NePS."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from neps_bcast import _neps_compat
from neps_bcast.errors import FollowerLostError, TrialFailedError, format_message
from neps_bcast.messages import TrialMessage
from neps_bcast.protocol import evaluate_once, failure_text
from neps_bcast.runtime import Runtime

RECORD_GRACE_S = 10.0
"""How long Lightning's observer waits for the leader to record a trial before killing."""


class SearchAborted(BaseException):
    """Stops ``neps.run`` after the current trial was recorded (the group is gone).

    A ``BaseException`` because NePS records and swallows every ``Exception`` of the
    evaluation and goes on sampling; with a follower lost, every later trial would fail.
    """

    def __init__(self, error: FollowerLostError) -> None:
        super().__init__(str(error))
        self.error = error


def wrap(rt: Runtime, fn: Callable[..., Any], root_directory: Path) -> Callable[..., Any]:
    """The function handed to ``neps.run`` in place of the user's.

    ``functools.wraps`` keeps the user's signature visible to NePS, so NePS injects
    ``pipeline_directory`` & co. exactly when the user's function asks for them, and
    for a ``PipelineSpace`` NePS's own wrapper calls this one with the resolved
    arguments: what this function receives is exactly what the followers must get.
    """

    @functools.wraps(fn)
    def evaluate(**kwargs: Any) -> Any:
        return evaluate_on_group(rt, fn, kwargs, root_directory)

    return evaluate


def evaluate_on_group(
    rt: Runtime, fn: Callable[..., Any], kwargs: dict[str, Any], root_directory: Path
) -> Any:
    """Hand the trial NePS is evaluating to the group, evaluate it here, end it."""
    info = _neps_compat.current_trial()
    rt.seq += 1
    message = TrialMessage(
        seq=rt.seq,
        trial_id=info.trial_id,
        kwargs=dict(kwargs),
        pipeline_directory=info.pipeline_directory,
        previous_pipeline_directory=info.previous_pipeline_directory,
    )
    try:
        rt.send(message)
        rt.reform_group()  # after the send: followers re-form once they hold the trial
    except FollowerLostError as exc:
        _abort(rt, info.trial_id, root_directory, exc)
    rt.log(logging.INFO, "trial %s (#%d) handed to the group", message.trial_id, message.seq)
    try:
        outcome = evaluate_once(rt, fn, message)
    except FollowerLostError as exc:
        _abort(rt, info.trial_id, root_directory, exc)
    except BaseException as exc:
        # Ctrl-C, SIGTERM, sys.exit: record the trial before leaving, never leave it
        # "evaluating" in NePS's state.
        _neps_compat.record_crashed(
            info.trial_id,
            root_directory,
            RuntimeError(f"interrupted: {type(exc).__name__} {exc}".rstrip()),
        )
        rt.settled.set()
        raise
    if outcome.failures:
        raise TrialFailedError(
            format_message(rt.tag, failure_text(outcome.failures, message.trial_id)),
            failures=outcome.failures,
        ) from outcome.error
    if outcome.error is not None:
        raise outcome.error
    return outcome.result


def _abort(rt: Runtime, trial_id: str, root_directory: Path, exc: FollowerLostError) -> None:
    rt.log(logging.ERROR, "%s", exc)
    _neps_compat.record_crashed(trial_id, root_directory, exc)
    rt.settled.set()
    raise SearchAborted(exc) from exc


def let_leader_record(rt: Runtime, root_directory: Path) -> None:
    """Lightning's observer is about to SIGKILL this launch (a child exited non-zero):
    give the leader time to record the running trial and leave by itself; if it is
    stuck, record the trial here, so it is never left "evaluating"."""
    if rt.settled.wait(RECORD_GRACE_S):
        time.sleep(RECORD_GRACE_S)  # recorded: it is leaving; kill only if it hangs
        return
    run = rt.current
    if run is None:
        return
    error = rt.lost(RuntimeError("Lightning's process observer is ending the launch"))
    rt.log(logging.ERROR, "%s", error)
    with contextlib.suppress(Exception):
        _neps_compat.record_crashed(run.message.trial_id, root_directory, error)
