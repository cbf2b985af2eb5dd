"""What the ranks of a group say to each other, and how it is encoded.

Every control step is one exchange in which every rank contributes one message (see
``runtime``): the leader a ``TrialMessage`` per trial and one ``StopMessage`` at the
end, while each follower contributes ``Ready`` (it waits for the next one); at fixed
points of a trial every rank contributes a ``Report`` (its ``Phase`` travels with it);
at the very end every rank contributes ``Goodbye``. Each message carries its kind, so
ranks at different steps are detected at once instead of blocking each other.

Encoding: one kind byte, a JSON header, and for a trial only, the pickled keyword
arguments of the user's function. Control records (stop, reports, errors) are plain
data: nothing but a trial's own arguments is ever unpickled.
"""

from __future__ import annotations

import json
import pickle
import struct
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from neps_bcast.errors import ErrorRecord, MessageError, format_message


class Phase(str, Enum):
    """The point of a trial at which a ``Report`` is exchanged."""

    GROUP_FORMED = "group-formed"
    SESSION_ENTER = "session-enter"
    TRIAL_END = "trial-end"


@dataclass(frozen=True)
class TrialMessage:
    seq: int
    trial_id: str
    kwargs: dict[str, Any]
    pipeline_directory: Path | None
    previous_pipeline_directory: Path | None
    group_generation: int | None = None
    """Every rank forms the DDP group again, as this generation, before the trial (the
    leader decides: a failure or user code ended it); None: keep the group as it is."""
    attempt: int = 1
    """1 for the trial's first evaluation; n + 1 after n interruptions (preemption, a
    time limit, a lost rank) put it back to pending."""
    resumed_from: Path | None = None
    """On a retry: the trial's directory, when an earlier attempt left files there."""


@dataclass(frozen=True)
class StopMessage:
    reason: str


@dataclass(frozen=True)
class Report:
    group_rank: int
    phase: Phase
    seq: int
    trial_id: str
    error: ErrorRecord | None = None
    has_group: bool = False
    """This rank has a default process group (told at session entry)."""


@dataclass(frozen=True)
class Ready:
    """A follower's part of a hand-over: it waits for the leader's next message."""

    group_rank: int


@dataclass(frozen=True)
class Goodbye:
    """Every rank's part of the last step: after it, the channel is closed."""

    group_rank: int


Message = TrialMessage | StopMessage | Report | Ready | Goodbye

_HEAD = struct.Struct(">cI")  # kind, header length
_TRIAL, _STOP, _REPORT, _READY, _GOODBYE = b"T", b"S", b"R", b"W", b"B"


def _typed(raw: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = raw.get(name)
    if not isinstance(value, kind):
        raise ValueError(f"field {name!r} has the wrong type")
    return value


def _frame(kind: bytes, header: dict[str, Any], body: bytes = b"") -> bytes:
    head = json.dumps(header).encode()
    return _HEAD.pack(kind, len(head)) + head + body


def encode(message: Message, *, tag: str) -> bytes:
    """The bytes of a message; names the argument that cannot be sent if that fails."""
    if isinstance(message, StopMessage):
        return _frame(_STOP, {"reason": message.reason})
    if isinstance(message, Ready | Goodbye):
        kind = _READY if isinstance(message, Ready) else _GOODBYE
        return _frame(kind, {"group_rank": message.group_rank})
    if isinstance(message, Report):
        error = asdict(message.error) if message.error is not None else None
        header = {
            "group_rank": message.group_rank,
            "phase": message.phase.value,
            "seq": message.seq,
            "trial_id": message.trial_id,
            "error": error,
            "has_group": message.has_group,
        }
        return _frame(_REPORT, header)
    header = {
        "seq": message.seq,
        "trial_id": message.trial_id,
        "pipeline_directory": _path_text(message.pipeline_directory),
        "previous_pipeline_directory": _path_text(message.previous_pipeline_directory),
        "group_generation": message.group_generation,
        "attempt": message.attempt,
        "resumed_from": _path_text(message.resumed_from),
    }
    return _frame(_TRIAL, header, _pickle_arguments(message, tag))


def decode(payload: bytes, *, tag: str) -> Message:
    try:
        kind, size = _HEAD.unpack_from(payload)
        header = json.loads(payload[_HEAD.size : _HEAD.size + size].decode())
        body = payload[_HEAD.size + size :]
        if kind == _STOP:
            return StopMessage(_typed(header, "reason", str))
        if kind in (_READY, _GOODBYE):
            rank = _typed(header, "group_rank", int)
            return Ready(rank) if kind == _READY else Goodbye(rank)
        if kind == _REPORT:
            error = header.get("error")
            return Report(
                group_rank=_typed(header, "group_rank", int),
                phase=Phase(_typed(header, "phase", str)),
                seq=_typed(header, "seq", int),
                trial_id=_typed(header, "trial_id", str),
                error=ErrorRecord.from_dict(error) if error is not None else None,
                has_group=_typed(header, "has_group", bool),
            )
        if kind != _TRIAL:
            raise ValueError(f"unknown message kind {kind!r}")
        kwargs = _unpickle_arguments(body, tag)
        return TrialMessage(
            seq=_typed(header, "seq", int),
            trial_id=_typed(header, "trial_id", str),
            kwargs=kwargs,
            pipeline_directory=_path(header.get("pipeline_directory")),
            previous_pipeline_directory=_path(header.get("previous_pipeline_directory")),
            group_generation=_generation(header.get("group_generation")),
            attempt=_attempt(header.get("attempt")),
            resumed_from=_path(header.get("resumed_from")),
        )
    except MessageError:
        raise
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise MessageError(
            format_message(
                tag,
                f"cannot read a message from another rank: {type(exc).__name__}: {exc}.",
                "every rank must run the same neps_bcast version.",
            )
        ) from exc


def _generation(raw: object) -> int | None:
    if raw is None:
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise ValueError("a group generation must be a positive integer")
    return raw


def _attempt(raw: object) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        raise ValueError("an attempt must be a positive integer")
    return raw


def _path_text(path: Path | None) -> str | None:
    return None if path is None else str(path)


def _path(raw: object) -> Path | None:
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ValueError("a directory must be a string")
    return Path(raw)


def _pickle_arguments(message: TrialMessage, tag: str) -> bytes:
    try:
        return pickle.dumps(message.kwargs, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        culprit = " the arguments"
        for name, value in message.kwargs.items():
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001 - find the culprit
                culprit = f" argument {name!r} ({type(value).__qualname__})"
                break
        raise MessageError(
            format_message(
                tag,
                f"cannot send{culprit} to the other ranks: {type(exc).__name__}: {exc}.",
                "every argument of evaluate_pipeline must be picklable (plain values,"
                " or functions and classes importable by module path); for a"
                " PipelineSpace Operation, give its operator as a string or a"
                " module-level class.",
            )
        ) from exc


def _unpickle_arguments(body: bytes, tag: str) -> dict[str, Any]:
    try:
        kwargs = pickle.loads(body)  # noqa: S301 - only the trial's own arguments
    except Exception as exc:
        raise MessageError(
            format_message(
                tag,
                "cannot read a message from the leader (the trial's arguments):"
                f" {type(exc).__name__}: {exc}.",
                "every rank must run the same code and the same library versions"
                " (a class in a trial argument must be importable on every rank).",
            )
        ) from exc
    if not isinstance(kwargs, dict):
        raise MessageError(format_message(tag, f"unexpected trial arguments {type(kwargs)!r}."))
    return kwargs
