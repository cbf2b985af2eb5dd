"""Liveness that cannot switch itself off (``neps_bcast.transport.liveness`` and what the
runtime does with its verdicts), on a real TCPStore, with real processes where a verdict
ends one.

- A watch thread that raises is logged at ERROR with its traceback and ends the trial as
  an infrastructure fault: it never leaves a rank unwatched without a word.
- A beat whose wait timed out is tried again: a leader heard again costs nothing.
- A leader silent in the goodbye after STOP ends its follower within the peer bound.

Bounds: the peer bound here (``BOUND``, 1 s) < each wait for a verdict or an exit
(``WAIT``) < pytest's timeout.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed

from neps_bcast.compat import procfs
from neps_bcast.compat.torch import TCPStore
from neps_bcast.transport import liveness, store
from neps_bcast.transport.auth import Signer, new_secret
from verdicts import WAIT, Verdicts, store_process, wait_until

BOUND = 1.0
PYTHON = sys.executable


@pytest.fixture
def leader_store() -> TCPStore:
    return store.serve(datetime.timedelta(seconds=30), loopback=True)


@pytest.fixture
def leader() -> Iterator[subprocess.Popen[str]]:
    """A process serving a store, as a leader does; a test may freeze it."""
    with store_process() as proc:
        yield proc


def _address(client: TCPStore) -> str:
    return f"127.0.0.1:{client.port}"


def _count(client: TCPStore, signer: Signer, group_rank: int) -> int:
    """A rank's last beat counter (0 before its first)."""
    key = liveness.beat_key(group_rank)
    if not client.check([key]):
        return 0
    record = json.loads(store.take(client, signer, key, sender=group_rank))
    return int(record["n"])


class PeerRecordsBroken(RuntimeError):
    """What a watch's thread raises in these tests (any bug of ours would do)."""


def _broken(_group_rank: int = 0) -> procfs.Process | None:
    raise PeerRecordsBroken("the peer records cannot be read")


def _error_with_traceback(caplog: pytest.LogCaptureFixture, watch: str) -> logging.LogRecord:
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR and watch in r.message]
    assert record.exc_info is not None
    assert record.exc_info[0] is PeerRecordsBroken
    return record


