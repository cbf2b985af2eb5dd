"""Externally launched ranks (torchrun, ``srun``, plain ``RANK``/``WORLD_SIZE``): start.

All ranks start together: they meet (bounded), agree on the secret, and join the
channel. The ranks first meet on the launcher's rendezvous store: a rank that never
calls ``neps_bcast.run`` is named within ``NEPS_BCAST_JOIN_TIMEOUT_S`` instead of
hanging in ``init_process_group``, and ranks given different arguments fail on every
rank before trial 1. The leader publishes the address of its control store there for
the followers.

No default process group is formed here: the user's code may form it itself, every
trial (PyTorch's DDP tutorial does), and a second ``init_process_group`` would raise.
Lightning and Fabric form it when they find none; code that uses one without forming it
gets one at ``session()`` (``ddp.group``). The launcher's store is held for the whole
run: every group formed with ``env://`` meets on it (rank 0's server is shared with
torch's, ``multi_tenant``), and each trial's group keeps its keys apart by its name.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from neps_bcast.compat import torch as _tc
from neps_bcast.config import Settings
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.log import logger, rank_tag
from neps_bcast.startup import rendezvous
from neps_bcast.startup.launch import Launch
from neps_bcast.startup.rendezvous import Meeting
from neps_bcast.transport import auth
from neps_bcast.transport.auth import Signer
from neps_bcast.transport.link import Link
from neps_bcast.transport.store import put as store_put
from neps_bcast.transport.store import take as store_take


@dataclass
class Started:
    """What ``start`` leaves to its caller, who joins the channel next."""

    users_group: bool
    """The user's code formed the default group before ``neps_bcast.run``."""
    launcher_store: _tc.Store | None = None
    """The launcher's store, to be held for the whole run (see the module docstring)."""
    secret_file: Path | None = None
    """Where the leader left the secret for this host's ranks: removed once all joined."""

    def forget_secret(self) -> None:
        if self.secret_file is not None:
            self.secret_file.unlink(missing_ok=True)


def start(
    launch: Launch, settings: Settings, link: Link, signer: Signer, fingerprint: dict[str, str]
) -> Started:
    """Meet, agree on the secret, form the group (unless the user did), reach the leader.

    The caller then joins the control channel (``Runtime.ensure_channel``) and calls
    ``Started.forget_secret`` once every rank has joined.
    """
    user_secret = auth.secret_from_env()
    if user_secret is not None:
        signer.use(user_secret)
    if dist.is_initialized():
        _hand_over_on_the_users_group(launch, settings, link, signer, user_secret)
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
    # The secret is compared like the arguments: a rank with another one is named on
    # every rank before trial 1 (by a check value, never the secret itself).
    check = signer.check_value("meet") if user_secret is not None else "not set"
    meeting = rendezvous.meet(launch, store, {**fingerprint, auth.ENV_SECRET: check}, join_timeout)
    link.loopback = meeting.is_single_host
    shared = _tc.PrefixStore(meeting.prefix, store)
    secret_file = None
    if user_secret is None:
        secret_file = _agree_on_a_secret(launch, signer, shared, meeting)
    started = Started(users_group=False, launcher_store=store, secret_file=secret_file)
    try:
        if launch.global_rank == 0:
            address = f"{_leader_address(launch, settings)}:{link.serve().port}"
            store_put(shared, signer, "leader", address.encode())
        else:
            link.connect(store_take(shared, signer, "leader").decode())
    except BaseException:
        started.forget_secret()
        raise
    return started


def _agree_on_a_secret(
    launch: Launch, signer: Signer, shared: _tc.Store, meeting: Meeting
) -> Path | None:
    """No NEPS_BCAST_SECRET: the leader makes one and hands it to the other ranks.

    On one host, through a file only this user can read (its path goes through the
    launcher's store, the secret does not). On several hosts there is no private way,
    so it goes through the launcher's store, and every rank warns once.
    """
    if not meeting.is_single_host:
        hosts = len(set(meeting.hosts))
        logger.warning(
            "this group spans %d hosts and %s is not set: the control store and channel"
            " are authenticated with a secret that passed through the launcher's store,"
            " so anyone who can reach that store's port can read it and drive the ranks."
            " HINT: export %s=<a long random string> to every rank (sbatch exports it to"
            " every task).",
            hosts,
            auth.ENV_SECRET,
            auth.ENV_SECRET,
        )
    path: Path | None = None
    if launch.global_rank == 0:
        secret = auth.new_secret()
        if meeting.is_single_host:
            handle, name = tempfile.mkstemp(prefix="neps_bcast-secret-")  # mode 0600
            with os.fdopen(handle, "w") as f:
                f.write(auth.secret_text(secret))
            path = Path(name)
            shared.set("secret_file", name)
        else:
            shared.set("secret", auth.secret_text(secret))
    elif meeting.is_single_host:
        secret = bytes.fromhex(Path(shared.get("secret_file").decode()).read_text())
    else:
        secret = bytes.fromhex(shared.get("secret").decode())
    signer.use(secret)
    return path


def _hand_over_on_the_users_group(
    launch: Launch, settings: Settings, link: Link, signer: Signer, user_secret: bytes | None
) -> None:
    """The user formed the group before neps_bcast.run: hand the address (and, without
    NEPS_BCAST_SECRET, the secret) over on it: its connections link the ranks directly."""
    gloo = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname(), group=gloo)
    link.loopback = len(set(hosts)) == 1
    box: list[Any] = [None, None]
    if launch.global_rank == 0:
        box = [f"{_leader_address(launch, settings)}:{link.serve().port}", None]
        if user_secret is None:
            box[1] = auth.secret_text(signer.secret)
    dist.broadcast_object_list(box, src=0, group=gloo)
    if gloo is not None:
        dist.destroy_process_group(gloo)
    if launch.global_rank != 0:
        if box[1] is not None:
            signer.use(bytes.fromhex(str(box[1])))
        link.connect(str(box[0]))


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
