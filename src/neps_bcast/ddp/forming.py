"""Forming a group on a store: with every rank or none, never waiting for a lost one.

Forming waits on the store for every rank of the group. ``all_or_none`` ends that wait
for a rank that will not come (it says so: ``abandon``), ``WatchedStore`` for one that
was killed on the way. ``form`` forms the default group so; ``ddp.group`` decides when,
and on which store.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch.distributed as dist

from neps_bcast.compat import torch as torch_compat
from neps_bcast.errors import format_message
from neps_bcast.log import rank_tag

ARRIVAL_CHECK = datetime.timedelta(seconds=1)
"""How often a rank waiting for its peers to come and form a group checks they live."""
ARRIVED = "neps_bcast/arrived"
GO = "neps_bcast/go"
ABANDONED = "abandoned"


class FormingAbandoned(RuntimeError):
    """A peer will not come to form the trial's group: it failed before it got there."""


def _nobody_to_watch() -> None:
    return None


_FORMED_ON: WatchedStore | None = None
"""The store of the group formed last, kept alive with it: torch holds the C++ half of a
store written in Python, and every later call into it (a ``new_group`` of the user's
code, on every torch tested) fails with "Not implemented" once the Python half is
collected. A group is formed only where none exists, so the last one is the only one."""


class WatchedStore(torch_compat.Store):
    """A store whose every wait looks, every ``ARRIVAL_CHECK``, that the group's peers
    live (``peers_alive`` raises for one it can see is gone), up to the store's timeout.

    Why: forming a group waits on the store twice, and a peer SIGKILLed in either wait
    never writes what the other ranks wait for: in ``all_or_none`` (it never counts
    itself in) and in torch's own rendezvous (it counted itself in and was killed
    before it published its address). torch waits there for its whole timeout (30 min;
    the fault sweep saw torchrun SIGKILL the leader after ~30 s). torch calls a store
    written in Python for every ``get`` and ``wait`` of its rendezvous, so the group is
    formed on this one: a lost peer is found within ``ARRIVAL_CHECK``. A peer that
    published its address and then died is found by gloo itself (the connection is
    refused). The other calls go to the store as they are.
    """

    def __init__(self, inner: torch_compat.Store, peers_alive: Callable[[], None]) -> None:
        super().__init__()
        self.inner = inner
        self.peers_alive = peers_alive
        self.set_timeout(inner.timeout)  # type: ignore[attr-defined]  # not in the stubs

    def set(self, key: str, value: str) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected_value: str, desired_value: str) -> bytes:
        return self.inner.compare_set(key, expected_value, desired_value)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait(keys, timeout)

    def _wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()  # type: ignore[attr-defined]
        while True:
            try:
                self.inner.wait(keys, min(ARRIVAL_CHECK, timeout or ARRIVAL_CHECK))
                return
            except dist.DistStoreError:
                self.peers_alive()
                if time.monotonic() > deadline:
                    raise


def all_or_none(store: torch_compat.Store, world_size: int) -> None:
    """Every rank enters torch's rendezvous for a new group, or none does.

    Why: torch's rendezvous waits for every rank for its whole timeout (30 min), and a
    rank that fails before it gets there (its code raises, a stop) leaves its peers in
    it, while it waits for them in the trial's end: the fault sweep hung a Lightning
    launch so (an exception as the group was re-formed after a failed trial). Here each
    rank counts itself in on the group's own store prefix; the last one says go. A rank
    that will not come says so instead (``abandon``), and its peers raise at once. The
    values are compared, never decoded: one written by someone else can only make a
    trial fail, as writing torch's own rendezvous keys there could. A rank killed
    before it counts itself in cannot say so: on a ``WatchedStore`` the wait raises
    for it.
    """
    if store.add(ARRIVED, 1) == world_size:
        store.set(GO, "form")
    store.wait([GO])
    if store.get(GO) == ABANDONED.encode():
        raise FormingAbandoned(
            format_message(
                rank_tag(),
                "a peer did not come to form the trial's DDP group: it failed before it"
                " got there (its error is the trial's).",
            )
        )


def abandon(store: torch_compat.Store) -> None:
    """This rank will not form the group its peers may wait to form (``all_or_none``):
    they raise instead of waiting. Does nothing once every rank arrived."""
    store.compare_set(GO, "", ABANDONED)


def form(
    backend: str,
    store: torch_compat.Store,
    group_rank: int,
    world_size: int,
    peers_alive: Callable[[], None],
) -> None:
    """Form the default group on ``store``: every rank or none (``all_or_none``), a lost
    peer seen while waiting (``WatchedStore``), the store kept alive with the group."""
    global _FORMED_ON  # noqa: PLW0603 - see _FORMED_ON
    watched = WatchedStore(store, peers_alive)
    all_or_none(watched, world_size)
    torch_compat.reset_group_names()  # a failed init left it one up
    dist.init_process_group(backend, store=watched, rank=group_rank, world_size=world_size)
    watched.peers_alive = _nobody_to_watch  # formed: holds no reference to the run
    _FORMED_ON = watched
