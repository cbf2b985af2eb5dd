"""Every torch name neps_bcast uses beyond ``torch.distributed``'s public functions.

``tests/test_torch_compat.py`` fails loudly when a torch release changes one of them.

- The store classes live in the C module's stubs: ``torch.distributed`` re-exports them
  only when distributed support is compiled in, so type checkers do not see them there.
- The control channel is a raw ``ProcessGroupGloo`` that is never registered with
  c10d, so user code and Lightning cannot see it or destroy it.
- An NCCL group is aborted with the private ``_abort_process_group``.
- The default group's name (and so the prefix of its keys on the store it is formed
  on) comes from c10d's private group counter, ``_world.group_count``.
- Whether ``init_process_group`` refused to form a second default group is told from
  its text.
- Whether an error was caused by a peer leaving is told from gloo's and c10d's texts.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = [
    "GROUP_GONE_MARKERS",
    "PEER_CLOSED_MARKERS",
    "SECOND_DEFAULT_GROUP",
    "PrefixStore",
    "Store",
    "TCPStore",
    "abort_nccl",
    "close_gloo_group",
    "empty_cuda_cache",
    "gloo_allgather",
    "gloo_allgather_through_root",
    "is_peer_closed",
    "is_second_default_group",
    "keep_groups_alive",
    "name_next_group",
    "new_gloo_group",
    "release_destroyed_groups",
    "reset_group_names",
    "set_bytes",
]

PEER_CLOSED_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)
"""Texts of the errors a rank sees when a peer closed the group (gloo, c10d, NCCL)."""
GROUP_GONE_MARKERS = ("not initialized", "has been destroyed")
"""Texts of the errors user code sees on a group that is gone (c10d). Caused by a peer
only when neps_bcast released this rank's group; otherwise the user's own mistake."""


def is_peer_closed(exc: BaseException, *, group_released: bool = False) -> bool:
    """Was this error caused by a peer leaving the group (not a failure of its own)?

    ``group_released``: neps_bcast took this rank's group down (a peer failed), so an
    error about a group that is gone was caused by that too.
    """
    text = f"{type(exc).__name__}: {exc}"
    markers = PEER_CLOSED_MARKERS + (GROUP_GONE_MARKERS if group_released else ())
    return any(marker in text for marker in markers)


def set_bytes(store: Store, key: str, value: bytes) -> None:
    """``Store.set`` with a bytes value (the stubs say str; the C++ side takes bytes)."""
    store.set(key, value)  # type: ignore[arg-type]  # see the docstring


def new_gloo_group(
    store: Store, group_rank: int, world_size: int, timeout: datetime.timedelta
) -> dist.ProcessGroupGloo:
    """A gloo group that c10d does not know about (never the default or a named group)."""
    return dist.ProcessGroupGloo(store, group_rank, world_size, timeout)


def gloo_allgather(
    pg: dist.ProcessGroupGloo, outputs: list[torch.Tensor], tensor: torch.Tensor
) -> None:
    pg.allgather([outputs], [tensor]).wait()  # type: ignore[attr-defined]  # missing in the stubs


CHANNEL_TAG = 0
"""The tag of every point-to-point message of ``gloo_allgather_through_root`` (its group
carries nothing else, and each pair of ranks sees the steps in order)."""


def gloo_allgather_through_root(
    pg: dist.ProcessGroupGloo, joined: torch.Tensor, tensor: torch.Tensor, rank: int
) -> None:
    """What an allgather gives every rank, through rank 0: every other rank sends its
    part to rank 0, which sends the joined parts (``joined``: world x ``tensor``'s size,
    slot r rank r's) to each rank directly.

    Point-to-point on the group, not its collectives: every rank is one hop from rank 0
    and back (gloo's broadcast is a tree: at world 8 a part passed through two ranks
    that had to be scheduled first), and the waiting thread is the caller's (a gloo
    collective runs on the group's worker thread, one more wake-up per collective and
    rank). Each wait is bounded by the group's timeout, and fails when the peer's
    connection closes, as a collective's does."""
    size = tensor.numel()
    world = joined.numel() // size
    send, recv = pg.send, pg.recv  # type: ignore[attr-defined]  # missing in the stubs
    if rank == 0:
        joined[:size].copy_(tensor)
        receives = [
            recv([joined[r * size : (r + 1) * size]], r, CHANNEL_TAG) for r in range(1, world)
        ]
        for work in receives:
            work.wait()
        sends = [send([joined], r, CHANNEL_TAG) for r in range(1, world)]
        for work in sends:
            work.wait()
    else:
        receive = recv([joined], 0, CHANNEL_TAG)
        send([tensor], 0, CHANNEL_TAG).wait()
        receive.wait()


