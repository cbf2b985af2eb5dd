"""A search whose trials have different sizes, packed onto a pool of ranks: PyTorch's
DDP tutorial (``init_process_group`` at the start of the function,
``destroy_process_group`` at its end), each trial on as many ranks as its config says.

    neps-bcast launch --pool 4 pool_search.py --root results/pool --trials 8

Test hooks, read from the environment (not part of what a user writes):
``POOL_RECORD`` (a folder: one JSON line per rank and trial: pid, trial, rank, world
size, devices, start and end times), ``POOL_SLOW`` (seconds each trial trains, in
steps of 0.05 s, so that trials overlap), ``POOL_FAIL`` (a trial id whose rank 1
raises in its training, the first time it runs), ``POOL_HANG`` (a trial id whose ranks
hang in its training the first time it runs, as a deadlock in user code would).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time
from pathlib import Path

import neps
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP

import neps_bcast


def record(event: str, **data: object) -> None:
    folder = os.environ.get("POOL_RECORD")
    if folder:
        line = {"event": event, "pid": os.getpid(), "t": time.time(), **data}
        Path(folder).mkdir(parents=True, exist_ok=True)
        with (Path(folder) / f"pid{os.getpid()}.jsonl").open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")


def evaluate_pipeline(pipeline_directory: Path, lr: float, ranks: int) -> float:
    dist.init_process_group("gloo")  # torchrun's variables, as the tutorial
    with neps_bcast.session() as trial:
        rank, world = dist.get_rank(), dist.get_world_size()
        start = time.time()
        record("started", trial=trial.id, rank=rank, world=world, attempt=trial.attempt)
        if trial.id == os.environ.get("POOL_HANG") and trial.attempt == 1:
            threading.Event().wait()  # never set: hung, until the launcher stops it
        torch.manual_seed(0)
        model = DDP(nn.Linear(8, 1))
        optimizer = optim.SGD(model.parameters(), lr=lr)
        x, y = torch.randn(16, 8), torch.randn(16, 1)
        loss = torch.zeros(())
        steps = max(3, round(float(os.environ.get("POOL_SLOW", "0")) / 0.05))
        for _ in range(steps):  # the same on every rank: DDP's allreduce per step
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            if trial.id == os.environ.get("POOL_FAIL") and trial.attempt == 1 and rank == 1:
                raise RuntimeError(f"rank 1 failed in trial {trial.id}")
            time.sleep(0.05)  # a training step that waits on its device
        weights = [p.detach().clone() for p in model.parameters()]
        record(
            "trained",
            trial=trial.id,
            rank=rank,
            world=world,
            config_ranks=ranks,
            attempt=trial.attempt,
            devices=trial.devices,
            device=trial.device,
            start=start,
            end=time.time(),
            weight=float(weights[0].sum()),
        )
    dist.destroy_process_group()
    return float(loss.item())


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    ranks = neps.Categorical(choices=(1, 2, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--root", default="results/pool")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer="random_search",
        ignore_errors=True,
        ranks_per_trial=lambda config: config["ranks"],
    )


if __name__ == "__main__":
    main()
