"""Liveness of a group's ranks that depends neither on sockets closing nor on the
user's collectives: a heartbeat through the leader's store, judged by each reader's
own monotonic clock.

Why: a killed process's kernel closes its sockets, and its peers read "connection
closed" at once. A lost node (power, panic, a cut cable), a frozen VM or a rank stuck
on a hung mount sends nothing more: its peers wait for the kernel's retransmission
limit (~15 min, and only if they send), gloo's 30-minute default or our last-resort
bound (7 days), and the blocked leader's lease stays fresh so that nobody takes the
trial over. Measured here (torch 2.13): an operation of a ``TCPStore`` client on a
SIGSTOPped server blocks past the client's own timeout, so no store or gloo timeout
bounds such a wait either.

How: once the control channel is up, every follower's beat thread writes a counter
under its own key of the leader's store every ``beat_s`` (a tenth of
``NEPS_BCAST_PEER_TIMEOUT_S``) and reads the leader's; the leader's monitor thread
reads every follower's and writes its own. Each record is tagged with the search's
secret and carries a counter that must grow (a replayed record is no beat), what the
rank is doing, the address it reaches the leader from, and who beats (``procfs.Process``:
host, boot id, pid namespace, pid, start time). A beat from another process than the one
the rank's peer record names (or, without a record, than the one that beat first) is
refused: a verdict names, and may signal, only the process that went silent.
- The leader finds a follower silent when its counter has not grown for the bound,
  counted only while the monitor itself was running (a leader that was frozen itself,
  or starved of CPU, does not blame its followers for its own gap).
- A follower finds its leader silent when one of its beats has waited for the bound:
  the leader's store runs in the leader's process, so a frozen leader, or one whose
  node is lost or cut off, never answers.
Kernel-level detection does not see a frozen process (its kernel still ACKs and
answers keepalives), so it is the heartbeat that covers frozen and hung ranks; the
beat connections also carry ``TCP_USER_TIMEOUT`` (the bound) and keepalives, so that
a beat stuck behind a lost node fails by itself instead of blocking its thread.

What a silent peer costs is decided above this module (``on_silent``): it gets the
outcome of a lost process. A watch that breaks (an exception in the monitor, a beat or
a judge thread) is no reason to stop watching quietly: it is logged at ERROR with its
traceback and reaches ``on_silent`` as a verdict of its own (``Silence.broken``), which
ends the trial as an infrastructure fault. A beat whose wait ran out is tried again on a
fresh connection, its silence counted from the first unanswered beat: a partition that
heals within the bound costs nothing, and one that does not is named as before. A busy
rank is never silent: the store is served by a C++ thread that needs no GIL, and a main
thread that holds the GIL for half the bound delays a beat by at most that much.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from neps_bcast.compat import procfs
from neps_bcast.compat.torch import Store
from neps_bcast.errors import AuthError
from neps_bcast.log import logger
from neps_bcast.transport import sockets, store
from neps_bcast.transport.auth import Signer

BEATS_PER_BOUND = 10
"""Beats in one ``NEPS_BCAST_PEER_TIMEOUT_S``: a silent peer is one that missed ~10."""

_doing = "starting"
_changed = threading.Event()
"""Set when this rank starts another step: its next beat goes out at once, so a peer
that goes silent right after it is named at the step it was in."""


def doing(what: str) -> None:
    """What this rank is doing now, sent with its beats (named when it goes silent)."""
    global _doing  # noqa: PLW0603 - one rank per process, read by the beat thread
    _doing = what
    _changed.set()


def now_doing() -> str:
    return _doing


_STEP_OF_TRIAL = re.compile(
    r"(?P<phase>handing|in a meeting of the ranks of|evaluating) trial \S+ \(#(?P<seq>\d+)\)"
)
_PHASES = {"handing": 0, "in a meeting of the ranks of": 1, "evaluating": 2}


def _step_key(what: str) -> tuple[int, int] | None:
    """Where a step lies in the search: (trial seq, phase); None for a step of no trial."""
    m = _STEP_OF_TRIAL.match(what)
    return None if m is None else (int(m["seq"]), _PHASES[m["phase"]])


_leader_floor: str | None = None
"""Follower: the latest step its leader must have reached, from this rank's own steps
(it received a trial: the leader handed it over; it met the leader). A leader that froze
right after a step is named there, not at the step of its last beat heard before."""


def leader_reached(what: str) -> None:
    """Follower: the leader has reached the step ``what`` (this rank's own step says so)."""
    global _leader_floor  # noqa: PLW0603 - one rank per process, read by the judge thread
    _leader_floor = what


def leader_step(last_heard: str) -> str:
    """Follower: what the silent leader was doing, the later of its last beat's step and
    the step this rank's own steps prove it reached (a beat is read once a tenth of the
    bound: a meeting shorter than that is never heard)."""
    floor = _leader_floor
    if floor is None:
        return last_heard
    heard, proven = _step_key(last_heard), _step_key(floor)
    if proven is None:
        return last_heard
    if last_heard in ("starting", "unknown") or (heard is not None and heard < proven):
        return floor
    return last_heard


def beat_key(group_rank: int) -> str:
    return f"{store.PREFIX}/beat/{group_rank}"


@dataclass(frozen=True)
class Silence:
    """A peer that has gone silent: who, where, what it was doing, for how long.

    ``host`` and ``pid`` name it in log lines; ``process`` is who it is (from its peer
    record, else from its beats; None: not known), and the only thing a verdict acts on:
    a peer whose ``process`` is not here (another host, boot or pid namespace) is never
    signalled."""

    group_rank: int
    host: str
    pid: int | None
    address: str | None
    silent_s: float
    doing: str
    process: procfs.Process | None = None
    broken: str | None = None
    """Not a silent peer but this process's own watch, broken (what raised, in which
    thread): nobody is signalled, and the trial ends as an infrastructure fault."""

    def describe(self) -> str:
        if self.broken is not None:
            return self.broken
        pid = f"pid {self.pid}" if self.pid is not None else "pid unknown"
        return (
            f"rank {self.group_rank} ({pid} on host {self.host}) silent for"
            f" {self.silent_s:.0f} s while {self.doing}"
        )


_silenced: dict[int, tuple[Silence, str]] = {}
"""The peers this process declared silent, and what it did about it."""


def silenced(group_rank: int) -> tuple[Silence, str] | None:
    """Whether (and how) this process declared ``group_rank`` silent."""
    return _silenced.get(group_rank)


def any_silent() -> bool:
    return bool(_silenced)


def silent_ones() -> list[Silence]:
    return [silence for silence, _ in _silenced.values()]


def mark(silence: Silence, action: str) -> None:
    _silenced[silence.group_rank] = (silence, action)


def forget() -> None:
    """A new ``run`` call (tests run several in one process)."""
    global _leader_floor  # noqa: PLW0603 - see leader_reached
    _silenced.clear()
    _leader_floor = None


@dataclass
class _Beat:
    n: int = 0
    doing: str = "unknown"
    address: str | None = None
    silent_s: float = 0.0
    process: procfs.Process | None = None
    """Who beats under this rank's key (from its first beat on)."""


_me: procfs.Process | None = None


def _myself() -> procfs.Process:
    """This process, read once (who it is does not change while it runs)."""
    global _me  # noqa: PLW0603 - a cache of this process's own identity
    if _me is None or _me.pid != os.getpid():
        _me = procfs.Process.me()
    return _me


def _record(n: int, address: str | None) -> dict[str, object]:
    record: dict[str, object] = {
        "n": n,
        "doing": _doing,
        "addr": address,
        "who": _myself().to_json(),
    }
    if _silenced:
        record["silent"] = "; ".join(silence.describe() for silence, _ in _silenced.values())
    return record


_leader_found: str | None = None
"""Follower: the silent ranks its leader last said it found (from the leader's beat)."""


def why_leader_left(error: str) -> str:
    """Follower: what to add to "lost the leader": the silence its leader found (it then
    leaves), or a connection that timed out (the leader's node lost or cut off)."""
    if _leader_found is not None:
        return f" (the leader had found {_leader_found}: frozen, hung, or its node lost or cut off)"
    if "timed out" in error.lower():
        return (
            " (no answer from the leader's host: the leader is silent, frozen or hung,"
            " or its node is lost or cut off)"
        )
    return ""


def _read(client: Store, signer: Signer, group_rank: int) -> dict[str, object] | None:
    """A rank's beat record, authenticated; None when it has not beaten yet."""
    key = beat_key(group_rank)
    if not client.check([key]):
        return None
    raw = json.loads(store.take(client, signer, key, sender=group_rank).decode())
    return raw if isinstance(raw, dict) else None


def _beater(
    record: dict[str, object], group_rank: int, expected: procfs.Process | None
) -> procfs.Process | None:
    """Who sent ``record`` (None: it does not say; it is authentic all the same, signed
    with the search's key, and a verdict without a process signals nobody); ``ValueError``
    for a record that names another process than ``expected`` (the rank's peer record, or
    the process that beat before)."""
    if record.get("who") is None:
        return None
    who = procfs.Process.from_json(record.get("who"))
    if who is None:
        raise ValueError("it names no process (host, boot id, pid namespace, pid, start time)")
    if expected is not None and who != expected:
        raise ValueError(
            f"it comes from {who.describe()} ({who.pid_namespace}, started at tick"
            f" {who.start_ticks}), not from rank {group_rank}'s process, {expected.describe()}"
            f" ({expected.pid_namespace}, started at tick {expected.start_ticks})"
        )
    return who


_STORE_ERRORS = (dist.DistError, OSError)
"""What a store operation raises when its peer is gone or silent (torch's store and
network errors, the kernel's): anything else in a watch's thread is a broken watch."""


def _end_of_watch(
    watch: str,
    group_rank: int,
    exc: BaseException,
    stopped: threading.Event,
    on_silent: Callable[[Silence], None],
    doing: str,
) -> None:
    """A watch's thread raised: logged at ERROR with the traceback and, unless the
    watch was over already, a verdict of its own (nobody signalled, the trial ended as
    an infrastructure fault). Only a store error after the watch was stopped (the run
    ends, its store may be gone) is quiet."""
    if stopped.is_set() and isinstance(exc, _STORE_ERRORS):
        logger.log(logging.DEBUG, "%s ends: %s", watch, exc)
        return
    what = f"{type(exc).__name__}: {exc}"
    logger.log(logging.ERROR, "%s raised %s", watch, what, exc_info=exc)
    if stopped.is_set():
        return  # a verdict was given (its handling raised: logged above) or the run ends
    stopped.set()
    text = f"{watch} broke ({what}): no silence would be found from here on"
    on_silent(Silence(group_rank, "unknown", None, None, 0.0, doing, None, broken=text))


def _no_identity(_group_rank: int) -> procfs.Process | None:
    return None


def _accrue(last_wake: float, beat_s: float) -> tuple[float, float]:
    """The time since this thread's last wake-up that counts towards a peer's silence
    (at most two beats: a gap longer than that was this process's own), and now."""
    now = time.monotonic()
    return min(now - last_wake, 2 * beat_s), now


KERNEL_BOUND = 1.5
"""The kernel's bound on unacknowledged data (``TCP_USER_TIMEOUT``) in peer bounds: later
than the heartbeat's verdict, so that a lost node is named silent by the heartbeat, and
the kernel only frees a thread still blocked on a connection to it."""


STORE_BOUND = 3.0
"""The timeout of a beat's store operations in peer bounds: a backstop, later than the
heartbeat's verdict. At one bound, torch's client gave up on a frozen leader's reply (and
logged the timeout) before the follower's judge, which counts the same wait in ticks of a
tenth of the bound, had named the leader silent (the fault sweep's frozen-leader cells)."""


def guard(inodes: set[int], bound_s: float) -> int:
    """TCP_USER_TIMEOUT and keepalives on the given connections of this process."""
    return sockets.set_liveness_options(inodes, KERNEL_BOUND * bound_s, bound_s / BEATS_PER_BOUND)


def _timed_out(exc: BaseException) -> bool:
    """A store operation that gave up waiting (torch's timeout, or the kernel's
    ``ETIMEDOUT`` on unacknowledged data), not one that found the peer gone."""
    if isinstance(exc, TimeoutError):
        return True
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _store_timeout(bound_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=STORE_BOUND * bound_s)


def _guard_connections(before: set[int], bound_s: float) -> None:
    guard(set(sockets.socket_inodes()) - before, bound_s)


class Monitor:
    """The leader's monitor of its followers (a thread), started once the channel is up."""

    def __init__(
        self,
        address: str,
        world_size: int,
        signer: Signer,
        bound_s: float,
        on_silent: Callable[[Silence], None],
        peer_of: Callable[[int], tuple[str, int | None]],
        process_of: Callable[[int], procfs.Process | None] = _no_identity,
    ) -> None:
        """``peer_of``: a rank's host and pid, for log lines; ``process_of``: who it is
        (its peer record), which its beats must come from."""
        self.world_size = world_size
        self.signer = signer
        self.bound_s = bound_s
        self.beat_s = bound_s / BEATS_PER_BOUND
        self._on_silent = on_silent
        self._peer_of = peer_of
        self._process_of = process_of
        self._stopped = threading.Event()
        self._beats = {r: _Beat() for r in range(1, world_size)}
        self._n = 0
        before = set(sockets.socket_inodes())
        host, _, port = address.rpartition(":")
        self._client = store.connect(f"{host}:{port}", _store_timeout(bound_s), bound_s)
        _guard_connections(before, bound_s)
        self.thread = threading.Thread(target=self._run, name="neps_bcast-monitor", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stopped.set()
        _changed.set()

    def beats_seen(self, group_rank: int) -> int:
        """The highest beat of ``group_rank`` this monitor has accepted."""
        return self._beats[group_rank].n

    def _run(self) -> None:
        try:
            self._watch()
        except Exception as exc:  # noqa: BLE001 - a broken watch ends the trial, never quietly
            watch = f"the leader's liveness monitor of ranks 1-{self.world_size - 1}"
            _end_of_watch(watch, -1, exc, self._stopped, self._on_silent, _doing)

    def _watch(self) -> None:
        n = 0
        last_wake = time.monotonic()
        while True:
            _changed.wait(self.beat_s)
            _changed.clear()
            if self._stopped.is_set():
                return
            n += 1
            self._put(n)
            gap, last_wake = _accrue(last_wake, self.beat_s)
            for r, beat in self._beats.items():
                self._look(r, beat, gap)

    def _put(self, n: int) -> None:
        """The leader's own beat (``n`` < 0: the last one, the counter kept)."""
        self._n = n if n >= 0 else self._n
        record = json.dumps(_record(self._n, None)).encode()
        store.put(self._client, self.signer, beat_key(0), record, sender=0)

    def _look(self, group_rank: int, beat: _Beat, gap: float) -> None:
        try:
            record = _read(self._client, self.signer, group_rank)
            who = None
            if record is not None:
                expected = self._process_of(group_rank) or beat.process
                who = _beater(record, group_rank, expected)
        except (AuthError, ValueError) as exc:
            logger.log(logging.ERROR, "refused a beat of rank %d: %s", group_rank, exc)
            record = None
        if record is None:
            if beat.n == 0:
                return  # not beating yet: the join bound covers a rank still starting
        elif isinstance(record.get("n"), int) and int(str(record["n"])) > beat.n:
            beat.n = int(str(record["n"]))
            beat.doing = str(record.get("doing", "unknown"))
            address = record.get("addr")
            beat.address = address if isinstance(address, str) else None
            beat.process = who or beat.process
            beat.silent_s = 0.0
            return
        beat.silent_s += gap
        if beat.silent_s > self.bound_s and not self._stopped.is_set():
            host, pid = self._peer_of(group_rank)
            process = self._process_of(group_rank) or beat.process
            silence = Silence(
                group_rank, host, pid, beat.address, beat.silent_s, beat.doing, process
            )
            self._stopped.set()
            self._on_silent(silence)
            with contextlib.suppress(Exception):  # the followers read it with their beats
                self._put(-1)


class LeaderBeat:
    """A follower's beat (a thread) and its judge of the leader (a second thread)."""

    def __init__(
        self,
        address: str,
        group_rank: int,
        signer: Signer,
        bound_s: float,
        on_silent: Callable[[Silence], None],
        leader: Callable[[], tuple[str, int | None]],
        leader_process: Callable[[], procfs.Process | None] = lambda: None,
    ) -> None:
        """``leader``: its host and pid, for log lines; ``leader_process``: who it is
        (its peer record), which its beats must come from."""
        self.group_rank = group_rank
        self.signer = signer
        self.bound_s = bound_s
        self.beat_s = bound_s / BEATS_PER_BOUND
        self._on_silent = on_silent
        self._leader = leader
        self._leader_process = leader_process
        self._heard: procfs.Process | None = None
        """The process the leader's beats came from."""
        self._stopped = threading.Event()
        self._pending_since: float | None = None
        self._leader_doing = "unknown"
        self._address = _route_to(address.rpartition(":")[0])
        self._store = address
        before = set(sockets.socket_inodes())
        self._client = store.connect(address, _store_timeout(bound_s), bound_s)
        _guard_connections(before, bound_s)
        self._beat_thread = threading.Thread(target=self._beat, name="neps_bcast-beat", daemon=True)
        self._judge_thread = threading.Thread(
            target=self._judge, name="neps_bcast-beat-judge", daemon=True
        )
        self._beat_thread.start()
        self._judge_thread.start()

    def stop(self) -> None:
        self._stopped.set()
        _changed.set()

    def _beat(self) -> None:
        try:
            self._beats()
        except Exception as exc:  # noqa: BLE001 - a broken watch ends the trial, never quietly
            self._break(f"rank {self.group_rank}'s beat to its leader", exc)

    def _break(self, watch: str, exc: BaseException) -> None:
        doing = leader_step(self._leader_doing)
        _end_of_watch(watch, 0, exc, self._stopped, self._on_silent, doing)

    def _beats(self) -> None:
        n = 0
        while not self._stopped.is_set():
            n += 1
            if self._pending_since is None:  # else a beat that timed out is tried again
                self._pending_since = time.monotonic()
            try:
                store.put(
                    self._client,
                    self.signer,
                    beat_key(self.group_rank),
                    json.dumps(_record(n, self._address)).encode(),
                    sender=self.group_rank,
                )
                record = _read(self._client, self.signer, 0)
                if record is not None:
                    expected = self._leader_process() or self._heard
                    self._heard = _beater(record, 0, expected) or self._heard
            except (AuthError, ValueError) as exc:
                logger.log(logging.ERROR, "refused the leader's beat: %s", exc)
                record = None
            except _STORE_ERRORS as exc:  # the leader is gone, or silent
                if not _timed_out(exc):
                    logger.log(logging.DEBUG, "beat ends: %s", exc)
                    self._pending_since = None  # gone (closed, refused): its watch says so
                    return
                # A wait that ran out (the store's backstop, the kernel's TCP_USER_TIMEOUT)
                # is the silence itself: it stays pending, so the judge, which counts only
                # the time it ran, names the leader once the bound has passed; meanwhile
                # the beat is tried again on a fresh connection (the old one may still
                # owe a late answer), and a leader heard again clears it.
                logger.log(logging.WARNING, "a beat to the leader timed out (%s); again", exc)
                if self._stopped.wait(self.beat_s) or not self._reconnect():
                    return
                continue
            self._pending_since = None
            if record is not None:
                self._leader_doing = str(record.get("doing", "unknown"))
                if isinstance(record.get("silent"), str):
                    global _leader_found  # noqa: PLW0603 - read by this rank's error texts
                    _leader_found = str(record["silent"])
            _changed.wait(self.beat_s)
            _changed.clear()

    def _reconnect(self) -> bool:
        """A fresh connection to the leader's store after a beat timed out; False when
        the leader is gone (refused: its watch says so). One that times out too stays
        pending, and is tried again."""
        before = set(sockets.socket_inodes())
        try:
            self._client = store.connect(self._store, _store_timeout(self.bound_s), self.bound_s)
        except _STORE_ERRORS as exc:
            if not _timed_out(exc):
                logger.log(logging.DEBUG, "beat ends: %s", exc)
                self._pending_since = None
                return False
            return True
        _guard_connections(before, self.bound_s)
        return True

    def _judge(self) -> None:
        try:
            self._rule()
        except Exception as exc:  # noqa: BLE001 - a broken watch ends the trial, never quietly
            self._break(f"rank {self.group_rank}'s judge of its leader", exc)

    def _rule(self) -> None:
        silent_s = 0.0
        waiting_beat: float | None = None
        last_wake = time.monotonic()
        while not self._stopped.wait(self.beat_s):
            pending_since = self._pending_since
            if pending_since != waiting_beat:
                silent_s, waiting_beat = 0.0, pending_since  # another beat (or none) waits
            # Only the time this beat has waited counts, and only while this process ran.
            gap, last_wake = _accrue(max(last_wake, pending_since or last_wake), self.beat_s)
            if pending_since is None:
                continue
            silent_s += gap
            if silent_s > self.bound_s and not self._stopped.is_set():
                host, pid = self._leader()
                process = self._leader_process() or self._heard
                self._stopped.set()
                doing = leader_step(self._leader_doing)
                self._on_silent(Silence(0, host, pid, None, silent_s, doing, process))
                return


def _route_to(host: str) -> str | None:
    """The address of this host that routes to ``host`` (no packet is sent)."""
    with contextlib.suppress(OSError):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return str(probe.getsockname()[0])
    return None


def kill_if_here(process: procfs.Process | None) -> bool:
    """SIGKILL a silent peer that runs here (a frozen process is ours to end): only the
    process its record names, on this host, boot and pid namespace, and only while its
    start time still matches (``procfs.send``). A peer in another container of this host,
    or one not known, is never signalled: its pid number names another process here."""
    if process is None or process.pid == os.getpid():
        return False
    try:
        return procfs.send(process, signal.SIGKILL)
    except OSError:
        return False
