"""``neps-bcast launch --pool D``: right-sized trials packed onto one node's D devices.

The launcher starts D warm *ranks*, one per device for life (rank i uses device i), and
D *agents*, each one NePS worker without a device: it samples a trial, asks for as many
ranks as ``ranks_per_trial`` says, and hands the trial to whichever ranks it is given.
Between the two sits this module: a placement (``placement.Placement``: FIFO with
backfilling and a drain) and a relay on a Unix socket (``wire``). For each trial the
chosen ranks form a DDP group of their own, as if torchrun had just started them (its
variables, a store the agent serves on a port the OS picked), run the user's function,
and go back to waiting; the trial's rank 0 returns the outcome to the agent.

Why warm ranks and agents (docs/architecture.md, "Right-sized trials"): a fresh rank
costs ~7 s of CPU (imports) per trial, a warm one a few ms to join a new group; and a
NePS worker that is not itself a rank can start its trial on any free ranks.

What the launcher does besides: a rank whose trial did not end cleanly (a failure, a
lost peer, an interrupt) is told to exit and a fresh one is started for its device; a
rank that dies is replaced the same way (its trial's agent is told); when every agent
has finished, the ranks are told to exit. SIGTERM/Ctrl-C go to every process, and
whatever is left after ``--stop-timeout`` is SIGKILLed (found by the launch id).
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from neps_bcast.compat import procfs
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.launcher import status, trial_placement
from neps_bcast.launcher.groups import Settings, Signals, _clean_up, _die_with_parent
from neps_bcast.launcher.plan import ENV_LAUNCH_ID, SLURM_TASK_VARIABLES, TAG
from neps_bcast.pool import wire
from neps_bcast.pool.placement import Placement

ENV_POOL_DEVICES = "NEPS_BCAST_POOL_DEVICES"
"""GPU pools: the ``CUDA_VISIBLE_DEVICES`` entries of the pool, in device order."""

LOST_PEER_GRACE_S = 10.0
"""How long the ranks of a trial that lost one of its ranks have to leave it before the
launcher SIGKILLs them. A peer lost in a collective is seen in milliseconds (gloo), and
rank 0 then reports the trial with its reason; one lost before it joined the trial's
group is not: the others wait in the rendezvous for ``NEPS_BCAST_JOIN_TIMEOUT_S``
(300 s), holding their devices (found by the pool's fault sweep: SIGKILL to a rank at
its order). A trial that lost its agent has no grace: its ranks are SIGKILLed at once
(``Pool._stop_ranks_of``)."""

DEVICE_START_FAILURES = 3
"""A device whose rank exits before it says hello (it proves its device first:
``pool.rank.prove_device``) this many times in a row is retired: no rank is started
for it again, trials that no longer fit the devices left are refused, and when no
device is left the launch ends. Without it a broken device's rank was restarted for
ever and the launch never ended."""

AGENT_RESTARTS = 3
"""Fresh agents started for one agent index that was killed by a signal (SIGKILL, the
OOM killer) while the search went on; past this, a lost agent is not replaced. An agent
that failed (exited with a code: the rule refused up front, a script error, NePS's
``WorkerRaiseError``) is not replaced: its cause would recur in every fresh one. It
decides the launch's exit status (its code), and its trial, if it left one evaluating,
is put back by the other agents' look for orphans before their next trial."""


@dataclass(frozen=True)
class PoolPlan:
    size: int
    """D: devices, warm ranks and agents."""
    devices: tuple[str, ...] | None
    """GPU entries (``CUDA_VISIBLE_DEVICES`` of every process); None on CPU."""
    script: Path
    script_args: tuple[str, ...]
    log_dir: Path
    trial_time_limit_s: float | None = None
    """``--trial-time-limit``: a trial still running this long after it was placed is
    stopped and goes back to pending (None: no limit)."""


@dataclass
class Member:
    """One process of the pool: an agent or a rank, and its connection once it proved
    the pool's key."""

    role: str
    index: int
    proc: subprocess.Popen[bytes]
    log: Path
    conn: wire.Conn | None = None
    order: str | None = None
    """A rank: the order it is in (from the order until it is free again)."""
    retiring: bool = False
    """Told to exit (recycled, or the search is over)."""
    said_hello: bool = False
    """It connected and proved the pool's key (a rank: after it proved its device)."""
    reaped: bool = False
    """Its exit was handled."""


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
    """When one of its ranks died (its other ranks then have ``LOST_PEER_GRACE_S``)."""
    succeeded: bool = False
    """Its rank 0 sent a result: only such a trial's duration feeds the drain's means."""
    placed_at: float | None = None
    """When its ranks were given (``--trial-time-limit`` counts from here)."""


