"""Checks of removed end-to-end launches, for the sweep cells that now run their scenario.

``pool_trial_stopped_by_its_time_limit``: from tests/e2e/test_e2e_pool.py's
``TestATrialPastItsTimeLimitIsStoppedAndRunsAgain`` (a pool trial that hangs in the
user's code, ``--trial-time-limit 30``), for the pool sweep's ``fit`` x ``hang`` cell
(tests/sweep/test_pool_sweep.py), whose table row already checks the trial's success,
its one failed attempt, the SIGKILLed ranks' -9 and the launcher's 0: what ended the
first attempt was the limit (the lease's record of the attempt and the launcher's log
name it), and that attempt never finished training.
"""

from __future__ import annotations

from pathlib import Path

from harness import Result
from neps_bcast.recovery.lease_file import read_lease


def pool_trial_stopped_by_its_time_limit(
    launch: Result, root: Path, trial_id: str, first_ranks: list[int], limit_s: int
) -> list[str]:
    """``first_ranks``: the pids of the ranks the launcher first gave the trial
    (``test_pool_sweep.first_attempt_ranks``); ``limit_s``: the launch's
    ``--trial-time-limit``."""
    problems = []
    why = f"still running {limit_s} s after it was placed (--trial-time-limit)"
    lease = read_lease(root / "configs" / f"config_{trial_id}")
    hows = [attempt.how for attempt in lease.attempts] if lease is not None else []
    if len(hows) != 1 or why not in hows[0]:
        problems.append(f"trial {trial_id}'s lease lists {hows}, want one attempt ended {why!r}")
    said = launch.rank_logs["launcher"]
    if f"trial {trial_id}: {why}: SIGKILL to its rank on device" not in said:
        problems.append(f"the launcher never said trial {trial_id} was stopped: {why}")
    if not first_ranks:
        problems.append(f"no rank was seen take trial {trial_id}")
    for pid in first_ranks:
        if f"(pid {pid}); a fresh one takes the device." not in said:
            problems.append(f"the launcher never said a fresh rank took pid {pid}'s device")
    for pid in first_ranks:
        # A warm rank may have trained earlier trials: only what came after it took this one.
        took = [e["t"] for e in launch.of("trial") if e["pid"] == pid and e["trial_id"] == trial_id]
        later = [e for e in launch.of("trained") if e["pid"] == pid and took and e["t"] > max(took)]
        if later:
            problems.append(f"pid {pid} trained after it took trial {trial_id}: {later}")
    return problems
