"""``neps-bcast status ROOT``: what a search on a NePS root is doing, read from its files.

One line per trial (state, attempt, where it runs, heartbeat, elapsed time, objective),
then the counts by state, the best trial so far, the budget used and, for a pool, each
device and the trial on it. Not to be confused with ``status.py``, the status lines a
running ``neps-bcast launch`` prints about its own groups.

Why it can run anywhere, at any time: it reads NePS's files (``compat/neps_files.py``),
the trials' leases (``lease_record.py``) and a pool's placements
(``trial_placement.py``) without importing NePS or torch and without taking any lock, so
it never holds up a search (a lock would make every worker wait while it reads a
thousand trials) and works from an account or node that can only read the root. Leases
and placements are replaced atomically; NePS's metadata is re-read when torn.

Whether a lease is stale is the leaders' own rule (``lease_record.why_dead``): on the
machine the leader runs on, its process is gone; elsewhere, no heartbeat for
``NEPS_BCAST_LEASE_GRACE_S``. A stale lease is what the next leader to look for orphans
puts back to pending.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from neps_bcast.compat import neps_files
from neps_bcast.config import Settings
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.launcher import trial_placement
from neps_bcast.launcher.lease_record import LEASE_FILE, Lease, Owner, parse_lease, why_dead

TAG = "neps_bcast status"
DEFAULT_ROOT = "neps_results"
"""``neps.run``'s default ``root_directory``."""


OUTCOMES = ("success", "failed", "crashed", "put back", "running")
"""How an attempt ended (``AttemptSpan.outcome``): NePS's final state for the last
attempt, ``put back`` for one an infrastructure failure interrupted, ``running``."""


@dataclass(frozen=True)
class AttemptSpan:
    """One attempt of a trial, from its start to its end, and where it ran."""

    number: int
    start: float
    end: float | None
    """None: still running."""
    outcome: str
    """An ``OUTCOMES`` value."""
    host: str | None = None
    pid: int | None = None
    """Its leader's process (a pool: the agent's)."""
    ranks: int | None = None
    devices: tuple[int, ...] | None = None
    """A pool: the devices it ran on."""
    launch_id: str | None = None
    """A pool: the launch that placed it."""
    cause: str | None = None
    """Why it was interrupted (a put-back attempt; a running one whose lease is stale)."""


@dataclass(frozen=True)
class TrialStatus:
    trial_id: str
    state: str
    attempt: int
    """1, or n + 1 after n interruptions (a pending trial: the attempt it runs next)."""
    host: str | None = None
    pid: int | None = None
    """The leader's (a pool: the agent's) process, from the lease."""
    ranks: int | None = None
    devices: tuple[int, ...] | None = None
    """A pool: the devices it runs on."""
    rank_pids: tuple[int, ...] | None = None
    """A pool: the processes of its ranks, in group-rank order (``pid`` is its agent's)."""
    heartbeat_age_s: float | None = None
    stale: str | None = None
    """Why its lease is stale (its leader is gone), None while it may be alive."""
    silent: str | None = None
    """A running trial whose leader found a rank of its group silent (frozen, hung, its
    node lost or cut off): suspect, its lease no longer renewed."""
    clock_offset_s: float | None = None
    """A running trial: its leader's wall clock against the shared filesystem's (the
    lease's heartbeat, written by the leader's clock, against its file's mtime, stamped
    by the filesystem's). Leases never compare two hosts' clocks; this only shows one
    that is off."""
    elapsed_s: float | None = None
    objective: float | list[float] | None = None
    cost: float | None = None
    error: str | None = None
    attempts: tuple[AttemptSpan, ...] = ()
    """Every attempt, in order (only when read with ``history``: ``--plot`` draws them)."""


@dataclass(frozen=True)
class DeviceStatus:
    host: str
    launch_id: str
    device: int
    gpu: str | None
    trial_id: str | None


@dataclass(frozen=True)
class Budget:
    evaluations: int
    """Trials NePS holds a result for (NePS's own count toward its budget)."""
    evaluations_limit: float | None
    cost: float
    cost_limit: float | None


