"""What only the benchmarks need on top of ``neps_bcast.compat.procfs`` (which parses ``/proc``).

- ``clean_env``: the environment a launch starts from (no launcher or rank variables);
- a launch marker: every process of one launch inherits ``BENCH_LAUNCH=<id>``, which is how
  the supervisor and the runner find them all (torch's launcher would move workers to a
  process session of their own, so a session-based scan could miss them);
- ``describe``: which rank a process is, for the CPU timelines.

The supervisor imports this module, so it stays light: ``neps_bcast.compat.procfs`` is
stdlib only, and importing the ``neps_bcast`` package does not import torch.
"""

from __future__ import annotations

import os
import uuid

from neps_bcast.compat import procfs

LAUNCH_MARKER = "BENCH_LAUNCH"
ROLE_VARIABLE = "BENCH_ROLE"


SCRUBBED_VARIABLES = frozenset(
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK MASTER_ADDR MASTER_PORT"
    " TORCHELASTIC_RUN_ID PL_GLOBAL_SEED NEPS_DDP_TRIAL_ID".split()
)
SCRUBBED_PREFIXES = ("SLURM_", "NEPS_BCAST_", "BENCH_", "PYTEST_")


def new_launch_id(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:12]}"


def clean_env(**extra: str) -> dict[str, str]:
    """The runner's environment without any launcher or rank variables (no fixed ports)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in SCRUBBED_VARIABLES and not key.startswith(SCRUBBED_PREFIXES)
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def launch_pids(launch_id: str, exclude: tuple[int, ...] = ()) -> list[int]:
    """Live processes of one launch (the caller itself is never listed)."""
    return [pid for pid in procfs.pids_with_env(LAUNCH_MARKER, launch_id) if pid not in exclude]


def describe(pid: int) -> dict[str, str]:
    """Role of a benchmark process (``rank1``, ``launcher``, ...) and a short command line."""
    env = procfs.environ(pid)
    rank = env.get("LOCAL_RANK") or env.get("RANK")
    return {
        "cmd": procfs.cmdline(pid)[-120:],
        "role": env.get(ROLE_VARIABLE) or (f"rank{rank}" if rank else "rank0"),
    }
