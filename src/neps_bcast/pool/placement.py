"""Which waiting trials start now on a pool of D devices, and on which devices.

Why a module of its own: the policy (docs/pool-design.md, "Packing trials onto D
devices") must be testable without a process, a clock or a GPU. Nothing here starts
anything or reads the time; the caller passes ``now`` in (any monotonic clock) and acts
on what ``place`` returns.

The policy: FIFO order, backfilling, with a drain. The oldest waiting request starts as
soon as it fits. While it does not, any later request that fits may start, oldest first,
until the oldest has waited more than ``drain_factor`` times the mean duration of the
finished trials of its size (of all sizes while none of its size has finished; no drain
while nothing has finished); then nothing starts before it. A request takes the
lowest-indexed contiguous run of free devices (one NVLink island, one NUMA node), else
the lowest free indexes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Start:
    """A request that starts now, on these device indexes (ascending)."""

    key: str
    devices: tuple[int, ...]


@dataclass(frozen=True)
class _Request:
    key: str
    size: int
    asked_at: float


@dataclass(frozen=True)
class _Run:
    size: int
    devices: tuple[int, ...]
    started_at: float


class Placement:
    """The scheduler's state: waiting requests, running trials, devices, durations so far.

    Devices are indexes ``0..D-1``. One instance per pool, driven from one thread."""

    def __init__(self, devices: int, drain_factor: float = 2.0) -> None:
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices {devices!r}: a pool needs a whole number of devices, >= 1")
        if math.isnan(drain_factor) or drain_factor < 0:
            raise ValueError(f"drain_factor {drain_factor!r}: must be >= 0 (math.inf: never drain)")
        self._devices = devices
        self._drain_factor = float(drain_factor)
        self._waiting: dict[str, _Request] = {}  # insertion order is ask order
        self._running: dict[str, _Run] = {}  # insertion order is start order
        self._busy: set[int] = set()
        self._unavailable: set[int] = set()
        self._total: dict[int, float] = {}  # size -> sum of finished durations
        self._count: dict[int, int] = {}  # size -> number of finished trials

    def ask(self, key: str, size: int, now: float) -> None:
        """Queue a request for ``size`` devices; it waits until ``place`` starts it.

        A size outside ``1..D`` could never start, so it is refused here rather than
        left waiting forever (and, as the head, draining the pool)."""
        d = self._devices
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(
                f"trial {key!r}: size {size!r} is not an integer;"
                f" a trial needs a whole number of devices in 1..{d} (one per rank)"
            )
        if not 1 <= size <= d:
            raise ValueError(
                f"trial {key!r}: size {size} is outside 1..{d};"
                f" a trial needs 1 to {d} devices (one per rank) on this pool of {d}"
            )
        if key in self._waiting or key in self._running:
            where = "waiting" if key in self._waiting else "running"
            raise ValueError(f"trial {key!r} was already asked for and is still {where}")
        self._waiting[key] = _Request(key, size, now)

    def cancel(self, key: str) -> None:
        """Withdraw a waiting request, or free a running trial's devices.

        A cancelled run records no duration: it did not run to its end, so it would
        bias the means the drain is measured against. An unknown key is ignored, so a
        cancel that races a release or a second cancel is harmless."""
        if self._waiting.pop(key, None) is not None:
            return
        run = self._running.pop(key, None)
        if run is not None:
            self._busy.difference_update(run.devices)

    def place(self, now: float) -> list[Start]:
        """Start every request the policy allows now, in start order; their devices
        become busy."""
        starts: list[Start] = []
        while self._waiting:
            request = self._next(now)
            if request is None:
                break
            devices = self._pick(request.size)
            del self._waiting[request.key]
            self._running[request.key] = _Run(request.size, devices, now)
            self._busy.update(devices)
            starts.append(Start(request.key, devices))
        return starts

    def release(self, key: str, now: float, *, measured: bool = True) -> None:
        """A running trial ended: free its devices and record its duration for its size,
        where ``measured`` (it ran to its end and succeeded): a crashed or lost trial's
        short run would pull the means the drain is measured against down, as a
        cancelled one would.

        A key that is not running is refused: releasing it would record a duration for
        nothing (or for a trial still waiting), a bug in the caller."""
        run = self._running.get(key)
        if run is None:
            where = "waiting, not running" if key in self._waiting else "not running"
            raise ValueError(f"release of trial {key!r}: it is {where}")
        duration = now - run.started_at
        if duration < 0:
            raise ValueError(
                f"release of trial {key!r} at {now}: before its start at {run.started_at}"
                " (pass times from one monotonic clock)"
            )
        del self._running[key]
        self._busy.difference_update(run.devices)
        if not measured:
            return
        self._total[run.size] = self._total.get(run.size, 0.0) + duration
        self._count[run.size] = self._count.get(run.size, 0) + 1

    def set_available(self, device: int, available: bool) -> None:
        """Mark a device (un)available, e.g. while its rank process is restarted.

        An unavailable device is never given out; one that is busy stays with its trial
        until that trial is released or cancelled."""
        if isinstance(device, bool) or not isinstance(device, int):
            raise ValueError(f"device {device!r} is not an integer index")
        if not 0 <= device < self._devices:
            raise ValueError(f"device {device} is outside 0..{self._devices - 1}")
        if available:
            self._unavailable.discard(device)
        else:
            self._unavailable.add(device)

    @property
    def waiting(self) -> list[tuple[str, int]]:
        """``(key, size)`` of the waiting requests, oldest first."""
        return [(r.key, r.size) for r in self._waiting.values()]

    @property
    def running(self) -> dict[str, tuple[int, ...]]:
        """Each running trial's devices, in start order."""
        return {key: run.devices for key, run in self._running.items()}

    @property
    def free(self) -> tuple[int, ...]:
        """The devices that may be given out now: available and not busy, ascending."""
        return tuple(
            i for i in range(self._devices) if i not in self._busy and i not in self._unavailable
        )

    def draining(self, now: float) -> bool:
        """Whether the oldest waiting request has waited past its drain limit at ``now``,
        so that nothing may start before it.

        Measured with the durations known at the call: a later, longer duration of its
        size can lift the limit again."""
        if not self._waiting:
            return False
        head = next(iter(self._waiting.values()))
        mean = self._mean_duration(head.size)
        if mean is None:
            return False
        return now - head.asked_at > self._drain_factor * mean

    def _mean_duration(self, size: int) -> float | None:
        """Mean duration of finished trials of ``size``, else of all sizes, else None."""
        count = self._count.get(size, 0)
        if count:
            return self._total[size] / count
        count = sum(self._count.values())
        if count:
            return sum(self._total.values()) / count
        return None

    def _next(self, now: float) -> _Request | None:
        """The request to start next: the head if it fits; else, unless draining, the
        oldest later one that fits; else None."""
        free = len(self.free)
        requests = iter(self._waiting.values())
        head = next(requests)
        if head.size <= free:
            return head
        if self.draining(now):
            return None
        return next((r for r in requests if r.size <= free), None)

    def _pick(self, size: int) -> tuple[int, ...]:
        """The lowest-indexed run of ``size`` consecutive free devices, else the
        ``size`` lowest free ones. The caller has checked that enough are free."""
        free = self.free
        for i in range(len(free) - size + 1):
            if free[i + size - 1] - free[i] == size - 1:
                return free[i : i + size]
        return free[:size]
