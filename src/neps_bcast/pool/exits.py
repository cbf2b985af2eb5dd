"""What a pool's launcher does when one of its processes exits, or is found silent.

An agent that exits is hung up, its waiting trials withdrawn and a placed one without
its outcome stopped on its ranks (``endings``); one killed by a signal is replaced
(``agent_lives``). A rank that exits is heard one last time (an outcome it sent), its
trial told (``endings.rank_lost``), and a fresh rank takes its device, unless its device
keeps failing to start (``devices``: then it is retired, and trials that no longer fit
are refused). A process found silent (``beats``: frozen or hung) is SIGKILLed first, so
that its exit is handled as a crash's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from neps_bcast.launcher import status
from neps_bcast.launcher.processes import Supervisor
from neps_bcast.pool import beats
from neps_bcast.pool.agent_lives import AgentLives, Overwrite
from neps_bcast.pool.devices import Devices
from neps_bcast.pool.endings import Endings
from neps_bcast.pool.members import Member, Members, exit_text
from neps_bcast.pool.trials import Trials


class Exits:
    """The launcher's handling of its processes' ends (driven by its loop)."""

    def __init__(
        self,
        members: Members,
        trials: Trials,
        endings: Endings,
        devices: Devices,
        supervisor: Supervisor,
        display: status.Display,
        overwrite: Overwrite,
        answer: Callable[[list[tuple[Member, bool]]], None],
        end: Callable[[float, str], None],
    ) -> None:
        self.members = members
        self.trials = trials
        self.endings = endings
        self.devices = devices
        self.supervisor = supervisor
        self.display = display
        self._answer = answer
        """Tell agents whether they may wipe the root (``Overwrite``'s answers)."""
        self._end = end
        """End the launch (no device left)."""
        self.overwrite = overwrite
        self.agent_lives = AgentLives(display)
        self._silent: list[beats.Silent] = []
        self._silent_lock = threading.Lock()

    # -- silence -------------------------------------------------------------------
    def found_silent(self, silent: beats.Silent) -> None:
        """The beats' thread: a process of the pool is silent (the loop ends it)."""
        with self._silent_lock:
            self._silent.append(silent)

    def end_silent(self) -> None:
        """SIGKILL each process found silent (frozen or hung: on this node it is ours to
        end); its exit is then handled as a crash's (``reap_agents``, ``reap_ranks``)."""
        with self._silent_lock:
            found, self._silent = self._silent, []
        for silent in found:
            member = self.members.by_beat(silent.name)
            if member is None or member.proc.poll() is not None:
                continue
            self.display.say(
                f"{silent.describe()}: frozen or hung; SIGKILL to it, and its trial (if any)"
                " goes back to pending. If it only stalls, raise NEPS_BCAST_PEER_TIMEOUT_S"
                f" (now {silent.bound_s:g} s)."
            )
            member.kill()

    # -- exits ---------------------------------------------------------------------
    def reap_agents(self) -> None:
        for agent in list(self.members.agents.values()):
            code = agent.proc.poll()
            if code is None or agent.reaped:
                continue
            agent.reaped = True
            self.members.hang_up(agent)
            self.members.unwatch(agent)
            self._answer(self.overwrite.gone(agent))
            for order in self.trials.of_agent(agent.index):
                if not order.ranks:  # still waiting: withdrawn
                    self.trials.withdraw(order)
                elif not order.answered and not self.supervisor.stopping:
                    # Placed, no outcome yet (a stop's SIGTERM settles it instead).
                    why = f"its agent {agent.index} {exit_text(code)} before its outcome"
                    self.endings.stop_ranks_of(order, why)
            ending = self.supervisor.stopping or self.supervisor.killed
            if self.agent_lives.replace(agent, code, ending):
                self.members.start("agent", agent.index)

    def reap_ranks(self, now: float) -> None:
        for index, rank in list(self.members.ranks.items()):
            code = rank.proc.poll()
            if code is None or rank.reaped:
                continue
            rank.reaped = True
            self.trials.hear(rank)  # its last words (an outcome) first
            self.members.hang_up(rank)
            self.members.unwatch(rank)
            self.trials.placement.set_available(index, False)
            order = self.trials.orders.get(rank.order) if rank.order is not None else None
            if order is not None:
                self.endings.rank_lost(order, rank, code, now)
            if self.supervisor.stopping:
                continue
            if not rank.said_hello and not rank.retiring and self.devices.failed_start(rank, code):
                self._retired(now)
                continue  # no fresh rank for its device
            if any(a.proc.poll() is None for a in self.members.agents.values()):
                if not rank.retiring:
                    self.display.say(
                        f"rank {index} {exit_text(code)}: a fresh one takes its device."
                    )
                self.members.start("rank", index)

    def _retired(self, now: float) -> None:
        """A device was retired: trials that no longer fit are refused; with no device
        left, the launch ends."""
        for order in self.trials.waiting():
            if order.size > self.devices.left():
                self.trials.refuse(order)
        if self.devices.left() == 0:
            self._end(now, self.devices.none_left())
