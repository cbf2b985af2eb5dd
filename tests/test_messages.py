"""Unit tests: the messages ranks exchange, their encoding, and errors as data."""

from __future__ import annotations

import pickle
import random
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from neps_bcast import errors
from neps_bcast.compat.torch import is_peer_closed
from neps_bcast.errors import ErrorRecord, MessageError, NepsBcastError
from neps_bcast.transport.messages import (
    Phase,
    Report,
    StopMessage,
    TrialMessage,
    decode,
    encode,
)

TAG = "neps_bcast rank 0/2 leader"


def _trial(**kwargs: object) -> TrialMessage:
    return TrialMessage(
        seq=3,
        trial_id="17_rung_1",
        kwargs=dict(kwargs),
        pipeline_directory=Path("/tmp/root/configs/config_17_rung_1"),
        previous_pipeline_directory=Path("/tmp/root/configs/config_17_rung_0"),
    )


def _roundtrip(message: object) -> object:
    payload = encode(message, tag=TAG)  # type: ignore[arg-type]
    assert isinstance(payload, bytes)
    return decode(payload, tag=TAG)


# -- round trips ----------------------------------------------------------------------


def test_trial_message_round_trip_keeps_paths_and_nested_values() -> None:
    message = _trial(
        lr=0.01,
        hidden=8,
        activation="relu",
        nested={"a": [1, 2, {"b": (3.5, None)}], "path": Path("x/y")},
        pipeline_directory=Path("/tmp/root/configs/config_17_rung_1"),
        previous_pipeline_directory=None,
        pipeline_id="17_rung_1",
    )
    back = _roundtrip(message)
    assert back == message
    assert isinstance(back, TrialMessage)
    assert isinstance(back.pipeline_directory, Path)
    assert isinstance(back.kwargs["nested"]["path"], Path)
    assert back.kwargs["nested"]["a"][2]["b"] == (3.5, None)


def test_trial_message_round_trip_with_a_1mb_argument() -> None:
    blob = random.Random(0).randbytes(1 << 20)
    message = _trial(blob=blob, lr=0.1)
    payload = encode(message, tag=TAG)
    assert len(payload) > 1 << 20
    back = decode(payload, tag=TAG)
    assert isinstance(back, TrialMessage)
    assert back.kwargs["blob"] == blob


def test_trial_message_without_directories_round_trips() -> None:
    message = TrialMessage(
        seq=1, trial_id="1", kwargs={}, pipeline_directory=None, previous_pipeline_directory=None
    )
    assert _roundtrip(message) == message


def test_trial_message_carries_the_group_generation_to_form() -> None:
    message = TrialMessage(
        seq=4,
        trial_id="4",
        kwargs={},
        pipeline_directory=None,
        previous_pipeline_directory=None,
        group_generation=3,
    )
    assert _roundtrip(message) == message
    assert _roundtrip(replace(message, group_generation=None)).group_generation is None


@pytest.mark.parametrize("bad", [0, -1, "2", True, 1.5])
def test_a_bad_group_generation_is_refused(bad: object) -> None:
    payload = encode(
        TrialMessage(
            seq=1,
            trial_id="1",
            kwargs={},
            pipeline_directory=None,
            previous_pipeline_directory=None,
            group_generation=bad,  # type: ignore[arg-type]  # what a broken peer could send
        ),
        tag=TAG,
    )
    with pytest.raises(MessageError, match="group generation"):
        decode(payload, tag=TAG)


def test_stop_message_round_trip() -> None:
    message = StopMessage("the search is over")
    back = _roundtrip(message)
    assert back == message
    assert isinstance(back, StopMessage)


def _record_of(exc_type: type[BaseException], text: str, group_rank: int = 1) -> ErrorRecord:
    try:
        raise exc_type(text)
    except exc_type as exc:
        return ErrorRecord.from_exception(group_rank, exc, pid=4242)


def test_report_with_error_record_round_trips_with_its_phase() -> None:
    record = _record_of(ValueError, "boom")
    report = Report(
        group_rank=1,
        phase=Phase.SESSION_ENTER,
        seq=2,
        trial_id="5",
        error=record,
    )
    back = _roundtrip(report)
    assert back == report
    assert isinstance(back, Report)
    assert back.phase is Phase.SESSION_ENTER
    assert back.error == record
    assert back.error is not None
    assert back.error.traceback == record.traceback


