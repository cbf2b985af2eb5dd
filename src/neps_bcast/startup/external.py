"""Externally launched ranks (torchrun, ``srun``, plain ``RANK``/``WORLD_SIZE``): start.

All ranks start together: they meet (bounded), agree on the secret, and join the
channel. The ranks first meet on the launcher's rendezvous store: a rank that never
calls ``neps_bcast.run`` is named within ``NEPS_BCAST_JOIN_TIMEOUT_S`` instead of
hanging. Then, over a gloo group of neps_bcast's own formed on that store for the
handshake only (``ranks.standalone``), the ranks compare their arguments, agree
on the secret and learn the address of the leader's control store (``handshake``):
nothing a rank trusts is read from the launcher's store.

No default process group is formed here: the user's code may form it itself, every
trial (PyTorch's DDP tutorial does), and a second ``init_process_group`` would raise.
Lightning and Fabric form it when they find none; code that uses one without forming it
gets one at ``session()`` (``ddp.group``). The launcher's store is held for the whole
run: every group formed with ``env://`` meets on it (rank 0's server is shared with
torch's, ``multi_tenant``), and each trial's group keeps its keys apart by its name.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch.distributed as dist

from neps_bcast.compat import torch as _tc
from neps_bcast.config import Settings
from neps_bcast.errors import AuthError, LaunchError, format_message
from neps_bcast.log import logger, rank_tag
from neps_bcast.startup import handshake, ranks, rendezvous
from neps_bcast.startup.launch import Launch
from neps_bcast.transport import auth
from neps_bcast.transport import store as _store
from neps_bcast.transport.auth import Signer
from neps_bcast.transport.link import Link


@dataclass
class Started:
    """What ``start`` leaves to its caller, who joins the channel next."""

    users_group: bool
    """The user's code formed the default group before ``neps_bcast.run``."""
    launcher_store: _tc.Store | None = None
    """The launcher's store, to be held for the whole run (see the module docstring)."""


def start(
    launch: Launch, settings: Settings, link: Link, signer: Signer, fingerprint: dict[str, str]
) -> Started:
    """Meet, agree on the secret, reach the leader; the default group is left to the user.

    The caller then joins the control channel (``Runtime.ensure_channel``).
    """
    if dist.is_initialized():
        _hand_over_on_the_users_group(launch, settings, link, signer, fingerprint)
        return Started(users_group=True)
    if launch.main_address is None or launch.main_port is None:
        raise LaunchError(
            format_message(
                rank_tag(),
                f"{launch.launcher} launch without a rendezvous address.",
                "set MASTER_ADDR and MASTER_PORT for every rank.",
            )
        )
    assert launch.world_size is not None  # external launches always know it
    join_timeout = datetime.timedelta(seconds=settings.join_timeout_s)
    store = rendezvous.rendezvous_store(launch, join_timeout)
    prefix = rendezvous.meet(launch, store, join_timeout).prefix
    # A gloo group's rendezvous keys, under /pg/ as every group's (torch reads them).
    handshake_store = _tc.PrefixStore(f"{prefix}/pg/handshake", store)
    with ranks.standalone(
        handshake_store, launch.global_rank, launch.world_size, join_timeout
    ) as group:
        _hand_over(launch, settings, link, signer, fingerprint, group)
    return Started(users_group=False, launcher_store=store)


POOL_LEADER_KEY = "neps_bcast/pool/leader"
"""Where a pool trial's rank 0 publishes its control store's address (signed)."""


def start_in_pool(
    launch: Launch, settings: Settings, link: Link, signer: Signer, secret: bytes, order: str
) -> Started:
    """A pool's trial (``pool.rank``): the same end as ``start``, without the meeting and
    the handshake. The pool's launcher proved every rank (the pool's key, on its private
    socket) and started them all from one command line, so there is nothing to compare
    and no secret to agree on: ``secret`` comes with the order (derived from the pool's
    key and the order's id, fresh for every trial, so nothing of an earlier trial checks
    out in this one). Rank 0 serves its control store and publishes the address on the
    trial's rendezvous store, signed with that secret; each follower checks it and
    connects. A rank that dies meanwhile has its trial's other ranks ended by the
    launcher (``pool.launcher``), so no wait here outlives a lost peer. Measured: a
    trial's start, placed to every rank in the function, 90-195 ms with the handshake,
    docs/architecture.md has the figures without it."""
    join_timeout = datetime.timedelta(seconds=settings.join_timeout_s)
    store = rendezvous.rendezvous_store(launch, join_timeout, agent_serves=True)
    signer.use(secret, auth.search_id(order.encode(), []))
    link.loopback = True  # a pool is one host
    if launch.global_rank == 0:
        address = f"127.0.0.1:{link.serve().port}"
        _store.put_json(store, signer, POOL_LEADER_KEY, address, sender=0)
    else:
        address = str(_store.take_json(store, signer, POOL_LEADER_KEY, sender=0))
        link.connect(address)
    return Started(users_group=False, launcher_store=store)


def _hand_over(
    launch: Launch,
    settings: Settings,
    link: Link,
    signer: Signer,
    fingerprint: dict[str, str],
    group: ranks.Ranks,
) -> None:
    """Agree on the secret and reach the leader over ``group`` (``handshake``).

    A ``NEPS_BCAST_SECRET`` this rank refuses (too weak) is told to every rank there,
    so that every rank stops, not only this one."""
    user_secret, refusal = None, None
    try:
        user_secret = auth.secret_from_env(tag=rank_tag())
    except AuthError as exc:
        refusal = handshake.message_of(exc)
        logger.error("%s", refusal)
    handshake.hand_over(
        launch,
        link,
        signer,
        fingerprint,
        user_secret=user_secret,
        refusal=refusal,
        address=lambda port: f"{_leader_address(launch, settings)}:{port}",
        group=group,
    )


def _hand_over_on_the_users_group(
    launch: Launch,
    settings: Settings,
    link: Link,
    signer: Signer,
    fingerprint: dict[str, str],
) -> None:
    """The user formed the group before neps_bcast.run: the same handshake, on it (its
    connections link the ranks directly): the same argument and secret checks, no
    pickle, and the same warning when the secret must cross hosts in the clear."""
    with ranks.control_group() as group:
        _hand_over(launch, settings, link, signer, fingerprint, group)


def _leader_address(launch: Launch, settings: Settings) -> str:
    """The address of this host that the other nodes use to reach the leader."""
    if settings.leader_addr:
        return settings.leader_addr
    target = launch.main_address or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, launch.main_port or 29500))
            return str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
