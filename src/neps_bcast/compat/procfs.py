"""Reading processes from ``/proc`` (Linux): the one place that parses it, and the one
place that signals a process it names.

Why one module: the library asks whether a peer process is still alive, the tests find
every process of a launch and check that none is left, the benchmarks measure CPU time
of followers. All three read the same files the same way, so they share this code
(tests and benchmarks import it from here). Nothing here imports torch.

A pid number names a process only inside one pid namespace of one boot of one machine,
and only until the process exits: containers that share a host's network (and hostname)
each number their own processes from 1, and a pid is handed out again once its process
is reaped. ``Process`` is what names one process everywhere (host, boot id, pid
namespace, pid, start time: what a lease's owner holds too), and ``send`` signals it
only while it is still that process (through a pidfd, where the kernel has one).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class ProcStat:
    """The fields of ``/proc/<pid>/stat`` we use (``man 5 proc``)."""

    pid: int
    state: str
    ppid: int
    session: int
    cpu_seconds: float
    """utime + stime of every thread, in seconds."""

    @property
    def is_zombie(self) -> bool:
        return self.state in ("Z", "X")


def read_stat(pid: int) -> ProcStat | None:
    """The process's stat, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0]=state, [1]=ppid, [3]=session, [11]=utime, [12]=stime
    return ProcStat(
        pid=pid,
        state=fields[0],
        ppid=int(fields[1]),
        session=int(fields[3]),
        cpu_seconds=(int(fields[11]) + int(fields[12])) / CLK_TCK,
    )


def start_ticks(pid: int | str) -> int | None:
    """When the process started, in clock ticks since boot (``starttime``, field 22 of
    ``/proc/<pid>/stat``); None if it is gone. A pid reused by a new process has a new
    start time: (pid, start time) names one process for as long as the machine is up.
    ``"self"``: this process, whatever pid namespace ``/proc`` was mounted for."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[19])


@functools.cache
def boot_id() -> str:
    """This machine's boot (``/proc/sys/kernel/random/boot_id``), "" where it cannot be
    read: pids and start times name processes of one boot only."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[<inode>]``), "" where it cannot be read: a
    pid means one process only within it."""
    try:
        return str(Path("/proc/self/ns/pid").readlink())
    except OSError:
        return ""


def proc_is_ours() -> bool:
    """Whether ``/proc`` shows this process's own pid namespace (a pid namespace made
    without ``--mount-proc`` keeps its parent's ``/proc``: a pid looked up there names
    another process)."""
    try:
        return Path("/proc/self").readlink().name == str(os.getpid())
    except OSError:
        return False


@dataclass(frozen=True)
class Process:
    """One process, named so that no other can be taken for it: its host, the machine's
    boot, its pid namespace, its pid there and when it started (clock ticks since boot).

    The same fields, under the same names, as a lease's owner
    (``launcher/lease_record.Owner``) and a peer's record (``transport/peers.Peer``)."""

    host: str
    boot_id: str
    pid_namespace: str
    pid: int
    start_ticks: int

    @classmethod
    def me(cls) -> Process:
        return cls(
            host=socket.gethostname(),
            boot_id=boot_id(),
            pid_namespace=pid_namespace(),
            pid=os.getpid(),
            start_ticks=start_ticks("self") or 0,
        )

    @classmethod
    def of(cls, pid: int) -> Process | None:
        """The process that has ``pid`` in this pid namespace now (None: no such process,
        or this ``/proc`` is not this namespace's). For a process this one started and
        has not reaped (its pid cannot be reused), that is the process it started."""
        ticks = start_ticks(pid) if proc_is_ours() else None
        if ticks is None:
            return None
        return cls(socket.gethostname(), boot_id(), pid_namespace(), pid, ticks)

    def shares_machine_with(self, other: Process) -> bool:
        """True when ``other``'s pid means the same process to both (same host, boot and
        pid namespace)."""
        return bool(self.boot_id) and (self.host, self.boot_id, self.pid_namespace) == (
            other.host,
            other.boot_id,
            other.pid_namespace,
        )

    @property
    def is_here(self) -> bool:
        """Its pid can be looked up and signalled from this process: same host, boot and
        pid namespace (a container that shares this host's name and network is not
        here), and a ``/proc`` that shows this namespace."""
        return Process.me().shares_machine_with(self) and proc_is_ours()

    def is_running(self) -> bool:
        """Here, alive, and still this process (its pid not taken by another since)."""
        return self.is_here and _is_still(self.pid, self.start_ticks)

    def where(self) -> str:
        """How this process relates to the one asking, for a log line ("" when here)."""
        me = Process.me()
        if me.shares_machine_with(self):
            return ""
        if self.host == me.host and self.boot_id == me.boot_id and self.boot_id:
            return "in another pid namespace of this host (a container): its pid is not ours"
        if self.host == me.host:
            return "on another machine of the same hostname (another boot id)"
        return ""

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"

    def to_json(self) -> dict[str, object]:
        return {
            "host": self.host,
            "boot_id": self.boot_id,
            "pid_namespace": self.pid_namespace,
            "pid": self.pid,
            "start_ticks": self.start_ticks,
        }

    @classmethod
    def from_json(cls, raw: object) -> Process | None:
        """A record's process; None for anything that is not one."""
        if not isinstance(raw, dict):
            return None
        host, boot, namespace = raw.get("host"), raw.get("boot_id"), raw.get("pid_namespace")
        pid, ticks = raw.get("pid"), raw.get("start_ticks")
        if not (isinstance(host, str) and isinstance(boot, str) and isinstance(namespace, str)):
            return None
        if type(pid) is not int or type(ticks) is not int:
            return None
        return cls(host, boot, namespace, pid, ticks)


