"""Right-sized trials: each trial on as many devices as its config says, packed onto a node.

    neps-bcast launch --pool 4 examples/pool.py --trials 12
    neps-bcast launch --pool 8 examples/pool.py --trials 60      # 8 GPUs

`neps-bcast launch --pool D` starts D warm ranks (one per device, for life) and D NePS
workers; `ranks_per_trial` gives each trial its size from its config (here: short
trials on one device, long ones on two), and trials run side by side where they fit. The Trainer is built inside the session and given
`devices=trial.devices` (the trial's GPUs in rank order, or on CPU the number of ranks),
so that each rank trains on its own device. Logs: logs/pool/{agent,rank}<i>.log.
"""

from __future__ import annotations

import argparse
import logging

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-4, 1e-1, log=True)
    epochs = neps.Integer(1, 4)


class Regressor(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] ** 2), batch_size=64)


def evaluate_pipeline(lr: float, epochs: int) -> float:
    with neps_bcast.session() as trial:
        trainer = L.Trainer(
            accelerator="auto",
            devices=trial.devices,  # this trial's devices: each rank on its own
            strategy="ddp",
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Regressor(lr), data(0), data(1))
    return float(trainer.callback_metrics["val_loss"].item())


def ranks_per_trial(config: dict[str, object]) -> int:
    """The trial's size from its config: 1 device for a short trial, more for a long one."""
    return 1 if int(config["epochs"]) <= 2 else 2  # type: ignore[call-overload]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=12, help="trials of the whole search")
    parser.add_argument("--root", default="results/pool")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning").setLevel(logging.WARNING)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer="random_search",
        ranks_per_trial=ranks_per_trial,
    )


if __name__ == "__main__":
    main()
