"""A plain PyTorch DDP search that survives SLURM's time limit and preemption the way
SLURM users set it up: ``#SBATCH --signal=USR1@90`` with a handler of their own that
saves a checkpoint, requeues the job and exits, and a SIGTERM handler that saves one
too. Each trial resumes from its own checkpoint (``trial.resumed_from``).

    srun python requeue_ddp.py --root results         # in an sbatch with --signal=USR1@90
    torchrun --standalone --nproc-per-node 2 requeue_ddp.py --root results

Test hooks, read from the environment (not part of what a user writes):
``REQUEUE_RECORD`` (a folder: JSON lines per rank: each trial's attempt and the steps it
trained from and to, each step of a slow trial, each handler that ran, the exit code)
and ``REQUEUE_SLOW`` (a trial id whose first attempt trains slowly, so that a test can
signal the job in its middle).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import neps
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

import neps_bcast

STEPS = 12
RUNNING: dict[str, Any] = {}
"""What the signal handlers save: the running trial's model, optimizer, step, directory."""


def record(event: str, **data: Any) -> None:
    folder = os.environ.get("REQUEUE_RECORD")
    if folder:
        rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
        line = {"event": event, "rank": rank, "pid": os.getpid(), "t": time.time(), **data}
        with (Path(folder) / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")


def save_checkpoint() -> None:
    if RUNNING and dist.get_rank() == 0:
        state = {
            "step": RUNNING["step"],
            "model": RUNNING["model"].module.state_dict(),
            "optimizer": RUNNING["optimizer"].state_dict(),
        }
        torch.save(state, RUNNING["directory"] / "checkpoint.pt")
        record("saved", step=RUNNING["step"])


def on_usr1(signum: int, _frame: object) -> None:
    """SLURM's warning before the time limit: checkpoint, requeue, exit."""
    record("handler", signal="USR1")
    save_checkpoint()
    job = os.environ.get("SLURM_JOB_ID")
    if job and int(os.environ.get("SLURM_PROCID", "0")) == 0:
        subprocess.run(["scontrol", "requeue", job], check=False)
    sys.exit(0)


def on_sigterm(signum: int, _frame: object) -> None:
    """Preemption or the end of the job: save what there is."""
    record("handler", signal="TERM")
    save_checkpoint()


def setup() -> None:
    # torchrun sets RANK and WORLD_SIZE; under srun they are SLURM's
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def evaluate_pipeline(pipeline_directory: Path, lr: float) -> float:
    setup()
    with neps_bcast.session() as trial:
        torch.manual_seed(0)
        model = DDP(nn.Linear(8, 1))
        optimizer = optim.SGD(model.parameters(), lr=lr)
        step = 0
        if trial.resumed_from is not None:
            checkpoint = torch.load(trial.resumed_from / "checkpoint.pt")
            model.module.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            step = checkpoint["step"]
        start = step
        slow = trial.id == os.environ.get("REQUEUE_SLOW") and trial.attempt == 1
        RUNNING.update(model=model, optimizer=optimizer, step=step, directory=pipeline_directory)
        x, y = torch.randn(32, 8), torch.randn(32, 1)
        loss = torch.zeros(())
        while step < STEPS:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            step += 1
            RUNNING["step"] = step
            if slow:
                record("step", trial=trial.id, step=step)
                time.sleep(0.5)  # a long training step
        RUNNING.clear()
        record("trained", trial=trial.id, attempt=trial.attempt, start=start, end=step)
    dist.destroy_process_group()
    return float(loss.item())


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--root", default="results/requeue")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_sigterm)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer="random_search",
    )


if __name__ == "__main__":
    try:
        main()
    except SystemExit as exc:
        record("exit", code=exc.code)
        raise
    record("exit", code=0)
