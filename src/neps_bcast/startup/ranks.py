"""The group the start-up handshake talks on, and plain bytes over it (never a pickle).

Two kinds of group: a gloo group of neps_bcast's own on the launcher's store, for the
handshake only (``standalone``: no default group is formed, the user's code may form
that itself), or the group the user formed before ``neps_bcast.run``
(``control_group``; a gloo group of the same ranks when the user's is NCCL). A rank
refuses a record larger than ``MAX_RECORD_BYTES`` before reading it.
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from neps_bcast.compat import torch as tc
from neps_bcast.errors import LaunchError, format_message

MAX_RECORD_BYTES = 1 << 20
"""Largest record a rank accepts from the group (a fingerprint is a few KB)."""


@dataclass
class Ranks:
    """The group the handshake talks on: a c10d group (``group``; None: the default),
    or a gloo group c10d does not know about (``gloo``)."""

    world_size: int
    group: dist.ProcessGroup | None = None
    gloo: dist.ProcessGroupGloo | None = None

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> None:
        if self.gloo is not None:
            tc.gloo_allgather(self.gloo, outputs, tensor)
        else:
            dist.all_gather(outputs, tensor, group=self.group)


@contextlib.contextmanager
def control_group() -> Iterator[Ranks]:
    """The user's default group when it is gloo, otherwise a gloo group of the same
    ranks (control messages never go through NCCL)."""
    if dist.get_backend() == "gloo":
        yield Ranks(dist.get_world_size())
        return
    gloo = dist.new_group(backend="gloo")
    try:
        yield Ranks(dist.get_world_size(), group=gloo)
    finally:
        dist.destroy_process_group(gloo)


@contextlib.contextmanager
def standalone(
    store: tc.Store, rank: int, world_size: int, timeout: datetime.timedelta
) -> Iterator[Ranks]:
    """A gloo group of every rank on ``store`` (the launcher's, under this attempt's
    prefix), for the handshake only: closed before the user's code runs, and never the
    default group, which the user's code may form itself."""
    gloo = tc.new_gloo_group(store, rank, world_size, timeout)
    try:
        yield Ranks(world_size, gloo=gloo)
    finally:
        tc.close_gloo_group(gloo)


def _frame(data: bytes) -> torch.Tensor:
    return (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if data
        else torch.empty(0, dtype=torch.uint8)
    )


def _checked_size(size: int, tag: str) -> int:
    if not 0 <= size <= MAX_RECORD_BYTES:
        raise LaunchError(
            format_message(
                tag,
                f"a rank sent a startup record of {size} bytes over the group; expected at"
                f" most {MAX_RECORD_BYTES}.",
                "every rank must run the same neps_bcast version; if they do, another"
                " process is tampering with the group's connections.",
            )
        )
    return size


def gather(ranks: Ranks, data: bytes, tag: str) -> list[bytes]:
    """Every rank's ``data``, by rank (two all-gathers: the sizes, then the bytes)."""
    world = ranks.world_size
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    ranks.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    lengths = [_checked_size(int(s.item()), tag) for s in sizes]
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = _frame(data)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    ranks.all_gather(out, mine)
    return [t.numpy().tobytes()[:n] for t, n in zip(out, lengths, strict=True)]


def broadcast(ranks: Ranks, data: bytes | None, tag: str) -> bytes:
    """The leader's ``data`` on every rank (a gather, the followers sending nothing)."""
    return gather(ranks, data if data is not None else b"", tag)[0]


def record(raw: bytes, what: str, tag: str) -> dict[str, Any]:
    """A JSON object another rank sent, or ``LaunchError`` (nothing else is accepted)."""
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        value = None
    if not isinstance(value, dict):
        raise LaunchError(
            format_message(
                tag,
                f"cannot read {what} sent over the group: it is not a JSON object.",
                "every rank must run the same neps_bcast version; if they do, another"
                " process is tampering with the group's connections.",
            )
        )
    return value
