"""The groups workload: a NePS search whose trials are Lightning ``strategy="ddp"`` jobs,
run by ``neps-bcast launch`` as K groups of N ranks on one root directory.

    neps-bcast launch --groups 2 --nproc-per-group 2 benchmarks/workloads/groups_search.py --root R --trials 8
    neps-bcast launch --groups 1 --nproc-per-group 4 benchmarks/workloads/groups_search.py --root R --trials 8

Every rank of every group runs this script (torchrun's variables; the Trainer takes its size
from LOCAL_WORLD_SIZE). Each trial is the same fixed amount of training whatever the layout:
one epoch over ``SAMPLES`` samples in global batches of ``GLOBAL_BATCH`` (each rank gets
``GLOBAL_BATCH / N`` of a batch, so every rank takes SAMPLES / GLOBAL_BATCH = 128 steps),
a fixed-width MLP (8-256-256-1), CPU, gloo; only the learning rate is searched (random
search), so no trial costs more than another. Sized so that a trial takes seconds, not the
~0.2 s of a 16-step trial, whose throughput is mostly Lightning's per-fit set-up. The
timings are NePS's own (``time_started`` / ``time_end`` in each trial's ``metadata.json``);
this script records nothing itself.
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

SAMPLES = 8192
GLOBAL_BATCH = 64
HIDDEN = 256


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)


class MLP(L.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, 1),
        )
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loader(size: int, seed: int, ranks: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 8, generator=generator)
    noise = 0.1 * torch.randn(size, 1, generator=generator)
    dataset = TensorDataset(inputs, (inputs[:, :1] * 2.0 + noise).float())
    return DataLoader(dataset, batch_size=GLOBAL_BATCH // ranks)


def evaluate_pipeline(lr: float) -> float:
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=ranks,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with neps_bcast.session():
        trainer.fit(MLP(lr), loader(SAMPLES, 0, ranks), loader(SAMPLES // 4, 1, ranks))
    return float(trainer.callback_metrics["val_loss"].item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--trials", type=int, default=8, help="trials of all groups together")
    args = parser.parse_args()
    # INFO: the launcher's status lines count the trials from the leaders' log lines.
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
