"""Settling a trial in NePS when it did not end by returning: never left "evaluating".

Why apart from the leader's loop: the handler that settles an interrupted trial must
never replace the interrupt with an error of its own (a SIGTERM whose exit code became
1 is not requeued by SLURM), so every failure here, a second signal included, is
attached to the original as a note and logged, and the original keeps its meaning and
exit code.

- an interrupt (``interrupted``): SIGTERM (preemption, a time limit) is no fault of the
  trial, it goes back to pending (``lease.Leases.give_back``); Ctrl-C and ``sys.exit``
  are the user's stop, the trial is recorded crashed;
- a lost rank (``give_back_lost``): back to pending with the lease's history, or
  crashed where there is no lease.
"""

from __future__ import annotations

import signal
from pathlib import Path

from neps_bcast.compat import neps as neps_compat
from neps_bcast.errors import first_line
from neps_bcast.log import logger
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.signals import Terminated


def interrupted(
    info: neps_compat.NepsTrialInfo,
    root_directory: Path,
    leases: Leases | None,
    exc: BaseException,
) -> None:
    """Ctrl-C, SIGTERM, ``sys.exit`` in a trial: settle it; never raises."""
    try:
        if isinstance(exc, Terminated) and leases is not None and info.pipeline_directory:
            what = leases.give_back(
                info.trial_id,
                info.pipeline_directory,
                f"preempted: {exc.how} on the leader (exit code {exc.code})",
            )
            asks = " asks to requeue" if exc.code == 128 + signal.SIGTERM else ""
            logger.warning(
                "%s in trial %s: %s; exit code %s%s", exc.how, info.trial_id, what, exc.code, asks
            )
        else:
            neps_compat.record_crashed(
                info.trial_id,
                root_directory,
                RuntimeError(f"interrupted: {type(exc).__name__} {exc}".rstrip()),
            )
    except BaseException as secondary:  # noqa: BLE001 - the original interrupt wins
        attach(exc, info.trial_id, secondary)


def give_back_lost(
    info: neps_compat.NepsTrialInfo,
    root_directory: Path,
    leases: Leases | None,
    exc: BaseException,
) -> None:
    """The group lost a rank in this trial: back to pending (or crashed); never raises."""
    try:
        if leases is not None and info.pipeline_directory is not None:
            what = leases.give_back(info.trial_id, info.pipeline_directory, first_line(exc))
            logger.warning("trial %s: %s", info.trial_id, what)
        else:
            neps_compat.record_crashed(info.trial_id, root_directory, exc)
    except BaseException as secondary:  # noqa: BLE001 - the search stops all the same
        attach(exc, info.trial_id, secondary)


def attach(exc: BaseException, trial_id: str, secondary: BaseException) -> None:
    """Keep ``exc`` as it is; add what went wrong while settling as a note, and log it."""
    note = f"neps_bcast could not settle trial {trial_id} in NePS: {first_line(secondary)}"
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if callable(add_note):
        add_note(note)
    logger.error("%s (while handling %s)", note, first_line(exc))
