"""Who the other ranks of the group are, and what became of a lost one.

A rank is named by its process (``procfs.Process``: host, boot id, pid namespace, pid,
start time), never by host and pid alone: containers that share a host's name and network
number their processes each from 1, so a peer is "here" (its pid looked up in this
``/proc``, its sockets read, its exit told) only on this host, boot and pid namespace, and
it is that process only while its start time matches.

Every rank publishes itself on the leader's store as soon as it reaches it (the leader
when it serves it; a Lightning child before Lightning's rendezvous), so that from the
first trial on any rank can tell which connections lead to its peers (``ddp/group.py``)
and the leader can say how a lost follower ended: "signal 9 (SIGKILL)" beats "process
died". A follower that is this process's child (Lightning's launcher) is inspected
with ``waitid(WNOWAIT)``, which reads its exit status and leaves it to Lightning to
reap; any other process on this host is looked up in ``/proc``.

A record that fails its check (forged, replayed from another search, not a record) or
cannot be read is an error naming its key, logged by every rank that reads it, and the
peer is then unknown from the store: where the group must still be released, the
process falls back to what it can see itself in ``/proc`` (``relatives``: Lightning's
parent or children, or the processes of this host that carry this launch's variables).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from neps_bcast.compat import procfs
from neps_bcast.compat.torch import Store
from neps_bcast.errors import AuthError, first_line
from neps_bcast.log import logger
from neps_bcast.transport import liveness, sockets
from neps_bcast.transport.auth import Signer
from neps_bcast.transport.store import Keys, put_json, take_json

EXIT_STATUS_WAIT_S = 2.0
"""How long the leader waits for a lost child's exit status before describing it."""


@dataclass(frozen=True)
class Peer:
    group_rank: int
    host: str
    pid: int
    listen: tuple[sockets.Endpoint, ...] = ()
    """This process's listening endpoints when it published (for peers on other hosts)."""
    boot_id: str = field(default_factory=procfs.boot_id)
    pid_namespace: str = field(default_factory=procfs.pid_namespace)
    """A peer built here from a pid (``relatives``) is of this boot and pid namespace; a
    record read from the store says its own (and names none if it has none)."""
    start_ticks: int | None = None
    """When it started (None: not known, and then it is never signalled)."""

    @property
    def process(self) -> procfs.Process | None:
        """Who it is; None where its start time is not known."""
        if self.start_ticks is None:
            return None
        return procfs.Process(
            self.host, self.boot_id, self.pid_namespace, self.pid, self.start_ticks
        )

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host,
            "boot_id": self.boot_id,
            "pid_namespace": self.pid_namespace,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
            "listen": [list(e) for e in self.listen],
        }

    @classmethod
    def from_json(cls, group_rank: int, raw: object) -> Peer | None:
        if not isinstance(raw, dict):
            return None
        process, listen = procfs.Process.from_json(raw), raw.get("listen", [])
        if process is None or not isinstance(listen, list):
            return None
        endpoints = tuple(
            (str(e[0]), int(e[1])) for e in listen if isinstance(e, list) and len(e) == 2
        )
        return cls(
            group_rank,
            process.host,
            process.pid,
            endpoints,
            process.boot_id,
            process.pid_namespace,
            process.start_ticks,
        )

    @property
    def is_here(self) -> bool:
        """Its pid names it in this ``/proc``: same host, boot and pid namespace."""
        return (
            bool(self.boot_id)
            and (self.host, self.boot_id, self.pid_namespace)
            == (socket.gethostname(), procfs.boot_id(), procfs.pid_namespace())
            and procfs.proc_is_ours()
        )


def this_process(group_rank: int) -> Peer:
    return _local(group_rank, os.getpid(), tuple(sorted(sockets.own_listening())))


def _local(group_rank: int, pid: int, listen: tuple[sockets.Endpoint, ...] = ()) -> Peer:
    """A process of this host and pid namespace, found by its pid now."""
    process = procfs.Process.me() if pid == os.getpid() else procfs.Process.of(pid)
    ticks = process.start_ticks if process is not None else None
    return Peer(group_rank, socket.gethostname(), pid, listen, start_ticks=ticks)


def _no_relatives() -> list[Peer]:
    return []


