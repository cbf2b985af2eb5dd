"""The control channel: the only module that issues control collectives.

A private gloo process group over the leader's own TCP store. It is not registered
with ``torch.distributed`` as a group, so the user's code (and Lightning) never sees
it: a ``destroy_process_group()`` in user code does not touch it, its collectives never
interleave with the user's, and it works unchanged when training uses NCCL.

Waiting is bounded by the peers being alive, not by a clock: when a peer process dies
its TCP connections close and a blocked receive fails within milliseconds, while a
live leader may take as long as it needs to choose the next trial. The per-operation
timeout is only a last resort against a peer that is alive but stuck.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Protocol

import torch
import torch.distributed as dist

from neps_bcast import _dist

WAIT_TIMEOUT = datetime.timedelta(
    seconds=float(os.environ.get("NEPS_BCAST_WAIT_TIMEOUT_S", str(7 * 24 * 3600)))
)
"""Last-resort bound on one blocking channel operation while every peer is alive."""
CONNECT_TIMEOUT = float(os.environ.get("NEPS_BCAST_CONNECT_TIMEOUT_S", "30"))
"""Bound on reaching the leader's store (it is up before anyone is told its address)."""
JOIN_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("NEPS_BCAST_JOIN_TIMEOUT_S", "300")))
"""Bound on the ranks of a group meeting on the channel for the first time."""


class ChannelClosedError(RuntimeError):
    """A peer left the channel (its process died or it closed its end)."""


class JoinTimeoutError(RuntimeError):
    """Not every rank came to the channel in time."""

    def __init__(self, missing: list[int], timeout: datetime.timedelta) -> None:
        super().__init__(f"ranks {missing} did not join within {timeout.total_seconds():.0f} s")
        self.missing = missing


class Channel(Protocol):
    """What leader, follower and session need from a channel (faked in unit tests)."""

    group_rank: int
    world_size: int

    def broadcast(self, payload: bytes | None) -> bytes:
        """Leader passes the payload; every rank returns it."""
        ...

    def allgather(self, payload: bytes) -> list[bytes]:
        """Every rank passes its payload; every rank returns all, by group rank."""
        ...

    def close(self) -> None: ...


def serve_store(timeout: datetime.timedelta = WAIT_TIMEOUT) -> _dist.TCPStore:
    """Start the leader's store on a port the OS picks (never a fixed port)."""
    return _dist.TCPStore(
        "0.0.0.0",  # noqa: S104 - followers on other nodes connect here
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
    )


def connect_store(address: str, timeout: datetime.timedelta = WAIT_TIMEOUT) -> _dist.TCPStore:
    """Connect to the leader's store; fails at once when nothing listens there.

    The store is up before its address is handed out, so a refused connection means
    the leader is gone: without this probe, TCPStore would retry it for ``timeout``.
    """
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT):
        pass
    return _dist.TCPStore(host, int(port), is_master=False, timeout=timeout)


class GlooChannel:
    def __init__(self, pg: dist.ProcessGroupGloo, group_rank: int, world_size: int) -> None:
        self._pg = pg
        self.group_rank = group_rank
        self.world_size = world_size
        self._closed = False

    @classmethod
    def join(
        cls,
        store: _dist.Store,
        group_rank: int,
        world_size: int,
        generation: int,
        join_timeout: datetime.timedelta = JOIN_TIMEOUT,
    ) -> GlooChannel:
        """Meet the other ranks on the channel of this generation (blocks until all came)."""
        prefix = f"neps_bcast/ctl/{generation}"
        base = _dist.PrefixStore(prefix, store)
        base.set(f"joined/{group_rank}", f"{socket.gethostname()}:{os.getpid()}")
        keys = [f"joined/{r}" for r in range(world_size)]
        try:
            # Blocks in the store server: no polling. A dead leader closes the socket.
            base.wait(keys, join_timeout)
        except dist.DistNetworkError as exc:
            raise ChannelClosedError(str(exc)) from exc
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise ChannelClosedError(str(exc)) from exc
            missing = [r for r in range(world_size) if not base.check([f"joined/{r}"])]
            raise JoinTimeoutError(missing, join_timeout) from exc
        pg = dist.ProcessGroupGloo(
            _dist.PrefixStore("pg", base), group_rank, world_size, WAIT_TIMEOUT
        )
        return cls(pg, group_rank, world_size)

    def _run(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise ChannelClosedError(str(exc)) from exc

    def broadcast(self, payload: bytes | None) -> bytes:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64)
        self._run(self._pg.broadcast([size], opts))  # type: ignore[attr-defined]
        n = int(size.item())
        if payload is not None:
            data = (
                torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
        else:
            data = torch.empty(n, dtype=torch.uint8)
        if n:
            self._run(self._pg.broadcast([data], opts))  # type: ignore[attr-defined]
        return payload if payload is not None else data.numpy().tobytes()

    def allgather(self, payload: bytes) -> list[bytes]:
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        self._run(self._pg.allgather([sizes], [size]))  # type: ignore[attr-defined]
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        outs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        if longest:
            self._run(self._pg.allgather([outs], [mine]))  # type: ignore[attr-defined]
        return [o[: int(s.item())].numpy().tobytes() for o, s in zip(outs, sizes, strict=True)]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            abort = getattr(self._pg, "abort", None)
            if callable(abort):
                try:
                    abort()
                except RuntimeError:
                    pass
            del self._pg
