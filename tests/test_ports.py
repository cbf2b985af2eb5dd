"""tests/ports.py's two claims, shown on the machine that runs the suite: rank 0's store
serves on a held port, and while it is held no one who asks the kernel for a free port is
given it (the pickers of this suite's launchers, each called 2000 times)."""

from __future__ import annotations

import datetime
import socket
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing, contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from torch.distributed.elastic.utils.distributed import get_free_port

from ports import HeldPort, bind_anywhere

TIMEOUT = datetime.timedelta(seconds=30)
PICKS = 2000
RUN_UP = 1000


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


PICKERS: dict[str, Callable[[], int]] = {
    "a_bind_to_port_0_on_loopback": a_bind_to_port_0_on_loopback,
    "lightnings_free_port": find_free_network_port,  # Lightning's MASTER_PORT when unset
    "torchruns_free_port": get_free_port,  # --standalone: binds ("localhost", 0)
    "a_bind_to_port_0_on_ipv6_loopback": a_bind_to_port_0_on_ipv6_loopback,
    "another_held_port": another_held_port,  # another test, under xdist
}


@contextmanager
def run_up_to(port: int) -> Iterator[int]:
    """Takes the ports that bind(0) tries just before ``port`` (every second one below it,
    wrapping within the ephemeral range, as the kernel scans), as many as it can bind of
    RUN_UP: a pick whose random start lands among them scans up to ``port`` next. Without
    it, 2000 picks would reach one port of ~14000 only by chance. Yields how many."""
    text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
    low, high = map(int, text.split())
    span = (high + 1 - low) & ~1
    with ExitStack() as stack:
        taken = 0
        for step in range(1, min(RUN_UP, span // 2 - 1) + 1):
            below = low + (port - low - 2 * step) % span
            try:
                stack.enter_context(closing(bind_anywhere(below, reuseaddr=False)))
            except OSError:
                continue  # another process holds it: taken all the same
            taken += 1
        yield taken


@pytest.mark.parametrize("pick", PICKERS.values(), ids=PICKERS.keys())
def test_no_free_port_picker_is_given_a_held_port(
    pick: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("STANDALONE_PORT", raising=False)  # Lightning would return it
    held = HeldPort()
    try:
        with run_up_to(held.number) as taken:
            given = Counter(pick() for _ in range(PICKS))
            held.release()
            # The control: the same picks, the port free, reach it within as many tries.
            reached = next((i for i in range(PICKS) if pick() == held.number), None)
    finally:
        held.release()
    assert given[held.number] == 0, f"port {held.number} was given out while held"
    assert reached is not None, (
        f"{PICKS} picks never reached port {held.number} once it was free, with {taken} ports"
        " below it taken: the run-up does not lead them there, and the test shows nothing"
    )
