"""What one ``neps_bcast.run`` call owns in this process, and its three messages.

A ``Runtime`` ties together who this rank is (``launch``, ``settings``), its link to the
group (``link``: store and channel), the user's DDP group (``group``) and the trial being
evaluated (``trial.run.running()``). It sends and receives the leader's
messages and gathers the ranks' reports; the per-trial protocol is in ``trial/run.py``
(forming and releasing the user's group in ``trial.forming`` and ``trial.failure``),
and the first trial of a Lightning leader's children in ``startup.lightning_children``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from neps_bcast import faults
from neps_bcast.compat import torch as torch_compat
from neps_bcast.compat.torch import Store
from neps_bcast.config import Settings
from neps_bcast.ddp.group import UserGroup
from neps_bcast.errors import (
    FollowerLostError,
    LeaderLostError,
    ProtocolError,
    first_line,
    format_message,
)
from neps_bcast.log import exit_now, logger, role_tag, tagged
from neps_bcast.recovery.signals import indivisible
from neps_bcast.startup import external, lightning_children
from neps_bcast.startup.launch import Launch
from neps_bcast.transport import liveness, peers, sockets
from neps_bcast.transport.auth import Signer, new_secret
from neps_bcast.transport.channel import Channel, ChannelClosedError
from neps_bcast.transport.link import Link
from neps_bcast.transport.messages import (
    Report,
    StopMessage,
    TrialMessage,
    encode,
)
from neps_bcast.transport.steps import Steps

_ACTIVE: Runtime | None = None
_T = TypeVar("_T")


def active() -> Runtime | None:
    return _ACTIVE


class Runtime:
    def __init__(
        self, launch: Launch, settings: Settings | None = None, signer: Signer | None = None
    ) -> None:
        self.launch = launch
        self.settings = settings or Settings.from_env()
        self.signer = signer or Signer(new_secret())
        self.group_rank = launch.global_rank
        # A Lightning child's WORLD_SIZE is the Trainer's plan; the group tells the truth
        # once it exists (before that, joining the channel would deadlock with the
        # leader's init_process_group).
        known = launch.world_size if launch.kind == "external" else None
        # Under an external launch the user's code may form (and destroy) the group
        # itself, every trial: it is formed again before a trial only if the user formed
        # it before run (``api``), never in the way of the user's init_process_group.
        self.group = UserGroup(self.group_rank, known, keep=launch.kind != "external")
        self.launcher_store: Store | None = None
        """External launches: the launcher's store (torchrun's agent store, or the
        server rank 0 runs at MASTER_ADDR:MASTER_PORT), held for the whole run so that
        every trial's group formed on it by the user's code finds it there."""
        self.link = Link(self.group_rank, self.settings, self.signer)
        self.link.peers.relatives = functools.partial(_relatives, launch, self.group_rank)
        self.link.on_silent = functools.partial(_on_silent, self)
        liveness.forget()
        self.children = lightning_children.Children()
        self.seq = 0
        self.steps = Steps(self.group_rank, self.signer, lambda: self.group.generation)
        self.owns_group = False
        self.settled = threading.Event()
        """Leader: the trial that ends the search is recorded (or neps.run ended)."""
        self.trial_label: str | None = None
        """The trial this rank evaluates, as its beats name it ("trial 4 (#2)")."""
        self.abandon_trial: Callable[[str], str] | None = None
        """Leader: put the trial it holds back (an infrastructure reason), from any
        thread; returns what became of it (set by ``leader.lead``)."""
        self.devices: tuple[int, ...] | None = None
        """A pool's trial: the device index of each rank, in rank order (else None)."""
        self.saying_goodbye = False
        """Follower in its goodbye: a silent leader there still ends it (the wait is
        bounded by the peer bound), though losing the leader after STOP is normal."""

    @property
    def world_size(self) -> int | None:
        return self.group.world_size

    @property
    def tag(self) -> str:
        return role_tag(self.group_rank, self.world_size)

    def log(self, level: int, message: str, *args: object) -> None:
        logger.log(level, message, *args)

    @contextmanager
    def activated(self) -> Iterator[Runtime]:
        global _ACTIVE  # noqa: PLW0603
        previous, _ACTIVE = _ACTIVE, self
        try:
            with tagged(lambda: self.tag):
                yield self
        finally:
            _ACTIVE = previous

    def start_external(self, fingerprint: dict[str, str]) -> None:
        """An external launch (torchrun, srun, a pool's trial): meet the other ranks,
        agree on the secret, join the channel (``startup.external``)."""
        self._started(
            external.start(self.launch, self.settings, self.link, self.signer, fingerprint)
        )

    def start_in_pool(self, secret: bytes, order: str) -> None:
        """A pool's trial: as ``start_external``, its secret from the order
        (``startup.external.start_in_pool``)."""
        self._started(
            external.start_in_pool(
                self.launch, self.settings, self.link, self.signer, secret, order
            )
        )

    def _started(self, started: external.Started) -> None:
        """After either start: keep the user's group and the launcher's store, join."""
        self.group.keep = started.users_group
        self.launcher_store = started.launcher_store
        self.observe_group()
        self.ensure_channel()

    # -- the user's group ------------------------------------------------------
    def observe_group(self) -> None:
        self.group.observe(
            fixed_size=self.link.channel is not None, single=self.launch.kind == "single"
        )

    def next_generation(self) -> int | None:
        """Leader: the generation the next trial forms the group as (None: keep it)."""
        return self.group.next_generation() if self.link.store is not None else None

    # -- messages --------------------------------------------------------------
    def ensure_channel(self) -> bool:
        """Join the channel if the group's size is known now; True when it is up."""
        if self.link.channel is not None:
            return True
        self.observe_group()
        if (self.world_size or 0) <= 1 or self.link.store is None:
            return False
        self.link.join(self.world_size or 0, self.lost)
        self.children.forget(self.link)  # the children have joined: nothing left to inherit
        # Every rank published itself before joining: read (and check) them all now, so a
        # later overwrite of those keys by an outsider cannot hide a peer.
        self.link.peers.others(self.link.store, self.world_size)
        return True

    def prepare_children(self) -> None:
        """Leader, just before Lightning starts its children: leave them the trial.

        Runs in Lightning's launcher (``compat.lightning.before_children_start``), so a
        search whose function never starts child processes never serves a store.
        """
        if self.link.channel is None:
            self.children.prepare(self.link, self.signer)

    def _on_channel(self, step: Callable[[Channel], _T]) -> _T:
        """One control step on the channel (``transport.steps``); a lost peer named."""
        assert self.link.channel is not None
        try:
            with indivisible():  # a stop that lands mid-step is raised once it is done
                return step(self.link.channel)
        except ChannelClosedError as exc:
            raise self.lost(exc) from exc

    def send(self, message: TrialMessage | StopMessage) -> None:
        """Leader: hand a message to every follower (first contact or a step)."""
        if self.ensure_channel():
            liveness.doing(
                f"handing trial {message.trial_id} (#{message.seq}) over"
                if isinstance(message, TrialMessage)
                else "stopping its followers"
            )
            self._on_channel(lambda c: self.steps.hand_over(c, message, self.tag))
        elif isinstance(message, TrialMessage):
            self.children.first = (message.seq, encode(message, tag=self.tag))
            self.steps.handed_seq = message.seq  # Lightning's children start with it
        if isinstance(message, TrialMessage):
            faults.point("handed", seq=message.seq)

    def receive(self) -> TrialMessage | StopMessage:
        """Follower: wait (blocked, no polling) for the leader's next message."""
        if self.steps.leader_stop is None and not self.ensure_channel():
            raise ProtocolError(
                format_message(
                    self.tag,
                    "no control channel to receive the next trial on.",
                    "this is a bug in neps_bcast; please report it.",
                )
            )
        liveness.doing("waiting for the next trial")
        message = self._on_channel(lambda c: self.steps.next_message(c, self.tag))
        if isinstance(message, TrialMessage):
            liveness.leader_reached(f"handing trial {message.trial_id} (#{message.seq}) over")
        return message

    def first_contact(self) -> TrialMessage:
        """Lightning child: the trial its leader was evaluating when it spawned us."""
        assert self.launch.leader_store is not None
        assert self.launch.first_seq is not None
        assert self.launch.first_trial is not None
        return lightning_children.first_trial(
            self.link,
            self.launch.leader_store,
            self.launch.first_seq,
            self.launch.first_trial,
            self.tag,
        )

    def exchange(self, report: Report) -> list[Report] | None:
        """Every rank contributes a report; None when there is no group to exchange with
        (no channel, or a leader whose followers never received this trial)."""
        self.check_stopped()
        if self.group_rank == 0 and report.seq > self.steps.handed_seq:
            return None  # interrupted before the hand-over: the followers wait for the next
        if not self.ensure_channel():
            return None
        label = self.trial_label or f"trial #{report.seq}"
        liveness.doing(f"in a meeting of the ranks of {label}")
        reports = self._on_channel(lambda c: self.steps.meet(c, report, self.tag))
        if self.group_rank != 0:
            liveness.leader_reached(f"in a meeting of the ranks of {label}")
        liveness.doing(f"evaluating {label}")
        return reports

    def check_stopped(self) -> None:
        """Follower: raise ``SearchStopped`` once a step brought the leader's STOP."""
        self.steps.check_stopped(self.tag)

    def lost(self, exc: BaseException) -> LeaderLostError | FollowerLostError:
        """The error for losing a peer: which follower and how, or the leader."""
        return _lost(self, exc)

    # -- the end ---------------------------------------------------------------
    def shutdown(self, reason: str) -> None:
        """Leader: tell every follower to stop, wait for their goodbye, close the channel."""
        faults.point("stop")
        try:
            self.link.release_followers(self.world_size or 1)
            if self.link.channel is not None or (self.world_size or 0) > 1:
                self.send(StopMessage(reason))
                self.say_goodbye()
        finally:
            self.close()

    def say_goodbye(self) -> None:
        """Leader and followers at STOP: the leader exits only after every goodbye."""
        if self.link.channel is None:
            return
        self.saying_goodbye = True
        try:
            self._on_channel(lambda c: self.steps.goodbye(c, self.tag))
        except (LeaderLostError, FollowerLostError):
            self.log(logging.DEBUG, "a peer left before saying goodbye")
        finally:
            self.saying_goodbye = False

    def close(self) -> None:
        self.link.close()
        self.children.forget(self.link)