class Overwrite:
    """``overwrite_root_directory=True`` in a pool: the root is wiped once per launch.

    Every agent runs ``neps.run`` on the same root, and a replacement agent starts it
    again: each wiping the root would lose the trials the others evaluated (seen: a
    trial evaluated twice with two configs). An agent asked to overwrite asks here
    first; the first asker is told yes and the others wait until it says the root is
    ready (NePS handed it its first trial, or its search ended), then are told no. If it
    is lost before that, the next one waiting is told yes."""

    def __init__(self) -> None:
        self.waiting: list[Member] = []
        self.holder: Member | None = None
        self.done = False

    def ask(self, agent: Member) -> list[tuple[Member, bool]]:
        self.waiting.append(agent)
        return self._answers()

    def ready(self) -> list[tuple[Member, bool]]:
        self.done = True
        return self._answers()

    def gone(self, agent: Member) -> list[tuple[Member, bool]]:
        if agent in self.waiting:
            self.waiting.remove(agent)
        if agent is self.holder:
            self.holder = None
        return self._answers()

    def _answers(self) -> list[tuple[Member, bool]]:
        if self.done:
            told, self.waiting = self.waiting, []
            return [(agent, False) for agent in told]
        if self.holder is None and self.waiting:
            self.holder = self.waiting.pop(0)
            return [(self.holder, True)]
        return []


