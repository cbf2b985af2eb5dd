"""PyTorch's DDP tutorial ("Getting Started with Distributed Data Parallel", its torchrun
version), turned into a NePS search the way a user would: the tutorial's training
function becomes ``evaluate_pipeline``, unchanged in shape, and every rank calls
``neps_bcast.run``.

    torchrun --standalone --nproc-per-node 2 tutorial_ddp.py --root results
    srun python tutorial_ddp.py --root results          # MASTER_ADDR/MASTER_PORT exported

``--group`` says where the process group is formed, the three ways people write it:

- ``per-trial``: the tutorial itself: ``init_process_group`` at the start of the
  function, ``destroy_process_group`` at its end, every trial;
- ``once``: formed once at the top of the script, before ``neps_bcast.run``;
- ``lazy``: formed in the function when it does not exist yet, never destroyed.

Test hooks, read from the environment (not part of what a user writes):
``--backend nccl``: the tutorial's GPU version (one GPU per rank, ``LOCAL_RANK``'s).
``TUTORIAL_RECORD`` (a folder: one JSON line per rank and trial, what it evaluated)
and ``TUTORIAL_FAIL`` (``"<trial>:<rank>"``: that rank raises in the middle of the
training of the trial-th trial it evaluates).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import neps
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

import neps_bcast

ARGS = argparse.Namespace(group="per-trial", steps=6, backend="gloo")
TRIALS_DONE = {"n": 0}


class ToyModel(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def setup() -> None:
    # torchrun sets RANK and WORLD_SIZE; under srun they are SLURM's
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world_size = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    if ARGS.backend == "nccl":  # the tutorial's GPU version: one GPU per rank
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(ARGS.backend, rank=rank, world_size=world_size)


def cleanup() -> None:
    dist.destroy_process_group()


def evaluate_pipeline(pipeline_directory: Path, lr: float, hidden: int) -> float:
    if ARGS.group == "per-trial":
        setup()
    elif ARGS.group == "lazy" and not dist.is_initialized():
        setup()
    rank = dist.get_rank()
    TRIALS_DONE["n"] += 1
    print(f"Start running basic DDP example on rank {rank}.")
    record(rank, pipeline_directory, lr, hidden)

    torch.manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device()) if ARGS.backend == "nccl" else None
    model = ToyModel(hidden).to(device)
    ddp_model = DDP(model, device_ids=[device] if device is not None else None)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=lr)
    loss = torch.zeros((), device=device)
    for step in range(ARGS.steps):
        optimizer.zero_grad()
        outputs = ddp_model(torch.randn(20, 10, device=device))
        labels = torch.randn(20, 5, device=device)
        loss = loss_fn(outputs, labels)
        loss.backward()
        optimizer.step()
        maybe_fail(rank, step)
    dist.all_reduce(loss.detach())

    if ARGS.group == "per-trial":
        cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")
    return float(loss.item())


def record(rank: int, pipeline_directory: Path, lr: float, hidden: int) -> None:
    folder = os.environ.get("TUTORIAL_RECORD")
    if folder:
        line = {
            "rank": rank,
            "pid": os.getpid(),
            "trial": Path(pipeline_directory).name,
            "lr": lr,
            "hidden": hidden,
            "backend": dist.get_backend(),
            "t": time.time(),
        }
        with (Path(folder) / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")


def maybe_fail(rank: int, step: int) -> None:
    trial, _, fail_rank = os.environ.get("TUTORIAL_FAIL", "").partition(":")
    if trial and TRIALS_DONE["n"] == int(trial) and rank == int(fail_rank) and step == 2:
        raise RuntimeError(f"rank {rank} failed in the middle of its training")


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(4, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--group", choices=["per-trial", "once", "lazy"], default="per-trial")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--root", default="results/tutorial")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(level=logging.INFO)
    if ARGS.group == "once":
        setup()
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
        ignore_errors=True,
    )


if __name__ == "__main__":
    main()
