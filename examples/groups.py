"""Several DDP groups on one node, each one NePS worker, sharing one root directory.

    neps-bcast launch --groups 2 --nproc-per-group 2 examples/groups.py --trials 8
    neps-bcast launch --nproc-per-group 2 examples/groups.py --trials 40     # 8 GPUs: 4 groups

`neps-bcast launch` starts one torchrun per group (its own free port, its own slice of
GPUs in CUDA_VISIBLE_DEVICES); every rank of every group runs this script. The Trainer
takes its size from the group torchrun started (LOCAL_WORLD_SIZE), so the script never
repeats --nproc-per-group. Logs: logs/group<k>/rank<r>.log; the status lines on the
terminal count the trials each group's leader logs (INFO level, set below).
"""

from __future__ import annotations

import argparse
import logging
import os

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-4, 1e-1, log=True)
    hidden = neps.Integer(4, 64)


class Regressor(L.LightningModule):
    def __init__(self, lr: float, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))
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


EPOCHS = argparse.Namespace(value=2)


def evaluate_pipeline(lr: float, hidden: int) -> float:
    trainer = L.Trainer(
        accelerator="auto",  # the group's GPUs (CUDA_VISIBLE_DEVICES), else CPU on gloo
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp",
        max_epochs=EPOCHS.value,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with neps_bcast.session():
        trainer.fit(Regressor(lr, hidden), data(0), data(1))
    return float(trainer.callback_metrics["val_loss"].item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=8, help="trials of all groups together")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--root", default="results/groups")
    args = parser.parse_args()
    EPOCHS.value = args.epochs
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning").setLevel(logging.WARNING)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer="random_search",
    )


if __name__ == "__main__":
    main()
