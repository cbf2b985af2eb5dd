"""The leader: rank 0 of a group, the only process that talks to NePS."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from neps_bcast import _neps_compat
from neps_bcast.errors import TrialFailedError, format_message
from neps_bcast.messages import TrialMessage
from neps_bcast.runtime import Runtime, failure_text


def wrap(rt: Runtime, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function handed to ``neps.run`` in place of the user's.

    ``functools.wraps`` keeps the user's signature visible to NePS, so NePS injects
    ``pipeline_directory`` & co. exactly when the user's function asks for them, and
    for a ``PipelineSpace`` NePS's own wrapper calls this one with the resolved
    arguments: what this function receives is exactly what the followers must get.
    """

    @functools.wraps(fn)
    def evaluate(**kwargs: Any) -> Any:
        return evaluate_on_group(rt, fn, kwargs)

    return evaluate


def evaluate_on_group(rt: Runtime, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    info = _neps_compat.current_trial()
    rt.seq += 1
    message = TrialMessage(
        seq=rt.seq,
        trial_id=info.trial_id,
        kwargs=dict(kwargs),
        pipeline_directory=info.pipeline_directory,
        previous_pipeline_directory=info.previous_pipeline_directory,
    )
    rt.reform_group()
    rt.send(message)
    rt.log(logging.INFO, "trial %s (#%d) handed to the group", message.trial_id, message.seq)
    error: BaseException | None = None
    result: Any = None
    with rt.running(message) as ctx:
        try:
            result = fn(**kwargs)
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised
            error = exc
        failures = rt.end_trial(ctx, error)
    if error is not None:
        raise error
    new = [f for f in failures if f not in ctx.reported]
    if new:
        raise TrialFailedError(format_message(rt.tag, failure_text(new, message.trial_id)))
    return result