def test_a_monitor_that_raises_says_so_at_error_and_gives_a_verdict_of_its_own(
    leader_store: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the leader's monitor ended on any exception with a DEBUG line: its
    followers unwatched, its lease renewed for ever, and nobody told."""
    caplog.set_level(logging.DEBUG)
    signer = Signer(new_secret())
    follower_verdicts = Verdicts[liveness.Silence]()
    beat = liveness.LeaderBeat(
        _address(leader_store), 1, signer, BOUND, follower_verdicts, lambda: ("here", None)
    )
    verdicts = Verdicts[liveness.Silence]()
    monitor = liveness.Monitor(
        _address(leader_store),
        2,
        signer,
        BOUND,
        verdicts,
        lambda _r: ("here", None),
        _broken,  # read once the follower's first beat is there
    )
    try:
        assert verdicts.event.wait(WAIT), "the monitor broke and said nothing"
    finally:
        monitor.stop()
        beat.stop()
        liveness.forget()
    (silence,) = verdicts.seen
    assert silence.broken is not None
    assert "the leader's liveness monitor of ranks 1-1 broke" in silence.broken
    assert "PeerRecordsBroken: the peer records cannot be read" in silence.broken
    assert silence.process is None  # nobody is signalled for it
    assert silence.describe() == silence.broken
    _error_with_traceback(caplog, "liveness monitor")
    assert not monitor.thread.is_alive() or monitor._stopped.is_set()
    assert follower_verdicts.seen == []


def test_a_beat_that_raises_says_so_at_error_and_gives_a_verdict_of_its_own(
    leader_store: TCPStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, a follower's beat thread ended on any exception with a DEBUG line: its
    judge then saw no beat waiting and never named a frozen leader."""
    caplog.set_level(logging.DEBUG)
    signer = Signer(new_secret())
    # The leader has beaten: the follower reads its record, and checks who sent it.
    record = {"n": 1, "doing": "evaluating trial 1 (#1)", "addr": None, "who": None}
    store.put(leader_store, signer, liveness.beat_key(0), json.dumps(record).encode(), sender=0)
    verdicts = Verdicts[liveness.Silence]()
    beat = liveness.LeaderBeat(
        _address(leader_store),
        1,
        signer,
        BOUND,
        verdicts,
        lambda: ("here", None),
        _broken,
    )
    try:
        assert verdicts.event.wait(WAIT), "the beat broke and said nothing"
    finally:
        beat.stop()
        liveness.forget()
    (silence,) = verdicts.seen
    assert silence.broken is not None
    assert "rank 1's beat to its leader broke" in silence.broken
    assert silence.group_rank == 0
    _error_with_traceback(caplog, "beat to its leader")


LEADER_WITH_A_BROKEN_MONITOR = """
import sys
from neps_bcast import runtime
from neps_bcast.config import Settings
from neps_bcast.startup.launch import Launch
from neps_bcast.transport import liveness, store
from neps_bcast.transport.auth import Signer, new_secret
import datetime, threading

def broken(_rank):
    raise RuntimeError("the peer records cannot be read")

rt = runtime.Runtime(
    Launch(kind="external", launcher="env", global_rank=0, world_size=2, local_rank=0,
           node_rank=0, main_address="127.0.0.1", main_port=1),
    Settings(peer_timeout_s=1.0), Signer(new_secret()))
def abandon(how):
    print("GAVE BACK:", how, flush=True)
    return "trial 7 back to pending"
rt.abandon_trial = abandon
served = store.serve(datetime.timedelta(seconds=30), loopback=True)
address = f"127.0.0.1:{served.port}"
beat = liveness.LeaderBeat(address, 1, rt.signer, 1.0, lambda s: None, lambda: ("here", None))
monitor = liveness.Monitor(address, 2, rt.signer, 1.0, rt.link.on_silent,
                           lambda _r: ("here", None), broken)
threading.Event().wait(float(sys.argv[1]))  # the old code: the monitor ends, nothing more
print("STILL RUNNING", flush=True)
"""


def test_a_leader_whose_monitor_breaks_puts_its_trial_back_and_exits_1(tmp_path: Path) -> None:
    """The runtime's answer to a broken watch: the trial back (an infrastructure fault),
    the process ended, as for a silent follower it cannot reach."""
    out = tmp_path / "leader.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [PYTHON, "-c", LEADER_WITH_A_BROKEN_MONITOR, str(WAIT / 2)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            code = proc.wait(WAIT)
        finally:
            proc.kill()
            proc.wait(WAIT)
    text = out.read_text()
    assert code == 1, text
    assert "GAVE BACK: the leader's liveness monitor of ranks 1-1 broke" in text, text
    assert "STILL RUNNING" not in text


class TimesOutOnce:
    """A store client whose next operation gives up waiting, as torch's does on a leader
    cut off for a while (its message, for a ``get``); every later one is the real one."""

    def __init__(self, client: TCPStore) -> None:
        self.client = client
        self.timed_out = False

    def __getattr__(self, name: str) -> object:
        if not self.timed_out:
            self.timed_out = True

            def wait(*_: object, **__: object) -> object:
                raise torch.distributed.DistStoreError("wait timeout after 300ms, keys: /beat/0")

            return wait
        return getattr(self.client, name)


def test_beats_resume_after_a_wait_that_timed_out(leader_store: TCPStore) -> None:
    """Before, a beat whose wait timed out ended the beat thread for good: its wait stayed
    pending, and the judge named a leader that answered again (a healed partition) silent
    one bound later."""
    signer = Signer(new_secret())
    verdicts = Verdicts[liveness.Silence]()
    beat = liveness.LeaderBeat(
        _address(leader_store), 1, signer, BOUND, verdicts, lambda: ("here", None)
    )
    try:
        wait_until(lambda: _count(leader_store, signer, 1) >= 3, "three beats answered")
        timing_out = TimesOutOnce(beat._client)
        beat._client = timing_out  # type: ignore[assignment]
        wait_until(lambda: timing_out.timed_out, "a beat's wait timing out")
        after = _count(leader_store, signer, 1)
        # Two bounds' worth of beats after it, or a verdict (the old code: one bound on).
        target = after + 2 * liveness.BEATS_PER_BOUND
        wait_until(
            lambda: bool(verdicts.seen) or _count(leader_store, signer, 1) >= target,
            "the beats resumed, or a verdict",
        )
    finally:
        beat.stop()
        liveness.forget()
    assert verdicts.seen == [], verdicts.seen[0].describe()
    assert _count(leader_store, signer, 1) >= target


FOLLOWER_IN_ITS_GOODBYE = """
import sys, threading
from neps_bcast import runtime
from neps_bcast.config import Settings
from neps_bcast.roles import follower
from neps_bcast.startup.launch import Launch
from neps_bcast.transport import liveness
from neps_bcast.transport.auth import Signer
from neps_bcast.transport.channel import ChannelClosedError
from neps_bcast.transport.messages import StopMessage

address, secret, goodbye_bound = sys.argv[1], bytes.fromhex(sys.argv[2]), float(sys.argv[3])

class LeaderFrozenAfterStop:
    # The leader sent STOP and froze: its goodbye never comes (the old code waited here
    # for NEPS_BCAST_WAIT_TIMEOUT_S; this fake, for goodbye_bound).
    world_size = 2
    def __init__(self):
        self.closed = threading.Event()
    def allgather(self, payload):
        self.closed.wait(goodbye_bound)
        raise ChannelClosedError("closed by peer")
    def close(self):
        self.closed.set()

rt = runtime.Runtime(
    Launch(kind="external", launcher="env", global_rank=1, world_size=2, local_rank=1,
           node_rank=0, main_address="127.0.0.1", main_port=1),
    Settings(peer_timeout_s=1.0), Signer(secret))
rt.link.channel = LeaderFrozenAfterStop()
rt.receive = lambda: StopMessage("the search is over (the leader's neps.run returned)")
rt.link.liveness = liveness.LeaderBeat(
    address, 1, rt.signer, 1.0, rt.link.on_silent, lambda: ("leader host", None))
sys.stdin.readline()  # the test froze the leader
with rt.activated():
    follower.follow(rt, lambda **kw: 0.0, None)
print("GOODBYE RETURNED", flush=True)
"""


def test_a_leader_frozen_between_stop_and_goodbye_ends_its_follower_within_the_bound(
    leader: subprocess.Popen[str], tmp_path: Path
) -> None:
    """Before, a follower set ``stopping`` before its goodbye and every silence verdict
    was ignored from then on: a leader frozen there left it in the goodbye's wait."""
    assert leader.stdout is not None
    port = int(leader.stdout.readline())
    secret = new_secret()
    signer = Signer(secret)
    out = tmp_path / "follower.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [
                PYTHON,
                "-c",
                FOLLOWER_IN_ITS_GOODBYE,
                f"127.0.0.1:{port}",
                secret.hex(),
                str(WAIT / 2),
            ],
            stdin=subprocess.PIPE,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            client = store.connect(f"127.0.0.1:{port}", datetime.timedelta(seconds=WAIT), WAIT)
            # Positive control: the follower's beats are answered before the freeze.
            wait_until(lambda: _count(client, signer, 1) >= 3, "three beats answered")
            leader.send_signal(signal.SIGSTOP)
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()
            code = proc.wait(WAIT)
        finally:
            proc.kill()
            proc.wait(WAIT)
    text = out.read_text()
    assert code == 1, text
    assert "lost the leader: rank 0 (pid unknown on host leader host) silent for" in text, text
    assert "GOODBYE RETURNED" not in text