class Pool:
    """One pool launch: its processes, its placement and its relay."""

    def __init__(self, plan: PoolPlan, settings: Settings, out: IO[str]) -> None:
        self.plan = plan
        self.settings = settings
        self.display = status.Display(out, settings.status_interval_s)
        self.launch_id = uuid.uuid4().hex
        self.key = wire.new_key()
        self.signals = Signals()
        self.placement = Placement(plan.size)
        for device in range(plan.size):
            self.placement.set_available(device, False)  # until its rank says hello
        self.agents: dict[int, Member] = {}
        self.ranks: dict[int, Member] = {}
        self.orders: dict[str, Order] = {}
        self.stop_deadline: float | None = None
        self.killed = False
        self.done = 0
        self.failed_agents: list[tuple[int, int]] = []
        self.agent_restarts: dict[int, int] = {}
        self.start_failures: dict[int, list[int]] = {}
        """A device's rank exits before its hello, in a row (exit codes)."""
        self.retired: dict[int, str] = {}
        """Retired devices, each with why."""
        self.ended: str | None = None
        """Why the launcher ended the launch itself (no device left)."""
        self.overwrite = Overwrite()
        self.openings: list[wire.Opening] = []
        """Connections still proving the key: driven by the loop, never waited on."""
        self.folder = Path(tempfile.mkdtemp(prefix="neps_bcast-pool-"))  # mode 0700
        self.path = str(self.folder / "pool.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    # -- processes -------------------------------------------------------------
    def _environment(self, role: str, index: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in SLURM_TASK_VARIABLES}
        env.update(
            {
                ENV_LAUNCH_ID: self.launch_id,
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

    def _start(self, role: str, index: int) -> Member:
        log = self.plan.log_dir / f"{role}{index}.log"
        with log.open("ab") as out:
            out.write(
                f"===== neps-bcast launch --pool: {role} {index} at"
                f" {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode()
            )
            out.flush()
            proc = subprocess.Popen(
                [sys.executable, "-u", str(self.plan.script), *self.plan.script_args],
                env=self._environment(role, index),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - the launcher has no threads
            )
        member = Member(role, index, proc, log)
        (self.agents if role == "agent" else self.ranks)[index] = member
        return member

    # -- the loop ----------------------------------------------------------------
    def run(self) -> int:
        self.plan.log_dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.plan.log_dir.glob("agent*.log"), *self.plan.log_dir.glob("rank*.log")]:
            old.unlink()
        self.server.bind(self.path)
        self.server.listen(4 * self.plan.size + 8)
        where = f"devices {','.join(self.plan.devices)}" if self.plan.devices is not None else "CPU"
        self.display.say(
            f"pool of {self.plan.size} ranks on {where} and {self.plan.size} agents;"
            f" logs {self.plan.log_dir}/"
        )
        try:
            with self.signals.installed():
                for index in range(self.plan.size):
                    self._start("rank", index)
                    self._start("agent", index)
                while self._step(time.monotonic()):
                    self._wait(0.5)
                left = _clean_up(self.launch_id, self.settings)
                if left:
                    self.display.say(f"SIGKILLed {len(left)} process(es) left running: {left}.")
        finally:
            for opening in self.openings:
                opening.conn.close()
            self.server.close()
            shutil.rmtree(self.folder, ignore_errors=True)
        return self._exit_status()

    def _wait(self, seconds: float) -> None:
        conns = [m.conn for m in self._members() if m.conn is not None]
        readable: list[Any] = [self.server, self.signals, *conns, *self.openings]
        if any(c.pending() for c in conns):
            seconds = 0.0
        try:
            ready, _, _ = select.select(readable, [], [], seconds)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            return
        for item in ready:
            if item is self.server:
                self._accept()
            elif item is self.signals:
                self.signals.drain()
            elif isinstance(item, wire.Opening):
                self._open(item)
        for member in self._members():
            if member.conn is not None and (member.conn in ready or member.conn.pending()):
                self._read(member)

    def _members(self) -> list[Member]:
        return [*self.agents.values(), *self.ranks.values()]

    def _accept(self) -> None:
        sock, _ = self.server.accept()
        conn = wire.Conn(sock)
        try:
            self.openings.append(wire.Opening(conn, self.key, time.monotonic()))
        except (wire.WireError, OSError) as exc:
            self.display.say(f"refused a connection to the pool's socket: {exc}")
            conn.close()

    def _open(self, opening: wire.Opening) -> None:
        """One step of a connection's opening (it was readable): once it proved the key
        and is admitted, it is the member's connection."""
        try:
            hello = opening.feed()
            if hello is None:
                return
            opening.finish(hello, self._admit(hello))
        except (wire.WireError, OSError) as exc:
            self.display.say(f"refused a connection to the pool's socket: {exc}")
            self.openings.remove(opening)
            opening.conn.close()
            return
        self.openings.remove(opening)
        role, index = hello["role"], hello["index"]
        member = (self.agents if role == "agent" else self.ranks)[index]
        member.conn = opening.conn
        member.said_hello = True
        if role == "rank":
            self.start_failures.pop(index, None)
        if role == "rank" and self.stop_deadline is None:
            self.placement.set_available(index, True)

    def _expire_openings(self, now: float) -> None:
        for opening in [o for o in self.openings if now >= o.deadline]:
            self.display.say(
                f"refused a connection to the pool's socket: pid {opening.pid} did not prove"
                " the pool's key in time"
            )
            self.openings.remove(opening)
            opening.conn.close()

    def _admit(self, hello: dict[str, Any]) -> str | None:
        """Why the process that proved the key is not taken (None: it is): it must be
        the one this launcher started for its role and index (by the kernel's pid),
        not yet connected."""
        role, index, pid = hello["role"], hello["index"], hello["pid"]
        member = (self.agents if role == "agent" else self.ranks).get(index)
        if member is None:
            return f"this launcher started no {role} {index}"
        if member.proc.pid != pid:
            return f"{role} {index} is pid {member.proc.pid} here, not pid {pid}"
        if member.conn is not None:
            return f"{role} {index} (pid {pid}) is connected already"
        return None

    def _read(self, member: Member) -> None:
        assert member.conn is not None
        try:
            records = member.conn.feed()
        except wire.WireError:
            member.conn.close()
            member.conn = None
            return  # its exit is handled in _step, with its exit code
        for record in records:
            try:
                self._handle(member, record)
            except (KeyError, TypeError, ValueError) as exc:
                self.display.say(f"{member.role} {member.index} sent a bad record: {exc}")

    def _handle(self, member: Member, record: dict[str, Any]) -> None:
        op = record["op"]
        if member.role == "agent" and op == "ask":
            key = str(record["order"])
            order = Order(
                key,
                member.index,
                str(record["trial"]),
                int(record["size"]),
                int(record["port"]),
                str(record["payload"]),
                asked_at=time.monotonic(),
                directory=str(record["directory"]) if record.get("directory") else None,
            )
            try:
                self.placement.ask(key, order.size, time.monotonic())
            except ValueError as exc:
                self._tell(member, {"op": "outcome", "order": key, "refused": str(exc)})
                return
            self.orders[key] = order
            if order.size > self._devices_left():
                self._refuse(order)
        elif member.role == "agent" and op == "may_overwrite":
            self._answer(self.overwrite.ask(member))
        elif member.role == "agent" and op == "root_ready":
            self._answer(self.overwrite.ready())
        elif member.role == "rank" and op == "outcome":
            ended = self.orders.get(str(record["order"]))
            if ended is None or not ended.members or member is not ended.members[0]:
                return  # only the trial's own rank 0 answers for it
            if ended.answered:
                return
            ended.answered = True
            ended.succeeded = "result" in record
            ended.clean = ended.clean and bool(record.get("clean"))
            agent = self.agents.get(ended.agent)
            if agent is not None:
                self._tell(agent, {**record, "op": "outcome"})
        elif member.role == "rank" and op == "free":
            freed = self.orders.get(str(record["order"]))
            member.order = None
            if freed is None:
                return
            freed.clean = freed.clean and bool(record.get("clean"))
            freed.free.add(member.index)
            self._maybe_release(freed)

    def _answer(self, answers: list[tuple[Member, bool]]) -> None:
        for agent, yes in answers:
            self._tell(agent, {"op": "overwrite", "yes": yes})

    def _devices_left(self) -> int:
        return self.plan.size - len(self.retired)

    def _refuse(self, order: Order) -> None:
        """A waiting trial that no longer fits the devices left: withdrawn, and its agent
        told why (NePS records the trial crashed with it)."""
        self.placement.cancel(order.key)
        self.orders.pop(order.key, None)
        left, size = self._devices_left(), self.plan.size
        retired = "; ".join(f"device {d}: {why}" for d, why in sorted(self.retired.items()))
        agent = self.agents.get(order.agent)
        if agent is not None:
            self._tell(
                agent,
                {
                    "op": "outcome",
                    "order": order.key,
                    "refused": f"trial {order.trial} needs {order.size} device(s), but {left}"
                    f" of the pool's {size} are left ({retired}); expected {order.size} <="
                    f" {left}. HINT: fix or replace the retired device(s) and start the pool"
                    " again, or make ranks_per_trial ask for at most"
                    f" {max(left, 1)}.",
                },
            )

    def _failed_start(self, rank: Member, code: int, now: float) -> bool:
        """A rank exited before its hello (its device failed to prove itself, or the
        script failed before ``neps_bcast.run``); True when its device is now retired
        (``DEVICE_START_FAILURES`` in a row)."""
        index = rank.index
        codes = self.start_failures.setdefault(index, [])
        codes.append(code)
        if len(codes) < DEVICE_START_FAILURES:
            return False
        self.retired[index] = (
            f"its rank failed to start {len(codes)} times in a row, exit codes"
            f" {', '.join(map(str, codes))}"
        )
        left = self._devices_left()
        self.display.say(
            format_message(
                TAG,
                f"device {index} is retired: its rank failed to start {len(codes)} times in"
                f" a row (exit codes {', '.join(map(str, codes))}; expected it to prove its"
                f" device and say hello); {left} of {self.plan.size} device(s) left.",
                f"see {rank.log} for why; check the device (nvidia-smi) or leave it out of"
                " CUDA_VISIBLE_DEVICES.",
            )
            + f" The end of {rank.log}:\n{status.tail(rank.log, 12)}"
        )
        for order in [o for o in self.orders.values() if not o.ranks]:
            if order.size > left:
                self._refuse(order)
        if left == 0:
            each = "; ".join(f"device {d}: {why}" for d, why in sorted(self.retired.items()))
            self._end(
                now,
                format_message(
                    TAG,
                    f"no device of the pool is left ({each}): no trial can run, so the"
                    " launch ends.",
                    f"see the ranks' logs in {self.plan.log_dir}/ for why they failed; check"
                    " the devices (nvidia-smi, CUDA_VISIBLE_DEVICES) and run the same"
                    " command again (its trials stay in the NePS root).",
                ),
            )
        return True

    def _tell(self, member: Member, record: dict[str, Any]) -> None:
        if member.conn is None:
            return
        try:
            member.conn.send(record)
        except wire.WireError:
            member.conn.close()
            member.conn = None

    def _lost(self, order: Order, why: str) -> None:
        """The trial's outcome, when its rank 0 cannot send one: its ranks were lost."""
        order.answered = True
        agent = self.agents.get(order.agent)
        if agent is not None:
            self._tell(agent, {"op": "outcome", "order": order.key, "lost": why})

    def _maybe_release(self, order: Order) -> None:
        if not order.free.issuperset(order.ranks):
            return
        self.placement.release(order.key, time.monotonic(), measured=order.succeeded)
        self.orders.pop(order.key, None)
        self.done += 1
        if not order.answered:
            self._lost(
                order,
                order.first_lost or f"the ranks of trial {order.trial} left it without an outcome",
            )
        agent = self.agents.get(order.agent)
        if agent is not None:
            self._tell(agent, {"op": "released", "order": order.key})
        if not order.clean:
            for rank in order.members:
                if rank.proc.poll() is None and self.ranks.get(rank.index) is rank:
                    rank.retiring = True
                    self.placement.set_available(rank.index, False)
                    self._tell(rank, {"op": "exit", "why": "recycled after an unclean trial"})

    def _place(self, now: float) -> None:
        if self.stop_deadline is not None:
            return
        for start in self.placement.place(now):
            order = self.orders[start.key]
            order.ranks = start.devices
            order.placed_at = now
            for group_rank, device in enumerate(start.devices):
                rank = self.ranks[device]
                rank.order = order.key
                order.members.append(rank)
                self._tell(
                    rank,
                    {
                        "op": "order",
                        "order": order.key,
                        "trial": order.trial,
                        "rank": group_rank,
                        "world": order.size,
                        "port": order.port,
                        "devices": list(start.devices),
                        "payload": order.payload if group_rank == 0 else None,
                    },
                )
            agent = self.agents.get(order.agent)
            if agent is not None:
                self._tell(
                    agent, {"op": "placed", "order": order.key, "devices": list(start.devices)}
                )
            self._write_placement(order)

    def _write_placement(self, order: Order) -> None:
        """``neps-bcast status`` shows which devices a trial runs on from this file."""
        if order.directory is None:
            return
        gpus = self.plan.devices
        placement = trial_placement.placed_now(
            order.trial,
            order.ranks,
            tuple(gpus[d] for d in order.ranks) if gpus is not None else None,
            self.plan.size,
            tuple(m.proc.pid for m in order.members),
            self.launch_id,
        )
        try:
            trial_placement.write(Path(order.directory), placement)
        except OSError as exc:
            self.display.say(f"could not write trial {order.trial}'s placement: {exc}")

    def _step(self, now: float) -> bool:
        """One look at everything; False once every process has exited."""
        if self.signals.received and self.stop_deadline is None:
            self._stop(now)
        if (
            self.stop_deadline is not None
            and not self.killed
            and (now >= self.stop_deadline or len(self.signals.received) > 1)
        ):
            self.display.say("pool still running: SIGKILL to every process of the launch.")
            for member in self._members():
                if member.proc.poll() is None:
                    procfs.kill(member.proc.pid)
            self.killed = True
        self._expire_openings(now)
        self._reap_agents()
        self._reap_ranks(now)
        self._end_orphaned_ranks(now)
        self._end_overdue_trials(now)
        self._place(now)
        agents_left = any(a.proc.poll() is None for a in self.agents.values())
        if not agents_left:
            for rank in self.ranks.values():
                # A rank still starting (not connected yet) is told once it says hello.
                if rank.proc.poll() is None and not rank.retiring and rank.conn is not None:
                    rank.retiring = True
                    self._tell(rank, {"op": "exit", "why": "the search is over"})
        running = any(m.proc.poll() is None for m in self._members())
        self.display.show([self._status()], self._status(), now, force=not running)
        return running

    def _reap_agents(self) -> None:
        for agent in list(self.agents.values()):
            code = agent.proc.poll()
            if code is None or agent.reaped:
                continue
            agent.reaped = True
            if agent.conn is not None:
                agent.conn.close()
                agent.conn = None
            self._answer(self.overwrite.gone(agent))
            for order in [o for o in self.orders.values() if o.agent == agent.index]:
                if not order.ranks:  # still waiting: withdrawn
                    self.placement.cancel(order.key)
                    self.orders.pop(order.key, None)
                elif not order.answered and self.stop_deadline is None:
                    # Placed, no outcome yet (a stop's SIGTERM settles it instead).
                    self._stop_ranks_of(
                        order, f"its agent {agent.index} {_exit_text(code)} before its outcome"
                    )
            replaced = code < 0 and self._replace_agent(agent, code)
            if code > 0 or (code < 0 and not replaced):
                self.failed_agents.append((agent.index, code))  # a killed one replaced: not
            if replaced:
                continue
            if code != 0:
                if self.stop_deadline is None:
                    self.display.say(
                        f"agent {agent.index} failed (exit {code}); the others go on."
                        f" The end of {agent.log}:\n{status.tail(agent.log, 12)}"
                    )

    def _replace_agent(self, agent: Member, code: int) -> bool:
        """An agent killed by a signal (not by this launcher's stop) is a lost NePS
        worker, as a killed rank is a lost device: a fresh agent takes its place. Its
        trial, left ``evaluating`` with the dead agent's lease, is proven dead by the
        fresh agent's look for orphans at its start (same host, the pid gone) and goes
        back to pending, which NePS hands out first. False when the launch is stopping
        or the index was replaced ``AGENT_RESTARTS`` times already."""
        if self.stop_deadline is not None or self.killed:
            return False
        done = self.agent_restarts.get(agent.index, 0)
        if done >= AGENT_RESTARTS:
            return False
        self.agent_restarts[agent.index] = done + 1
        self.display.say(
            f"agent {agent.index} {_exit_text(code)}: a fresh one takes its place (its trial"
            f" goes back to pending). The end of {agent.log}:\n{status.tail(agent.log, 12)}"
        )
        self._start("agent", agent.index)
        return True

    def _reap_ranks(self, now: float) -> None:
        for index, rank in list(self.ranks.items()):
            code = rank.proc.poll()
            if code is None or rank.reaped:
                continue
            rank.reaped = True
            if rank.conn is not None:
                self._read(rank)  # its last words (an outcome) first
                if rank.conn is not None:
                    rank.conn.close()
                    rank.conn = None
            self.placement.set_available(index, False)
            order = self.orders.get(rank.order) if rank.order is not None else None
            if order is not None:
                self._rank_of_a_trial_lost(order, rank, code, now)
            over = not any(a.proc.poll() is None for a in self.agents.values())
            if (
                not rank.said_hello
                and not rank.retiring
                and self.stop_deadline is None
                and self._failed_start(rank, code, now)
            ):
                continue  # retired: no fresh rank for its device
            if self.stop_deadline is None and not over:
                if not rank.retiring:
                    self.display.say(
                        f"rank {index} {_exit_text(code)}: a fresh one takes its device."
                    )
                self._start("rank", index)

    def _rank_of_a_trial_lost(self, order: Order, rank: Member, code: int, now: float) -> None:
        """A rank of a running trial exited. Its rank 0 answers for the trial when it can
        (a peer lost in a collective is seen in milliseconds); when rank 0 itself is gone,
        the launcher tells the agent, naming the first rank the trial lost (rank 0's last
        words are read first: an outcome it sent wins). The trial's other ranks have
        ``LOST_PEER_GRACE_S`` to leave it (``_end_orphaned_ranks``)."""
        order.clean = False
        if order.first_lost is None:
            order.first_lost = (
                f"rank {order.ranks.index(rank.index)} of trial {order.trial} (device"
                f" {rank.index}, pid {rank.proc.pid}) {_exit_text(code)}"
            )
        # The trial's own rank 0, not whoever holds its device now: a fresh rank there
        # is idle, and has no last words about this trial.
        head = order.members[0] if order.members else None
        if head is not None and head is not rank and head.conn is not None:
            self._read(head)
        if not order.answered and head is rank:
            self._lost(order, order.first_lost)
        order.free.add(rank.index)
        if order.lost_at is None:
            order.lost_at = now
        self._maybe_release(order)

    def _stop_ranks_of(self, order: Order, why: str) -> None:
        """A placed trial that runs again elsewhere, in the same directory (its agent is
        gone, or it ran past ``--trial-time-limit``): its ranks are SIGKILLed at once;
        each is then reaped as a lost rank, and a fresh one takes its device."""
        order.lost_at = float("inf")  # no grace to wait for: done here
        order.first_lost = order.first_lost or f"trial {order.trial}: {why}"
        for rank in order.members:
            if rank.index not in order.free and rank.proc.poll() is None:
                self.display.say(
                    f"trial {order.trial}: {why}: SIGKILL to its rank on device"
                    f" {rank.index} (pid {rank.proc.pid}); a fresh one takes the device."
                )
                procfs.kill(rank.proc.pid)

    def _end_orphaned_ranks(self, now: float) -> None:
        """A trial that lost a rank: its ranks still in it after ``LOST_PEER_GRACE_S``
        are SIGKILLed (a rank waiting in the trial's rendezvous for the lost one would
        hold its device for the join timeout); each is then reaped as a lost rank, and
        a fresh one takes its device."""
        for order in list(self.orders.values()):
            if order.lost_at is None or now < order.lost_at + LOST_PEER_GRACE_S:
                continue
            order.lost_at = float("inf")  # once
            for rank in order.members:
                if rank.index not in order.free and rank.proc.poll() is None:
                    self.display.say(
                        f"rank {rank.index} (pid {rank.proc.pid}) is still in trial"
                        f" {order.trial} {LOST_PEER_GRACE_S:.0f} s after it lost a process:"
                        " SIGKILL; a fresh one takes its device."
                    )
                    procfs.kill(rank.proc.pid)

    def _end_overdue_trials(self, now: float) -> None:
        """``--trial-time-limit``: a trial placed longer ago than the limit and still
        without an outcome (hung in the user's code, or just too long) has its ranks
        SIGKILLed; its agent hears it lost, naming the limit, so the trial goes back to
        pending (``NEPS_BCAST_MAX_RETRIES`` times, then crashed), and fresh ranks take
        its devices. A hung trial would otherwise hold its devices for ever and, wide at
        the head of the queue, stall every trial behind it."""
        limit = self.plan.trial_time_limit_s
        if limit is None or self.stop_deadline is not None:
            return
        for order in list(self.orders.values()):
            if order.placed_at is None or order.answered or order.lost_at is not None:
                continue
            if now - order.placed_at < limit:
                continue
            self._stop_ranks_of(
                order, f"still running {limit:g} s after it was placed (--trial-time-limit)"
            )

    def _status(self) -> str:
        running = ", ".join(
            f"trial {o.trial} on {','.join(map(str, o.ranks))}"
            for o in self.orders.values()
            if o.ranks
        )
        waiting = sum(1 for o in self.orders.values() if not o.ranks)
        return (
            f"pool: {len(self.placement.free)} of {self.plan.size} devices free;"
            f" running: {running or 'nothing'}; {waiting} waiting; {self.done} done"
        )

    def _stop(self, now: float) -> None:
        name = signal.Signals(self.signals.received[0]).name
        self._end(
            now,
            f"{name} received: stopping every agent and rank (SIGTERM; SIGKILL after"
            f" {self.settings.stop_timeout_s:.0f} s; again to kill at once).",
        )

    def _end(self, now: float, why: str) -> None:
        """Stop every process of the launch: SIGTERM now, SIGKILL at the deadline. An
        agent's trial in progress is settled by its leader's stop (back to pending)."""
        if self.stop_deadline is not None:
            return
        if not self.signals.received:
            self.ended = why
        self.display.say(why)
        for member in self._members():
            if member.proc.poll() is None:
                procfs.kill(member.proc.pid, signal.SIGTERM)
        self.stop_deadline = now + self.settings.stop_timeout_s

    def _exit_status(self) -> int:
        if self.signals.received:
            return 128 + self.signals.received[0]
        if self.ended is not None:
            self.display.say(self.ended)  # last: the reason the launch failed
            return 1
        if not self.failed_agents:
            return 0
        index, code = self.failed_agents[0]
        self.display.say(f"agent {index} failed first (exit {code}); see {self.plan.log_dir}/.")
        return code if code > 0 else 1


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def check(size: int, trial_time_limit_s: float | None = None) -> None:
    """Refuse a pool that cannot run, before anything starts (devices are checked as
    for one group of ``size`` ranks, ``plan.plan``)."""
    if size < 1:
        raise LaunchError(
            format_message(
                TAG, f"--pool {size}: a pool needs at least one device.", "pass --pool 1 or more."
            )
        )
    if trial_time_limit_s is not None and not trial_time_limit_s > 0:
        raise LaunchError(
            format_message(
                TAG,
                f"--trial-time-limit {trial_time_limit_s:g}: a limit must be a positive"
                " number of seconds.",
                "pass e.g. --trial-time-limit 3600, or leave it out for no limit.",
            )
        )


def run(plan: PoolPlan, settings: Settings, out: IO[str]) -> int:
    """Run the pool to the end of the search; the launch's exit status (0: every agent
    finished; 128 + signum: stopped by that signal; else the first failed agent's)."""
    return Pool(plan, settings, out).run()
