"""The error hierarchy and the one message format every error shares."""

from __future__ import annotations

import datetime

import pytest

import neps_bcast
from neps_bcast import errors
from neps_bcast.log import logger, rank_tag, role_tag, tagged
from neps_bcast.transport.channel import JoinTimeoutError

ERROR_CLASSES = [
    errors.SessionError,
    errors.LaunchError,
    errors.MessageError,
    errors.TrialMismatchError,
    errors.TrialFailedError,
    errors.ProtocolError,
    errors.LeaderLostError,
    errors.FollowerLostError,
]


def test_public_base_error_is_exported() -> None:
    assert neps_bcast.NepsBcastError is errors.NepsBcastError
    assert "NepsBcastError" in neps_bcast.__all__
    assert issubclass(errors.NepsBcastError, RuntimeError)


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_is_a_neps_bcast_error(cls: type[Exception]) -> None:
    assert issubclass(cls, errors.NepsBcastError)
    with pytest.raises(errors.NepsBcastError, match="what"):
        raise cls("what")


def test_format_message_with_hint() -> None:
    tag = role_tag(1, 4)
    text = errors.format_message(tag, "lost the leader.", "see its log.")
    assert text == "[neps_bcast rank 1/4 follower] lost the leader. HINT: see its log."


def test_format_message_without_hint_has_no_hint() -> None:
    text = errors.format_message("neps_bcast launch", "something happened.")
    assert text == "[neps_bcast launch] something happened."
    assert "HINT" not in text


@pytest.mark.parametrize(
    ("group_rank", "world_size", "tag"),
    [
        (0, None, "neps_bcast rank 0/? leader"),
        (0, 3, "neps_bcast rank 0/3 leader"),
        (2, 3, "neps_bcast rank 2/3 follower"),
    ],
)
def test_role_tag_names_rank_size_and_role(
    group_rank: int, world_size: int | None, tag: str
) -> None:
    assert role_tag(group_rank, world_size) == tag


def test_log_lines_carry_the_tag_of_the_running_call(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="neps_bcast"), tagged(lambda: role_tag(1, 4)):
        logger.info("trial %s received", "7")
        inside = rank_tag()
    assert caplog.messages == ["[neps_bcast rank 1/4 follower] trial 7 received"]
    assert inside == "neps_bcast rank 1/4 follower"


def test_outside_a_run_the_tag_names_the_process() -> None:
    assert rank_tag().startswith("neps_bcast pid ")


def test_join_timeout_error_names_the_missing_ranks() -> None:
    exc = JoinTimeoutError([1, 3], datetime.timedelta(seconds=5))
    assert exc.missing == [1, 3]
    assert str(exc) == "ranks [1, 3] did not join within 5 s"
