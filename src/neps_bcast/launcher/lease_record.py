"""What a lease on a running trial says, read without any lock, torch or NePS.

Why a module of its own, in ``launcher/`` and not in ``recovery/``: the leaders that
write leases (``recovery/lease.py``, ``lease_file.py``) and ``neps-bcast status`` that
only reads them (from any node, while the search runs: ``launcher/search_status.py``)
must agree on one format and on one rule for when an owner is gone, and the launch
command may not import a rank's machinery (the contracts in pyproject.toml). The leaders
read it from here as they read a pool's ``trial_placement.py``; it imports nothing of
ours but ``compat/procfs.py`` (the layers contract keeps it on the base layer). Nothing
here locks or writes: a lease file is replaced atomically (``lease_file.write_lease``),
so a reader sees the old lease or the new one.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from neps_bcast.compat import procfs

OURS_PREFIX = ".neps_bcast_"
"""Every file neps_bcast keeps in a trial's directory starts with it (hidden: ours, not
the user's): the lease, its lock, a pool's placement."""

LEASE_FILE = ".neps_bcast_lease.json"
"""The lease's name inside the trial's directory (hidden: it is ours, not the user's)."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class Owner:
    """One process on one machine, for as long as that machine is up."""

    host: str
    boot_id: str
    pid_namespace: str
    pid: int
    start_ticks: int

    @classmethod
    def me(cls) -> Owner:
        pid = os.getpid()
        return cls(
            host=socket.gethostname(),
            boot_id=_boot_id(),
            pid_namespace=procfs.pid_namespace(),
            pid=pid,
            start_ticks=procfs.start_ticks(pid) or 0,
        )

    def shares_machine_with(self, other: Owner) -> bool:
        """True when ``other``'s pid can be looked up here (same host, boot, namespace)."""
        return bool(self.boot_id) and (self.host, self.boot_id, self.pid_namespace) == (
            other.host,
            other.boot_id,
            other.pid_namespace,
        )

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}"

    def worker_id(self) -> str:
        """The worker id this leader gives NePS (``neps.run(worker_id=...)``): NePS
        stores it in every trial it sets evaluating, so a leader killed before it wrote
        the trial's lease is still proven dead at once on its machine."""
        return (
            f"{WORKER_PREFIX}{self.pid}-{self.start_ticks}"
            f"@{self.host}/{self.boot_id}/{self.pid_namespace}"
        )

    @classmethod
    def from_worker_id(cls, worker_id: str | None) -> Owner | None:
        """The owner a ``worker_id`` of ours names; None for any other worker id."""
        match = _WORKER_ID.fullmatch(worker_id or "")
        if match is None:
            return None
        pid, ticks, host, boot_id, pid_namespace = match.groups()
        return cls(host, boot_id, pid_namespace, int(pid), int(ticks))


WORKER_PREFIX = "neps_bcast-"
_WORKER_ID = re.compile(re.escape(WORKER_PREFIX) + r"(\d+)-(\d+)(?:\.\d+)?@([^/]*)/([^/]*)/(.*)")


def next_worker_id(worker_id: str, entry: int) -> str:
    """The worker id for this process's ``entry``-th ``neps.run`` (a pool's agent enters
    it again after a lost trial, and NePS refuses a worker id twice): ours gets
    ``.<entry>`` after its start time, still naming this process; another's a suffix."""
    if _WORKER_ID.fullmatch(worker_id):
        head, _, tail = worker_id.partition("@")
        return f"{head.split('.')[0]}.{entry}@{tail}"
    return f"{worker_id}-{entry}"


@dataclass(frozen=True)
class Attempt:
    """One evaluation of the trial that an infrastructure failure interrupted.

    Where it ran (``ranks``, and in a pool ``devices`` of the launch ``launch_id``) is
    recorded since ``neps-bcast status --plot`` draws each attempt on its group's or
    device's row; a lease written before that has none of them (None)."""

    owner: Owner
    started: float
    ended: float
    how: str
    ranks: int | None = None
    devices: tuple[int, ...] | None = None
    """A pool's device indices the attempt ran on (its placement's)."""
    launch_id: str | None = None
    """The pool launch that placed it (None: not in a pool)."""

    def describe(self, number: int) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (
            f"attempt {number} ({self.owner.describe()}, started {when},"
            f" {self.ended - self.started:.1f} s): {self.how}"
        )


