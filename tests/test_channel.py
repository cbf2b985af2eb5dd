"""The control channel on real gloo groups: 2 and 3 processes started from pytest.

The leader serves its store on a port the OS picks (never a fixed port) and hands the
port to the other processes through a queue. Bounds: the channel's per-operation
timeout (``NEPS_BCAST_WAIT_TIMEOUT_S``, set for the children) < the queue waits here <
pytest's timeout.
"""

from __future__ import annotations

import datetime
import faulthandler
import hashlib
import multiprocessing as mp
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing import connection as mp_connection
from typing import Any

import pytest

from neps_bcast.compat import torch as torch_compat

CTX = mp.get_context("spawn")
STORE_TIMEOUT = datetime.timedelta(seconds=30)
WAIT = 60.0  # seconds the test waits for any one child's message
MB = 1 << 20


def _digest(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


def _blob(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


# Payloads around the channel's first frame (2048 bytes per rank, starting with an
# 8-byte length): one collective when every payload fits, a second one for the rest
# when one does not. The leader-only payloads are what a hand-over carries (a trial,
# while the followers contribute a short "ready").
LEADER_PAYLOADS = (
    b"",
    b"x",
    b"small payload \x00\xff",
    _blob(2048 - 8, seed=2),
    _blob(2048 - 7, seed=3),
    _blob(MB, seed=1),
)
GATHERS: tuple[Callable[[int, int], bytes], ...] = (
    lambda rank, size: _blob(1000 * rank, seed=rank),
    lambda rank, size: b"",
    lambda rank, size: _blob(MB if rank == size - 1 else 7, seed=10 + rank),
    lambda rank, size: _blob(2048 - 8 + (rank % 2), seed=20 + rank),
)


# -- what each child runs (module level: spawn pickles them by name) -----------------


def _child(
    scenario: str,
    rank: int,
    size: int,
    ports: Any,
    results: Any,
    release: Any,
    extra: dict[str, Any],
) -> None:
    from neps_bcast.transport.channel import GlooChannel
    from neps_bcast.transport.store import connect as connect_store
    from neps_bcast.transport.store import serve as serve_store

    # A child still running near the test's bound shows where it is (captured stderr).
    faulthandler.dump_traceback_later(WAIT - 10)
    try:
        if rank == 0:
            store = serve_store(STORE_TIMEOUT, loopback=True)
            for _ in range(size - 1):
                ports.put(store.port)
        else:
            port = ports.get(timeout=WAIT)
            store = connect_store(f"127.0.0.1:{port}", STORE_TIMEOUT, 30.0)
        join_timeout = datetime.timedelta(seconds=extra.get("join_timeout_s", 30))
        SCENARIOS[scenario](rank, size, store, results, release, join_timeout, GlooChannel)
    except BaseException as exc:
        results.send((rank, "error", f"{type(exc).__module__}.{type(exc).__name__}: {exc}"))
        raise


def _round_trips(
    rank: int,
    size: int,
    store: Any,
    results: Any,
    release: Any,
    join_timeout: datetime.timedelta,
    gloo_channel: Any,
) -> None:
    from neps_bcast.transport.channel import ChannelClosedError

    channel = gloo_channel.join(store, rank, size, join_timeout, STORE_TIMEOUT)
    assert (channel.group_rank, channel.world_size) == (rank, size)
    seen: list[Any] = []
    # Hand-over shaped: the leader's payload empty, small, 1 MB; the followers' short.
    for payload in LEADER_PAYLOADS:
        got = channel.allgather(payload if rank == 0 else b"ready")
        seen.append(("hand-over", _digest(got[0]), got[1:]))
    # Allgather: sizes differ by rank, rank 0 sends nothing; then all empty; then one
    # rank 1 MB and the others small.
    for round_ in range(len(GATHERS)):
        mine = GATHERS[round_](rank, size)
        seen.append(("allgather", [_digest(d) for d in channel.allgather(mine)]))
    # Several rounds, interleaved, in order.
    for i in range(5):
        got = channel.allgather(f"round {i}".encode() if rank == 0 else b"ready")
        seen.append(("round", got[0].decode()))
        seen.append(
            (
                "round-gather",
                [d.decode() for d in channel.allgather(f"rank {rank} round {i}".encode())],
            )
        )
    if rank == 0:
        results.send((rank, "ready", seen))
        # The test SIGKILLs this process while it waits here.
        release.poll(WAIT)
        results.send((rank, "error", "the leader was not killed"))
        return
    results.send((rank, "waiting", seen))
    # Blocked for the next trial when the leader dies: must fail fast, not wait it out.
    start = time.monotonic()
    try:
        channel.allgather(b"ready")
    except ChannelClosedError as exc:
        results.send((rank, "closed", (str(exc), time.monotonic() - start)))
        return
    results.send((rank, "error", "allgather returned after the leader was killed"))


def _expected_round_trips(size: int) -> list[Any]:
    seen: list[Any] = [("hand-over", _digest(p), [b"ready"] * (size - 1)) for p in LEADER_PAYLOADS]
    for gather in GATHERS:
        seen.append(("allgather", [_digest(gather(r, size)) for r in range(size)]))
    for i in range(5):
        seen.append(("round", f"round {i}"))
        seen.append(("round-gather", [f"rank {r} round {i}" for r in range(size)]))
    return seen


def _partial_join(
    rank: int,
    size: int,
    store: Any,
    results: Any,
    release: Any,
    join_timeout: datetime.timedelta,
    gloo_channel: Any,
) -> None:
    from neps_bcast.transport.channel import JoinTimeoutError

    # Ranks 0 and 1 start their join clocks together (imports under load can differ by
    # seconds): rank 1 says it is here through a key of the test's own.
    if rank == 0:
        store.wait(["test/here/1"], datetime.timedelta(seconds=WAIT))
    else:
        store.set(f"test/here/{rank}", "1")
    try:
        gloo_channel.join(store, rank, size, join_timeout, STORE_TIMEOUT)
    except JoinTimeoutError as exc:
        results.send((rank, "join-timeout", (str(exc), exc.missing)))
        if rank == 0:
            # The leader's store must outlive the follower's check of who is missing.
            release.poll(WAIT)
        return
    results.send((rank, "error", "join returned although a rank never came"))


SCENARIOS: dict[str, Callable[..., None]] = {
    "round_trips": _round_trips,
    "partial_join": _partial_join,
}


# -- the test side -------------------------------------------------------------------


@contextmanager
def group(
    scenario: str, size: int, *, start: int | None = None, **extra: Any
) -> Iterator[tuple[list[Any], list[Any], Any]]:
    """Start ``start`` (default ``size``) ranks of a ``size``-rank channel; always reap them.

    Each rank reports on a pipe of its own: a process SIGKILLed while it holds a shared
    queue's lock would block every other writer of that queue.
    """
    # ``release`` is a pipe, not an Event: notifying an Event blocks for a waiter that
    # was SIGKILLed. Closing the write end wakes the reader (EOF).
    ports = CTX.Queue()
    release, release_writer = CTX.Pipe(duplex=False)
    n = size if start is None else start
    pipes = [CTX.Pipe(duplex=False) for _ in range(n)]
    procs = [
        CTX.Process(
            target=_child,
            args=(scenario, rank, size, ports, pipes[rank][1], release, extra),
            name=f"channel-rank-{rank}",
            daemon=True,
        )
        for rank in range(n)
    ]
    try:
        for p, (_, writer) in zip(procs, pipes, strict=True):
            p.start()
            writer.close()  # the child has its own copy; EOF once it exits
        yield procs, [reader for reader, _ in pipes], release_writer
    finally:
        release_writer.close()
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
        alive = [p.pid for p in procs if p.is_alive()]
        ports.close()
        for reader, _ in pipes:
            reader.close()
        assert not alive, f"channel test processes {alive} still alive"


def collect(readers: list[Any], ranks: list[int]) -> dict[int, tuple[str, Any]]:
    """One message from each of ``ranks``; fail at once when a rank that still owes one
    has exited (e.g. it could not even import), or after ``WAIT`` seconds."""
    got: dict[int, tuple[str, Any]] = {}
    pending = {readers[r]: r for r in ranks}
    deadline = time.monotonic() + WAIT
    while pending:
        ready = mp_connection.wait(list(pending), timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise AssertionError(
                f"ranks {sorted(pending.values())} did not answer within"
                f" {WAIT} s (got {got}); see the captured stderr"
            )
        for reader in ready:
            rank = pending.pop(reader)
            try:
                sender, kind, data = reader.recv()
            except EOFError:
                raise AssertionError(
                    f"rank {rank} exited without answering (got {got}); see the captured stderr"
                ) from None
            assert sender == rank
            assert kind != "error", f"rank {rank} failed: {data}"
            got[rank] = (kind, data)
    return got


def join_all(procs: list[Any]) -> list[int | None]:
    for p in procs:
        p.join(WAIT)
    return [p.exitcode for p in procs]


@pytest.fixture(autouse=True)
def _bounded_children(monkeypatch: pytest.MonkeyPatch) -> None:
    # Read by neps_bcast.transport.channel at import in the children: a stuck live peer fails
    # the collective after 45 s instead of the library's default week.
    monkeypatch.setenv("NEPS_BCAST_WAIT_TIMEOUT_S", "45")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("size", [2, 3])
def test_round_trips_then_followers_notice_the_leader_killed(size: int) -> None:
    """One launch per size (each process pays ~3 s of imports): round trips, then the
    leader is SIGKILLed while every follower is blocked waiting for the next trial."""
    with group("round_trips", size) as (procs, readers, _):
        got = collect(readers, list(range(size)))
        killed_at = time.monotonic()
        os.kill(procs[0].pid, signal.SIGKILL)
        closed = collect(readers, list(range(1, size)))
        noticed_s = time.monotonic() - killed_at
        codes = join_all(procs)

    expected = _expected_round_trips(size)
    for rank in range(size):
        kind, seen = got[rank]
        assert kind == ("ready" if rank == 0 else "waiting")
        assert len(seen) == len(expected)
        for step, (mine, want) in enumerate(zip(seen, expected, strict=True)):
            assert mine == want, f"rank {rank}, step {step}: {mine} != {want}"

    assert sorted(closed) == list(range(1, size))
    # Far below any timeout of the channel (45 s here, a week by default): the peer's
    # death is noticed, not waited out.
    assert noticed_s < 15, f"followers noticed the leader's death after {noticed_s:.1f} s"
    for rank, (kind, (text, blocked_s)) in closed.items():
        assert kind == "closed", (rank, kind)
        assert blocked_s < 15, (rank, blocked_s)
        # The text gloo gives is what runtime classifies as caused by a peer.
        assert torch_compat.is_peer_closed(RuntimeError(text)), text
    assert codes == [-signal.SIGKILL] + [0] * (size - 1)


@pytest.mark.timeout(120)
def test_join_timeout_names_the_missing_rank() -> None:
    # A 3-rank channel of which only ranks 0 and 1 ever start.
    with group("partial_join", 3, start=2, join_timeout_s=4) as (procs, readers, release):
        got = collect(readers, [0, 1])
        release.close()
        codes = join_all(procs)
    for rank in (0, 1):
        kind, (text, missing) = got[rank]
        assert kind == "join-timeout"
        assert missing == [2], text
        assert "ranks [2] did not join within 4 s" in text
    assert codes == [0, 0]