def close_gloo_group(pg: dist.ProcessGroupGloo) -> None:
    abort = getattr(pg, "abort", None)
    if callable(abort):
        try:
            abort()
        except RuntimeError:
            pass


def reset_group_names() -> None:
    """Name the next default group "0" again, as ``destroy_process_group()`` does.

    Every ``init_process_group`` takes the next number of c10d's group counter as the
    group's name, and its store keys live under that name. A failed init leaves the
    counter one up with no group to destroy, while the peers whose init worked count
    from 0 again after destroying theirs: the next group would meet under another prefix
    on this rank and wait for ever (seen after a "connectFullMesh failed" in CI).
    """
    dist.distributed_c10d._world.group_count = 0


def name_next_group(number: int) -> None:
    """Name the next default group ``str(number)``, and with it the prefix of its keys.

    ``init_process_group`` names the default group after c10d's group counter, and every
    key of its rendezvous lives under that name on the store it is formed on (under
    ``default_pg/`` for ``env://`` and ``tcp://``). ``destroy_process_group()`` sets the
    counter back to 0, so a group formed again on the same store (torchrun's agent store,
    or a rank-0 server that outlives the group) meets the keys of the one before it:
    measured on torch 2.13, a second ``init_process_group("gloo")`` after every rank had
    destroyed the first read the first group's addresses and failed with "Gloo
    connectFullMesh failed ... Connection refused" in 2 of 2 launches (torchrun and
    env://), within its first 4 rounds; with a new name per round, 10 of 10 rounds
    formed, in both.
    """
    dist.distributed_c10d._world.group_count = number


SECOND_DEFAULT_GROUP = "trying to initialize the default process group twice"
"""torch's text when ``init_process_group`` is called while a default group exists."""


def is_second_default_group(exc: BaseException) -> bool:
    return isinstance(exc, ValueError) and SECOND_DEFAULT_GROUP in str(exc)


class _KeptGroups(dict):  # type: ignore[type-arg]  # c10d's own, untyped at runtime
    """c10d's registry of process groups that also holds every group put in it until
    ``release_destroyed_groups`` (a dict: c10d gets, sets, pops, clears and iterates it)."""

    def __init__(self, registry: dict[Any, Any]) -> None:
        super().__init__(registry)
        self.kept: list[Any] = list(registry)

    def __setitem__(self, group: Any, value: Any) -> None:
        if all(group is not g for g in self.kept):
            self.kept.append(group)
        super().__setitem__(group, value)


def keep_groups_alive() -> None:
    """From now on (once per process), every process group registered with c10d is also
    referenced here, until ``release_destroyed_groups``.

    Why: torch's DDP ``Reducer`` holds its group from C++, and its Python binding frees it
    with the GIL held. When the user's code destroyed the group first (PyTorch's DDP
    tutorial does, then returns and frees the model), the Reducer's free destroys the
    gloo group, which joins its worker threads while holding the GIL, and a worker that
    is still freeing the last collective's tensor waits for the GIL: a deadlock. Measured
    on torch 2.13 with plain torch (no neps_bcast): the tutorial's function called 40
    times in one process under torchrun deadlocked so in 8 of 8 runs; with the groups
    kept until the ranks had met after each call, 3 of 3 runs finished. A group whose last
    reference is this one is freed through its own binding, which releases the GIL.
    """
    c10d = dist.distributed_c10d
    if not isinstance(c10d._pg_map, _KeptGroups):
        c10d._pg_map = _KeptGroups(c10d._pg_map)


def release_destroyed_groups() -> int:
    """Drop the reference to every kept group that c10d no longer has (the user's code or
    neps_bcast destroyed it); how many. Call it once the trial's code has returned."""
    registry = dist.distributed_c10d._pg_map
    if not isinstance(registry, _KeptGroups):
        return 0
    gone = [g for g in registry.kept if g not in registry]
    registry.kept = [g for g in registry.kept if g in registry]
    count = len(gone)
    del gone  # freed here, through the groups' own bindings (GIL released)
    return count


def empty_cuda_cache() -> bool:
    """Return CUDA's cached blocks to the device, only where this process initialised
    CUDA already (``torch.cuda.is_initialized`` never initialises it; a pool's agent has
    no GPU and must never get a context); whether it did."""
    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]  # untyped in torch
        return False
    torch.cuda.empty_cache()
    return True


def abort_nccl() -> None:
    """Abort every NCCL communicator of this process (releases peers blocked in NCCL)."""
    dist.distributed_c10d._abort_process_group()
