"""SIGTERM as an exception, so that the running trial is recorded before the process ends.

SLURM preemption, ``scancel`` and a time limit send SIGTERM. Python's default ends the
process at once, leaving the trial "evaluating" in NePS; inside ``neps_bcast.run`` it
raises ``Terminated`` (a ``SystemExit`` with code 128 + 15) instead, so the trial fails
on every rank like any error and the leader records it. Only the first SIGTERM raises:
a second one (``scancel`` twice, a launcher forwarding it again) arriving while the
trial is being recorded is ignored, so the record is not cut short.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Terminated(SystemExit):
    """SIGTERM (e.g. SLURM preemption) turned into an exception, so the trial is recorded."""


_waiting = False
_pending: Terminated | None = None


def wait_with_sigterm() -> None:
    """From now on a SIGTERM waits for ``raise_waiting_sigterm`` instead of raising.

    For the leader while NePS's own code runs between two trials (it records the
    finished trial, then samples the next): NePS catches only ``Exception``, so a
    ``Terminated`` raised there would skip its record and leave the trial
    "evaluating". The signal is raised at our next step instead: when NePS hands over
    the next trial (which then goes back to pending) or when ``neps.run`` returns.
    """
    global _waiting  # noqa: PLW0603 - the handler runs in the main thread only
    _waiting = True


def raise_waiting_sigterm() -> None:
    """Stop waiting; raise the SIGTERM that came while waiting, if one did."""
    global _waiting, _pending  # noqa: PLW0603
    _waiting = False
    pending, _pending = _pending, None
    if pending is not None:
        raise pending


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside the block, SIGTERM raises ``Terminated`` (unless someone else handles it)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    ):
        yield
        return

    terminating = False

    def handler(signum: int, _frame: object) -> None:
        nonlocal terminating
        if terminating:
            return  # a second SIGTERM must not interrupt the recording of the first
        terminating = True
        error = Terminated(128 + signum)
        if _waiting:
            global _pending  # noqa: PLW0603
            _pending = error
            return
        raise error

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        global _waiting, _pending
        _waiting, _pending = False, None
