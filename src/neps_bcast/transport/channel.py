"""The control channel: the only module that issues control collectives.

A private gloo process group over the leader's own store. It is not registered with
``torch.distributed`` as a group, so the user's code (and Lightning) never sees it: a
``destroy_process_group()`` in user code does not touch it, its collectives never
interleave with the user's, and it works unchanged when training uses NCCL.

It has one operation: an allgather, in which every rank contributes one payload and
every rank receives all of them. Every control step (handing over a trial, the
meetings of a trial, STOP, goodbye) is that same operation with the same first frame,
so two ranks that are at different steps never block each other in two different
collectives: they meet in the same one, and each sees the other's message and its kind
(the first release broadcast trials and gathered reports: a leader that broadcast STOP
while its followers gathered a trial's reports hung every rank until the last-resort
timeout). One step is one allgather on the wire where it fits: a fixed-size first
frame per rank (a length, then as much of the payload as fits); only a step in which
some payload is larger takes a second allgather for the rest, and every rank knows it
from the first frames. Each allgather goes through the leader
(``compat.torch.gloo_allgather_through_root``): every follower sends its frame to the
leader, which sends all of them to each follower directly, so every rank is one hop
from the leader and back, where gloo's ring allgather passes each frame through
world - 1 ranks in turn (at world 8 on 2 cores it took twice as long) and gloo's
broadcast passes it down a tree; and a rank that dies is seen at once by the leader,
its peer in both directions.

Waiting is bounded by the peers being alive, not by a clock: when a peer process dies
its TCP connections close and a blocked receive fails within milliseconds, while a
live leader may take as long as it needs to choose the next trial. The per-operation
timeout is only a last resort against a peer that is alive but stuck.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import struct
from typing import Protocol

import torch
import torch.distributed as dist

from neps_bcast.compat import torch as tc
from neps_bcast.transport.store import Keys, prefixed

FRAME = 2048
"""Bytes per rank of a step's first frame: a trial or a report of usual size fits whole."""
_LENGTH = struct.Struct("<Q")


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

    def allgather(self, payload: bytes) -> list[bytes]:
        """Every rank passes its payload; every rank returns all, by group rank."""
        ...

    def close(self) -> None: ...


def _frame(payload: bytes, size: int) -> torch.Tensor:
    """This rank's part of a first frame: the payload's length, then as much as fits."""
    frame = bytearray(size)
    head = _LENGTH.pack(len(payload)) + payload[: size - _LENGTH.size]
    frame[: len(head)] = head
    return torch.frombuffer(frame, dtype=torch.uint8)


class GlooChannel:
    def __init__(self, pg: dist.ProcessGroupGloo, group_rank: int, world_size: int) -> None:
        self._pg = pg
        self.group_rank = group_rank
        self.world_size = world_size
        self._closed = False

    @classmethod
    def join(
        cls,
        store: tc.Store,
        group_rank: int,
        world_size: int,
        join_timeout: datetime.timedelta,
        wait_timeout: datetime.timedelta,
    ) -> GlooChannel:
        """Meet the other ranks on the channel (blocks until all came, or the bound)."""
        base = prefixed(Keys.channel(), store)
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid()})
        base.set(f"joined/{group_rank}", me)
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
        pg = tc.new_gloo_group(prefixed("pg", base), group_rank, world_size, wait_timeout)
        return cls(pg, group_rank, world_size)

    def _allgather(self, tensor: torch.Tensor) -> bytes:
        """Every rank's ``tensor`` (one size on every rank), joined in group-rank order."""
        joined = torch.empty(tensor.numel() * self.world_size, dtype=torch.uint8)
        try:
            tc.gloo_allgather_through_root(self._pg, joined, tensor, self.group_rank)
        except RuntimeError as exc:
            raise ChannelClosedError(str(exc)) from exc
        return joined.numpy().tobytes()

    def allgather(self, payload: bytes) -> list[bytes]:
        frames = self._allgather(_frame(payload, FRAME))
        parts = []
        for r in range(self.world_size):
            (length,) = _LENGTH.unpack_from(frames, r * FRAME)
            start = r * FRAME + _LENGTH.size
            parts.append((length, frames[start : start + min(length, FRAME - _LENGTH.size)]))
        longest_rest = max(length - len(first) for length, first in parts)
        if longest_rest <= 0:
            return [first for _, first in parts]
        mine = bytearray(longest_rest)
        extra = payload[FRAME - _LENGTH.size :]
        mine[: len(extra)] = extra
        tails = self._allgather(torch.frombuffer(mine, dtype=torch.uint8))
        return [
            first + tails[r * longest_rest : r * longest_rest + length - len(first)]
            for r, (length, first) in enumerate(parts)
        ]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            tc.close_gloo_group(self._pg)
            del self._pg
