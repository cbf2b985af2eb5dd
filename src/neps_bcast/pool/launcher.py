"""``neps-bcast launch --pool D``: right-sized trials packed onto one node's D devices.

The launcher starts D warm *ranks*, one per device for life (rank i uses device i), and
D *agents*, each one NePS worker without a device: it samples a trial, asks for as many
ranks as ``ranks_per_trial`` says, and hands the trial to whichever ranks it is given.
Between the two sits the launcher: its processes (``members``, started and stopped by
the launch's ``processes.Supervisor``, as groups are), the trials on their way
(``trials``: a placement, FIFO with backfilling and a drain, and the relay of orders and
outcomes on a Unix socket, ``wire``) and the devices that keep failing (``devices``).
For each trial the chosen ranks form a DDP group of their own, as if torchrun had just
started them (its variables, a store the agent serves on a port the OS picked), run the
user's function, and go back to waiting; the trial's rank 0 returns the outcome to the
agent.

Why warm ranks and agents (docs/architecture.md, "Right-sized trials"): a fresh rank
costs ~7 s of CPU (imports) per trial, a warm one a few ms to join a new group; and a
NePS worker that is not itself a rank can start its trial on any free ranks.

This module is the loop: what the processes say is handled as it comes, their exits
and silences by ``exits`` (a rank whose trial did not end cleanly, or that dies, is
replaced by a fresh one for its device, its trial's agent told; an agent killed by a
signal is replaced); when every agent has finished, the ranks are told to exit.
SIGTERM/Ctrl-C go to every process, and whatever is left after ``--stop-timeout`` is
SIGKILLed (found by the launch id).
"""

from __future__ import annotations

import select
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from neps_bcast import config
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.launcher import status
from neps_bcast.launcher.plan import TAG
from neps_bcast.launcher.processes import Settings, Supervisor
from neps_bcast.pool import beats
from neps_bcast.pool.agent_lives import Overwrite
from neps_bcast.pool.devices import Devices
from neps_bcast.pool.endings import Endings
from neps_bcast.pool.exits import Exits
from neps_bcast.pool.members import Member, Members, PoolPlan
from neps_bcast.pool.opening import Opening
from neps_bcast.pool.trials import Trials

__all__ = ["Pool", "PoolPlan", "check", "run"]


