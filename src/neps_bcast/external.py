"""Externally launched ranks (torchrun, ``srun``, plain ``RANK``/``WORLD_SIZE``): start.

All ranks start together: they meet (bounded), form the group, and join the channel.
The ranks first meet on the launcher's rendezvous store: a rank that never calls
``neps_bcast.run`` is named within ``NEPS_BCAST_JOIN_TIMEOUT_S`` instead of hanging in
``init_process_group``, and ranks given different arguments fail on every rank before
trial 1. The default group is then formed on that same store (Lightning, Fabric and
plain DDP code find it and reuse it), and the leader publishes the address of its
control store there for the followers.
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist

from neps_bcast import _torch_compat, rendezvous
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.runtime import Runtime


def start(rt: Runtime, fingerprint: dict[str, str]) -> None:
    """Meet, form the group (unless the user did), and join the channel."""
    launch = rt.launch
    if dist.is_initialized():
        rt.observe_group()
        _hand_over_on_the_users_group(rt)
        rt.ensure_channel()
        return
    if launch.main_address is None or launch.main_port is None:
        raise LaunchError(
            format_message(
                rt.tag,
                f"{launch.launcher} launch without a rendezvous address.",
                "set MASTER_ADDR and MASTER_PORT for every rank.",
            )
        )
    assert launch.world_size is not None  # external launches always know it
    join_timeout = datetime.timedelta(seconds=rt.settings.join_timeout_s)
    store = rendezvous.rendezvous_store(launch, join_timeout)
    prefix = rendezvous.meet(launch, store, fingerprint, join_timeout)
    backend = _backend(rt)
    rt.log(logging.DEBUG, "forming the DDP group (%s)", backend)
    dist.init_process_group(
        backend,
        store=_torch_compat.PrefixStore(f"{prefix}/pg", store),
        rank=launch.global_rank,
        world_size=launch.world_size,
    )
    rt.owns_group = True
    rt.observe_group()
    meeting = _torch_compat.PrefixStore(prefix, store)
    if rt.group_rank == 0:
        meeting.set("leader", f"{_leader_address(rt)}:{rt.link.serve().port}")
    else:
        rt.link.connect(meeting.get("leader").decode())
    rt.ensure_channel()


def _hand_over_on_the_users_group(rt: Runtime) -> None:
    """The user formed the group before neps_bcast.run: hand the address over on it."""
    address = None
    if rt.group_rank == 0:
        address = f"{_leader_address(rt)}:{rt.link.serve().port}"
    gloo = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    box: list[Any] = [address]
    dist.broadcast_object_list(box, src=0, group=gloo)
    if gloo is not None:
        dist.destroy_process_group(gloo)
    if rt.group_rank != 0:
        rt.link.connect(str(box[0]))


def _backend(rt: Runtime) -> str:
    if rt.settings.backend:
        return rt.settings.backend
    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        torch.cuda.set_device(rt.launch.local_rank % torch.cuda.device_count())
        return "nccl"
    return "gloo"


def _leader_address(rt: Runtime) -> str:
    """The address of this host that the other nodes use to reach the leader."""
    if rt.settings.leader_addr:
        return rt.settings.leader_addr
    target = rt.launch.main_address or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, rt.launch.main_port or 29500))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
