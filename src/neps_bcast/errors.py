"""Every error neps_bcast raises, and the one format they share.

Messages read ``[neps_bcast rank 1/4 follower] what happened. HINT: what to do.``
so that a line in any rank's log says where it came from and what to try.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from neps_bcast.transport.messages import ErrorRecord


class NepsBcastError(RuntimeError):
    """Base class of every error raised by neps_bcast."""


class SessionError(NepsBcastError):
    """``session()`` was used where no trial is running (outside ``neps_bcast.run``)."""


class LaunchError(NepsBcastError):
    """The launch environment is inconsistent or was not recognised."""


class MessageError(NepsBcastError):
    """A trial's arguments or a rank's report could not be sent to the other ranks."""


class TrialMismatchError(NepsBcastError):
    """The ranks of one DDP group do not hold the same trial."""


class TrialFailedError(NepsBcastError):
    """A rank of the group raised while evaluating the trial; raised on every rank.

    ``failures`` holds every rank's failure as a record (``group_rank``, ``type_name``,
    ``message``, ``traceback``, ``pid``, ``secondary``), root causes first, so code can
    tell which rank failed without parsing the text.
    """

    def __init__(self, message: str, failures: Sequence[ErrorRecord] = ()) -> None:
        super().__init__(message)
        self.failures: tuple[ErrorRecord, ...] = tuple(failures)


class ProtocolError(NepsBcastError):
    """The ranks reached different points of the per-trial protocol."""


class AuthError(NepsBcastError):
    """A value read from a store or the channel failed authentication; nothing in it ran."""


class LeaderLostError(NepsBcastError):
    """A follower lost its leader (the leader process died or closed the channel)."""


class FollowerLostError(NepsBcastError):
    """The leader lost a follower in the middle of a trial."""


def format_message(tag: str, what: str, hint: str | None = None) -> str:
    """Build the text of an error: ``[tag] what. HINT: hint``."""
    text = f"[{tag}] {what}"
    if hint:
        text += f" HINT: {hint}"
    return text


def first_line(exc: BaseException) -> str:
    """``TypeName: first line of the message``, for one-line logs and error texts."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
