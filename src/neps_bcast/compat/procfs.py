"""Reading processes from ``/proc`` (Linux): the one place that parses it.

Why one module: the library asks whether a peer process is still alive, the tests find
every process of a launch and check that none is left, the benchmarks measure CPU time
of followers. All three read the same files the same way, so they share this code
(tests and benchmarks import it from here). Nothing here imports torch.
"""

from __future__ import annotations

import os
import signal
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


def start_ticks(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (``starttime``, field 22 of
    ``/proc/<pid>/stat``); None if it is gone. A pid reused by a new process has a new
    start time: (pid, start time) names one process for as long as the machine is up."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(raw[raw.rindex(")") + 2 :].split()[19])


def pid_namespace() -> str:
    """This process's pid namespace (``pid:[<inode>]``), "" where it cannot be read: a
    pid means one process only within it."""
    try:
        return str(Path("/proc/self/ns/pid").readlink())
    except OSError:
        return ""


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
    """Send ``sig``; False if the process was already gone."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True
