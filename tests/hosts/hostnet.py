"""Hosts on one machine: network namespaces on a bridge, each with its own name and address.

Why: a lost node, a cut cable or a failed switch port sends nothing more, no FIN, no RST,
so its peers see only silence (DESIGN.md, "Nodes fail silently"); a killed process does
not show that, its kernel closes its sockets. Here each host is a network namespace of
its own (``ip netns add``) whose processes also get a hostname of their own (a UTS
namespace: ``unshare --uts`` and ``hostname``), with one veth link into a bridge that
lives in a namespace of its own too, so nothing touches the machine's real network.
Addresses are in 198.18.0.0/15 (RFC 2544's benchmarking range) and exist only inside
these namespaces: nothing is routed anywhere else.

``Network.cut(host)`` takes the host's port on the bridge down: a cable pulled at the
switch. The host keeps its address and routes and its packets go nowhere (its own link
shows NO-CARRIER); a peer sees silence. ``heal`` brings the port up and TCP carries on
where it stopped. (Taking ``eth0`` down inside the host instead would remove its routes,
and its processes would get "network unreachable" at once: not silence.)

Every process shares this machine's filesystem: a folder under the test's ``tmp_path``
is the shared filesystem. torch's c10d cannot resolve the made-up hostnames: every
launcher flag and variable carries an address (``--local-addr``, ``--rdzv-endpoint``,
``NEPS_BCAST_LEADER_ADDR``, ``GLOO_SOCKET_IFNAME``).

Names carry the pytest process's pid and a random part, so concurrent or repeated runs
never share one; ``remove`` deletes every namespace (their veths go with them), and a
new ``Network`` first removes what a dead pytest process left. A machine where
namespaces cannot be made fails the test with the reason, never skips it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import launches
from exits import ExitWatch
from harness import MARKER, Running, base_env, default_sigint, kind_of, root_of
from neps_bcast.compat import procfs

PREFIX = "nbh"
"""Every namespace this module makes: ``nbh-<pytest pid>-<random>-<host>``."""
IFACE = "eth0"
"""A host's one interface, inside its namespace (the same name in every host)."""
SUBNET = "198.18.0.{}"
"""Host i (1-based) has 198.18.0.i/24; single digits keep torch's rank order (it sorts
the nodes' addresses as text) the order of the hosts."""
IP_TIMEOUT_S = 30.0
"""A bound on one ``ip`` command (they take milliseconds)."""

_HOLD_PORT = """
import sys
sys.path.insert(0, sys.argv[1])
from ports import bind_anywhere
sock = bind_anywhere(0, reuseaddr=True)
print(sock.getsockname()[1], flush=True)
sys.stdin.read()
"""
"""Held inside a host's namespace: a port the kernel picked there, bound (SO_REUSEADDR,
not listening) until the test ends, as tests/ports.py's ``HeldPort`` does on this host."""


class NamespaceError(AssertionError):
    """The machine cannot make the hosts (not root, no iproute2, no veth or bridge)."""


def ip(*args: str) -> str:
    """Run ``ip ARGS``; its output, or ``NamespaceError`` with its stderr."""
    try:
        done = subprocess.run(
            ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False
        )
    except FileNotFoundError as exc:
        raise NamespaceError(
            "the multi-host tests make hosts with iproute2's `ip`, which is not installed"
            " (make test-hosts installs it with apt-get)"
        ) from exc
    if done.returncode != 0:
        raise NamespaceError(
            f"`ip {' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}."
            " The multi-host tests make network namespaces, veth links and a bridge:"
            " they need root (CAP_SYS_ADMIN and CAP_NET_ADMIN), as `make test-hosts` in CI has."
        )
    return done.stdout


