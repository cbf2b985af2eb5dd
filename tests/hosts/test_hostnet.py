"""The hosts themselves (hostnet.py), without a launch: made, cut, healed, removed."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hostnet import NamespaceError, Network, ip, remove_left_by_dead_runs


def netns_names() -> set[str]:
    return {line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()}


def reaches(net: Network, src: str, dst: str) -> bool:
    """A TCP connect from host ``src`` to a port on host ``dst`` that nobody listens
    on: refused (RST) means the packet got there; a timeout means it did not."""
    code = (
        "import socket, sys\n"
        "s = socket.socket(); s.settimeout(1.0)\n"
        "try:\n"
        f"    s.connect(({net.host(dst).address!r}, 9))\n"
        "except ConnectionRefusedError: sys.exit(0)\n"
        "except OSError: sys.exit(1)\n"
    )
    done = subprocess.run(net.host(src).wrap([sys.executable, "-c", code]), timeout=30, check=False)
    return done.returncode == 0


def test_a_failing_ip_command_says_what_the_tier_needs() -> None:
    with pytest.raises(NamespaceError, match=r"failed .*they need root"):
        ip("link", "add", "nbh-x", "type", "no-such-kind")


def test_hosts_reach_each_other_until_one_is_cut_off_and_again_once_healed() -> None:
    net = Network(2)
    try:
        seen = [reaches(net, "h1", "h2")]
        net.cut(net.host("h2"))
        seen.append(reaches(net, "h1", "h2"))
        net.heal(net.host("h2"))
        seen.append(reaches(net, "h1", "h2"))
    finally:
        net.remove()
    assert seen == [True, False, True]


def test_each_host_has_its_own_hostname() -> None:
    net = Network(2)
    try:
        names = [
            subprocess.run(
                h.wrap(["hostname"]), capture_output=True, text=True, check=True
            ).stdout.strip()
            for h in net.hosts
        ]
    finally:
        net.remove()
    assert names == ["h1", "h2"]


def test_a_network_leaves_no_namespace_and_no_link_on_this_machine() -> None:
    links = ip("-o", "link").count("\n")
    net = Network(3)
    made = {net.bridge, *(h.netns for h in net.hosts)}
    during = netns_names() >= made, ip("-o", "link").count("\n")
    net.remove()
    assert (during, made & netns_names()) == ((True, links), set())


def test_namespaces_of_a_dead_pytest_process_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"nbh-{dead.pid}-abcdef-h1"
    ip("netns", "add", name)
    remove_left_by_dead_runs()
    assert name not in netns_names()
