"""Operators for search.py's PipelineSpace, in a module of their own so that NePS's
pickled search space can be read back by the tests (not only by ``__main__``)."""

from __future__ import annotations

import os
import threading

BUILT = {"n": 0}


def unpicklable_tool() -> object:
    """A lock (which cannot be pickled) for the n-th object built, n in
    NB_UNPICKLABLE_SEQS (NePS builds one per trial), else a plain string."""
    BUILT["n"] += 1
    bad = {int(s) for s in os.environ.get("NB_UNPICKLABLE_SEQS", "").split(",") if s}
    return threading.Lock() if BUILT["n"] in bad else "a plain string"
