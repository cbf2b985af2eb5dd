"""The user's DDP group as this rank sees it: observe, validate, release, re-form.

The group belongs to the user's code (Lightning, Fabric, a plain DDP loop): neps_bcast
only learns its size, rank and backend while it exists, releases it when a rank fails
(so that peers blocked in its collectives fail at once instead of after the group
timeout), and forms one only where the user's code expects one it did not form:

- Lightning's own launches (``keep``): the group Lightning formed in trial 1 is formed
  again before the next trial on the leader's store once a failure released it; so is
  a group the user formed before ``neps_bcast.run``.
- External launches (torchrun, srun): never before a trial, because the user's code may
  form the group itself, every trial (PyTorch's DDP tutorial does: ``init_process_group``
  at the start of the function, ``destroy_process_group`` at its end). Each trial names
  the next default group after itself (``name_for_trial``), so a group formed again on
  the launcher's store (torchrun's agent store, rank 0's server) never meets the keys of
  the previous trial's. If, at ``session()``, no rank has a group, neps_bcast forms one
  there (``form_for_session``) for code that uses it without forming it.

Wherever it is formed, it is formed with every rank or with none, and a peer lost
meanwhile is seen within a second (``ddp.forming``).

Releasing exactly the group. A gloo pair is one TCP connection between two ranks of the
group, to a listening port of one of them; DDP keeps the group alive while it is
referenced, so destroying it does not close them (see ``sockets``). The connections
shut are therefore those that lead to another rank's process:

- a peer on this host: the remote end of the connection is a socket held by the peer's
  process (read from ``/proc``), whenever and by whomever the group was formed (a
  ``new_group`` inside the trial, gloo's lazy connections included);
- a peer on another host: the remote end is a listening endpoint the peer published when
  it joined, or the connection came in on a listening port of this process from the
  peer's host.

Never shut: neps_bcast's own store, watch and channel connections (recorded when they
are made), and every connection to anything that is not a rank of this group (the
user's database, tracker, or anything opened before or during the trial).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from neps_bcast.compat import torch as torch_compat
from neps_bcast.ddp.forming import form
from neps_bcast.ddp.teardown import drop_finished_frames
from neps_bcast.errors import ProtocolError, format_message
from neps_bcast.log import logger, rank_tag
from neps_bcast.transport import sockets
from neps_bcast.transport.peers import Peer
from neps_bcast.transport.store import Keys, prefixed


def group_connections(
    peers: Iterable[Peer], own: set[int], exclude_local_ports: set[int]
) -> set[int]:
    """Inodes of this process's established connections to the processes of ``peers``."""
    table = sockets.tcp_table()
    mine = sockets.socket_inodes()
    remote_ends: set[sockets.Endpoint] = set()
    remote_hosts: set[str] = set()
    for peer in peers:
        if peer.is_here:
            for inode in sockets.socket_inodes(peer.pid):
                entry = table.get(inode)
                if entry is not None:
                    remote_ends.add(entry.local)
        else:
            remote_ends.update(peer.listen)
            remote_hosts.update(ip for ip, _ in peer.listen)
    my_listen_ports = {port for _, port in sockets.listening(table, mine)}
    found = set()
    for inode in mine:
        entry = table.get(inode)
        if inode in own or entry is None or entry.state != sockets.ESTABLISHED:
            continue
        if entry.local[1] in exclude_local_ports:
            continue
        accepted_from_peer_host = (
            entry.local[1] in my_listen_ports and entry.remote[0] in remote_hosts
        )
        if entry.remote in remote_ends or accepted_from_peer_host:
            found.add(inode)
    return found


