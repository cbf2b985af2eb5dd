"""A port for a launch that a test starts: one the OS picks, kept from everyone else until
the launch is over.

Binding port 0, closing the socket and handing its number over leaves a window in which
the kernel may give the same port to anyone else who binds port 0 (another test under
xdist, another job on the machine, torchrun's ``--standalone``), and the launch then
fails with EADDRINUSE. A ``HeldPort`` keeps its socket bound, with SO_REUSEADDR and never
listening, until the launch is over. On Linux:

* a socket with SO_REUSEADDR may bind and listen on a port that only non-listening
  SO_REUSEADDR sockets are bound to; torch's TCPStore sets SO_REUSEADDR (libuv's bind
  does, and so does its older backend), so rank 0's store serves on the held port;
* ``bind(port 0)`` never returns a port that a socket on an overlapping address is bound
  to, with or without SO_REUSEADDR, while ``net.ipv4.ip_autobind_reuse`` is 0 (the
  default; at 1 a SO_REUSEADDR ``bind(port 0)`` may share it). The socket is bound to
  every IPv6 and IPv4 address (``::``, dual-stack): bound to IPv4's ``0.0.0.0`` only, the
  port is still handed to ``bind(("::1", 0))``, which is how torchrun's ``--standalone``
  picks its port when ``localhost`` resolves to ``::1`` first.

tests/test_ports.py shows both with the kernel and settings of the machine that runs the
suite. A port is held for
the whole launch, not only until its store listens: a requeued SLURM job binds it again
later, and the port must still be nobody else's then.
"""

from __future__ import annotations

import errno
import socket
from types import TracebackType


def bind_anywhere(port: int, *, reuseaddr: bool) -> socket.socket:
    """A TCP socket bound to ``port`` on every address of this host: IPv6 and IPv4
    (dual-stack ``::``), or IPv4 only where the host has no IPv6."""
    error: OSError | None = None
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            error = exc
            continue
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            if reuseaddr:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
        except OSError as exc:
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise  # taken; only a host without IPv6 falls back to IPv4
            error = exc
            continue
        return sock
    assert error is not None
    raise error


class HeldPort:
    """A port the OS picked, held (bound, not listening) until ``release()``. As a
    context manager, ``with HeldPort() as port:`` gives its number and releases it at
    the end of the block."""

    def __init__(self) -> None:
        self._socket = bind_anywhere(0, reuseaddr=True)
        self.number: int = self._socket.getsockname()[1]

    def release(self) -> None:
        """Let the port go (idempotent)."""
        self._socket.close()

    def __enter__(self) -> int:
        return self.number

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()
