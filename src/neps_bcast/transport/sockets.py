"""The TCP connections of processes on this host, read from ``/proc``, and shutting them.

Why: a rank that raises while its peers wait in a DDP collective must release them.
Destroying the process group is not enough: DDP's reducer keeps the gloo group (and
its connections) alive until the process exits, and gloo's ``abort()`` does not cancel
a pending operation (measured, torch 2.13 and 2.14). Shutting the group's connections
makes every peer's pending collective fail within milliseconds with gloo's "Connection
closed by peer", exactly as if this rank had died, while this process lives on to
report the error and to join the next trial on a fresh group. Which connections are
the group's is decided in ``ddp/group.py``; this module only reads and shuts.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from neps_bcast.compat import procfs

Endpoint = tuple[str, int]
"""(IP address as text, port); IPv4-mapped IPv6 addresses are given as IPv4."""

ESTABLISHED = "01"
LISTEN = "0A"


@dataclass(frozen=True)
class TcpSocket:
    inode: int
    local: Endpoint
    remote: Endpoint
    state: str


def _endpoint(text: str) -> Endpoint:
    address, port = text.split(":")
    raw = bytes.fromhex(address)
    # /proc prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    ip = ipaddress.ip_address(words)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port, 16)


def tcp_table() -> dict[int, TcpSocket]:
    """Every TCP socket of this network namespace, by inode."""
    found: dict[int, TcpSocket] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[9] != "0":
                inode = int(fields[9])
                found[inode] = TcpSocket(
                    inode, _endpoint(fields[1]), _endpoint(fields[2]), fields[3]
                )
    return found


def socket_inodes(pid: int | None = None) -> dict[int, int]:
    """inode -> fd for every socket a process holds (this one by default)."""
    found: dict[int, int] = {}
    fd_dir = Path(f"/proc/{'self' if pid is None else pid}/fd")
    try:
        entries = list(fd_dir.iterdir())
    except OSError:
        return found
    for entry in entries:
        try:
            target = str(entry.readlink())
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(entry.name)
    return found


def own_listening() -> set[Endpoint]:
    """The TCP endpoints this process listens on, asked of each socket it holds.

    The same answer as ``listening(tcp_table(), socket_inodes())``, without reading
    the host's TCP tables: those took 6 ms each here (12 ms for the pair, more on a
    busy host), on the path of every rank's start."""
    found: set[Endpoint] = set()
    for fd in socket_inodes().values():
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                if (
                    sock.family in (socket.AF_INET, socket.AF_INET6)
                    and sock.type == socket.SOCK_STREAM
                    and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                ):
                    host, port = sock.getsockname()[:2]
                    ip = ipaddress.ip_address(str(host).split("%")[0])
                    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                        ip = ip.ipv4_mapped
                    found.add((str(ip), int(port)))
            finally:
                sock.close()
    return found


def listening(table: dict[int, TcpSocket], inodes: set[int] | dict[int, int]) -> set[Endpoint]:
    """The listening endpoints among ``inodes``."""
    return {table[i].local for i in inodes if i in table and table[i].state == LISTEN}


def shutdown(inodes: set[int]) -> int:
    """Shut the given connections of this process both ways; returns how many."""
    count = 0
    for inode, fd in socket_inodes().items():
        if inode not in inodes:
            continue
        with contextlib.suppress(OSError):
            dup = os.dup(fd)
            sock = socket.socket(fileno=dup)
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            finally:
                sock.close()
    return count


def set_liveness_options(inodes: set[int], bound_s: float, probe_s: float) -> int:
    """Kernel-level detection on the given TCP connections of this process: data left
    unacknowledged for ``bound_s`` fails the connection (``TCP_USER_TIMEOUT``), and an
    idle one is probed every ``probe_s`` (keepalive), so a peer whose node is lost or cut
    off is found even by a thread blocked in C++. Returns how many were set."""
    count = 0
    for inode, fd in socket_inodes().items():
        if inode not in inodes:
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                idle = max(1, int(probe_s))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, idle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(bound_s * 1000))
                count += 1
            finally:
                sock.close()
    return count


def connections_to(addresses: set[str]) -> set[int]:
    """Inodes of this process's established TCP connections whose other end is at one of
    ``addresses`` (never loopback): every connection to a lost node, whatever made it."""
    table = tcp_table()
    found = set()
    for inode in socket_inodes():
        entry = table.get(inode)
        if entry is None or entry.state != ESTABLISHED:
            continue
        ip = entry.remote[0]
        if ip in addresses and not ipaddress.ip_address(ip).is_loopback:
            found.add(inode)
    return found


def connections_out_of_sight(addresses: set[str]) -> set[int]:
    """Inodes of this process's established TCP connections to ``addresses`` or loopback
    whose other end is a socket of this network namespace that no process this one can
    see holds: a process in another pid namespace (a container sharing this host's
    network: Kubernetes ``hostNetwork``, ``docker run --network host``). Such a peer's
    connections share the addresses of this container's own processes, so they are told
    apart by who holds their other end; this process's own and its container's stay (a
    process here whose sockets this one may not read, another user's, counts as out of
    sight: shutting a connection to it only hastens the end the silence brings)."""
    table = tcp_table()
    by_ends = {(e.local, e.remote): e.inode for e in table.values()}
    seen: set[int] = set(socket_inodes())
    for pid in procfs.all_pids():
        seen.update(socket_inodes(pid))
    found = set()
    for inode in socket_inodes():
        entry = table.get(inode)
        if entry is None or entry.state != ESTABLISHED:
            continue
        ip = entry.remote[0]
        if ip not in addresses and not ipaddress.ip_address(ip).is_loopback:
            continue
        other_end = by_ends.get((entry.remote, entry.local))
        if other_end is not None and other_end not in seen:
            found.add(inode)
    return found
