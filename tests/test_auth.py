"""The authentication of store values and channel messages, on a real TCP store."""

from __future__ import annotations

import logging
import pickle

import pytest

from neps_bcast.compat import torch as tc
from neps_bcast.errors import AuthError, ErrorRecord
from neps_bcast.transport import store
from neps_bcast.transport.auth import Signer

SIGNER = Signer(b"s" * 32)


def test_a_signed_value_opens_only_under_its_own_key_and_secret() -> None:
    signed = SIGNER.sign("neps_bcast/trial/1", b"payload")
    assert SIGNER.open("neps_bcast/trial/1", signed) == b"payload"
    with pytest.raises(AuthError, match="refused the value under 'neps_bcast/trial/2'"):
        SIGNER.open("neps_bcast/trial/2", signed)  # replayed under another key
    with pytest.raises(AuthError, match=r"HINT: .*NEPS_BCAST_SECRET"):
        Signer(b"t" * 32).open("neps_bcast/trial/1", signed)  # another secret
    tampered = signed[:-1] + b"X"
    with pytest.raises(AuthError):
        SIGNER.open("neps_bcast/trial/1", tampered)
    with pytest.raises(AuthError):
        SIGNER.open("neps_bcast/trial/1", b"short")


def test_the_error_board_refuses_a_forged_record_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = tc.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    board = store.ErrorBoard(server, SIGNER)
    genuine = ErrorRecord.from_exception(1, ValueError("real"), pid=1)
    board.publish(3, genuine)
    tc.set_bytes(server, store.Keys.error(3, 0), pickle.dumps(ValueError("forged")))
    tc.set_bytes(  # a valid tag, but for another rank's key: a replay
        server, store.Keys.error(3, 2), SIGNER.sign(store.Keys.error(3, 1), genuine.to_json())
    )
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        assert board.read(3, 3) == [genuine]
    refused = [r.getMessage() for r in caplog.records if "refused the value" in r.getMessage()]
    assert len(refused) == 2, refused
    assert "'neps_bcast/err/3/0'" in refused[0]


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
