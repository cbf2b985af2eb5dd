"""A NePS search of plain PyTorch DDP trials, submitted with submitit the way its users
do: ``AutoExecutor``, 1 node x N tasks, ``submitit.helpers.TorchDistributedEnvironment``
for the variables of ``env://``, and a ``Checkpointable`` whose ``checkpoint`` saves the
running trial before submitit requeues the job (on preemption, or at its time limit:
submitit asks SLURM for SIGUSR2 90 s before it).

    python submitit_search.py --folder jobs --root results --trials 8

The submitting process waits for the job's result, as ``job.result()`` does.

Test hooks, read from the environment (not part of what a user writes):
``SUBMITIT_RECORD`` (a folder: JSON lines per rank, what each attempt of each trial
trained, from and to which step, and each step of a slow trial) and ``SUBMITIT_SLOW``
(a trial id whose first attempt trains slowly, so that a test can signal the job in
its middle).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import neps
import submitit
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

import neps_bcast

STEPS = 12
RUNNING: dict[str, Any] = {}
"""The running trial, for ``checkpoint``: its model, optimizer, step and directory."""


def record(event: str, **data: Any) -> None:
    folder = os.environ.get("SUBMITIT_RECORD")
    if folder:
        rank = int(os.environ.get("RANK", "0"))
        line = {"event": event, "rank": rank, "pid": os.getpid(), "t": time.time(), **data}
        with (Path(folder) / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")


def evaluate_pipeline(pipeline_directory: Path, lr: float) -> float:
    dist.init_process_group(backend="gloo")  # env://, exported by TorchDistributedEnvironment
    with neps_bcast.session() as trial:
        torch.manual_seed(0)
        model = DDP(nn.Linear(8, 1))
        optimizer = optim.SGD(model.parameters(), lr=lr)
        step = 0
        if trial.resumed_from is not None:
            state = torch.load(trial.resumed_from / "checkpoint.pt")
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step = state["step"]
        start = step
        slow = trial.id == os.environ.get("SUBMITIT_SLOW") and trial.attempt == 1
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


class Search(submitit.helpers.Checkpointable):
    """What every task of the job runs; submitit requeues it from ``checkpoint``."""

    def __call__(self, root: str, trials: int) -> str:
        logging.basicConfig(level=logging.INFO)
        # overwrite: the job inherits the free MASTER_PORT the test chose (submitit's own
        # pick, seeded by the job id, repeats in every fresh test cluster); export()
        # refuses a variable that is already set, and keeps its value when overwriting.
        dist_env = submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True
        )
        record("start", rank=dist_env.rank, world_size=dist_env.world_size)
        neps_bcast.run(
            evaluate_pipeline,
            pipeline_space=Space(),
            root_directory=root,
            total_evaluations_to_spend=trials,
            optimizer="random_search",
        )
        return f"rank {dist_env.rank} done"

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Task 0, in submitit's signal handler: save the running trial, then requeue."""
        if RUNNING:
            state = {
                "step": RUNNING["step"],
                "model": RUNNING["model"].module.state_dict(),
                "optimizer": RUNNING["optimizer"].state_dict(),
            }
            torch.save(state, RUNNING["directory"] / "checkpoint.pt")
            record("saved", step=RUNNING["step"])
        # This script runs as __main__, so submitit pickles this class by value with
        # the globals its methods use: RUNNING, holding a DDP model, which cannot be
        # unpickled before a process group exists (the requeued job failed on it).
        RUNNING.clear()
        return super().checkpoint(*args, **kwargs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--folder", default="submitit_jobs")
    parser.add_argument("--root", default="results/submitit")
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=2)
    args = parser.parse_args()
    executor = submitit.AutoExecutor(folder=args.folder)
    executor.update_parameters(
        name="neps-submitit",
        nodes=1,
        tasks_per_node=args.tasks,  # one task per GPU on a GPU node
        cpus_per_task=1,
        timeout_min=20,
    )
    job = executor.submit(Search(), str(Path(args.root).resolve()), args.trials)
    print(f"submitted job {job.job_id}", flush=True)
    print(job.results(), flush=True)


if __name__ == "__main__":
    main()
