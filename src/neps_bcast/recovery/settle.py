"""Settling a trial in NePS when it did not end by returning: never left "evaluating".

Why apart from the leader's loop: the handler that settles an interrupted trial must
never replace the interrupt with an error of its own (a SIGTERM whose exit code became
1 is not requeued by SLURM), so every failure here, a second signal included, is
attached to the original as a note and logged, and the original keeps its meaning and
exit code.

- a scheduler's stop (SIGTERM, a time limit: ``Terminated``) is no fault of the trial,
  it goes back to pending (``lease.Leases.give_back``); Ctrl-C and ``sys.exit`` are the
  user's stop, the trial is recorded crashed;
- a lost rank: back to pending with the lease's history, or crashed where there is no
  lease.
"""

from __future__ import annotations

import signal
from pathlib import Path

from neps_bcast import faults
from neps_bcast.compat import neps as neps_compat
from neps_bcast.errors import FollowerLostError, first_line
from neps_bcast.log import logger
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.signals import Terminated, indivisible


def trial(
    info: neps_compat.NepsTrialInfo,
    root_directory: Path,
    leases: Leases | None,
    exc: BaseException,
) -> None:
    """A trial that ended with ``exc`` instead of a result: settle it; never raises.

    A scheduler's stop (``Terminated``) or a lost rank puts it back to pending where it
    has a lease; anything else (Ctrl-C, ``sys.exit``, or no lease) records it crashed.

    Settling is one step for a stop: a SIGTERM or Ctrl-C that lands in it waits until
    the trial is settled, then is attached to ``exc`` (the original keeps its exit
    code). Raised in the middle, it left the trial "evaluating": the fault sweep saw
    torchrun's SIGTERM, sent because a follower was SIGKILLed, land while the leader put
    the trial back."""
    try:
        with indivisible():
            try:
                _settle(info, root_directory, leases, exc)
            except BaseException as secondary:  # noqa: BLE001 - the original error wins
                attach(exc, info.trial_id, secondary)
    except BaseException as stop:  # noqa: BLE001 - a stop held until settled; the original wins
        note = f"{type(stop).__name__} {stop} came while trial {info.trial_id} was settled".rstrip()
        add_note = getattr(exc, "add_note", None)  # Python >= 3.11
        if callable(add_note):
            add_note(note)
        logger.warning("%s (after %s)", note, first_line(exc))


def _settle(
    info: neps_compat.NepsTrialInfo,
    root_directory: Path,
    leases: Leases | None,
    exc: BaseException,
) -> None:
    lost = isinstance(exc, FollowerLostError)
    if leases is not None and info.pipeline_directory and (lost or isinstance(exc, Terminated)):
        why, how = (first_line(exc), ("", "")) if lost else _preempted(exc)
        what = leases.give_back(info.trial_id, info.pipeline_directory, why)
        logger.warning("%strial %s: %s%s", how[0], info.trial_id, what, how[1])
    elif lost:
        faults.point("settle")
        neps_compat.record_crashed(info.trial_id, root_directory, exc)
    else:
        faults.point("settle")
        neps_compat.record_crashed(
            info.trial_id,
            root_directory,
            RuntimeError(f"interrupted: {type(exc).__name__} {exc}".rstrip()),
        )


def _preempted(exc: BaseException) -> tuple[str, tuple[str, str]]:
    """What the lease records, and the log line's head and tail, for a scheduler's stop."""
    assert isinstance(exc, Terminated)
    asks = " asks to requeue" if exc.code == 128 + signal.SIGTERM else ""
    why = f"preempted: {exc.how} on the leader (exit code {exc.code})"
    return why, (f"{exc.how} in ", f"; exit code {exc.code}{asks}")


def attach(exc: BaseException, trial_id: str, secondary: BaseException) -> None:
    """Keep ``exc`` as it is; add what went wrong while settling as a note, and log it."""
    note = f"neps_bcast could not settle trial {trial_id} in NePS: {first_line(secondary)}"
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if callable(add_note):
        add_note(note)
    logger.error("%s (while handling %s)", note, first_line(exc))