@dataclass(frozen=True)
class Lease:
    trial_id: str
    owner: Owner | None
    """None: nobody evaluates it (it was put back to pending)."""
    started: float
    heartbeat: float
    attempts: tuple[Attempt, ...] = field(default=())
    ranks: int | None = None
    """Ranks in the owner's group (None: not known yet, e.g. under Lightning ddp before
    the first ``fit`` formed the group)."""
    silent: str | None = None
    """A rank of the owner's group it found silent (frozen, hung, its node lost or cut
    off), as the owner said it: the trial is suspect, its lease no longer renewed."""
    attempt: int = 0
    """The owner's attempt: 1, or n + 1 after n interruptions (0: a lease an older
    neps_bcast wrote). Only this attempt's owner may record the trial's result."""
    beats: int = 0
    """Renewals so far: a reader on another host times its changes on its own monotonic
    clock, never comparing two hosts' wall clocks."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Lease:
        raw: dict[str, Any] = json.loads(text)
        owner = raw.get("owner")
        return cls(
            trial_id=str(raw["trial_id"]),
            owner=Owner(**owner) if owner else None,
            started=float(raw["started"]),
            heartbeat=float(raw["heartbeat"]),
            attempts=tuple(_attempt(a) for a in raw.get("attempts", ())),
            ranks=int(raw["ranks"]) if raw.get("ranks") is not None else None,
            silent=str(raw["silent"]) if raw.get("silent") is not None else None,
            attempt=int(raw.get("attempt", 0)),
            beats=int(raw.get("beats", 0)),
        )

    def history(self) -> str:
        return "; ".join(a.describe(n) for n, a in enumerate(self.attempts, 1))


def _attempt(raw: dict[str, Any]) -> Attempt:
    """One attempt of a lease's history; ``ranks``, ``devices`` and ``launch_id`` may be
    absent (a lease an older neps_bcast wrote)."""
    devices = raw.get("devices")
    return Attempt(
        Owner(**raw["owner"]),
        float(raw["started"]),
        float(raw["ended"]),
        str(raw["how"]),
        ranks=int(raw["ranks"]) if raw.get("ranks") is not None else None,
        devices=tuple(int(d) for d in devices) if devices is not None else None,
        launch_id=str(raw["launch_id"]) if raw.get("launch_id") is not None else None,
    )


def parse_lease(trial_dir: Path) -> Lease | None:
    """The trial's lease, or None if it has none; raises ``OSError`` or ``ValueError``
    (``KeyError``, ``TypeError``) for one that cannot be read."""
    try:
        return Lease.from_json((trial_dir / LEASE_FILE).read_text())
    except FileNotFoundError:
        return None


def why_dead(
    lease: Lease | None,
    time_started: float | None,
    me: Owner,
    now: float,
    grace_s: float,
    worker_id: str | None = None,
    *,
    fs_age_s: float | None = None,
    unchanged_s: float | None = None,
) -> str | None:
    """Why the trial's owner is provably gone, or None while it may be alive.

    ``worker_id``: the worker NePS holds the trial evaluating for; a leader of ours on
    this machine that died before it wrote the lease is named there.

    An owner on another machine is judged without comparing two hosts' clocks where the
    reader can: ``unchanged_s``, how long this reader has seen the lease (or its absence)
    unchanged, timed on its own monotonic clock; and ``fs_age_s``, the lease's age by
    the shared filesystem's own clock (its file's mtime against a file this reader just
    wrote). Gone: unchanged for the grace period as timed here, or, at a first look,
    stale by both the filesystem's clock and this host's (a clock ahead sees a live
    lease as old by its own clock only; a clock behind waits for its own timing). A
    reader that can do neither (``neps-bcast status``) compares wall clocks."""
    if unchanged_s is not None and unchanged_s > grace_s:
        owner = lease.owner if lease is not None else None
        if owner is None or not me.shares_machine_with(owner):
            who = owner.describe() if owner is not None else f"worker {worker_id}"
            return (
                f"its lease ({who}) unchanged for {unchanged_s:.0f} s, timed on this host"
                f" (grace {grace_s:.0f} s)"
            )
    owner = lease.owner if lease is not None else None
    if lease is None or owner is None:
        worker = Owner.from_worker_id(worker_id)
        if worker is not None and me.shares_machine_with(worker):
            gone = _gone(worker)
            return None if gone is None else f"{gone}, before it leased the trial"
        if (
            time_started is not None
            and now - time_started > grace_s
            and (fs_age_s is None or fs_age_s > grace_s)
        ):
            return (
                f"evaluating for {now - time_started:.0f} s without a lease (grace"
                f" {grace_s:.0f} s): its worker died before it wrote one"
            )
        return None
    if me.shares_machine_with(owner):
        return _gone(owner)
    age = now - lease.heartbeat
    if age > grace_s and (fs_age_s is None or fs_age_s > grace_s):
        by_fs = f", {fs_age_s:.0f} s by the filesystem's clock" if fs_age_s is not None else ""
        return (
            f"no heartbeat from its leader ({owner.describe()}) for {age:.0f} s{by_fs}"
            f" (grace {grace_s:.0f} s)"
        )
    return None


def _gone(owner: Owner) -> str | None:
    """On this machine: why ``owner`` is gone, or None while it runs."""
    ticks = procfs.start_ticks(owner.pid)
    if ticks is None or not procfs.is_alive(owner.pid):
        return f"its leader ({owner.describe()}) is gone"
    if ticks != owner.start_ticks:
        return f"its leader ({owner.describe()}) is gone; that pid is another process now"
    return None
