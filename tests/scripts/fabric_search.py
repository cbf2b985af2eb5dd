"""A user's NePS search whose trials use Lightning Fabric: ``strategy="ddp"`` and
``fabric.launch()`` inside the function (under ``python fabric_search.py`` Fabric starts
the other ranks; under torchrun they are all there). Test hooks as in lightning_search.py.
"""

from __future__ import annotations

import argparse
import logging

import faults
import lightning as L
import neps
import probe
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

ARGS = argparse.Namespace()


class Basic(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)


@probe.evaluation
def evaluate_pipeline(lr: float, hidden: int, activation: str) -> float:
    faults.at("before")
    with neps_bcast.session() as trial:
        probe.trial(trial)
        faults.at("session")
        # In a pool (--pool-sized) the trial says how many: Lightning's docs' devices=N.
        devices = trial.devices if ARGS.pool_sized else ARGS.devices
        fabric = L.Fabric(accelerator="cpu", devices=devices, strategy="ddp")
        fabric.launch()
        model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=lr))
        loss = torch.zeros(())
        for x, y in fabric.setup_dataloaders(loader()):
            faults.at("fit")
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
        mean = float(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        probe.trained(trial.rank, mean)
        faults.at("after")
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--root", default="results")
    parser.add_argument(
        "--pool-sized",
        action="store_true",
        help="under neps-bcast launch --pool: 1 rank for a narrow model, 2 for a wide one",
    )
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    logging.getLogger("lightning").setLevel(logging.WARNING)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Basic(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
        **(
            {"ranks_per_trial": lambda config: 1 if config["hidden"] <= 8 else 2}
            if ARGS.pool_sized
            else {}
        ),
    )


if __name__ == "__main__":
    probe.run_script(main)
