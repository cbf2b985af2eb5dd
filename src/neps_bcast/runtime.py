"""Per-process state shared by leader, follower and session.

One ``Runtime`` exists per ``neps_bcast.run`` call. It owns the leader's store, the
control channel, what is known of the user's DDP group (size, backend) and the trial
being evaluated in this process, and it implements the three per-trial exchanges
(session enter, session exit, trial end) on top of the channel.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from neps_bcast import _log
from neps_bcast._neps_compat import INJECTED_ARGUMENTS
from neps_bcast.channel import (
    Channel,
    ChannelClosedError,
    GlooChannel,
    JoinTimeoutError,
    connect_store,
    serve_store,
)
from neps_bcast.errors import (
    FollowerLostError,
    LeaderLostError,
    ProtocolError,
    TrialFailedError,
    format_message,
)
from neps_bcast.identity import Identity
from neps_bcast.launch import ENV_FIRST_SEQ, ENV_LEADER, ENV_LEADER_ADDR, Launch
from neps_bcast.messages import (
    ErrorRecord,
    Message,
    Phase,
    Report,
    StopMessage,
    TrialMessage,
    decode,
    encode,
)

_PEER_CLOSED_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "not initialized",
    "has been destroyed",
    "NCCL communicator was aborted",
)


def is_secondary(exc: BaseException) -> bool:
    """Was this error caused by a peer leaving the group (not a failure of its own)?"""
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in _PEER_CLOSED_MARKERS)


@dataclass
class TrialContext:
    message: TrialMessage
    runtime: Runtime
    in_session: bool = False
    reported: list[ErrorRecord] = field(default_factory=list)
    """Errors already raised on every rank by ``session()`` for this trial."""

    @property
    def config(self) -> dict[str, Any]:
        return {k: v for k, v in self.message.kwargs.items() if k not in INJECTED_ARGUMENTS}


_ACTIVE: Runtime | None = None


def active() -> Runtime | None:
    return _ACTIVE


class Runtime:
    def __init__(self, launch: Launch) -> None:
        self.launch = launch
        self.group_rank = launch.global_rank
        # A Lightning child's WORLD_SIZE is the Trainer's plan; the group tells the truth
        # once it exists (before that, joining the channel would deadlock with the
        # leader's init_process_group).
        self.world_size: int | None = launch.world_size if launch.kind == "external" else None
        self.backend: str | None = None
        self.store: dist.TCPStore | None = None
        self.channel: Channel | None = None
        self.generation = 0
        self.current: TrialContext | None = None
        self.seq = 0
        self.group_broken = False
        self.owns_group = False

    # -- identity and logging -------------------------------------------------
    @property
    def identity(self) -> Identity:
        return Identity(self.group_rank, self.world_size)

    @property
    def tag(self) -> str:
        return self.identity.tag

    def log(self, level: int, message: str, *args: object) -> None:
        _log.log(level, self.tag, message, *args)

    @contextmanager
    def activated(self) -> Iterator[Runtime]:
        global _ACTIVE  # noqa: PLW0603
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous

    # -- the user's DDP group -------------------------------------------------
    def observe_group(self) -> None:
        """Learn the size, rank and backend of the user's group while it exists."""
        if not (dist.is_available() and dist.is_initialized()):
            return
        size, rank = dist.get_world_size(), dist.get_rank()
        if self.world_size is not None and size != self.world_size and self.channel is not None:
            raise ProtocolError(
                format_message(
                    self.tag,
                    f"the DDP group now has {size} ranks, but this search started on"
                    f" {self.world_size}.",
                    "every trial must use the same number of processes"
                    " (Trainer devices x num_nodes).",
                )
            )
        if rank != self.group_rank:
            if self.launch.kind == "single" and rank == 0:
                pass
            else:
                raise ProtocolError(
                    format_message(
                        self.tag,
                        f"torch.distributed says this process is rank {rank}, but the"
                        f" launch made it rank {self.group_rank}.",
                        "do not change RANK/LOCAL_RANK between neps_bcast.run and fit.",
                    )
                )
        self.world_size = size
        self.backend = str(dist.get_backend())

    def break_group(self) -> None:
        """Destroy the user's group so that peers blocked in its collectives fail now."""
        self.observe_group()
        if dist.is_available() and dist.is_initialized():
            self.log(logging.DEBUG, "destroying the DDP group to release its peers")
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail to close
                self.log(logging.DEBUG, "destroy_process_group failed", exc_info=True)
        self.group_broken = True

    def reform_group(self) -> None:
        """Re-create the user's group before a trial, when a failure broke it.

        Uses the leader's store under a fresh prefix, so no stale rendezvous keys of an
        earlier group can be read; Lightning then finds the group and reuses it.
        """
        if not self.group_broken or self.world_size is None or self.world_size <= 1:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation += 1
        assert self.store is not None  # noqa: S101 - set whenever a group existed
        prefix = dist.PrefixStore(f"neps_bcast/pg/{self.generation}", self.store)
        backend = self.backend or "gloo"
        self.log(logging.INFO, "re-forming the DDP group (%s, generation %d)", backend,
                 self.generation)
        dist.init_process_group(backend, store=prefix, rank=self.group_rank,
                                world_size=self.world_size)
        self.group_broken = False

    # -- the leader's store ---------------------------------------------------
    def serve(self) -> dist.TCPStore:
        if self.store is None:
            self.store = serve_store()
            os.environ[ENV_LEADER] = f"127.0.0.1:{self.store.port}"
        return self.store

    def connect(self, address: str) -> dist.TCPStore:
        try:
            self.store = connect_store(address)
        except Exception as exc:
            raise LeaderLostError(
                format_message(
                    self.tag,
                    f"cannot reach the leader's store at {address}: {exc}.",
                    "the leader process has probably exited; see its log.",
                )
            ) from exc
        return self.store

    def leader_address(self) -> str:
        explicit = os.environ.get(ENV_LEADER_ADDR)
        if explicit:
            return explicit
        target = self.launch.main_address or "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect((target, self.launch.main_port or 29500))
                return str(probe.getsockname()[0])
            except OSError:
                return "127.0.0.1"

    # -- the channel ----------------------------------------------------------
    def ensure_channel(self) -> Channel | None:
        """The channel, joined now if the group is known and it was not joined yet."""
        if self.channel is not None:
            return self.channel
        self.observe_group()
        if self.world_size is None or self.world_size <= 1:
            return None
        if self.store is None:
            return None
        self.log(logging.DEBUG, "joining the control channel")
        try:
            self.channel = GlooChannel.join(self.store, self.group_rank, self.world_size,
                                            generation=0)
        except JoinTimeoutError as exc:
            raise ProtocolError(
                format_message(
                    self.tag,
                    f"ranks {exc.missing} of {self.world_size} never reached the end of"
                    " their first trial.",
                    "every rank must call neps_bcast.run and run the same"
                    " evaluate_pipeline; see the missing ranks' logs.",
                )
            ) from exc
        except ChannelClosedError as exc:
            raise self.lost(exc) from exc
        self.log(logging.INFO, "control channel up (%d ranks)", self.world_size)
        return self.channel

    def lost(self, exc: BaseException) -> LeaderLostError | FollowerLostError:
        if self.group_rank == 0:
            return FollowerLostError(
                format_message(
                    self.tag,
                    f"a follower left the group during the trial: {exc}.",
                    "see the followers' logs; a follower killed by a signal cannot report.",
                )
            )
        return LeaderLostError(
            format_message(
                self.tag,
                f"lost the leader (rank 0): {exc}.",
                "the leader process exited or was killed; see its log. This follower"
                " stops because no one is left to hand it trials.",
            )
        )

    def send(self, message: Message) -> None:
        """Leader: hand a message to every follower (first contact or broadcast)."""
        payload = encode(message, tag=self.tag)
        channel = self.ensure_channel()
        if channel is not None:
            try:
                channel.broadcast(payload)
            except ChannelClosedError as exc:
                raise self.lost(exc) from exc
            return
        if isinstance(message, TrialMessage):
            store = self.serve()
            store.set(f"neps_bcast/trial/{message.seq}", payload)
            os.environ[ENV_FIRST_SEQ] = str(message.seq)

    def receive(self) -> TrialMessage | StopMessage:
        """Follower: wait (blocked, no polling) for the leader's next message."""
        channel = self.ensure_channel()
        if channel is None:
            raise ProtocolError(
                format_message(self.tag, "no control channel to receive the next trial on.",
                               "this is a bug in neps_bcast; please report it.")
            )
        try:
            payload = channel.broadcast(None)
        except ChannelClosedError as exc:
            raise self.lost(exc) from exc
        message = decode(payload, tag=self.tag)
        if not isinstance(message, TrialMessage | StopMessage):
            raise ProtocolError(format_message(self.tag, f"expected a trial, got {message!r}."))
        return message

    def first_contact(self) -> TrialMessage:
        """Lightning child: the trial its leader was evaluating when it spawned us."""
        assert self.launch.leader_store is not None  # noqa: S101 - checked by detect()
        store = self.connect(self.launch.leader_store)
        try:
            payload = store.get(f"neps_bcast/trial/{self.launch.first_seq}")
        except Exception as exc:
            raise self.lost(exc) from exc
        message = decode(payload, tag=self.tag)
        if not isinstance(message, TrialMessage):
            raise ProtocolError(format_message(self.tag, f"expected a trial, got {message!r}."))
        return message

    def exchange(self, phase: Phase, ctx: TrialContext,
                 error: ErrorRecord | None) -> list[Report] | None:
        """Every rank contributes a report for ``phase``; None when there is no group."""
        channel = self.ensure_channel()
        if channel is None:
            return None
        mine = Report(self.group_rank, phase, ctx.message.seq, ctx.message.trial_id, error)
        try:
            raw = channel.allgather(encode(mine, tag=self.tag))
        except ChannelClosedError as exc:
            raise self.lost(exc) from exc
        reports = [decode(r, tag=self.tag) for r in raw]
        if not all(isinstance(r, Report) for r in reports):
            raise ProtocolError(format_message(self.tag, "a rank sent a non-report."))
        typed = [r for r in reports if isinstance(r, Report)]
        if any(r.phase != phase for r in typed):
            where = ", ".join(f"rank {r.group_rank} at {r.phase.value}" for r in typed)
            raise ProtocolError(
                format_message(
                    self.tag,
                    f"the ranks reached different points of trial {ctx.message.trial_id}:"
                    f" {where}.",
                    "call neps_bcast.session() on every rank, once per trial, and return"
                    " from evaluate_pipeline on every rank.",
                )
            )
        return typed

    @contextmanager
    def running(self, message: TrialMessage) -> Iterator[TrialContext]:
        ctx = TrialContext(message, self)
        self.current = ctx
        try:
            yield ctx
        finally:
            self.current = None

    def end_trial(self, ctx: TrialContext, error: BaseException | None) -> list[ErrorRecord]:
        """Trial end on every rank: report how the function ended, learn the others'.

        Returns the failures not already raised by ``session()``, root causes first.
        """
        record = None
        if error is not None and not isinstance(error, TrialFailedError):
            record = ErrorRecord.from_exception(self.group_rank, error, pid=os.getpid(),
                                                secondary=is_secondary(error))
            if (self.world_size or 0) > 1:
                self.break_group()
        reports = self.exchange(Phase.TRIAL_END, ctx, record)
        records = [record] if record is not None else []
        if reports is not None:
            records = [r.error for r in reports if r.error is not None]
        if records or isinstance(error, TrialFailedError):
            if (self.world_size or 0) > 1:
                self.break_group()
        return sort_records(records)

    def shutdown(self, reason: str) -> None:
        """Leader: tell every follower to stop, then close the channel."""
        try:
            if self.channel is not None or (self.world_size or 0) > 1:
                self.send(StopMessage(reason))
        finally:
            self.close()

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for name in (ENV_LEADER, ENV_FIRST_SEQ):
            if self.launch.kind == "single":
                os.environ.pop(name, None)


def sort_records(records: list[ErrorRecord]) -> list[ErrorRecord]:
    """Root causes first (errors of their own, earliest first), then secondary ones."""
    return sorted(records, key=lambda r: (r.secondary, r.timestamp, r.group_rank))


def failure_text(records: list[ErrorRecord], trial_id: str) -> str:
    primary = [r for r in records if not r.secondary] or records
    secondary = [r for r in records if r not in primary]
    ranks = ", ".join(str(r.group_rank) for r in primary)
    head = f"trial {trial_id} failed on rank{'s' if len(primary) > 1 else ''} {ranks}: "
    head += "; ".join(r.headline() for r in primary)
    if secondary:
        head += ". Caused by it: " + "; ".join(r.headline() for r in secondary)
    tracebacks = "\n".join(
        f"--- traceback of rank {r.group_rank} (pid {r.pid}) ---\n{r.traceback}" for r in primary
    )
    return f"{head}.\n{tracebacks}"


def timedelta_s(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)
