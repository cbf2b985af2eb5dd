"""PyTorch's DDP tutorial as a NePS search: the tutorial's training function is the
``evaluate_pipeline``, unchanged in shape (it forms the process group at its start and
destroys it at its end, every trial), and every rank calls ``neps_bcast.run``.

    torchrun --standalone --nproc-per-node 2 examples/tutorial_ddp.py --trials 10
    srun python examples/tutorial_ddp.py --trials 10    # MASTER_ADDR/MASTER_PORT exported

Each trial resumes from its own checkpoint when an earlier attempt of it was stopped
(preemption, a time limit: see examples/slurm_usr1.sbatch).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import neps
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

import neps_bcast

ARGS = argparse.Namespace(steps=50)


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
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(
            int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
        )
    dist.init_process_group(backend, rank=rank, world_size=world_size)


def cleanup() -> None:
    dist.destroy_process_group()


def evaluate_pipeline(pipeline_directory: Path, lr: float, hidden: int) -> float:
    setup()
    rank = dist.get_rank()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    with neps_bcast.session() as trial:  # every rank: the same trial, failures on every rank
        torch.manual_seed(0)
        model = DDP(ToyModel(hidden).to(device))
        optimizer = optim.SGD(model.parameters(), lr=lr)
        checkpoint = pipeline_directory / "checkpoint.pt"
        start = 0
        if trial.resumed_from is not None:  # an earlier attempt was stopped: go on from it
            state = torch.load(trial.resumed_from / "checkpoint.pt", map_location=device)
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            start = state["step"]
        loss = torch.zeros((), device=device)
        for step in range(start, ARGS.steps):
            optimizer.zero_grad()
            outputs = model(torch.randn(20, 10, device=device))
            loss = nn.functional.mse_loss(outputs, torch.randn(20, 5, device=device))
            loss.backward()
            optimizer.step()
            if rank == 0 and step % 10 == 9:
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step + 1}, checkpoint)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
    cleanup()
    return float(mean_loss.item())


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(4, 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--root", default="results/tutorial")
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
    )


if __name__ == "__main__":
    main()