class UserGroup:
    """What this rank knows of the user's group, and the three things done to it."""

    def __init__(self, group_rank: int, world_size: int | None, *, keep: bool = True) -> None:
        self.group_rank = group_rank
        self.world_size = world_size
        """``None`` until the group exists (a Lightning leader before its first fit)."""
        self.backend: str | None = None
        self.broken = False
        self.generation = 0
        self.keep = keep
        """Form the group again before a trial once a release (or user code) ended it."""

    @staticmethod
    def exists() -> bool:
        return dist.is_available() and dist.is_initialized()

    def observe(self, *, fixed_size: bool, single: bool) -> None:
        """Learn the size, rank and backend of the user's group while it exists.

        ``fixed_size``: the search already runs on a known number of ranks, and a group
        of another size is an error. ``single``: a single-process launch, whose function
        may start a group of its own (``ddp_spawn``) where this process is rank 0.
        """
        if not self.exists():
            return
        size, rank = dist.get_world_size(), dist.get_rank()
        if fixed_size and self.world_size is not None and size != self.world_size:
            raise ProtocolError(
                format_message(
                    rank_tag(),
                    f"the DDP group now has {size} ranks, but this search started on"
                    f" {self.world_size}.",
                    "every trial must use the same number of processes"
                    " (Trainer devices x num_nodes).",
                )
            )
        if rank != self.group_rank and not (single and rank == 0):
            raise ProtocolError(
                format_message(
                    rank_tag(),
                    f"torch.distributed says this process is rank {rank}, but the"
                    f" launch made it rank {self.group_rank}.",
                    "do not change RANK/LOCAL_RANK between neps_bcast.run and fit.",
                )
            )
        self.world_size = size
        self.backend = str(dist.get_backend())

    def release(self, connections: Callable[[], set[int]], exc: BaseException | None) -> None:
        """Take the group down so that peers blocked in its collectives fail now."""
        drop_finished_frames(exc)  # their DDP wrappers keep the group alive
        exists = self.exists()
        if exists and self.backend == "nccl":
            with contextlib.suppress(Exception):
                torch_compat.abort_nccl()
        shut = sockets.shutdown(connections())
        logger.log(logging.DEBUG, "shut %d connection(s) of the DDP group", shut)
        if exists:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail to close
                logger.log(logging.DEBUG, "destroy failed", exc_info=True)
        gc.collect()
        self.broken = True

    def needs_reform(self) -> bool:
        return self.keep and (self.world_size or 0) > 1 and (self.broken or not self.exists())

    def next_generation(self) -> int | None:
        """Leader, before handing a trial: the generation to form it as, if it must be."""
        return self.generation + 1 if self.needs_reform() else None

    def reform(
        self, store: torch_compat.Store, generation: int, peers_alive: Callable[[], None]
    ) -> None:
        """Form the group again, as the leader said, before a trial.

        Uses the leader's store under the generation's own prefix, so no stale
        rendezvous keys of an earlier group can be read; Lightning then finds the group
        and reuses it. Every rank forms the generation the leader chose, whatever its
        own view of the group, so they always meet under the same prefix.
        """
        self.generation = generation
        if self.exists():
            dist.destroy_process_group()
        backend = self.backend or "gloo"
        logger.log(
            logging.INFO,
            "re-forming the DDP group (%s, generation %d)",
            backend,
            self.generation,
        )
        self._form(backend, prefixed(Keys.group(self.generation), store), peers_alive)

    def name_for_trial(self) -> None:
        """Before each trial (external launches, every rank): the next default group,
        whoever forms it, gets a name no group of this process had, the same on every
        rank (every rank evaluates every trial).

        Its keys then live under a prefix of their own on whatever store it is formed
        on, so a group formed again on the launcher's store, which outlives every
        trial, never reads the addresses of the previous trial's group (see
        ``compat.torch.name_next_group``). A group that still exists is left as it is.
        """
        number = next(_TRIAL_NAMES)
        if self.exists():
            return
        self.broken = False  # the previous trial's group is gone; the next is new
        torch_compat.name_next_group(number)

    def form_for_session(
        self,
        store: torch_compat.Store,
        seq: int,
        backend: str | None,
        local_rank: int,
        peers_alive: Callable[[], None],
    ) -> str:
        """At ``session()``, where no rank's code formed a group: form it (on the
        leader's store, under the trial's own prefix); returns the backend."""
        chosen = backend or _default_backend(local_rank)
        logger.log(logging.INFO, "forming the DDP group for trial #%d (%s)", seq, chosen)
        self._form(chosen, prefixed(Keys.trial_group(seq), store), peers_alive)
        return chosen

    def _form(
        self, backend: str, store: torch_compat.Store, peers_alive: Callable[[], None]
    ) -> None:
        if self.world_size is None:
            raise ProtocolError(
                format_message(
                    rank_tag(),
                    "asked to form the DDP group before its size is known.",
                    "this is a bug in neps_bcast; please report it with every rank's log.",
                )
            )
        form(backend, store, self.group_rank, self.world_size, peers_alive)
        self.backend = backend
        self.broken = False


_TRIAL_NAMES = itertools.count(1_000_001)
"""Names of the default groups formed in trials, one per trial this process evaluated
(in every ``neps_bcast.run`` call: a second search on the same launcher store must not
meet the first one's keys either). torch names groups from 0 up; a group's own
``new_group``s are named, and keep their keys, under its name."""


def names_for_a_new_store() -> None:
    """A pool's rank, before each trial: its group is formed on a store of its own (the
    trial's agent serves a new one per trial), so the names count from the start again:
    the same on every rank of the trial, whatever trials each rank took before (a
    count kept per process named one rank's group 1000004 and its peer's 1000002, and
    both waited in gloo's rendezvous for ever)."""
    global _TRIAL_NAMES  # noqa: PLW0603 - the count is this process's, by design
    _TRIAL_NAMES = itertools.count(1_000_001)


def _default_backend(local_rank: int) -> str:
    """NCCL (on this rank's GPU) when there are GPUs, else gloo."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return "nccl"
    return "gloo"
