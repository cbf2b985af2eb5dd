"""Who the other ranks are: records on a real TCP store, and what a process sees by itself.

A forged, replayed or unreadable peer record is an error naming its key, logged, never
skipped in silence; the rank is then found from this host's processes (``/proc``), so a
failure can still release the group.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from neps_bcast.compat import torch as tc
from neps_bcast.transport import auth, peers, store
from neps_bcast.transport.auth import Context, Signer

KEY = b"k" * 32
SEARCH = auth.search_id(b"n" * 32, [b"a", b"b"])


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.fixture
def server() -> tc.TCPStore:
    return tc.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_a_genuine_record_is_read(server: tc.TCPStore) -> None:
    """The positive control of the refusals below."""
    peers.Peers(1, Signer(KEY, SEARCH)).publish(server)
    found = peers.Peers(0, Signer(KEY, SEARCH)).others(server, 2)
    assert [(p.group_rank, p.pid) for p in found] == [(1, os.getpid())]


def test_a_forged_record_is_an_error_naming_its_key_once(
    server: tc.TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    tc.set_bytes(server, store.Keys.rank(1), pickle.dumps({"host": "x", "pid": 1}))
    table = peers.Peers(0, Signer(KEY, SEARCH))
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        assert table.others(server, 2) == []
        assert table.others(server, 2) == []  # asked again: said once
    logged = refusals(caplog)
    assert len(logged) == 1, logged
    assert "refused the value under 'neps_bcast/rank/1'" in logged[0]


def test_a_record_replayed_from_another_search_is_refused(
    server: tc.TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    earlier = Signer(KEY, auth.search_id(b"e" * 32, [b"a", b"b"]))  # the same secret
    peers.Peers(1, earlier).publish(server)
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        assert peers.Peers(0, Signer(KEY, SEARCH)).others(server, 2) == []
    assert "refused the value under 'neps_bcast/rank/1'" in refusals(caplog)[0]


def test_a_tagged_value_that_is_no_record_is_refused(
    server: tc.TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    signer = Signer(KEY, SEARCH)
    key = store.Keys.rank(1)
    tc.set_bytes(server, key, signer.sign(Context(key, 1), json.dumps([1, 2]).encode()))
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        assert peers.Peers(0, signer).others(server, 2) == []
    logged = refusals(caplog)
    assert len(logged) == 1, logged
    assert (
        "refused the peer record under 'neps_bcast/rank/1': cannot read it (ValueError: it is"
        " not a peer record" in logged[0]
    )
    assert "HINT:" in logged[0]


@pytest.fixture
def launch_processes() -> Iterator[tuple[str, dict[str, subprocess.Popen[bytes]]]]:
    """Processes of this user that look like this launch's rank 1 and rank 0, and one of
    another launch (each sleeps until killed)."""
    run_id = uuid.uuid4().hex
    started = {}
    for name, (rid, rank) in {
        "rank 1": (run_id, "1"),
        "rank 0 child": (run_id, "0"),
        "another launch": (uuid.uuid4().hex, "1"),
    }.items():
        env = {**os.environ, "NB_TEST_RUN_ID": rid, "RANK": rank}
        started[name] = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], env=env, stdin=subprocess.PIPE
        )
    try:
        yield run_id, started
    finally:
        for proc in started.values():
            proc.kill()
            proc.wait()


def test_a_rank_without_a_record_is_found_among_this_hosts_processes(
    server: tc.TCPStore,
    launch_processes: tuple[str, dict[str, subprocess.Popen[bytes]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    run_id, started = launch_processes
    tc.set_bytes(server, store.Keys.rank(1), b"forged")
    identity = (("NB_TEST_RUN_ID", run_id),)
    table = peers.Peers(0, Signer(KEY, SEARCH), lambda: peers.launch_relatives(identity, "RANK", 0))
    with caplog.at_level(logging.ERROR, logger="neps_bcast"):
        group = table.group(server, 2)
    assert [(p.group_rank, p.pid) for p in group] == [(1, started["rank 1"].pid)]
    assert "refused the value under 'neps_bcast/rank/1'" in refusals(caplog)[0]
    # Nothing of another launch, and not this rank's own processes.
    assert peers.launch_relatives((), "RANK", 0) == []
