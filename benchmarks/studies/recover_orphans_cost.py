"""Cost of one ``Leases.recover_orphans()`` (what a leader runs after every trial).

    PYTHONPATH=src python benchmarks/studies/recover_orphans_cost.py ROOT [CALLS]

ROOT: a finished NePS root (no orphans: the common case). Prints p10 / median / p90 of
wall and CPU time per call, in ms. See benchmarks/studies/bo_gap.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from neps_bcast.compat import neps as neps_compat
from neps_bcast.config import Settings
from neps_bcast.recovery.lease import Leases


def spread(values: list[float]) -> list[float]:
    ordered = sorted(values)
    picks = (
        ordered[len(ordered) // 10],
        statistics.median(ordered),
        ordered[len(ordered) * 9 // 10],
    )
    return [round(1000 * value, 2) for value in picks]


def main() -> None:
    root = Path(sys.argv[1])
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    neps_compat.use_neps_locking()
    leases = Leases(root, Settings.from_env())
    leases.recover_orphans()  # imports and first load out of the figures
    walls, cpus = [], []
    for _ in range(calls):
        wall, cpu = time.perf_counter(), time.thread_time()
        leases.recover_orphans()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    trials = len(list((root / "configs").glob("config_*")))
    print(
        f"trials={trials} calls={calls} wall ms p10/median/p90={spread(walls)}"
        f" cpu ms p10/median/p90={spread(cpus)}"
    )


if __name__ == "__main__":
    main()