@dataclass(frozen=True)
class Host:
    name: str
    """Its hostname: h1, h2, ..."""
    netns: str
    address: str
    port: str
    """Its link's end on the bridge, in the bridge's namespace."""

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run on this host: in its network namespace, with its own hostname."""
        return [
            "ip", "netns", "exec", self.netns,
            "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.name,
            *cmd,
        ]  # fmt: skip


@dataclass
class Network:
    """``count`` hosts on one bridge; ``remove()`` takes every part away again."""

    count: int
    tag: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    hosts: list[Host] = field(default_factory=list)
    bridge: str = ""
    _made: list[str] = field(default_factory=list)
    _holders: list[subprocess.Popen[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        remove_left_by_dead_runs()
        self.bridge = f"{self.tag}-br"
        try:
            self._make()
        except BaseException:
            self.remove()
            raise

    def _make(self) -> None:
        self._add_netns(self.bridge)
        ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", self.bridge, "link", "set", "br0", "up")
        for i in range(1, self.count + 1):
            host = Host(f"h{i}", f"{self.tag}-h{i}", SUBNET.format(i), f"h{i}")
            self._add_netns(host.netns)
            # Both ends are made inside their namespaces: none ever exists on this machine's.
            ip("link", "add", host.port, "netns", self.bridge, "type", "veth",
               "peer", "name", IFACE, "netns", host.netns)  # fmt: skip
            ip("-n", self.bridge, "link", "set", host.port, "master", "br0", "up")
            ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", IFACE)
            ip("-n", host.netns, "link", "set", IFACE, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            self.hosts.append(host)

    def _add_netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def cut(self, host: Host) -> float:
        """Pull ``host``'s cable at the switch; the time (``time.time()``) it was cut."""
        ip("-n", self.bridge, "link", "set", host.port, "down")
        return time.time()

    def heal(self, host: Host) -> float:
        ip("-n", self.bridge, "link", "set", host.port, "up")
        return time.time()

    def held_port(self, host: Host) -> int:
        """A free port on ``host``, held there (bound, not listening) until ``remove``."""
        tests = str(Path(__file__).resolve().parent.parent)
        holder = subprocess.Popen(
            host.wrap([sys.executable, "-c", _HOLD_PORT, tests]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._holders.append(holder)
        assert holder.stdout is not None
        line = holder.stdout.readline()  # the holder prints its port, then waits on stdin
        if not line.strip().isdigit():
            raise NamespaceError(f"no port could be held on {host.name}: {line!r}")
        return int(line)

    def remove(self) -> None:
        """Every holder ended, every namespace deleted (the veths and bridge go with them)."""
        for holder in self._holders:
            holder.kill()
            holder.wait()
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._made.clear()


def remove_left_by_dead_runs() -> None:
    """Namespaces of this module whose pytest process is gone (killed before its
    finalizers ran): deleted, so that no run leaves them behind for good."""
    try:
        listed = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=False
        ).stdout
    except FileNotFoundError:
        return  # reported by the first `ip` the network runs
    for line in listed.splitlines():
        found = re.match(rf"({PREFIX}-(\d+)-[0-9a-f]+-\w+)", line)
        if found and not procfs.is_alive(int(found.group(2))):
            subprocess.run(["ip", "netns", "del", found.group(1)], capture_output=True, check=False)


def kill_marked(name: str, value: str) -> list[str]:
    """SIGKILL every process whose environment has ``name=value``; what was killed
    ("pid cmdline"), and a bounded wait for them to be gone."""
    killed = []
    for pid in procfs.pids_with_env(name, value):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            cmdline = "?"
        if procfs.kill(pid, signal.SIGKILL):
            killed.append(f"{pid} {cmdline.strip()}")
    deadline = time.monotonic() + 30.0
    while procfs.pids_with_env(name, value) and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded wait for the kernel to reap what was killed
    return killed


def hide_folder(pid: int, folder: Path) -> None:
    """``folder`` gone from the host of ``pid``: an empty tmpfs mounted over it in that
    process's mount namespace, which only its launch shares (``ip netns exec`` makes
    one for each command it runs, a slave of this machine's: nothing propagates back).
    Its processes then find none of the folder's files, as on a mount cut off from its
    server; whatever they hold open stays theirs."""
    _nsenter(pid, "mount", "-t", "tmpfs", "-o", "size=1m", "nbh-cut", str(folder))


def show_folder(pid: int, folder: Path) -> None:
    """``hide_folder`` undone: the host sees the shared folder again."""
    _nsenter(pid, "umount", str(folder))


def _nsenter(pid: int, *cmd: str) -> None:
    done = subprocess.run(
        ["nsenter", "--target", str(pid), "--mount", *cmd],
        capture_output=True,
        text=True,
        timeout=IP_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        raise NamespaceError(f"`{' '.join(cmd)}` in pid {pid}'s mount namespace: {done.stderr}")


def signal_marked(name: str, value: str, sig: signal.Signals) -> list[int]:
    """Send ``sig`` to every process whose environment has ``name=value`` (SIGSTOP: a
    whole host frozen; SIGCONT: it resumes); the pids it was sent to."""
    return [pid for pid in procfs.pids_with_env(name, value) if procfs.kill(pid, sig)]


class OnHost(Running):
    """One launch on one host: ``cmd`` runs inside the host's namespaces, its records and
    logs go to ``folder`` (on the shared filesystem) like any launch's. It is counted as
    the launcher it runs (torchrun), not as ``ip``, which is only how it gets there."""

    def __init__(
        self,
        host: Host,
        name: str,
        cmd: list[str],
        *,
        env: dict[str, str],
        cwd: Path,
        folder: Path,
        timeout: float,
        under: Sequence[str] = (),
        clock_shift_s: float = 0.0,
    ) -> None:
        self.host = host
        self.clock_shift_s = clock_shift_s
        self.name = name
        self.marker = env[MARKER]
        self.folder = folder
        self.root = root_of(cmd, cwd)
        self.cmd = cmd
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.started = time.monotonic()
        self._log = (folder / "launcher.log").open("wb")
        launches.count(kind_of(cmd))
        self.watch = ExitWatch.get()  # listening before the first process of the launch
        self.proc = subprocess.Popen(
            host.wrap([*under, *cmd]),
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=default_sigint,  # noqa: PLW1509 - launches start from one thread
        )

    def events(self) -> list[dict[str, Any]]:
        """The launch's records, their times on this machine's clock: a host whose wall
        clock is shifted (``clock_shift_s``) stamps them shifted, and the exit watch's
        times, to which the harness compares them, are this machine's."""
        events = super().events()
        for e in events:
            e["t"] -= self.clock_shift_s
        return events


def start_on(
    host: Host,
    cmd: list[str],
    tmp: Path,
    *,
    name: str,
    env: dict[str, str],
    timeout: float,
    fault: str = "",
    under: Sequence[str] = (),
    clock_shift_s: float = 0.0,
) -> OnHost:
    """Start ``cmd`` on ``host`` as ``harness.start`` starts a launch: its own marker,
    records and logs under ``tmp/name``, the cwd ``tmp/<host>`` (the node's own folder).
    ``under``: a command that runs ``cmd`` on the host (``faketime -f +600s``: the host's
    wall clock shifted by ``clock_shift_s``: its records' times are shifted back); the
    launch is still counted as ``cmd``'s launcher."""
    folder = tmp / name
    folder.mkdir(parents=True)
    cwd = tmp / host.name
    cwd.mkdir(exist_ok=True)
    full_env = base_env(
        **env,
        NB_FAULT=fault,
        NB_RECORD_DIR=str(folder / "rec"),
        NB_LOG_DIR=str(folder / "logs"),
    )
    full_env[MARKER] = uuid.uuid4().hex
    return OnHost(
        host,
        name,
        cmd,
        env=full_env,
        cwd=cwd,
        folder=folder,
        timeout=timeout,
        under=under,
        clock_shift_s=clock_shift_s,
    )