class Peers:
    """The group's ranks as published on the leader's store (read lazily, cached)."""

    def __init__(
        self,
        group_rank: int,
        signer: Signer,
        relatives: Callable[[], list[Peer]] = _no_relatives,
    ) -> None:
        self.group_rank = group_rank
        self.signer = signer
        self.relatives = relatives
        """What this process sees of its group by itself, for ranks without a record."""
        self._known: dict[int, Peer] = {}
        self._refused: set[int] = set()

    def known(self, group_rank: int) -> Peer | None:
        """A rank's record as read so far (no store operation)."""
        return self._known.get(group_rank)

    def publish(self, store: Store) -> None:
        me = this_process(self.group_rank)
        self._known[self.group_rank] = me
        put_json(store, self.signer, Keys.rank(self.group_rank), me.to_json(), sender=me.group_rank)

    def others(self, store: Store | None, world_size: int | None) -> list[Peer]:
        """Every other rank known from its record so far (reads the ones not yet seen).

        A record that is there but fails its check, or cannot be read, is logged as an
        error naming its key (once) and that rank stays unknown."""
        if store is not None and world_size is not None:
            for r in range(world_size):
                if r not in self._known and r not in self._refused:
                    self._read(store, r)
        return [p for r, p in sorted(self._known.items()) if r != self.group_rank]

    def _read(self, store: Store, group_rank: int) -> None:
        key = Keys.rank(group_rank)
        try:
            if not store.check([key]):
                return  # not published yet (a Lightning child still starting)
            peer = Peer.from_json(group_rank, take_json(store, self.signer, key, sender=group_rank))
            if peer is None:
                raise ValueError(
                    "it is not a peer record (host, boot id, pid namespace, pid, start time,"
                    " listen)"
                )
        except AuthError as exc:
            self._refused.add(group_rank)
            logger.log(logging.ERROR, "%s", exc)
            return
        except Exception as exc:  # noqa: BLE001 - unreadable: said so, the rank stays unknown
            self._refused.add(group_rank)
            logger.log(
                logging.ERROR,
                "refused the peer record under %r: cannot read it (%s); rank %d is found"
                " from this host's processes instead where it runs here. HINT: another"
                " process wrote to the leader's store, or the leader is gone.",
                key,
                first_line(exc),
                group_rank,
            )
            return
        self._known[group_rank] = peer

    def group(self, store: Store | None, world_size: int | None) -> list[Peer]:
        """Every other rank: its record, and where one is missing or was refused, what
        this process sees by itself (``relatives``)."""
        others = self.others(store, world_size)
        if len(others) < (world_size or 1) - 1:
            pids = {p.pid for p in others}
            others += [p for p in self.relatives() if p.pid not in pids]
        return others

    def describe_lost(self, store: Store | None, world_size: int | None) -> str:
        """Which peers are gone, and how (exit code or signal), where this host can tell."""
        lost = []
        for peer in self.group(store, world_size):
            silent = liveness.silenced(peer.group_rank) if peer.group_rank >= 0 else None
            if silent is not None:
                silence, action = silent
                lost.append(
                    f"{silence.describe()}: frozen, hung, or its node lost or cut off ({action})"
                )
                continue
            if not peer.is_here:
                continue
            how = _how_it_ended(peer.pid, peer.start_ticks)
            if how is not None:
                who = f"rank {peer.group_rank}" if peer.group_rank >= 0 else "a child process"
                lost.append(f"{who} lost: {how} (pid {peer.pid})")
        return "; ".join(lost)


def lightning_relatives(launch_kind: str) -> list[Peer]:
    """Under Lightning's own launcher the group is this process's parent (a child's
    leader) or its child processes (the leader's)."""
    if launch_kind == "lightning_child":
        stat = procfs.read_stat(os.getpid())
        return [_local(0, stat.ppid)] if stat is not None else []
    if launch_kind == "single":
        me = os.getpid()
        children = [
            pid
            for pid in procfs.all_pids()
            if (st := procfs.read_stat(pid)) is not None and st.ppid == me
        ]
        return [_local(-1, pid) for pid in children]
    return []


def launch_relatives(
    identity: tuple[tuple[str, str], ...], rank_variable: str | None, group_rank: int
) -> list[Peer]:
    """An external launch's other ranks on this host: this user's processes whose
    environment carries this launch's variables (``identity``: the launcher's run id,
    rendezvous address, ...), with their rank in ``rank_variable``."""
    if not identity or rank_variable is None:
        return []
    me, uid = os.getpid(), os.geteuid()
    found = []
    for pid in procfs.all_pids():
        if pid == me or procfs.owner(pid) != uid:
            continue
        env = procfs.environ(pid)
        if any(env.get(name) != value for name, value in identity):
            continue
        try:
            rank = int(env.get(rank_variable, ""))
        except ValueError:
            continue
        if rank != group_rank:  # not this rank's own children (data loader workers)
            found.append(_local(rank, pid))
    return found


def _how_it_ended(pid: int, ticks: int | None = None) -> str | None:
    if ticks is not None and procfs.is_alive(pid) and procfs.start_ticks(pid) != ticks:
        return "its process is gone (its pid is another process's now)"
    stat = procfs.read_stat(pid)
    if stat is not None and stat.ppid == os.getpid():
        deadline = time.monotonic() + EXIT_STATUS_WAIT_S
        while True:
            try:
                info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                break
            if info is not None:
                if info.si_code == os.CLD_EXITED:
                    return f"exit code {info.si_status}"
                return f"signal {info.si_status} ({signal.Signals(info.si_status).name})"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.02)  # bounded: the peer's connections closed, its exit follows
    if not procfs.is_alive(pid):
        return "its process is gone"
    return None
