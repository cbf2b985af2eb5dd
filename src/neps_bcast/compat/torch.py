"""Every torch name neps_bcast uses beyond ``torch.distributed``'s public functions.

``tests/test_torch_compat.py`` fails loudly when a torch release changes one of them.

- The store classes live in the C module's stubs: ``torch.distributed`` re-exports them
  only when distributed support is compiled in, so type checkers do not see them there.
- The control channel is a raw ``ProcessGroupGloo`` that is never registered with
  c10d, so user code and Lightning cannot see it or destroy it.
- An NCCL group is aborted with the private ``_abort_process_group``.
- Whether an error was caused by a peer leaving is told from gloo's and c10d's texts.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = [
    "GROUP_GONE_MARKERS",
    "PEER_CLOSED_MARKERS",
    "PrefixStore",
    "Store",
    "TCPStore",
    "abort_nccl",
    "close_gloo_group",
    "gloo_allgather",
    "is_peer_closed",
    "new_gloo_group",
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


def abort_nccl() -> None:
    """Abort every NCCL communicator of this process (releases peers blocked in NCCL)."""
    dist.distributed_c10d._abort_process_group()