def _relatives(launch: Launch, group_rank: int) -> list[peers.Peer]:
    """The group as this process sees it by itself (a peer's record is missing)."""
    if launch.kind == "external":
        return peers.launch_relatives(launch.identity, launch.rank_variable, group_rank)
    return peers.lightning_relatives(launch.kind)


def _on_silent(rt: Runtime, silence: liveness.Silence) -> None:
    """A peer has gone silent for the bound (``transport.liveness``, on its thread): it
    gets the outcome of a lost process.

    A peer is here only when its process (``silence.process``: host, boot id, pid
    namespace, pid, start time) is: a peer in another container of this host (another pid
    namespace) is handled as one on another host, and its pid number, which names another
    process here, is never signalled. Leader: a silent follower here is SIGKILLed (frozen:
    ours to end) if its start time still matches; one elsewhere has every connection of
    this process to it shut (gloo's and the control channel's: to its addresses, and, for a
    container sharing this host's network, those whose other end no process here holds),
    and an NCCL group is aborted. Either way the waits of this rank fail as if the peer
    had died, and the trial ends as for a lost follower: back to ``pending``,
    ``FollowerLostError`` naming the silence. Follower: a silent leader here is
    SIGKILLed, and this process exits with code 1 (``LeaderLostError``) at once, whatever
    it was blocked in; so does one in the goodbye after STOP (a leader frozen between STOP
    and the goodbye), whose wait is otherwise bounded only by NEPS_BCAST_WAIT_TIMEOUT_S.

    A broken watch (``silence.broken``: a liveness thread raised) ends the trial as an
    infrastructure fault (``_on_broken``): no rank is left unwatched without a word.
    """
    if rt.link.stopping and not rt.saying_goodbye:
        return  # the follower is leaving: losing its leader now is normal
    if silence.broken is not None:
        _on_broken(rt, silence.broken)
        return
    process = silence.process
    here = process is not None and process.is_here
    if here and process is not None and not process.is_running():
        return  # it died: its closed connections tell the main thread how
    where = process.where() if process is not None else "not known which process it is"
    if rt.group_rank == 0:
        action = "killed by the leader (SIGKILL)" if here else "its connections shut"
        if not here and where:
            action += f"; {where}"
        liveness.mark(silence, action)
        logger.log(
            logging.ERROR,
            "%s: frozen, hung, or its node lost or cut off. It is treated as lost (%s);"
            " the trial goes back to pending. HINT: see that rank's host; if it only"
            " stalls (a long checkpoint write, swapping), raise NEPS_BCAST_PEER_TIMEOUT_S"
            " (now %g s).",
            silence.describe(),
            action,
            rt.settings.peer_timeout_s,
        )
        if rt.abandon_trial is not None:  # a search's leader (not a pool's trial rank)
            threading.Thread(
                target=_settle_or_leave, args=(rt, silence), name="neps_bcast-silent", daemon=True
            ).start()
        if here:
            liveness.kill_if_here(process)
            return
        if rt.group.backend == "nccl":
            with contextlib.suppress(Exception):
                torch_compat.abort_nccl()
        peer = rt.link.peers.known(silence.group_rank)
        addresses = {ip for ip, _ in peer.listen} if peer is not None else set()
        if silence.address is not None:
            addresses.add(silence.address)
        addresses.discard("0.0.0.0")  # noqa: S104 - a wildcard is no peer's address
        inodes = sockets.connections_to(addresses) | sockets.connections_out_of_sight(addresses)
        shut = sockets.shutdown(inodes)
        logger.log(logging.INFO, "shut %d connection(s) to %s", shut, sorted(addresses))
        return
    killed = here and liveness.kill_if_here(process)
    liveness.mark(silence, "killed by this follower (SIGKILL)" if killed else "left")
    logger.log(
        logging.ERROR,
        "lost the leader: %s: frozen, hung, or its node lost or cut off%s. Exiting with"
        " code 1 (LeaderLostError). HINT: see the leader's host; the trial goes back to"
        " pending when a leader next looks for orphans (the same command again). If the"
        " leader only stalls, raise NEPS_BCAST_PEER_TIMEOUT_S (now %g s).",
        silence.describe(),
        " (killed by this follower: it was on this host)"
        if killed
        else f" (not signalled: {where})"
        if where
        else "",
        rt.settings.peer_timeout_s,
    )
    exit_now(1)


