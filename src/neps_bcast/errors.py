"""Every error neps_bcast raises, and the one format they share.

Messages read ``[neps_bcast rank 1/4 follower] what happened. HINT: what to do.``
so that a line in any rank's log says where it came from and what to try.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ErrorRecord:
    """One rank's failure, as data (after torchelastic's error files)."""

    group_rank: int
    type_name: str
    message: str
    traceback: str
    timestamp: float
    pid: int = 0
    secondary: bool = False
    """True for an error caused by another rank's failure (a peer closed the group)."""
    preempted: bool = False
    """True when the rank was interrupted by SIGTERM (preemption, a time limit), which is
    no fault of the trial's config."""

    @classmethod
    def from_exception(
        cls,
        group_rank: int,
        exc: BaseException,
        *,
        pid: int,
        secondary: bool = False,
        preempted: bool = False,
    ) -> ErrorRecord:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(
            group_rank,
            type(exc).__name__,
            str(exc),
            tb,
            time.time(),
            pid=pid,
            secondary=secondary,
            preempted=preempted,
        )

    def headline(self) -> str:
        return f"rank {self.group_rank}: {self.type_name}: {self.message}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_dict(cls, raw: object) -> ErrorRecord:
        if not isinstance(raw, dict):
            raise ValueError(f"an error record must be an object, got {type(raw).__name__}")
        return cls(
            group_rank=_typed(raw, "group_rank", int),
            type_name=_typed(raw, "type_name", str),
            message=_typed(raw, "message", str),
            traceback=_typed(raw, "traceback", str),
            timestamp=float(_typed(raw, "timestamp", (int, float))),
            pid=_typed(raw, "pid", int),
            secondary=_typed(raw, "secondary", bool),
            preempted=_typed(raw, "preempted", bool),
        )

    @classmethod
    def from_json(cls, payload: bytes) -> ErrorRecord | None:
        """The record, or None for anything that is not one (never executes anything)."""
        try:
            return cls.from_dict(json.loads(payload.decode()))
        except (ValueError, UnicodeDecodeError):
            return None


def _typed(raw: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = raw.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"field {name!r} has the wrong type")
    return value


class NepsBcastError(RuntimeError):
    """Base class of every error raised by neps_bcast."""


class SessionError(NepsBcastError):
    """``session()`` was used where no trial is running (outside ``neps_bcast.run``)."""


class LaunchError(NepsBcastError):
    """The launch environment is inconsistent or was not recognised."""


class SettingsError(NepsBcastError):
    """A ``NEPS_BCAST_*`` setting has a value neps_bcast cannot use."""


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


class SearchStopped(NepsBcastError):
    """Follower: the leader stopped the search while this rank was in a trial.

    Raised where the follower expected the trial's next meeting (e.g. inside
    ``session()``); the follower then ends the trial, says goodbye and returns.
    """

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


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


def sort_records(records: list[ErrorRecord]) -> list[ErrorRecord]:
    """Root causes first (errors of their own, earliest first), then secondary ones."""
    return sorted(records, key=lambda r: (r.secondary, r.timestamp, r.group_rank))


def failure_text(records: list[ErrorRecord], trial_id: str) -> str:
    primary = [r for r in records if not r.secondary] or records
    secondary = [r for r in records if r not in primary]
    ranks = ", ".join(str(r.group_rank) for r in primary)
    head = f"trial {trial_id} failed on rank{'s' if len(primary) > 1 else ''} {ranks}: "
    head += "; ".join(r.headline() for r in primary)
    if secondary:
        head += ". Caused by it: " + "; ".join(r.headline() for r in secondary)
    tracebacks = "\n".join(
        f"--- traceback of rank {r.group_rank} (pid {r.pid}) ---\n{r.traceback}" for r in primary
    )
    return f"{head}.\n{tracebacks}"
