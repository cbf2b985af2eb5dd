"""A follower: evaluates what its leader hands it until the leader says stop."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import StopMessage, TrialMessage
from neps_bcast.trial import evaluate_once


def follow(rt: Runtime, fn: Callable[..., Any], first: TrialMessage | None) -> None:
    """Evaluate trials until STOP. A trial's error is reported, never raised here:

    Lightning's process observer kills the whole launch when a child exits non-zero,
    so a follower leaves with code 0 unless its leader is lost.
    """
    message: TrialMessage | StopMessage = first if first is not None else rt.receive()
    while isinstance(message, TrialMessage):
        rt.log(logging.INFO, "trial %s (#%d) received", message.trial_id, message.seq)
        outcome = evaluate_once(rt, fn, message)
        if outcome.failures:
            rt.log(
                logging.INFO,
                "trial %s failed: %s",
                message.trial_id,
                "; ".join(f.headline() for f in outcome.failures),
            )
        message = rt.receive()
    rt.link.stopping = True
    rt.log(logging.INFO, "stopping: %s", message.reason)
    rt.say_goodbye()
    rt.close()