class Pool:
    """One pool launch: its processes, its trials, its devices, and the loop."""

    def __init__(self, plan: PoolPlan, settings: Settings, out: IO[str]) -> None:
        self.plan = plan
        self.settings = settings
        self.display = status.Display(out, settings.status_interval_s)
        self.supervisor = Supervisor(settings)
        self.signals = self.supervisor.signals
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # The socket's path is known once ``run`` made the launcher's private folder.
        self.members = Members(plan, self.supervisor, "", self.display)
        self.devices = Devices(plan, self.display)
        self.trials = Trials(self.members, self.devices, self.display, self.supervisor.launch_id)
        self.endings = Endings(self.trials, self.display)
        self.overwrite = Overwrite()
        self.exits = Exits(
            self.members,
            self.trials,
            self.endings,
            self.devices,
            self.supervisor,
            self.display,
            self.overwrite,
            self._answer,
            self._end,
        )
        self.ended: str | None = None
        """Why the launcher ended the launch itself (no device left)."""
        self.beats: beats.Beats | None = None

    def run(self) -> int:
        # The launcher's private folder (its socket, the beats), made here and removed
        # here, so that a pool built and never run leaves nothing in /tmp.
        folder = Path(tempfile.mkdtemp(prefix="neps_bcast-pool-"))  # mode 0700
        try:
            self._serve(folder)
        finally:
            if self.beats is not None:
                self.beats.stop()
            self.members.close()
            self.server.close()
            shutil.rmtree(folder, ignore_errors=True)
        return self._exit_status()

    def _serve(self, folder: Path) -> None:
        """Open the pool's socket and beats in ``folder``, start every member, and run
        the loop until the launch ends."""
        self.members.path = str(folder / "pool.sock")
        self.plan.log_dir.mkdir(parents=True, exist_ok=True)
        for old in [*self.plan.log_dir.glob("agent*.log"), *self.plan.log_dir.glob("rank*.log")]:
            old.unlink()
        self.server.bind(self.members.path)
        self.server.listen(2 * (self.plan.size + self.plan.agent_count) + 8)
        beats_folder = beats.folder_of(self.members.path)
        beats_folder.mkdir()
        bound_s = config.Settings.from_env().peer_timeout_s
        self.beats = beats.Beats(beats_folder, beats.LAUNCHER, bound_s, self.exits.found_silent)
        self.members.beats = self.beats
        where = f"devices {','.join(self.plan.devices)}" if self.plan.devices is not None else "CPU"
        self.display.say(
            f"pool of {self.plan.size} ranks on {where} and {self.plan.agent_count} agents;"
            f" logs {self.plan.log_dir}/"
        )
        with self.signals.installed():
            for index in range(max(self.plan.size, self.plan.agent_count)):
                if index < self.plan.size:
                    self.members.start("rank", index)
                if index < self.plan.agent_count:
                    self.members.start("agent", index)
            while self._step(time.monotonic()):
                self._wait(0.5)
            left = self.supervisor.clean_up()
            if left:
                self.display.say(f"SIGKILLed {len(left)} process(es) left running: {left}.")

    def _wait(self, seconds: float) -> None:
        conns = [m.conn for m in self.members.all() if m.conn is not None]
        readable: list[Any] = [self.server, self.signals, *conns, *self.members.openings]
        if any(c.pending() for c in conns):
            seconds = 0.0
        try:
            ready, _, _ = select.select(readable, [], [], seconds)
        except InterruptedError:  # pragma: no cover - PEP 475 retries
            return
        for item in ready:
            if item is self.server:
                self.members.accept(self.server)
            elif item is self.signals:
                self.signals.drain()
            elif isinstance(item, Opening):
                self._welcome(self.members.open(item))
        for member in self.members.all():
            if member.conn is not None and (member.conn in ready or member.conn.pending()):
                for record in self.members.read(member):
                    self._handle(member, record)

    def _welcome(self, member: Member | None) -> None:
        if member is not None and member.role == "rank":
            self.devices.started(member.index)
            if not self.supervisor.stopping:
                self.trials.placement.set_available(member.index, True)

    def _handle(self, member: Member, record: dict[str, Any]) -> None:
        handlers = {
            ("agent", "ask"): lambda: self.trials.ask(member, record),
            ("agent", "may_overwrite"): lambda: self._answer(self.overwrite.ask(member)),
            ("agent", "root_ready"): lambda: self._answer(self.overwrite.ready()),
            ("rank", "outcome"): lambda: self.trials.outcome(member, record),
            ("rank", "free"): lambda: self.trials.free(member, record),
        }
        handler = handlers.get((member.role, str(record.get("op"))))
        if handler is None:
            return
        try:
            handler()
        except (KeyError, TypeError, ValueError) as exc:
            self.display.say(f"{member.role} {member.index} sent a bad record: {exc}")

    def _answer(self, answers: list[tuple[Member, bool]]) -> None:
        for agent, yes in answers:
            self.members.tell(agent, {"op": "overwrite", "yes": yes})

    def _step(self, now: float) -> bool:
        """One look at everything; False once every process has exited."""
        if self.signals.received and not self.supervisor.stopping:
            self._stop(now)
        self.exits.end_silent()
        if self.supervisor.kill_if_due(now, self.members.running()):
            self.display.say("pool still running: SIGKILL to every process of the launch.")
        self.members.expire(now)
        self.exits.reap_agents()
        self.exits.reap_ranks(now)
        self.endings.end_orphaned(now)
        if not self.supervisor.stopping:
            self.endings.end_overdue(now)
            self.trials.place(now)
        if not any(a.proc.poll() is None for a in self.members.agents.values()):
            for rank in self.members.ranks.values():
                # A rank still starting (not connected yet) is told once it says hello.
                if rank.proc.poll() is None and not rank.retiring and rank.conn is not None:
                    rank.retiring = True
                    self.members.tell(rank, {"op": "exit", "why": "the search is over"})
        running = bool(self.members.running())
        line = self.trials.status()
        self.display.show([line], line, now, force=not running)
        return running

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
        if self.supervisor.stopping:
            return
        if not self.signals.received:
            self.ended = why
        self.display.say(why)
        self.supervisor.stop(now, self.members.running())

    def _exit_status(self) -> int:
        stopped = self.supervisor.exit_status()
        if stopped is not None:
            return stopped
        if self.ended is not None:
            self.display.say(self.ended)  # last: the reason the launch failed
            return 1
        if not self.exits.agent_lives.failed:
            return 0
        index, code = self.exits.agent_lives.failed[0]
        self.display.say(f"agent {index} failed first (exit {code}); see {self.plan.log_dir}/.")
        return code if code > 0 else 1


def check(size: int, trial_time_limit_s: float | None = None, agents: int | None = None) -> None:
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
    if agents is not None and agents < 1:
        raise LaunchError(
            format_message(
                TAG,
                f"--agents {agents}: a pool needs at least one agent (a NePS worker).",
                f"pass --agents 1 or more, or leave it out for one per device ({size}).",
            )
        )


def run(plan: PoolPlan, settings: Settings, out: IO[str]) -> int:
    """Run the pool to the end of the search; the launch's exit status (0: every agent
    finished; 128 + signum: stopped by that signal; else the first failed agent's)."""
    return Pool(plan, settings, out).run()