def test_report_without_error_round_trips() -> None:
    report = Report(group_rank=0, phase=Phase.TRIAL_END, seq=1, trial_id="1")
    assert _roundtrip(report) == report


# -- what cannot be sent --------------------------------------------------------------


def _generator():  # type: ignore[no-untyped-def]
    yield 1


@pytest.mark.parametrize(
    ("value", "type_name"),
    [
        (lambda x: x, "function"),
        (threading.Lock(), "lock"),
        (_generator(), "generator"),
    ],
    ids=["lambda", "lock", "generator"],
)
def test_encode_names_the_unpicklable_argument(value: object, type_name: str) -> None:
    message = _trial(lr=0.1, hidden=4, culprit=value, pipeline_id="17_rung_1")
    with pytest.raises(MessageError) as info:
        encode(message, tag=TAG)
    text = str(info.value)
    assert isinstance(info.value, NepsBcastError)
    assert text.startswith(f"[{TAG}] ")
    assert "argument 'culprit'" in text
    assert f"({type_name})" in text
    assert "HINT:" in text
    # Only the culprit is named, not the arguments that are fine.
    assert "'lr'" not in text
    assert "'hidden'" not in text


def test_encode_error_keeps_the_pickling_error_as_cause() -> None:
    with pytest.raises(MessageError) as info:
        encode(_trial(fn=lambda: None), tag=TAG)
    assert info.value.__cause__ is not None


@pytest.mark.parametrize(
    "payload",
    [b"", b"garbage, not a pickle", b"\x80\x05\x95\xff\xff\xff"],
    ids=["empty", "garbage", "truncated-header"],
)
def test_decode_of_garbage_raises_message_error(payload: bytes) -> None:
    with pytest.raises(MessageError) as info:
        decode(payload, tag=TAG)
    text = str(info.value)
    assert text.startswith(f"[{TAG}] cannot read a message")
    assert "HINT:" in text


