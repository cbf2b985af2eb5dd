"""A stand-in for ``srun`` on one node: start N tasks with the variables SLURM gives them.

    python fake_srun.py --ntasks 2 -- python lightning_search.py --trials 3

Sets what Lightning's ``SLURMEnvironment`` reads (SLURM_NTASKS, SLURM_PROCID,
SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS_PER_NODE, SLURM_NNODES, SLURM_JOB_ID,
SLURM_JOB_NAME, SLURM_NODELIST) and nothing of torchrun's; MASTER_ADDR/MASTER_PORT come
from the caller's environment, as an sbatch script exports them. Exits with the first
non-zero exit code of a task (a negative code, a signal, becomes 128 + signal).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ntasks", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    tasks = []
    for task in range(args.ntasks):
        env = dict(os.environ)
        env.update(
            SLURM_NTASKS=str(args.ntasks),
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_NODEID="0",
            SLURM_NTASKS_PER_NODE=str(args.ntasks),
            SLURM_NNODES="1",
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="neps_bcast_test",
            SLURM_NODELIST="localhost",
        )
        tasks.append(subprocess.Popen(command, env=env))
    codes = [t.wait() for t in tasks]
    bad = [c for c in codes if c != 0]
    if not bad:
        return 0
    return bad[0] if bad[0] > 0 else 128 - bad[0]


if __name__ == "__main__":
    sys.exit(main())