@dataclass(frozen=True)
class SearchStatus:
    root: str
    taken_at: float
    trials: list[TrialStatus]
    counts: dict[str, int]
    best: TrialStatus | None
    best_config: dict[str, Any] | None
    budget: Budget
    devices: list[DeviceStatus] = field(default_factory=list)
    files_read: int = 0
    """Files this status opened (a test bounds it: one scan, a few files per trial)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=str)


def check_root(root: Path) -> Path:
    """``root`` if it is a NePS root; else a ``LaunchError`` naming the path and the fix."""
    shown = root if root.is_absolute() else Path.cwd() / root
    if not root.exists():
        raise LaunchError(
            format_message(
                TAG,
                f"{shown} does not exist; expected the root_directory your script passes to"
                f" neps_bcast.run (NePS's default: {DEFAULT_ROOT}).",
                "pass that directory (a relative path is taken from the current directory,"
                " on any node that sees the shared filesystem), e.g."
                " neps-bcast status results.",
            )
        )
    if not root.is_dir():
        raise LaunchError(
            format_message(
                TAG,
                f"{shown} is a file; expected a NePS root directory.",
                f"pass the directory the search writes to, e.g. {shown.parent}.",
            )
        )
    if neps_files.looks_like_root(root):
        return root
    guess = _nearby_root(root)
    raise LaunchError(
        format_message(
            TAG,
            f"{shown} is not a NePS root: it holds none of"
            f" {', '.join(neps_files.STATE_FILES)}, {neps_files.OPTIMIZER_STATE_FILE} or"
            f" {neps_files.CONFIGS_DIR}/.",
            f"did you mean {guess}? neps-bcast status {guess}."
            if guess is not None
            else "pass the root_directory your script passes to neps_bcast.run; a search"
            " that has not started yet has no root: start it first.",
        )
    )


def _nearby_root(path: Path) -> Path | None:
    """A NePS root the user may have meant: an ancestor (they gave ``ROOT/configs`` or a
    trial's directory) or a child (they gave the folder holding the root)."""
    for parent in path.resolve().parents:
        if neps_files.looks_like_root(parent):
            return parent
    try:
        children = sorted(c for c in path.iterdir() if c.is_dir())
    except OSError:
        return None
    return next((c for c in children if neps_files.looks_like_root(c)), None)


_NUMBERS = re.compile(r"(\d+)")


def _natural(trial_id: str) -> tuple[Any, ...]:
    """``2`` before ``10``, ``3_rung_0`` before ``3_rung_1``."""
    return tuple(int(p) if p.isdigit() else p for p in _NUMBERS.split(trial_id))


def read_status(
    root: Path, settings: Settings | None = None, now: float | None = None, history: bool = False
) -> SearchStatus:
    """The search on ``root`` now (``check_root`` first). ``history``: each trial's
    attempts too (``TrialStatus.attempts``; a finished pool trial's placement is read
    for it, one file more per trial)."""
    try:
        return _read_status(root, settings, now, history)
    except OSError as exc:
        raise LaunchError(
            format_message(
                TAG,
                f"could not read the search on {root}: {type(exc).__name__}: {exc}.",
                "run it as a user who can read the root and every trial's directory in it;"
                " a root that another process is deleting cannot be shown.",
            )
        ) from exc


def _read_status(
    root: Path, settings: Settings | None, now: float | None, history: bool
) -> SearchStatus:
    settings = settings or Settings.from_env()
    now = time.time() if now is None else now
    me = Owner.me()
    fmt = neps_files.serialize_format()
    files_read = 0
    trials: list[TrialStatus] = []
    placements: list[trial_placement.TrialPlacement] = []
    for directory in neps_files.trial_dirs(root):
        files = neps_files.read_trial(directory, fmt)
        files_read += files.files_read + 1
        try:
            lease = parse_lease(directory)
        except (OSError, ValueError, KeyError, TypeError):
            lease = None
        placement = None
        if files.state == "evaluating" or (history and files.time_started is not None):
            files_read += 1
            placement = trial_placement.read(directory)
            if placement is not None and _earlier(placement.placed, lease, files):
                placement = None  # from an earlier attempt
            if placement is not None and files.state == "evaluating":
                placements.append(placement)
        trial = _trial_status(files, lease, placement, me, now, settings.lease_grace_s)
        if lease is not None and lease.owner is not None and files.state == "evaluating":
            trial = replace(trial, clock_offset_s=_clock_offset(directory, lease))
        if history:
            trial = replace(trial, attempts=attempt_spans(files, lease, placement, trial))
        trials.append(trial)
    trials.sort(key=lambda t: _natural(t.trial_id))
    by_id = {t.trial_id: t for t in trials}
    scored = [t for t in trials if t.state == "success" and isinstance(t.objective, float)]
    best = min(scored, key=lambda t: t.objective, default=None)  # type: ignore[arg-type, return-value]
    best_config = None
    if best is not None:
        best_dir = root / neps_files.CONFIGS_DIR / f"{neps_files.TRIAL_DIR_PREFIX}{best.trial_id}"
        best_config = neps_files.read_config(best_dir, fmt)
        files_read += 1
    limits = neps_files.budget_limits(root) or {}
    files_read += 1
    evaluated = [t for t in trials if t.state in neps_files.FINAL_STATES]
    budget = Budget(
        evaluations=len(evaluated),
        evaluations_limit=limits.get("total_evaluations_to_spend"),
        cost=sum(t.cost for t in evaluated if t.cost is not None),
        cost_limit=limits.get("total_cost_to_spend"),
    )
    counts = Counter(t.state for t in trials)
    return SearchStatus(
        root=str(root.resolve()),
        taken_at=now,
        trials=trials,
        counts={s: counts[s] for s in (*neps_files.STATES, "unreadable") if counts[s]},
        best=best,
        best_config=best_config,
        budget=budget,
        devices=_devices(placements, by_id),
        files_read=files_read,
    )


def _earlier(placed: float, lease: Lease | None, files: neps_files.TrialFiles) -> bool:
    """A placement made before this attempt started (the lease's start, else NePS's)."""
    if lease is not None and lease.owner is not None:
        return placed < lease.started
    return files.time_started is not None and placed < files.time_started


def attempt_spans(
    files: neps_files.TrialFiles,
    lease: Lease | None,
    placement: trial_placement.TrialPlacement | None,
    trial: TrialStatus,
) -> tuple[AttemptSpan, ...]:
    """Every attempt of a trial: those its lease's history records as interrupted, then
    the one NePS holds now (running, or ended as NePS recorded it).

    The last attempt's start and end are NePS's (``time_started`` is set afresh at each
    attempt, ``time_end`` when it ended), but in a pool it starts when the launcher
    placed it on its devices (its agent holds it evaluating while it waits for them, and
    the picture shows the devices' time); where it ran is its lease's (written by the
    leader that took it: a lease whose owner is None was handed back and is an earlier
    attempt's), else NePS's record of the worker, whose id names our leader's process.
    A trial crashed by the retry limit ends with its last interrupted attempt."""
    history = lease.attempts if lease is not None else ()
    spans = [
        AttemptSpan(
            number=n,
            start=a.started,
            end=a.ended,
            outcome="put back",
            host=a.owner.host,
            pid=a.owner.pid,
            ranks=a.ranks,
            devices=a.devices,
            launch_id=a.launch_id,
            cause=a.how,
        )
        for n, a in enumerate(history, 1)
    ]
    handed_back = lease is not None and lease.owner is None
    if files.state == "crashed" and handed_back and spans:
        spans[-1] = replace(spans[-1], outcome="crashed")
        return tuple(spans)
    running = files.state == "evaluating"
    if files.time_started is None or not (running or files.state in neps_files.FINAL_STATES):
        return tuple(spans)
    owner = lease.owner if lease is not None and lease.owner is not None else None
    if owner is None or (lease is not None and lease.started < files.time_started - 1.0):
        owner = Owner.from_worker_id(files.evaluating_worker_id)
    ranks = lease.ranks if lease is not None and lease.owner is not None else None
    spans.append(
        AttemptSpan(
            number=len(spans) + 1,
            start=max(files.time_started, placement.placed) if placement else files.time_started,
            end=None if running else (files.time_end or files.time_started),
            outcome="running" if running else files.state,
            host=placement.host if placement is not None else owner.host if owner else None,
            pid=owner.pid if owner is not None else None,
            ranks=len(placement.devices) if placement is not None else ranks,
            devices=placement.devices if placement is not None else None,
            launch_id=placement.launch_id if placement is not None else None,
            cause=trial.stale,
        )
    )
    return tuple(spans)


def _trial_status(
    files: neps_files.TrialFiles,
    lease: Lease | None,
    placement: trial_placement.TrialPlacement | None,
    me: Owner,
    now: float,
    grace_s: float,
) -> TrialStatus:
    interruptions = len(lease.attempts) if lease is not None else 0
    running = files.state == "evaluating"
    owner = lease.owner if lease is not None and running else None
    if files.time_started is None:
        elapsed = None
    elif running:
        elapsed = now - files.time_started
    else:
        elapsed = (files.time_end or now) - files.time_started
    stale = (
        why_dead(lease, files.time_started, me, now, grace_s, files.evaluating_worker_id)
        if running
        else None
    )
    return TrialStatus(
        trial_id=files.trial_id,
        state=files.state,
        attempt=interruptions + 1,
        host=owner.host if owner is not None else None,
        pid=owner.pid if owner is not None else None,
        ranks=(
            len(placement.devices)
            if placement is not None
            else (lease.ranks if lease is not None and running else None)
        ),
        devices=placement.devices if placement is not None else None,
        rank_pids=placement.rank_pids if placement is not None else None,
        heartbeat_age_s=now - lease.heartbeat if owner is not None and lease is not None else None,
        stale=stale,
        silent=lease.silent if lease is not None and running else None,
        elapsed_s=elapsed,
        objective=files.objective,
        cost=files.cost,
        error=files.error,
    )


def _devices(
    placements: list[trial_placement.TrialPlacement], by_id: dict[str, TrialStatus]
) -> list[DeviceStatus]:
    """Each pool's devices (every pool with a running trial), and the trial on each."""
    pools: dict[tuple[str, str], list[trial_placement.TrialPlacement]] = {}
    for p in placements:
        pools.setdefault((p.host, p.launch_id), []).append(p)
    found = []
    for (host, launch_id), placed in sorted(pools.items()):
        size = max(p.pool_size for p in placed)
        on: dict[int, tuple[str, str | None]] = {}
        for p in placed:
            for i, device in enumerate(p.devices):
                on[device] = (p.trial_id, p.gpus[i] if p.gpus is not None else None)
        for device in range(size):
            trial_id, gpu = on.get(device, (None, None))
            found.append(DeviceStatus(host, launch_id, device, gpu, trial_id))
    return found


def _clock_offset(directory: Path, lease: Lease) -> float | None:
    """The lease writer's clock minus the filesystem's, from one renewal."""
    try:
        return lease.heartbeat - (directory / LEASE_FILE).stat().st_mtime
    except OSError:
        return None