def test_decode_of_a_truncated_message_raises_message_error() -> None:
    # NePS's own DDP mode loses whole searches to truncated pickles: ours must raise
    # our error instead of an UnpicklingError from deep inside.
    payload = encode(_trial(blob=b"x" * 10_000), tag=TAG)
    with pytest.raises(MessageError, match="cannot read a message"):
        decode(payload[: len(payload) // 2], tag=TAG)


def test_decode_of_a_pickle_that_is_no_message_raises_message_error() -> None:
    with pytest.raises(MessageError, match="cannot read a message"):
        decode(pickle.dumps({"seq": 1, "trial_id": "1"}), tag=TAG)


class _Boom:
    """Unpickling this runs code: the kind of value an outsider would plant."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (_record_unpickled, ("ran",))


UNPICKLED: list[str] = []


def _record_unpickled(what: str) -> str:
    UNPICKLED.append(what)
    return what


@pytest.mark.parametrize("kind", [b"S", b"R"])
def test_control_messages_are_never_unpickled(kind: bytes) -> None:
    # A stop or a report carrying a pickle (in its header or after it) is refused or
    # read as plain data: only a trial's own arguments are ever unpickled.
    import struct

    bomb = pickle.dumps(_Boom())
    for payload in (
        struct.pack(">cI", kind, len(bomb)) + bomb,
        struct.pack(">cI", kind, 2) + b"{}" + bomb,
    ):
        with pytest.raises(MessageError, match="cannot read a message"):
            decode(payload, tag=TAG)
    assert UNPICKLED == []
    # The positive control: the same object as a trial argument is unpickled.
    decode(encode(_trial(x=_Boom()), tag=TAG), tag=TAG)
    assert UNPICKLED == ["ran"]
    UNPICKLED.clear()


def test_error_record_from_garbage_json_is_none() -> None:
    assert ErrorRecord.from_json(b"\x80\x05garbage") is None
    assert ErrorRecord.from_json(b'{"group_rank": "1"}') is None
    record = ErrorRecord.from_exception(2, ValueError("x"), pid=7)
    assert ErrorRecord.from_json(record.to_json()) == record


# -- errors as data ---------------------------------------------------------------------


def _fail_deep_inside() -> None:
    raise KeyError("missing-key")


def test_error_record_from_exception_captures_type_message_and_traceback() -> None:
    before = time.time()
    try:
        _fail_deep_inside()
    except KeyError as exc:
        record = ErrorRecord.from_exception(2, exc, pid=1234)
    after = time.time()
    assert record.group_rank == 2
    assert record.type_name == "KeyError"
    assert record.message == "'missing-key'"
    assert record.pid == 1234
    assert record.secondary is False
    assert before <= record.timestamp <= after
    assert record.traceback.startswith("Traceback (most recent call last)")
    assert "_fail_deep_inside" in record.traceback
    assert "KeyError: 'missing-key'" in record.traceback
    assert record.headline() == "rank 2: KeyError: 'missing-key'"


def test_error_record_keeps_the_secondary_flag() -> None:
    try:
        raise RuntimeError("peer gone")
    except RuntimeError as exc:
        record = ErrorRecord.from_exception(0, exc, pid=1, secondary=True)
    assert record.secondary is True


@pytest.mark.parametrize(
    "text",
    [
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"
        " [127.0.0.1]:33071",
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:598] Connection reset by peer",
    ],
)
def test_is_secondary_recognizes_a_peer_closing_the_group(text: str) -> None:
    assert is_peer_closed(RuntimeError(text))


def test_is_secondary_rejects_a_failure_of_its_own() -> None:
    assert not is_peer_closed(ValueError("injected failure on rank 1 at fit"))
    assert not is_peer_closed(RuntimeError("CUDA out of memory"))


def _record(group_rank: int, timestamp: float, *, secondary: bool, message: str) -> ErrorRecord:
    return ErrorRecord(
        group_rank=group_rank,
        type_name="RuntimeError" if secondary else "ValueError",
        message=message,
        traceback=f"Traceback of rank {group_rank}\n",
        timestamp=timestamp,
        pid=100 + group_rank,
        secondary=secondary,
    )


def test_sort_records_puts_root_causes_first_earliest_first() -> None:
    peer = _record(0, 1.0, secondary=True, message="Connection closed by peer")
    late = _record(2, 5.0, secondary=False, message="late failure")
    early = _record(1, 3.0, secondary=False, message="early failure")
    assert errors.sort_records([peer, late, early]) == [early, late, peer]


def test_failure_text_names_the_failing_ranks_and_then_the_consequences() -> None:
    peer = _record(0, 1.0, secondary=True, message="Connection closed by peer")
    early = _record(1, 3.0, secondary=False, message="early failure")
    late = _record(2, 5.0, secondary=False, message="late failure")
    text = errors.failure_text(errors.sort_records([peer, late, early]), "9")
    head = text.splitlines()[0]
    assert head.startswith(
        "trial 9 failed on ranks 1, 2: rank 1: ValueError: early failure;"
        " rank 2: ValueError: late failure."
    )
    assert "Caused by it: rank 0: RuntimeError: Connection closed by peer" in head
    assert head.index("rank 1:") < head.index("rank 2:") < head.index("Caused by it")
    # Tracebacks of the root causes only.
    assert "--- traceback of rank 1 (pid 101) ---\nTraceback of rank 1" in text
    assert "--- traceback of rank 2 (pid 102) ---" in text
    assert "traceback of rank 0" not in text


def test_failure_text_for_one_rank_says_rank() -> None:
    only = _record(1, 3.0, secondary=False, message="boom")
    text = errors.failure_text([only], "4")
    assert text.startswith("trial 4 failed on rank 1: rank 1: ValueError: boom.")
    assert "Caused by it" not in text


def test_failure_text_with_only_secondary_errors_still_names_them() -> None:
    a = _record(0, 1.0, secondary=True, message="Connection closed by peer")
    b = _record(1, 2.0, secondary=True, message="Connection reset by peer")
    text = errors.failure_text([a, b], "4")
    assert text.startswith("trial 4 failed on ranks 0, 1: rank 0: RuntimeError:")
    assert "traceback of rank 0" in text
    assert "traceback of rank 1" in text


def test_a_preempted_rank_is_told_by_its_record_not_by_its_error_type_name() -> None:
    class Terminated(Exception):  # a user's own exception that happens to share the name
        pass

    users = ErrorRecord.from_exception(1, Terminated("my own"), pid=1)
    ours = ErrorRecord.from_exception(1, RuntimeError("SIGTERM"), pid=1, preempted=True)
    assert (users.preempted, ours.preempted) == (False, True)
    assert ErrorRecord.from_json(ours.to_json()) == ours