def _is_still(pid: int, ticks: int) -> bool:
    stat = read_stat(pid)
    return stat is not None and not stat.is_zombie and start_ticks(pid) == ticks


def send(process: Process, sig: int) -> bool:
    """Send ``sig`` to ``process`` if it runs here and is still that process, checked
    right before the signal; True when it was sent.

    Through a pidfd where the kernel has one (Linux >= 5.3): the pidfd is opened first and
    the start time read after, so the check and the signal name the same process (had the
    pid been reused before the pidfd was opened, the start time read after it would be
    another's). Without one, the check is made just before ``kill``: a window of
    microseconds in which the pid would have to be reaped and handed out again. Raises
    ``PermissionError`` for a process this one may not signal."""
    if not process.is_here:
        return False
    pidfd: int | None = None
    if hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal"):
        try:
            pidfd = os.pidfd_open(process.pid)
        except ProcessLookupError:
            return False
        except OSError:
            pidfd = None  # ENOSYS (an older kernel) or a seccomp filter: check, then kill
    try:
        if not _is_still(process.pid, process.start_ticks):
            return False
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, sig)
        else:
            os.kill(process.pid, sig)
    except ProcessLookupError:
        return False
    finally:
        if pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(pidfd)
    return True


def is_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    stat = read_stat(pid)
    return stat is not None and not stat.is_zombie


def owner(pid: int) -> int | None:
    """The uid that owns the process, or None if it is gone."""
    try:
        return Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        return None


def all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]  # noqa: PTH208


def environ(pid: int) -> dict[str, str]:
    """The environment the process started with (empty if unreadable or gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    found = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep:
            found[key] = value
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes whose environment has ``name=value``.

    How tests and benchmarks find every process of one launch: a marker every process
    inherits, unlike the session or process group, which torch's launcher changes for
    its workers (``start_new_session=True``).
    """
    me = os.getpid()
    return [
        pid for pid in all_pids() if pid != me and is_alive(pid) and environ(pid).get(name) == value
    ]


def kill(pid: int, sig: int = signal.SIGKILL) -> bool:
    """Send ``sig`` by pid alone; False if the process was already gone. Only for a
    process whose pid cannot have been handed out again (a child not yet reaped) or one
    found a moment ago (the tests); any other goes through ``send``."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True
