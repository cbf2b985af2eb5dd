"""The error hierarchy and the one message format every error shares."""

from __future__ import annotations

import datetime

import pytest

import neps_bcast
from neps_bcast import errors
from neps_bcast.channel import JoinTimeoutError
from neps_bcast.identity import Identity

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
    tag = Identity(group_rank=1, world_size=4).tag
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
def test_identity_tag_names_rank_size_and_role(
    group_rank: int, world_size: int | None, tag: str
) -> None:
    identity = Identity(group_rank, world_size)
    assert identity.tag == tag
    assert identity.is_leader is (group_rank == 0)
    assert identity.role == ("leader" if group_rank == 0 else "follower")


def test_join_timeout_error_names_the_missing_ranks() -> None:
    exc = JoinTimeoutError([1, 3], datetime.timedelta(seconds=5))
    assert exc.missing == [1, 3]
    assert str(exc) == "ranks [1, 3] did not join within 5 s"