def _on_broken(rt: Runtime, why: str) -> None:
    """This rank's liveness watch broke (``why``: which, and what it raised; the
    traceback is logged already). Without it a frozen peer would never be found and the
    lease would be renewed for ever, so the trial ends here as for a lost peer: a leader
    stops renewing its lease, puts the trial back (pending) and exits 1; a follower
    exits 1, and its leader, seeing it gone, puts the trial back."""
    liveness.mark(
        liveness.Silence(-1, "unknown", None, None, 0.0, liveness.now_doing(), broken=why),
        "the trial ended",
    )
    became = ""
    if rt.group_rank == 0 and rt.abandon_trial is not None:
        try:
            became = f"; the trial it held: {rt.abandon_trial(why)}"
        except Exception as exc:  # noqa: BLE001 - the exit below must happen: say what failed
            became = f"; the trial it held: not settled ({type(exc).__name__}: {exc})"
    logger.log(
        logging.ERROR,
        "%s%s. Exiting with code 1: an infrastructure fault, the trial goes back to"
        " pending. HINT: the traceback above names the fault; please report it.",
        why,
        became,
    )
    exit_now(1)


def _settle_or_leave(rt: Runtime, silence: liveness.Silence) -> None:
    """Leader, after a silent follower: the main thread settles the trial and ends the
    search once its waits fail. Where it stays blocked (on another rank that itself waits
    for the silent one: three ranks, a node cut off), this thread puts the trial back and
    ends the process, and every follower's leader watch then ends its own."""
    wait_s = max(5.0, rt.settings.peer_timeout_s)
    if rt.settled.wait(wait_s):
        return
    how = f"{silence.describe()}: frozen, hung, or its node lost or cut off"
    try:
        became = rt.abandon_trial(how) if rt.abandon_trial is not None else "left to its lease"
    except Exception as exc:  # noqa: BLE001 - the exit below must happen: say what failed
        became = f"not settled ({type(exc).__name__}: {exc}); a leader's look hands it back"
    logger.log(
        logging.ERROR,
        "still blocked %.0f s after %s; the trial it held: %s. Exiting with code 1"
        " (FollowerLostError); the followers' leader watches end the rest.",
        wait_s,
        how,
        became,
    )
    exit_now(1)


def _lost(rt: Runtime, exc: BaseException) -> LeaderLostError | FollowerLostError:
    if rt.group_rank == 0:
        who = rt.link.peers.describe_lost(rt.link.store, rt.world_size)
        hint = (
            "see the silent rank's host (frozen, swapping, a hung mount, its network);"
            if liveness.any_silent()
            else "a follower killed by a signal cannot report its error: see its log;"
        )
        return FollowerLostError(
            format_message(
                rt.tag,
                f"{who or 'a follower left the group'} ({first_line(exc)}).",
                f"{hint} the search stops here, and running the same command again resumes it.",
            )
        )
    return LeaderLostError(
        format_message(
            rt.tag,
            f"lost the leader (rank 0): {first_line(exc)}{liveness.why_leader_left(str(exc))}.",
            "the leader process exited or was killed; see its log. This follower"
            " stops because no one is left to hand it trials.",
        )
    )
