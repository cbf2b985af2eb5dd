"""tests/ports.py's two claims, shown on the machine that runs the suite: rank 0's store
serves on a held port, and while it is held no one who asks the kernel for a free port is
given it (the pickers of this suite's launchers).

The second is shown in a network namespace of its own (``unshare --net``; a child
process, so that the suite's own sockets stay where they are) whose ephemeral range is
one port. There the answer does not hang on chance: no other process can take the port
or free one (on the machine's whole range, pytest-xdist's other worker took the port the
picks had been led to once it was freed, and the control failed), and the kernel, which
never hands out a port outside the range, has only the held one to give: a picker that
could be given it is given it at every pick. The kernel settings that decide the answer
(``ip_autobind_reuse``: may bind(0) share a port with SO_REUSEADDR sockets; ``bindv6only``)
are copied into the namespace from the machine's own. Two positive controls show that the
check fails where a held port is handed out.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import logging
import os
import random
import socket
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.distributed.elastic.utils.distributed import get_free_port

from ports import HeldPort, bind_anywhere

TIMEOUT = datetime.timedelta(seconds=30)
PICKS = 200
"""Picks per picker while the port is held. With one port in the range every pick asks
the kernel the same question; several catch a picker that keeps state between calls."""
THE_PORT = 50000
"""The namespace's whole ephemeral range (any unprivileged port: nobody else is there)."""
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
KERNEL_SETTINGS = [
    Path("/proc/sys/net/ipv4/ip_autobind_reuse"),
    Path("/proc/sys/net/ipv6/bindv6only"),
]
CHILD_TIMEOUT_S = 120


def rank_0s_store(port: int, use_libuv: bool) -> dist.TCPStore:
    """The store rank 0 serves a launch from, as torch's launchers make it."""
    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=TIMEOUT,
        use_libuv=use_libuv,
    )


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv_store", "older_store"])
def test_rank_0s_store_serves_on_a_held_port(use_libuv: bool) -> None:
    with HeldPort() as port:
        server = rank_0s_store(port, use_libuv)
        client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
        server.set("written by rank 0", "read by rank 1")
        assert client.get("written by rank 0") == b"read by rank 1"


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv_store", "older_store"])
def test_a_port_bound_without_reuseaddr_keeps_the_store_off(use_libuv: bool) -> None:
    """Why a held port's socket has SO_REUSEADDR (the control of the test above)."""
    with closing(bind_anywhere(0, reuseaddr=False)) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(dist.DistNetworkError, match=r"EADDRINUSE|Address already in use"):
            rank_0s_store(port, use_libuv)


def a_bind_to_port_0_on_loopback() -> int:
    """What this suite's tests did before tests/ports.py."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def a_bind_to_port_0_on_ipv6_loopback() -> int:
    """What torchrun's free port is where ``localhost`` resolves to ``::1`` first."""
    with socket.socket(socket.AF_INET6) as sock:
        sock.bind(("::1", 0))
        return int(sock.getsockname()[1])


def another_held_port() -> int:
    with HeldPort() as port:
        return port


def a_random_port_of_the_ephemeral_range() -> int:
    """A picker that never asks the kernel (``MASTER_PORT=$((RANDOM + 20000))``): the
    positive control, handed the held port at every pick in the one-port range."""
    low, high = map(int, PORT_RANGE.read_text().split())
    return random.randint(low, high)


PICKERS: dict[str, Callable[[], int]] = {
    "a_bind_to_port_0_on_loopback": a_bind_to_port_0_on_loopback,
    "lightnings_free_port": find_free_network_port,  # Lightning's MASTER_PORT when unset
    "torchruns_free_port": get_free_port,  # --standalone: binds ("localhost", 0)
    "a_bind_to_port_0_on_ipv6_loopback": a_bind_to_port_0_on_ipv6_loopback,
    "another_held_port": another_held_port,  # another test, under xdist
}


class HeldOnIPv4Only(HeldPort):
    """A hold as tests/ports.py's first one was: bound to IPv4's 0.0.0.0 only."""

    def __init__(self) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("0.0.0.0", 0))
        self.number = self._socket.getsockname()[1]


CHECKS: dict[str, tuple[Callable[[], HeldPort], Callable[[], int]]] = {
    **{name: (HeldPort, pick) for name, pick in PICKERS.items()},
    "a_random_port_of_the_ephemeral_range": (HeldPort, a_random_port_of_the_ephemeral_range),
    "a_bind_to_port_0_on_ipv6_loopback_beside_an_ipv4_hold": (
        HeldOnIPv4Only,
        a_bind_to_port_0_on_ipv6_loopback,
    ),
}
"""Each check: how the port is held, and who picks while it is."""


