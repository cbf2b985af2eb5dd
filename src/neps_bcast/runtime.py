"""Per-process state shared by leader, follower and session.

One ``Runtime`` exists per ``neps_bcast.run`` call. It owns the leader's store, the
control channel, what is known of the user's DDP group (size, backend) and the trial
being evaluated in this process, and it implements the three per-trial exchanges
(session enter, session exit, trial end) on top of the channel.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import socket
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from neps_bcast import _dist, _log, sockets, watchdog
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
    mine: ErrorRecord | None = None
    """This rank's failure in this trial, once it raised."""
    published: bool = False
    end_reports: list[Report] | None = None
    """The trial-end exchange, when a peer already made it during session entry."""

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
        self.store: _dist.TCPStore | None = None
        self.channel: Channel | None = None
        self.generation = 0
        self.current: TrialContext | None = None
        self.seq = 0
        self.group_broken = False
        self.owns_group = False
        self.own_sockets: set[int] = set()
        """Connections of neps_bcast's own store and channel (never shut on failure)."""
        self.group_sockets: set[int] | None = None
        """Connections of the user's current group, once known."""
        self._seen_group: object | None = None
        self._trial_start_sockets: set[int] = set()
        self.peer_pids: dict[int, str] = {}
        self.stopping = False
        """Follower: the leader said STOP, so losing it from now on is normal."""
        self.settled = threading.Event()
        self.watch: watchdog.LeaderWatch | None = None
        """Follower: the thread watching the leader (see ``watchdog``)."""
        """Leader: the trial that ends the search is recorded (or neps.run ended)."""

    # -- identity and logging -------------------------------------------------
    @property
    def identity(self) -> Identity:
        return Identity(self.group_rank, self.world_size)

    @property
    def tag(self) -> str:
        return self.identity.tag

    def log(self, level: int, message: str, *args: object, exc_info: bool = False) -> None:
        _log.log(level, self.tag, message, *args, exc_info=exc_info)

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
        world = dist.group.WORLD
        if world is not self._seen_group:
            # A group formed during this trial (by Lightning or the user): its
            # connections are the ones that appeared since the trial started.
            self._seen_group = world
            if self.group_sockets is None:
                self.group_sockets = self._new_sockets(self._trial_start_sockets)

    def _new_sockets(self, before: set[int]) -> set[int]:
        new = sockets.tcp_among(sockets.socket_set() - before - self.own_sockets)
        if (
            self.store is not None
            and self.group_rank == 0
            and self.launch.kind != "lightning_child"
        ):
            new -= sockets.connections_on_port(self.store.port)
        return new

    @contextlib.contextmanager
    def own_connections(self) -> Iterator[None]:
        """Remember the connections neps_bcast makes inside this block as its own."""
        before = sockets.socket_set()
        try:
            yield
        finally:
            self.own_sockets |= sockets.socket_set() - before

    def break_group(self, exc: BaseException | None = None) -> None:
        """Take the user's group down so that peers blocked in its collectives fail now.

        Destroying the group is not enough while DDP holds it (see ``sockets``):
        its connections are shut (gloo) or its communicators aborted (NCCL).
        """
        with contextlib.suppress(Exception):
            self.observe_group()
        if exc is not None and exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)  # drop finished frames' DDP refs
        initialized = dist.is_available() and dist.is_initialized()
        if initialized and self.backend == "nccl":
            with contextlib.suppress(Exception):
                dist.distributed_c10d._abort_process_group()
        if self.group_sockets:
            n = sockets.shutdown(self.group_sockets)
            self.log(logging.DEBUG, "shut %d connection(s) of the DDP group", n)
        if initialized:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may fail to close
                self.log(logging.DEBUG, "destroy_process_group failed", exc_info=True)
        self.group_sockets = None
        self._seen_group = None
        gc.collect()
        self.group_broken = True

    def needs_group(self) -> bool:
        return (self.world_size or 0) > 1 and (
            self.group_broken or not (dist.is_available() and dist.is_initialized())
        )

    def reform_group(self) -> None:
        """Re-create the user's group before a trial, when a failure (or user code) ended it.

        Uses the leader's store under a fresh prefix, so no stale rendezvous keys of an
        earlier group can be read; Lightning then finds the group and reuses it.
        """
        if not self.needs_group() or self.store is None or self.world_size is None:
            return
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation += 1
        assert self.store is not None
        prefix = _dist.PrefixStore(f"neps_bcast/pg/{self.generation}", self.store)
        backend = self.backend or "gloo"
        self.log(
            logging.INFO, "re-forming the DDP group (%s, generation %d)", backend, self.generation
        )
        before = sockets.socket_set()
        dist.init_process_group(
            backend, store=prefix, rank=self.group_rank, world_size=self.world_size
        )
        self.group_sockets = sockets.tcp_among(sockets.socket_set() - before - self.own_sockets)
        self._seen_group = dist.group.WORLD
        self.group_broken = False

    # -- the leader's store ---------------------------------------------------
    def serve(self) -> _dist.TCPStore:
        if self.store is None:
            with self.own_connections():
                self.store = serve_store()
            os.environ[ENV_LEADER] = f"127.0.0.1:{self.store.port}"
        return self.store

    def connect(self, address: str) -> _dist.TCPStore:
        try:
            with self.own_connections():
                self.store = connect_store(address)
                self.watch = watchdog.LeaderWatch(
                    address, self.group_rank, lambda: self.tag, lambda: self.stopping
                )
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
            with self.own_connections():
                self.channel = GlooChannel.join(
                    self.store, self.group_rank, self.world_size, generation=0
                )
            self._read_peer_pids()
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

    def _read_peer_pids(self) -> None:
        if self.store is None or self.world_size is None:
            return
        with contextlib.suppress(Exception):
            for r in range(self.world_size):
                raw = self.store.get(f"neps_bcast/ctl/0/joined/{r}")
                self.peer_pids[r] = raw.decode()

    def describe_lost_peers(self) -> str:
        """Which followers are gone, and how (exit code or signal), where we can tell."""
        import signal as _signal
        import subprocess

        here = socket.gethostname()
        procs = {p.pid: p for p in gc.get_objects() if isinstance(p, subprocess.Popen)}
        lost = []
        for r, where in sorted(self.peer_pids.items()):
            if r == self.group_rank:
                continue
            host, _, pid_text = where.rpartition(":")
            pid = int(pid_text)
            if host != here:
                continue
            proc = procs.get(pid)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2.0)  # Lightning's child: its exit status is ours to read
                code = proc.returncode
                if code is None:
                    continue
                how = (
                    f"signal {-code} ({_signal.Signals(-code).name})"
                    if code < 0
                    else f"exit code {code}"
                )
                lost.append(f"rank {r} lost: {how} (pid {pid})")
            elif not _alive(pid):
                lost.append(f"rank {r} lost: its process (pid {pid}) is gone")
        return "; ".join(lost)

    def lost(self, exc: BaseException) -> LeaderLostError | FollowerLostError:
        if self.group_rank == 0:
            who = self.describe_lost_peers() or "a follower left the group"
            return FollowerLostError(
                format_message(
                    self.tag,
                    f"{who} ({_first_line(exc)}).",
                    "a follower killed by a signal cannot report its error: see its log;"
                    " the search stops here, and running the same command again resumes it.",
                )
            )
        return LeaderLostError(
            format_message(
                self.tag,
                f"lost the leader (rank 0): {_first_line(exc)}.",
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
            store.set(f"neps_bcast/trial/{message.seq}", payload)  # type: ignore[arg-type]  # stubs say str; bytes work
            os.environ[ENV_FIRST_SEQ] = str(message.seq)

    def receive(self) -> TrialMessage | StopMessage:
        """Follower: wait (blocked, no polling) for the leader's next message."""
        channel = self.ensure_channel()
        if channel is None:
            raise ProtocolError(
                format_message(
                    self.tag,
                    "no control channel to receive the next trial on.",
                    "this is a bug in neps_bcast; please report it.",
                )
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
        assert self.launch.leader_store is not None
        store = self.connect(self.launch.leader_store)
        try:
            payload = store.get(f"neps_bcast/trial/{self.launch.first_seq}")
        except Exception as exc:
            raise self.lost(exc) from exc
        message = decode(payload, tag=self.tag)
        if not isinstance(message, TrialMessage):
            raise ProtocolError(format_message(self.tag, f"expected a trial, got {message!r}."))
        return message

    def exchange(
        self, phase: Phase, ctx: TrialContext, error: ErrorRecord | None
    ) -> list[Report] | None:
        """Every rank contributes a report for ``phase``; None when there is no group.

        Ranks may be at different phases after a failure: the caller decides.
        """
        channel = self.ensure_channel()
        if channel is None:
            return None
        mine = Report(self.group_rank, phase, ctx.message.seq, ctx.message.trial_id, error)
        try:
            raw = channel.allgather(encode(mine, tag=self.tag))
        except ChannelClosedError as exc:
            raise self.lost(exc) from exc
        reports = [decode(r, tag=self.tag) for r in raw]
        typed = [r for r in reports if isinstance(r, Report)]
        if len(typed) != len(reports):
            raise ProtocolError(format_message(self.tag, "a rank sent a non-report."))
        return typed

    def mismatch_record(self, reports: list[Report], ctx: TrialContext) -> ErrorRecord:
        where = ", ".join(f"rank {r.group_rank} at {r.phase.value}" for r in reports)
        text = format_message(
            self.tag,
            f"the ranks reached different points of trial {ctx.message.trial_id}: {where}.",
            "call neps_bcast.session() on every rank, once per trial, or on none.",
        )
        return ErrorRecord.from_exception(self.group_rank, ProtocolError(text), pid=os.getpid())

    @contextmanager
    def running(self, message: TrialMessage) -> Iterator[TrialContext]:
        ctx = TrialContext(message, self)
        self.current = ctx
        # Cheap (no /proc/net read): the group's connections are told apart later.
        self._trial_start_sockets = sockets.socket_set()
        try:
            yield ctx
        finally:
            self.current = None

    # -- failures -------------------------------------------------------------
    def publish_error(self, ctx: TrialContext, record: ErrorRecord) -> None:
        """Make this rank's failure readable by every rank before releasing them."""
        if ctx.published or self.store is None:
            return
        ctx.published = True
        prefix = f"neps_bcast/err/{ctx.message.seq}"
        try:
            self.store.set(f"{prefix}/{self.group_rank}", pickle.dumps(record))  # type: ignore[arg-type]  # stubs say str; bytes work
            self.store.add(f"{prefix}/n", 1)  # a round trip: the set above has landed
        except Exception as exc:
            if self.group_rank != 0:
                raise self.lost(exc) from exc
            raise

    def published_errors(self, ctx: TrialContext) -> list[ErrorRecord]:
        if self.store is None or self.world_size is None:
            return []
        prefix = f"neps_bcast/err/{ctx.message.seq}"
        found = []
        try:
            if self.store.add(f"{prefix}/n", 0) == 0:
                return []
            for r in range(self.world_size):
                if self.store.check([f"{prefix}/{r}"]):
                    record = pickle.loads(self.store.get(f"{prefix}/{r}"))  # noqa: S301
                    if isinstance(record, ErrorRecord):
                        found.append(record)
        except Exception as exc:
            if self.group_rank != 0:
                raise self.lost(exc) from exc
            raise
        return found

    def fail(self, ctx: TrialContext, exc: BaseException) -> list[ErrorRecord]:
        """This rank raised in a trial: report it, release the peers, return all known."""
        record = ErrorRecord.from_exception(
            self.group_rank, exc, pid=os.getpid(), secondary=is_secondary(exc)
        )
        ctx.mine = record
        self.log(
            logging.ERROR,
            "trial %s raised %s: %s",
            ctx.message.trial_id,
            record.type_name,
            _first_line(exc),
        )
        self.publish_error(ctx, record)
        if (self.world_size or 0) > 1 or dist.is_initialized():
            self.break_group(exc)
        others = [r for r in self.published_errors(ctx) if r.group_rank != self.group_rank]
        return sort_records([record, *others])

    def end_trial(self, ctx: TrialContext, error: BaseException | None) -> list[ErrorRecord]:
        """Trial end on every rank: report how the function ended, learn the others'.

        Returns every failure of the trial, root causes first.
        """
        if error is not None and ctx.mine is None:
            self.fail(ctx, error)
        if ctx.end_reports is None:
            ctx.end_reports = self.exchange(Phase.TRIAL_END, ctx, ctx.mine)
        reports = ctx.end_reports
        records = [ctx.mine] if ctx.mine is not None else []
        if reports is not None:
            records = [r.error for r in reports if r.error is not None]
            if not records and any(r.phase != Phase.TRIAL_END for r in reports):
                records = [self.mismatch_record(reports, ctx)]
        if records and (self.world_size or 0) > 1 and not self.group_broken:
            self.break_group()
        return sort_records(records)

    def shutdown(self, reason: str) -> None:
        """Leader: tell every follower to stop, wait for their goodbye, close the channel."""
        try:
            if self.store is not None:
                with contextlib.suppress(Exception):  # losing us is normal from now on
                    for r in range(1, self.world_size or 1):
                        self.store.set(watchdog.released_key(r), b"1")  # type: ignore[arg-type]  # stubs say str; bytes work
            if self.channel is not None or (self.world_size or 0) > 1:
                self.send(StopMessage(reason))
                if self.channel is not None:
                    with contextlib.suppress(ChannelClosedError):
                        self.channel.allgather(b"bye")
        finally:
            self.close()

    def release_watch(self) -> None:
        """Follower leaving (normally or not): end the leader watch first."""
        self.stopping = True
        if self.store is not None and self.watch is not None:
            self.watch.release(self.store)
        self.watch = None

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        for name in (ENV_LEADER, ENV_FIRST_SEQ):
            if self.launch.kind == "single":
                os.environ.pop(name, None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


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
