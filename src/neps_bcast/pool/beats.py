"""Beats between a pool's launcher and its processes: a frozen or hung one is found.

A pool runs on one node, and a process frozen there (SIGSTOP, a hang in the kernel, a
debugger) closes nothing: its sockets stay open, the wire stays quiet, and no parent-death
signal comes. The launcher would wait for a frozen agent forever (the search never ends),
and every agent and rank would wait for a frozen launcher forever.

So each process of the pool (the launcher, each agent, each rank) writes a growing
counter to a file of its own in the launcher's private folder (``folder_of``: made by the
launcher, mode 0700, so only this user's processes reach it; nothing read there is more
than a number) every tenth of ``NEPS_BCAST_PEER_TIMEOUT_S``, from a thread of its own,
and reads the counters it judges: the launcher its processes', each process the
launcher's. A counter that does not grow for the bound is silence. Only time during which
the judge itself ran counts (at most two beats per wake-up, as ``transport.liveness``):
a judge that was frozen or starved, then resumed, blames nobody.

What silence costs is what a crash costs, so that the kill cells of the fault table hold:
the launcher SIGKILLs a silent agent or rank (an agent is replaced and its trial goes
back to pending, a rank's trial is put back and a fresh rank takes its device), and a
process that finds the launcher silent SIGKILLs it, so that every process of the launch
gets its parent-death SIGTERM: the launch stops as after a launcher's crash, each trial
back to pending, and the same command again goes on.

Each watched process is named by who it is (``procfs.Process``: host, boot id, pid
namespace, pid, start time), read when it was started or connected; it is SIGKILLed only
while its start time still matches (``procfs.send``), never by its pid number alone.

What it does not find: a process frozen before its first beat (a member beats once it
has connected to the launcher), and a thread of a live process that hangs while its beat
thread runs (``--trial-time-limit`` bounds a trial that hangs so).

No torch, no NePS here: the launcher imports this module too.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from neps_bcast.compat import procfs

BEATS_PER_BOUND = 10
"""Beats in one bound: a silent process is one that missed ~10."""

LAUNCHER = "launcher"


def folder_of(socket_path: str) -> Path:
    """The beats' folder, beside the pool's socket in the launcher's private folder."""
    return Path(socket_path).parent / "beats"


def name_of(role: str, index: int, pid: int) -> str:
    """A member's beat file (its pid too: a fresh process for the same device or agent
    slot starts a counter of its own)."""
    return f"{role}{index}.{pid}"


LEAVING = "leaving"
"""What a process's file says once it exits (``Beats.leave``): no longer judged. Its exit
(atexit handlers, the interpreter's finalization, where a daemon thread beats no more)
may take longer than the bound on a loaded machine; the launcher sees the exit itself."""


def read(folder: Path, name: str) -> int | None:
    """A process's counter; None before its first beat (or a file that is not one)."""
    text = _read_text(folder, name)
    return int(text) if text is not None and text.isdigit() else None


def _read_text(folder: Path, name: str) -> str | None:
    try:
        return (folder / name).read_text()
    except OSError:
        return None


@dataclass
class Silent:
    """A process whose counter stopped growing for the bound."""

    name: str
    label: str
    pid: int | None
    silent_s: float
    bound_s: float
    process: procfs.Process | None = None
    """Who it is (None: not known, and then it is never signalled)."""

    def describe(self) -> str:
        pid = f"pid {self.pid}" if self.pid is not None else "pid unknown"
        return f"{self.label} ({pid}) silent for {self.silent_s:.0f} s"


@dataclass
class _Watch:
    label: str
    process: procfs.Process | None
    n: int = 0
    silent_s: float = 0.0


