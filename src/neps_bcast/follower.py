"""A follower: evaluates what its leader hands it until the leader says stop."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from neps_bcast.errors import NepsBcastError
from neps_bcast.messages import StopMessage, TrialMessage
from neps_bcast.runtime import Runtime


def follow(rt: Runtime, fn: Callable[..., Any], first: TrialMessage | None) -> None:
    """Evaluate trials until STOP. A trial's error is reported, never raised here:

    Lightning's process observer kills the whole launch when a child exits non-zero,
    so a follower leaves with code 0 unless its leader is lost.
    """
    message: TrialMessage | StopMessage = first if first is not None else rt.receive()
    while isinstance(message, TrialMessage):
        rt.reform_group()
        rt.log(logging.INFO, "trial %s (#%d) received", message.trial_id, message.seq)
        error: BaseException | None = None
        with rt.running(message) as ctx:
            try:
                fn(**message.kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to the leader instead
                error = exc
            except BaseException as exc:
                if ctx.mine is None:
                    rt.fail(ctx, exc)
                with contextlib.suppress(NepsBcastError):
                    rt.end_trial(ctx, exc)
                raise
            failures = rt.end_trial(ctx, error)
        if failures:
            rt.log(
                logging.INFO,
                "trial %s failed: %s",
                message.trial_id,
                "; ".join(f.headline() for f in failures),
            )
        message = rt.receive()
    rt.stopping = True
    rt.log(logging.INFO, "stopping: %s", message.reason)
    if rt.channel is not None:
        with contextlib.suppress(Exception):
            rt.channel.allgather(b"bye")  # the leader exits only after every goodbye
    rt.close()
