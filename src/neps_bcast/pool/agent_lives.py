"""The launcher's bookkeeping of a pool's agents: which were replaced and which failed
(``AgentLives``), and which one wipes the root when the search asks for it
(``Overwrite``)."""

from __future__ import annotations

from neps_bcast.launcher import status
from neps_bcast.pool.members import Member, exit_text

AGENT_RESTARTS = 3
"""Fresh agents started for one agent index that was killed by a signal (SIGKILL, the
OOM killer) while the search went on; past this, a lost agent is not replaced. An agent
that failed (exited with a code: the rule refused up front, a script error, NePS's
``WorkerRaiseError``) is not replaced: its cause would recur in every fresh one. It
decides the launch's exit status (its code), and its trial, if it left one evaluating,
is put back by the other agents' look for orphans before their next trial."""


class AgentLives:
    """Which agents were replaced and which failed: an agent killed by a signal (not by
    this launcher's stop) is a lost NePS worker, as a killed rank is a lost device, and
    a fresh agent takes its place. Its trial, left ``evaluating`` with the dead agent's
    lease, is proven dead by the fresh agent's look for orphans at its start (same host,
    the pid gone) and goes back to pending, which NePS hands out first."""

    def __init__(self, display: status.Display) -> None:
        self.display = display
        self.restarts: dict[int, int] = {}
        self.failed: list[tuple[int, int]] = []
        """Agents that failed, or were killed and not replaced: (index, exit status)."""

    def replace(self, agent: Member, code: int, ending: bool) -> bool:
        """After ``agent`` exited with ``code``: True when a fresh one takes its place
        (killed by a signal, the launch not ending, fewer than ``AGENT_RESTARTS`` for
        its index so far)."""
        done = self.restarts.get(agent.index, 0)
        replaced = code < 0 and not ending and done < AGENT_RESTARTS
        if replaced:
            self.restarts[agent.index] = done + 1
            self.display.say(
                f"agent {agent.index} {exit_text(code)}: a fresh one takes its place (its"
                f" trial goes back to pending). The end of {agent.log}:\n"
                f"{status.tail(agent.log, 12)}"
            )
            return True
        if code != 0:
            self.failed.append((agent.index, code))
            if not ending:
                self.display.say(
                    f"agent {agent.index} failed (exit {code}); the others go on."
                    f" The end of {agent.log}:\n{status.tail(agent.log, 12)}"
                )
        return False


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
