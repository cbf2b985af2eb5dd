"""Who the other ranks of the group are (host, pid), and what became of a lost one.

Every rank publishes itself on the leader's store as soon as it reaches it (the leader
when it serves it; a Lightning child before Lightning's rendezvous), so that from the
first trial on any rank can tell which connections lead to its peers (``ddp/group.py``)
and the leader can say how a lost follower ended: "signal 9 (SIGKILL)" beats "process
died". A follower that is this process's child (Lightning's launcher) is inspected
with ``waitid(WNOWAIT)``, which reads its exit status and leaves it to Lightning to
reap; any other process on this host is looked up in ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from dataclasses import dataclass

from neps_bcast.compat import procfs
from neps_bcast.compat.torch import Store
from neps_bcast.transport import sockets
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

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host,
            "pid": self.pid,
            "listen": [list(e) for e in self.listen],
        }

    @classmethod
    def from_json(cls, group_rank: int, raw: object) -> Peer | None:
        if not isinstance(raw, dict):
            return None
        host, pid, listen = raw.get("host"), raw.get("pid"), raw.get("listen", [])
        if not isinstance(host, str) or not isinstance(pid, int) or not isinstance(listen, list):
            return None
        endpoints = tuple(
            (str(e[0]), int(e[1])) for e in listen if isinstance(e, list) and len(e) == 2
        )
        return cls(group_rank, host, pid, endpoints)

    @property
    def is_here(self) -> bool:
        return self.host == socket.gethostname()


def this_process(group_rank: int) -> Peer:
    table = sockets.tcp_table()
    listen = sockets.listening(table, sockets.socket_inodes())
    return Peer(group_rank, socket.gethostname(), os.getpid(), tuple(sorted(listen)))


class Peers:
    """The group's ranks as published on the leader's store (read lazily, cached)."""

    def __init__(self, group_rank: int, signer: Signer) -> None:
        self.group_rank = group_rank
        self.signer = signer
        self._known: dict[int, Peer] = {}

    def publish(self, store: Store) -> None:
        me = this_process(self.group_rank)
        self._known[self.group_rank] = me
        put_json(store, self.signer, Keys.rank(self.group_rank), me.to_json())

    def others(self, store: Store | None, world_size: int | None) -> list[Peer]:
        """Every other rank known so far (reads the ones not yet seen)."""
        if store is not None and world_size is not None:
            for r in range(world_size):
                if r in self._known:
                    continue
                with contextlib.suppress(Exception):
                    if store.check([Keys.rank(r)]):
                        peer = Peer.from_json(r, take_json(store, self.signer, Keys.rank(r)))
                        if peer is not None:
                            self._known[r] = peer
        return [p for r, p in sorted(self._known.items()) if r != self.group_rank]

    def lightning_relatives(self, launch_kind: str) -> list[Peer]:
        """Where a peer's record is missing: under Lightning's own launcher the group is
        this process's parent (a child's leader) or its child processes (the leader's)."""
        here = socket.gethostname()
        if launch_kind == "lightning_child":
            stat = procfs.read_stat(os.getpid())
            return [Peer(0, here, stat.ppid)] if stat is not None else []
        if launch_kind == "single":
            me = os.getpid()
            children = [
                pid
                for pid in procfs.all_pids()
                if (st := procfs.read_stat(pid)) is not None and st.ppid == me
            ]
            return [Peer(-1, here, pid) for pid in children]
        return []

    def describe_lost(self, store: Store | None, world_size: int | None) -> str:
        """Which peers are gone, and how (exit code or signal), where this host can tell."""
        lost = []
        for peer in self.others(store, world_size):
            if not peer.is_here:
                continue
            how = _how_it_ended(peer.pid)
            if how is not None:
                lost.append(f"rank {peer.group_rank} lost: {how} (pid {peer.pid})")
        return "; ".join(lost)


def _how_it_ended(pid: int) -> str | None:
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
