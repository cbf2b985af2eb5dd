"""Operators for the search spaces of the test scripts, in a module of their own so that
NePS's pickled search space can be read back by the tests (not only by ``__main__``)."""

from __future__ import annotations

import threading

BUILT = {"n": 0}


def unpicklable_tool() -> object:
    """A lock (which cannot be pickled) for the n-th object built when NB_FAULT names
    ``unpicklable`` for trial n (NePS builds one per trial), else a plain string."""
    import faults

    BUILT["n"] += 1
    return threading.Lock() if faults.fires("unpicklable", BUILT["n"]) else "a plain string"
