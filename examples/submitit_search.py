"""A NePS search of PyTorch DDP trials submitted with submitit: one SLURM job of 1 node x
N tasks (``AutoExecutor``), ``TorchDistributedEnvironment`` for the variables of
``env://``, and a ``Checkpointable``: on preemption or near its time limit (submitit asks
SLURM for SIGUSR2 90 s before it) submitit saves it and requeues the job; neps_bcast puts
the running trial back to pending, and the requeued job evaluates it first.

    python examples/submitit_search.py --trials 10 --tasks 2
    python examples/submitit_search.py --cluster local --trials 4    # this machine, no SLURM
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import neps
import submitit
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

import neps_bcast


def evaluate_pipeline(lr: float, hidden: int) -> float:
    dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with neps_bcast.session():
        torch.manual_seed(0)
        model = DDP(
            nn.Sequential(nn.Linear(10, hidden), nn.ReLU(), nn.Linear(hidden, 1)).to(device)
        )
        optimizer = optim.SGD(model.parameters(), lr=lr)
        loss = torch.zeros((), device=device)
        for _ in range(50):
            optimizer.zero_grad()
            x = torch.randn(32, 10, device=device)
            loss = nn.functional.mse_loss(model(x), x[:, :1] * 2)
            loss.backward()
            optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= dist.get_world_size()
    dist.destroy_process_group()
    return float(mean_loss.item())


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(4, 64)


class Search(submitit.helpers.Checkpointable):
    """Every task of the job runs it; ``Checkpointable`` makes submitit requeue it."""

    def __call__(self, root: str, trials: int) -> str:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
        # MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK (CUDA_VISIBLE_DEVICES: one GPU per task)
        submitit.helpers.TorchDistributedEnvironment().export()
        neps_bcast.run(
            evaluate_pipeline,
            pipeline_space=Space(),
            root_directory=root,
            total_evaluations_to_spend=trials,
            optimizer="random_search",
        )
        return "done"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=2, help="tasks (GPUs) of the one node")
    parser.add_argument("--root", default="results/submitit")
    parser.add_argument("--folder", default="results/submitit_jobs", help="submitit's logs")
    parser.add_argument("--cluster", default=None, help="submitit's cluster: slurm, local, ...")
    args = parser.parse_args()
    executor = submitit.AutoExecutor(folder=args.folder, cluster=args.cluster)
    parameters: dict[str, Any] = {"gpus_per_node": args.tasks} if torch.cuda.is_available() else {}
    executor.update_parameters(
        name="neps-submitit", nodes=1, tasks_per_node=args.tasks, timeout_min=60, **parameters
    )
    job = executor.submit(Search(), str(Path(args.root).resolve()), args.trials)
    print(f"submitted job {job.job_id}; logs in {args.folder}", flush=True)
    print(job.results())


if __name__ == "__main__":
    main()
