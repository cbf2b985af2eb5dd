"""Operators for search.py's PipelineSpace, in a module of their own so that NePS's
pickled search space can be read back by the tests (not only by ``__main__``)."""

from __future__ import annotations

import threading

BUILT = {"n": 0}


def unpicklable_tool() -> object:
    """A lock (which cannot be pickled) for the n-th object built, n in the scenario's
    ``unpicklable_seqs`` (NePS builds one per trial), else a plain string."""
    from probe import SCENARIO

    BUILT["n"] += 1
    return threading.Lock() if BUILT["n"] in SCENARIO.unpicklable_seqs else "a plain string"
