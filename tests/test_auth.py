"""The authentication of store values and channel messages, on a real TCP store.

A tag binds the key, the search (a nonce per search and per restart, bound to the
followers' challenges), the sender's rank, the sequence number and the group
generation: a value recorded from any other of these is refused, with the same user
secret as the one it was recorded under.
"""

from __future__ import annotations

import logging
import pickle

import pytest

from neps_bcast.compat import torch as tc
from neps_bcast.errors import AuthError, ErrorRecord
from neps_bcast.transport import auth, store
from neps_bcast.transport.auth import Context, Signer, channel_context

USER_SECRET = "5f0c6a1e9b2d4c7a8e3f1b6d0a9c2e4f7b1d3a5c8e0f2b4d6a8c1e3f5b7d9a0c"
KEY = auth.derive_key(USER_SECRET)
CHALLENGES = [b"rank-0-challenge", b"rank-1-challenge"]
SEARCH = auth.search_id(b"n" * 32, CHALLENGES)
SIGNER = Signer(KEY, SEARCH)
TRIAL = channel_context("leader", sender=0, seq=4, generation=1)


def test_a_signed_value_opens_under_its_own_context() -> None:
    assert SIGNER.open(TRIAL, SIGNER.sign(TRIAL, b"payload")) == b"payload"


@pytest.mark.parametrize(
    ("what", "reader"),
    [
        ("another key", Signer(KEY, SEARCH)),
        ("another search", Signer(KEY, auth.search_id(b"m" * 32, CHALLENGES))),
        # A restart: the same user secret, a new leader nonce and new challenges.
        ("a restart", Signer(KEY, auth.search_id(b"n" * 32, [b"new-0", b"new-1"]))),
        ("another secret", Signer(auth.derive_key(USER_SECRET[::-1]), SEARCH)),
    ],
)
def test_a_value_recorded_elsewhere_is_refused(what: str, reader: Signer) -> None:
    context = Context("neps_bcast/rank/1", sender=1)
    signed = SIGNER.sign(context, b"{}")
    where = Context("neps_bcast/rank/2", sender=1) if what == "another key" else context
    with pytest.raises(AuthError, match=rf"refused the value under '{where.key}'"):
        reader.open(where, signed)


@pytest.mark.parametrize(
    "replayed",
    [
        channel_context("leader", sender=0, seq=3, generation=1),  # an earlier message
        channel_context("leader", sender=0, seq=4, generation=0),  # another generation
        channel_context("leader", sender=1, seq=4, generation=1),  # another sender
        channel_context("report", sender=0, seq=4, generation=1),  # another kind
    ],
    ids=["seq", "generation", "sender", "kind"],
)
def test_a_channel_message_replayed_in_another_place_is_refused(replayed: Context) -> None:
    with pytest.raises(AuthError, match=r"refused the value under 'channel/") as refused:
        SIGNER.open(replayed, SIGNER.sign(TRIAL, b"trial"))
    assert "HINT:" in str(refused.value)
    assert "NEPS_BCAST_SECRET" in str(refused.value)


def test_the_positive_control_of_replays_the_same_context_opens_again() -> None:
    """Tags are deterministic: what refuses a replay is the context, not chance."""
    again = channel_context("leader", sender=0, seq=4, generation=1)
    assert SIGNER.open(again, SIGNER.sign(TRIAL, b"trial")) == b"trial"


def test_a_tampered_or_short_value_is_refused() -> None:
    signed = SIGNER.sign(TRIAL, b"payload")
    with pytest.raises(AuthError):
        SIGNER.open(TRIAL, signed[:-1] + b"X")
    with pytest.raises(AuthError):
        SIGNER.open(TRIAL, b"short")


def test_a_key_two_ranks_write_opens_for_either_and_no_one_else() -> None:
    key = store.Keys.released(1)
    writers = [Context(key, 0), Context(key, 1)]
    assert SIGNER.open_any(writers, SIGNER.sign(Context(key, 1), b"1")) == b"1"
    assert SIGNER.open_any(writers, SIGNER.sign(Context(key, 0), b"1")) == b"1"
    with pytest.raises(AuthError, match="refused the value under 'neps_bcast/watch/released/1'"):
        SIGNER.open_any(writers, SIGNER.sign(Context(key, 2), b"1"))