@dataclass(frozen=True)
class Picks:
    """What one picker was given in the namespace: the held port's number, what its
    PICKS picks got while the port was held (a port, or the error of a pick refused for
    want of one: the range has no other), and what one pick got once it was free."""

    held: int
    while_held: dict[str, int]
    once_free: str

    @property
    def given_while_held(self) -> int:
        return self.while_held.get(str(self.held), 0)


def outcome(pick: Callable[[], int]) -> str:
    try:
        return str(pick())
    except (OSError, RuntimeError) as error:  # no port left: torchrun's is a RuntimeError
        return repr(error)


def picks_of(hold: Callable[[], HeldPort], pick: Callable[[], int]) -> Picks:
    held = hold()
    try:
        while_held = Counter(outcome(pick) for _ in range(PICKS))
        held.release()
        once_free = outcome(pick)
    finally:
        held.release()
    return Picks(held.number, dict(while_held), once_free)


def bring_loopback_up() -> None:
    """``ip link set lo up``, without needing iproute2: a new namespace's lo is down."""
    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(sock, siocgifflags, request))[1]
        fcntl.ioctl(sock, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def in_own_network(settings: dict[str, str], out: Path) -> None:
    """The child's part, run in the namespace: set it up as the machine is, but with a
    one-port range, and write each check's Picks to ``out``."""
    bring_loopback_up()
    for path, value in settings.items():
        Path(path).write_text(value)
    PORT_RANGE.write_text(f"{THE_PORT} {THE_PORT}")
    os.environ.pop("STANDALONE_PORT", None)  # Lightning would return it
    # torchrun's picker logs each refused bind with its traceback: keep stderr readable
    logging.getLogger("torch.distributed.elastic.utils.distributed").setLevel(logging.ERROR)
    records = {name: picks_of(hold, pick).__dict__ for name, (hold, pick) in CHECKS.items()}
    out.write_text(json.dumps(records))


@pytest.fixture(scope="module")
def picks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Picks]:
    """Every check's picks, from one child process in a network namespace of its own."""
    unshare = ["unshare", "--net"]
    if os.geteuid() != 0:
        unshare = ["unshare", "--map-root-user", "--net"]
    settings = {str(path): path.read_text().strip() for path in KERNEL_SETTINGS if path.exists()}
    out = tmp_path_factory.mktemp("picks") / "picks.json"
    child = subprocess.run(
        [*unshare, sys.executable, __file__, json.dumps(settings), str(out)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        check=False,
    )
    if child.returncode != 0:
        pytest.fail(
            f"the picks in a network namespace of their own exited {child.returncode};"
            f" stderr's tail:\n{child.stderr[-3000:]}\nHINT: `{' '.join(unshare)} true` must"
            " work (root, or unprivileged user namespaces allowed)"
        )
    return {name: Picks(**record) for name, record in json.loads(out.read_text()).items()}


@pytest.mark.parametrize("name", PICKERS.keys())
def test_no_free_port_picker_is_given_a_held_port(picks: dict[str, Picks], name: str) -> None:
    assert picks[name].given_while_held == 0, picks[name]


@pytest.mark.parametrize("name", PICKERS.keys())
def test_a_picker_is_given_the_port_once_it_is_free(picks: dict[str, Picks], name: str) -> None:
    """The control of the test above: the one port the picks could be given is the held one."""
    assert picks[name].once_free == str(picks[name].held), picks[name]


def test_a_picker_that_never_asks_the_kernel_is_given_the_held_port(
    picks: dict[str, Picks],
) -> None:
    """The positive control: where a picker can be handed a held port, the check counts it."""
    assert picks["a_random_port_of_the_ephemeral_range"].given_while_held == PICKS


def test_a_port_held_on_ipv4_only_is_given_to_a_bind_on_ipv6_loopback(
    picks: dict[str, Picks],
) -> None:
    """Why tests/ports.py holds a port on every IPv6 and IPv4 address."""
    check = picks["a_bind_to_port_0_on_ipv6_loopback_beside_an_ipv4_hold"]
    assert check.given_while_held == PICKS, check


if __name__ == "__main__":
    in_own_network(json.loads(sys.argv[1]), Path(sys.argv[2]))
