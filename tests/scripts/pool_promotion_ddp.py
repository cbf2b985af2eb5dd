"""Promotions that grow, in plain PyTorch DDP: successive halving promotes a trial from
1 epoch on one rank to 3 epochs on two, and the promoted trial goes on from its lower
rung's checkpoint.

    neps-bcast launch --pool 2 pool_promotion_ddp.py --root results/promotion --trials 8

The tutorial's shape (``init_process_group`` at the start of the function,
``destroy_process_group`` at its end). Rank 0 saves the model, the optimizer, the
epoch and the global step to ``pipeline_directory/checkpoint.pt``; a promoted trial
loads it from ``previous_pipeline_directory`` on every rank, whatever the world size
(DDP's state is the same on every rank). Each rank writes what it saw to
``pipeline_directory/rank<r>.json``: world size, the checkpoint it loaded, the global
step at its start and end, a fingerprint of the weights it started and ended with.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import neps
import torch
import torch.distributed as dist
from torch import nn, optim
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import neps_bcast


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    epochs = neps.IntegerFidelity(1, 3)  # rungs of successive halving (eta 3): 1 and 3


def fingerprint(model: nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def evaluate_pipeline(
    lr: float, epochs: int, pipeline_directory: Path, previous_pipeline_directory: Path | None
) -> float:
    dist.init_process_group("gloo")  # the pool's torchrun variables, as the tutorial
    with neps_bcast.session():  # every rank: the same trial, failures on every rank
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        optimizer = optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        step, first_epoch, loaded = 0, 0, None
        if previous_pipeline_directory is not None:  # a promotion: every rank loads
            loaded = Path(previous_pipeline_directory) / "checkpoint.pt"
            state = torch.load(loaded, map_location="cpu")
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            step, first_epoch = state["step"], state["epoch"]
        seen: dict[str, object] = {
            "rank": rank,
            "world_size": world,
            "loaded": loaded and str(loaded),
            "start_step": step,
            "start_weights": fingerprint(model),
        }
        ddp = DDP(model)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 8, generator=g)
        dataset = TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] ** 2)
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        loss = torch.zeros(())
        for epoch in range(first_epoch, epochs):
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(ddp(xb), yb)
                loss.backward()
                optimizer.step()
                step += 1
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(
                {**state, "epoch": epochs, "step": step}, Path(pipeline_directory) / "checkpoint.pt"
            )
        seen.update(end_step=step, end_weights=fingerprint(model))
        (Path(pipeline_directory) / f"rank{rank}.json").write_text(json.dumps(seen))
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
    dist.destroy_process_group()
    return float(mean_loss.item())


def ranks_per_trial(config: dict[str, object]) -> int:
    """One rank at the lowest rung, two for a promoted (longer) trial."""
    return 1 if int(config["epochs"]) <= 1 else 2  # type: ignore[call-overload]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--root", default="results/promotion")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer="successive_halving",
        ranks_per_trial=ranks_per_trial,
    )


if __name__ == "__main__":
    main()
