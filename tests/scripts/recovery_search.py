"""search.py for the recovery tests (issue 11), plus one knob: a hold.

``NB_HOLD=<n>:<path>``: before its n-th trial, every rank waits (bounded, 180 s) until
``<path>`` exists. The test creates it once the state it needs is observable (another
worker's lease older than the grace period), so two launches meet in a known order
without a sleep. Everything else is tests/scripts/search.py's (the scenario, faults,
records, workload), imported unchanged.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from typing import Any

import probe
import search
from probe import SEQ, record


def _held(fn: Any) -> Any:
    @functools.wraps(fn)
    def evaluate(**kwargs: Any) -> Any:
        seq, _, path = os.environ.get("NB_HOLD", "").partition(":")
        if seq and SEQ["n"] + 1 == int(seq):
            record("hold", seq=int(seq))
            deadline = time.monotonic() + 180
            while not Path(path).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # test orchestration only: released by the test
            record("released", seq=int(seq))
        return fn(**kwargs)

    return evaluate


search.evaluate = _held(search.evaluate)  # with_dirs calls it through this global


if __name__ == "__main__":
    probe.log_to_own_file()
    try:
        search.main()
    except BaseException as exc:
        probe.record_exit(exc)
        raise
    probe.record_exit(None)