class Beats:
    """This process's beat and its judge of the processes it watches: one thread.

    ``on_silent`` is called from that thread, once for each process found silent (which
    is then no longer watched)."""

    def __init__(
        self, folder: Path, name: str, bound_s: float, on_silent: Callable[[Silent], None]
    ) -> None:
        self.folder = folder
        self.name = name
        self.bound_s = bound_s
        self.beat_s = bound_s / BEATS_PER_BOUND
        self._on_silent = on_silent
        self._watched: dict[str, _Watch] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._n = 0
        self._beat()  # the first at once: a judge that starts next sees this process live
        self._thread = threading.Thread(target=self._run, name="neps_bcast-pool-beat", daemon=True)
        self._thread.start()

    def watch(self, name: str, label: str, process: procfs.Process | None) -> None:
        """Judge ``name``'s counter from its first beat on (``process``: who beats there)."""
        with self._lock:
            self._watched.setdefault(name, _Watch(label, process))

    def unwatch(self, name: str) -> None:
        with self._lock:
            self._watched.pop(name, None)

    def stop(self) -> None:
        self._stopped.set()

    def leave(self) -> None:
        """This process exits: its file says so, and it is judged no more."""
        self._stopped.set()
        self._write(LEAVING)

    def _beat(self) -> None:
        self._n += 1
        self._write(str(self._n))

    def _write(self, text: str) -> None:
        path = self.folder / self.name
        temporary = self.folder / f".{self.name}.{threading.get_ident()}.tmp"
        with contextlib.suppress(OSError):  # the folder is gone: the launch is over
            temporary.write_text(text)
            temporary.replace(path)

    def _run(self) -> None:
        last_wake = time.monotonic()
        while not self._stopped.wait(self.beat_s):
            self._beat()
            now = time.monotonic()
            # Only the time this process ran counts: a wake-up late by more than two
            # beats was a freeze or starvation of ours, not the watched one's silence.
            gap, last_wake = min(now - last_wake, 2 * self.beat_s), now
            for silent in self._judge(gap):
                self._on_silent(silent)

    def _judge(self, gap: float) -> list[Silent]:
        found = []
        with self._lock:
            for name, watch in list(self._watched.items()):
                text = _read_text(self.folder, name)
                if text == LEAVING:
                    del self._watched[name]  # exiting: its exit is seen by the launcher
                    continue
                n = int(text) if text is not None and text.isdigit() else None
                if n is None and watch.n == 0:
                    continue  # not beating yet
                if n is not None and n > watch.n:
                    watch.n, watch.silent_s = n, 0.0
                    continue
                watch.silent_s += gap
                if watch.silent_s > self.bound_s:
                    del self._watched[name]
                    pid = watch.process.pid if watch.process is not None else None
                    found.append(
                        Silent(name, watch.label, pid, watch.silent_s, self.bound_s, watch.process)
                    )
        return found


def of_member(
    socket_path: str,
    role: str,
    index: int,
    launcher_pid: int,
    bound_s: float,
    on_silent: Callable[[Silent], None],
) -> Beats:
    """An agent's or a rank's beats, judging its launcher (``launcher_pid``: the
    kernel's word for the process serving the pool's socket, ``SO_PEERCRED``, 0 where that
    process is in no pid namespace this one sees; its start time read now)."""
    member = Beats(folder_of(socket_path), name_of(role, index, os.getpid()), bound_s, on_silent)
    launcher = procfs.Process.of(launcher_pid) if launcher_pid > 0 else None
    member.watch(LAUNCHER, "the pool's launcher", launcher)
    atexit.register(member.leave)  # registered last: runs before the imports' handlers
    return member


def end_silent_launcher(tag: str) -> Callable[[Silent], None]:
    """A member's verdict on a silent launcher: SIGKILL it (its parent, on this node: a
    frozen process is ours to end), so that every process of the launch gets its
    parent-death SIGTERM and stops as after a launcher's crash (each trial back to
    pending). A launcher that is no longer this process's parent is gone already (its
    parent-death SIGTERM came or comes): nothing is killed then; nor is a launcher whose
    start time no longer matches (``procfs.send``), so no other process that took its
    pid is."""
    from neps_bcast.log import exit_now, logger

    def verdict(silent: Silent) -> None:
        launcher = silent.process
        if launcher is None or os.getppid() != launcher.pid:
            return
        logger.error(
            "%s lost the pool's launcher: %s: frozen or hung; SIGKILL to it, so that every"
            " process of the launch stops and each trial goes back to pending. Run the same"
            " command again to go on. If the launcher only stalls, raise"
            " NEPS_BCAST_PEER_TIMEOUT_S (now %g s).",
            tag,
            silent.describe(),
            silent.bound_s,
        )
        try:
            procfs.send(launcher, signal.SIGKILL)  # False: gone, its parent-death SIGTERM comes
        except OSError as exc:
            logger.error("%s could not end the launcher (%s): leaving.", tag, exc)
            exit_now(1)

    return verdict