@pytest.mark.parametrize(
    ("secret", "observed"),
    [
        ("the search's secret", "observed 19 characters"),
        ("ab12" * 15, "observed 60 hex characters"),  # 30 bytes
        ("a" * 80, "observed only 1 distinct characters"),
    ],
)
def test_a_weak_user_secret_is_refused(secret: str, observed: str) -> None:
    with pytest.raises(AuthError) as refused:
        auth.secret_from_env({"NEPS_BCAST_SECRET": secret}, tag="neps_bcast rank 0/2 leader")
    text = str(refused.value)
    assert text.startswith(
        "[neps_bcast rank 0/2 leader] refused NEPS_BCAST_SECRET: too weak to protect the"
        " search; expected at least 32 random bytes (64 hex characters, or 43 characters"
        " of another alphabet), "
    ), text
    assert observed in text
    assert "HINT: export NEPS_BCAST_SECRET=$(python -c 'import secrets;" in text
    assert secret not in text  # the error never shows the secret


def test_a_strong_user_secret_is_taken_and_derived_slowly() -> None:
    """The positive control of the refusals above: 64 hex characters (token_hex(32)) and
    43 characters of base64 (token_urlsafe(32)) are taken."""
    assert auth.secret_from_env({"NEPS_BCAST_SECRET": USER_SECRET}) == KEY
    urlsafe = "Jq3vX0_mK9sLw2Rb8TzY4nH6cPfA1dGe7UoEiVxQh5s"
    assert len(auth.secret_from_env({"NEPS_BCAST_SECRET": urlsafe}) or b"") == 32
    assert auth.secret_from_env({}) is None
    assert auth.KDF_ITERATIONS >= 100_000  # a recorded tag does not make guessing cheap
    assert KEY != auth.derive_key(USER_SECRET + "0")


def test_the_error_board_refuses_forged_and_replayed_records_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = tc.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    board = store.ErrorBoard(server, SIGNER)
    genuine = ErrorRecord.from_exception(1, ValueError("real"), pid=1)
    board.publish(3, genuine)
    tc.set_bytes(server, store.Keys.error(3, 0), pickle.dumps(ValueError("forged")))
    tc.set_bytes(  # a valid tag, but for another rank's key
        server,
        store.Keys.error(3, 2),
        SIGNER.sign(Context(store.Keys.error(3, 1), 1, 3), genuine.to_json()),
    )
    earlier = Signer(KEY, auth.search_id(b"e" * 32, CHALLENGES))  # an earlier search's board
    tc.set_bytes(
        server,
        store.Keys.error(3, 3),
        earlier.sign(Context(store.Keys.error(3, 3), 3, 3), genuine.to_json()),
    )
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        assert board.read(3, 4) == [genuine]
    refused = [r.getMessage() for r in caplog.records if "refused the value" in r.getMessage()]
    assert len(refused) == 3, refused
    assert "'neps_bcast/err/3/0'" in refused[0]
    assert "'neps_bcast/err/3/3'" in refused[2]


def test_the_error_board_refuses_a_tagged_value_that_is_no_record(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = tc.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    key = store.Keys.error(2, 1)
    tc.set_bytes(server, key, SIGNER.sign(Context(key, 1, 2), b'{"not": "a record"}'))
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        assert store.ErrorBoard(server, SIGNER).read(2, 2) == []
    assert any(
        "refused the error record under 'neps_bcast/err/2/1': not a record" in r.getMessage()
        for r in caplog.records
    ), caplog.text


def test_a_store_served_on_loopback_listens_on_loopback_only() -> None:
    import datetime

    from neps_bcast.transport import sockets

    served = store.serve(datetime.timedelta(seconds=10), loopback=True)
    listening = sockets.listening(sockets.tcp_table(), sockets.socket_inodes())
    assert ("127.0.0.1", served.port) in listening
    client = store.connect(f"127.0.0.1:{served.port}", datetime.timedelta(seconds=10), 5.0)
    client.set("k", "v")
    assert served.get("k") == b"v"
    everywhere = store.serve(datetime.timedelta(seconds=10), loopback=False)
    listening = sockets.listening(sockets.tcp_table(), sockets.socket_inodes())
    assert any(port == everywhere.port and ip in ("0.0.0.0", "::") for ip, port in listening)
