"""Every error neps_bcast raises, and the one format they share.

Messages read ``[neps_bcast rank 1/4 follower] what happened. HINT: what to do.``
so that a line in any rank's log says where it came from and what to try.
"""

from __future__ import annotations


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
    """A rank of the group raised while evaluating the trial; raised on every rank."""


class ProtocolError(NepsBcastError):
    """The ranks reached different points of the per-trial protocol."""


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
