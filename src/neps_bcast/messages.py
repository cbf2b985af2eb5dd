"""What the ranks of a group say to each other, and how it is encoded.

The leader sends a ``TrialMessage`` per trial and one ``StopMessage`` at the end.
At fixed points of a trial every rank contributes a ``Report``; the kind of the
point (``Phase``) travels with it so that ranks at different points are detected
instead of exchanging garbage.
"""

from __future__ import annotations

import pickle
import time
import traceback
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from neps_bcast.errors import MessageError, format_message


class Phase(str, Enum):
    """The point of a trial at which a ``Report`` is exchanged."""

    SESSION_ENTER = "session-enter"
    SESSION_EXIT = "session-exit"
    TRIAL_END = "trial-end"


@dataclass(frozen=True)
class TrialMessage:
    seq: int
    trial_id: str
    kwargs: dict[str, Any]
    pipeline_directory: Path | None
    previous_pipeline_directory: Path | None


@dataclass(frozen=True)
class StopMessage:
    reason: str


@dataclass(frozen=True)
class ErrorRecord:
    """One rank's failure, as data (after torchelastic's error files)."""

    group_rank: int
    type_name: str
    message: str
    traceback: str
    timestamp: float
    pid: int = 0
    exit_code: int | None = None
    secondary: bool = False
    """True for an error caused by another rank's failure (a peer closed the group)."""

    @classmethod
    def from_exception(
        cls, group_rank: int, exc: BaseException, *, pid: int, secondary: bool = False
    ) -> ErrorRecord:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(
            group_rank, type(exc).__name__, str(exc), tb, time.time(), pid=pid, secondary=secondary
        )

    def headline(self) -> str:
        return f"rank {self.group_rank}: {self.type_name}: {self.message}"


@dataclass(frozen=True)
class Report:
    group_rank: int
    phase: Phase
    seq: int
    trial_id: str
    error: ErrorRecord | None = None
    extra: dict[str, Any] = field(default_factory=dict)


Message = TrialMessage | StopMessage | Report


def encode(message: Message, *, tag: str) -> bytes:
    """Pickle a message; name the argument that cannot be sent if that fails."""
    try:
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        culprit = ""
        if isinstance(message, TrialMessage):
            for name, value in message.kwargs.items():
                try:
                    pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception:  # noqa: BLE001 - find the culprit
                    culprit = f" argument {name!r} ({type(value).__qualname__})"
                    break
        raise MessageError(
            format_message(
                tag,
                f"cannot send{culprit or ' the message'} to the other ranks:"
                f" {type(exc).__name__}: {exc}.",
                "every argument of evaluate_pipeline must be picklable (plain values,"
                " or functions and classes importable by module path); for a"
                " PipelineSpace Operation, give its operator as a string or a"
                " module-level class.",
            )
        ) from exc


def decode(payload: bytes, *, tag: str) -> Message:
    try:
        message = pickle.loads(payload)  # noqa: S301 - only our own group's ranks send
    except Exception as exc:
        raise MessageError(
            format_message(
                tag,
                f"cannot read a message from the leader: {type(exc).__name__}: {exc}.",
                "every rank must run the same code and the same library versions"
                " (a class in a trial argument must be importable on every rank).",
            )
        ) from exc
    if not isinstance(message, TrialMessage | StopMessage | Report):
        raise MessageError(format_message(tag, f"unexpected message {type(message)!r}."))
    return message
