"""Find and shut the TCP connections of the user's gloo group in this process.

Why: a rank that raises while its peers wait in a DDP collective must release them.
Destroying the process group is not enough: DDP's reducer keeps the gloo group (and
its connections) alive until the process exits, and gloo's ``abort()`` does not
cancel a pending operation (both measured here, torch 2.13). Shutting the group's
sockets makes every peer's pending collective fail within milliseconds with gloo's
"Connection closed by peer", exactly as if this rank had died, while this process
lives on to report the error and to join the next trial on a fresh group.

The group's sockets are told apart from everything else as the TCP connections that
appeared while the group was being formed, minus neps_bcast's own store and channel.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path

_ESTABLISHED = "01"


def socket_inodes() -> dict[int, int]:
    """inode -> fd for every socket this process holds."""
    found: dict[int, int] = {}
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():
        return found
    for entry in fd_dir.iterdir():
        try:
            target = str(entry.readlink())
        except OSError:
            continue
        if target.startswith("socket:["):
            found[int(target[8:-1])] = int(entry.name)
    return found


def established_tcp() -> dict[int, int]:
    """inode -> local port of every established TCP connection on this machine."""
    result: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _ESTABLISHED:
                result[int(fields[9])] = int(fields[1].rsplit(":", 1)[1], 16)
    return result


def socket_set() -> set[int]:
    """Inodes of every socket this process holds: cheap (no /proc/net read)."""
    return set(socket_inodes())


def tcp_among(inodes: set[int]) -> set[int]:
    """The established TCP connections among ``inodes``."""
    return {inode for inode in established_tcp() if inode in inodes}


def connections_on_port(port: int) -> set[int]:
    mine = socket_inodes()
    return {inode for inode, local in established_tcp().items() if local == port and inode in mine}


def shutdown(inodes: set[int]) -> int:
    """Shut the given connections both ways; returns how many were shut."""
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
