"""The pool's processes as its launcher knows them: the plan, each agent and rank it
started (``Member``), each trial on its way (``Order``), and ``Members``: starting them,
their openings on the pool's socket, what they say and what they are told."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neps_bcast.compat import procfs
from neps_bcast.launcher import status
from neps_bcast.launcher.plan import SLURM_TASK_VARIABLES
from neps_bcast.launcher.processes import Supervisor
from neps_bcast.pool import beats, wire
from neps_bcast.pool.opening import Opening

ENV_POOL_DEVICES = "NEPS_BCAST_POOL_DEVICES"
"""GPU pools: the ``CUDA_VISIBLE_DEVICES`` entries of the pool, in device order."""


@dataclass(frozen=True)
class PoolPlan:
    size: int
    """D: devices and warm ranks."""
    devices: tuple[str, ...] | None
    """GPU entries (``CUDA_VISIBLE_DEVICES`` of every process); None on CPU."""
    script: Path
    script_args: tuple[str, ...]
    log_dir: Path
    trial_time_limit_s: float | None = None
    """``--trial-time-limit``: a trial still running this long after it was placed is
    stopped and goes back to pending (None: no limit)."""
    agents: int = 0
    """``--agents``: NePS workers (0: D). More than D sample trials ahead of free devices."""

    @property
    def agent_count(self) -> int:
        return self.agents or self.size


@dataclass
class Member:
    """One process of the pool: an agent or a rank, and its connection once it proved
    the pool's key."""

    role: str
    index: int
    proc: subprocess.Popen[bytes]
    log: Path
    process: procfs.Process | None = None
    """Who it is (read once it was started: a child not reaped, so its pid is still it);
    every signal to it goes through ``procfs.send``, which checks its start time."""
    conn: wire.Conn | None = None
    order: str | None = None
    """A rank: the order it is in (from the order until it is free again)."""
    retiring: bool = False
    """Told to exit (recycled, or the search is over)."""
    said_hello: bool = False
    """It connected and proved the pool's key (a rank: after it proved its device)."""
    reaped: bool = False
    """Its exit was handled."""

    def kill(self) -> None:
        """SIGKILL it while it is still the process this launcher started: by its identity
        (``procfs.send``), or, where ``/proc`` could not tell it, through ``Popen``, which
        signals only a child it has not reaped (whose pid cannot name another process)."""
        if self.process is not None:
            procfs.send(self.process, signal.SIGKILL)
        elif self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)


@dataclass
class Order:
    """One trial on its way: asked by an agent, placed, run, released."""

    key: str
    agent: int
    trial: str
    size: int
    port: int
    payload: str
    ranks: tuple[int, ...] = ()
    members: list[Member] = field(default_factory=list)
    """The rank processes it was placed on (a device's process may be replaced since)."""
    free: set[int] = field(default_factory=set)
    answered: bool = False
    clean: bool = True
    asked_at: float = 0.0
    directory: str | None = None
    """The trial's directory under the NePS root (the agent names it), where the
    placement is written for ``neps-bcast status``."""
    first_lost: str | None = None
    """The first of its ranks that exited, and how (what the agent is told)."""
    lost_at: float | None = None
    """When one of its ranks died (its other ranks then have a grace to leave it)."""
    succeeded: bool = False
    """Its rank 0 sent a result: only such a trial's duration feeds the drain's means."""
    placed_at: float | None = None
    """When its ranks were given (``--trial-time-limit`` counts from here)."""


def exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class Members:
    """The pool's agents and ranks, by index, and the openings of the connections that
    are still proving the pool's key (driven by the launcher's loop, never waited on)."""

    def __init__(
        self, plan: PoolPlan, supervisor: Supervisor, path: str, display: status.Display
    ) -> None:
        self.plan = plan
        self.supervisor = supervisor
        self.key = wire.new_key()
        self.path = path
        self.display = display
        self.agents: dict[int, Member] = {}
        self.ranks: dict[int, Member] = {}
        self.openings: list[Opening] = []
        self.beats: beats.Beats | None = None
        """The launcher's beats: each member is judged once it beats."""

    def all(self) -> list[Member]:
        return [*self.agents.values(), *self.ranks.values()]

    def running(self) -> list[int]:
        return [m.proc.pid for m in self.all() if m.proc.poll() is None]

    def of(self, role: str) -> dict[int, Member]:
        return self.agents if role == "agent" else self.ranks

    # -- starting ----------------------------------------------------------------
    def environment(self, role: str, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in SLURM_TASK_VARIABLES}
        env.update(
            {
                wire.ENV_POOL: self.path,
                wire.ENV_POOL_ROLE: role,
                wire.ENV_POOL_INDEX: str(index),
                wire.ENV_POOL_SIZE: str(self.plan.size),
                wire.ENV_POOL_KEY: self.key,
            }
        )
        if role == "agent":
            # An agent never trains: no device of a rank's may get a CUDA context of it.
            env["CUDA_VISIBLE_DEVICES"] = ""
        elif self.plan.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.plan.devices)
            env[ENV_POOL_DEVICES] = ",".join(self.plan.devices)
        return env

    def start(self, role: str, index: int) -> Member:
        log = self.plan.log_dir / f"{role}{index}.log"
        with log.open("ab") as out:
            out.write(
                f"===== neps-bcast launch --pool: {role} {index} at"
                f" {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode()
            )
            out.flush()
            proc = self.supervisor.spawn(
                [sys.executable, "-u", str(self.plan.script), *self.plan.script_args],
                self.environment(role, index),
                out,
            )
        member = Member(role, index, proc, log, procfs.Process.of(proc.pid))
        self.of(role)[index] = member
        if self.beats is not None:
            name = beats.name_of(role, index, proc.pid)
            self.beats.watch(name, f"{role} {index}", member.process)
        return member

    def by_beat(self, name: str) -> Member | None:
        """The member whose beat file ``name`` is."""
        return next(
            (m for m in self.all() if beats.name_of(m.role, m.index, m.proc.pid) == name), None
        )

    def unwatch(self, member: Member) -> None:
        if self.beats is not None:
            self.beats.unwatch(beats.name_of(member.role, member.index, member.proc.pid))

    # -- talking -------------------------------------------------------------------
    def tell(self, member: Member, record: dict[str, Any]) -> None:
        if member.conn is None:
            return
        try:
            member.conn.send(record)
        except wire.WireError:
            member.conn.close()
            member.conn = None

    def read(self, member: Member) -> list[dict[str, Any]]:
        """What the member has said (never waits); its connection closed when it is gone
        (its exit is handled by the launcher's loop, with its exit code)."""
        if member.conn is None:
            return []
        try:
            return member.conn.feed()
        except wire.WireError:
            member.conn.close()
            member.conn = None
            return []

    def hang_up(self, member: Member) -> None:
        if member.conn is not None:
            member.conn.close()
            member.conn = None

    # -- openings ----------------------------------------------------------------
    def accept(self, server: socket.socket) -> None:
        sock, _ = server.accept()
        conn = wire.Conn(sock)
        try:
            self.openings.append(Opening(conn, self.key, time.monotonic()))
        except (wire.WireError, OSError) as exc:
            self.display.say(f"refused a connection to the pool's socket: {exc}")
            conn.close()

    def open(self, opening: Opening) -> Member | None:
        """One step of a connection's opening (it was readable); the member whose
        connection it now is, once it proved the key and was admitted."""
        try:
            hello = opening.feed()
            if hello is None:
                return None
            opening.finish(hello, self.admit(hello))
        except (wire.WireError, OSError) as exc:
            self.display.say(f"refused a connection to the pool's socket: {exc}")
            self.openings.remove(opening)
            opening.conn.close()
            return None
        self.openings.remove(opening)
        member = self.of(hello["role"])[hello["index"]]
        member.conn = opening.conn
        member.said_hello = True
        return member

    def expire(self, now: float) -> None:
        for opening in [o for o in self.openings if now >= o.deadline]:
            self.display.say(
                f"refused a connection to the pool's socket: pid {opening.pid} did not prove"
                " the pool's key in time"
            )
            self.openings.remove(opening)
            opening.conn.close()

    def admit(self, hello: dict[str, Any]) -> str | None:
        """Why the process that proved the key is not taken (None: it is): it must be
        the one this launcher started for its role and index (by the kernel's pid),
        not yet connected."""
        role, index, pid = hello["role"], hello["index"], hello["pid"]
        member = self.of(role).get(index)
        if member is None:
            return f"this launcher started no {role} {index}"
        if member.proc.pid != pid:
            return f"{role} {index} is pid {member.proc.pid} here, not pid {pid}"
        if member.conn is not None:
            return f"{role} {index} (pid {pid}) is connected already"
        return None

    def close(self) -> None:
        for opening in self.openings:
            opening.conn.close()
        for member in self.all():
            self.hang_up(member)
