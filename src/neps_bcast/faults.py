"""Fault points: the named steps of a trial's life where a test may land a fault.

Why in the library: the fault sweep (tests/sweep) lands a fault at every step of the
table in docs/failures.md. It used to wrap private methods of ours from outside
(``Runtime.send``, ``Leases.take``, ...), so renaming one broke the whole sweep, found
only 40 minutes later. A point is a call in the code at the step itself, in the manner
of FoundationDB's ``BUGGIFY`` and the fail crate's ``fail_point!``: a refactor keeps it,
or a seconds-long test (``tests/test_fault_points.py``) that lists every point the
table names fails.

Off (always, outside tests) a point is one test of an empty set: nothing is armed
unless a process both names points in ``NEPS_BCAST_FAULTS`` and registers a handler
with ``arm``. Only test scripts do that; no library path arms anything.

    NEPS_BCAST_FAULTS="handed,lease"   # or "*": every point (tests that list the reached)

The handler gets the point's name and its context (keyword arguments of ``point``:
a trial's id, a group rank) and may raise or signal: that is the fault.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping

ENV_FAULTS = "NEPS_BCAST_FAULTS"
EVERY = "*"

POINTS: Mapping[str, str] = {
    "evaluate": "the leader (a pool's agent) was handed a trial by NePS (context: trial_id)",
    "orphans": "the leader, before it looks for orphaned trials, before the trial's lease",
    "lease": "the leader, before it takes the trial's lease",
    "leased": "the leader, right after it took the trial's lease",
    "handed": "the leader, right after it handed a trial to its group (context: seq)",
    "form": "every rank, before the trial's group is formed (again)",
    "exchange": "every rank, before the trial-end exchange",
    "settle": "the leader, settling an interrupted trial (back to pending, or crashed)",
    "sample": "the leader's NePS, before it samples the next trial",
    "record": "the leader's NePS, before it records a trial's result (context: trial_id)",
    "stop": "the leader, before it sends STOP at the end of the search",
    "order": "a pool rank got its order for a trial (context: trial_id, group_rank)",
    "done": "a pool rank's part of a trial is over, before it says it is free",
    "ask": "a pool's agent asked the launcher for ranks (the launcher places the trial)",
    "device": "a pool rank, before it proves its device (context: device)",
}
"""Every point, by name, and where it lies. A point not listed here cannot be armed."""

Handler = Callable[[str, Mapping[str, object]], None]

_armed: frozenset[str] = frozenset()
_handler: Handler | None = None


def point(name: str, **context: object) -> None:
    """A step where a fault may land; does nothing unless a test armed ``name``."""
    if _armed and (name in _armed or EVERY in _armed) and _handler is not None:
        _handler(name, context)


def armed(name: str) -> bool:
    """Whether ``name`` is armed in this process (for points that need a hook installed,
    like the ones inside NePS)."""
    return _handler is not None and (name in _armed or EVERY in _armed)


def arm(handler: Handler, names: Iterable[str] | None = None) -> frozenset[str]:
    """Tests only: call ``handler`` at the points named (``NEPS_BCAST_FAULTS`` by
    default). Returns what is armed. An unknown name is an error, not a silent no-op."""
    global _armed, _handler
    if names is None:
        names = os.environ.get(ENV_FAULTS, "").split(",")
    chosen = frozenset(n.strip() for n in names if n.strip())
    unknown = sorted(chosen - set(POINTS) - {EVERY})
    if unknown:
        raise ValueError(
            f"{ENV_FAULTS}: no fault point named {', '.join(unknown)}; the points are"
            f" {', '.join(POINTS)} (or {EVERY!r} for all)."
        )
    _armed, _handler = chosen, handler
    return chosen


def disarm() -> None:
    global _armed, _handler
    _armed, _handler = frozenset(), None
