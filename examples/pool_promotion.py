"""Promotions that grow: a trial promoted to a higher rung runs on more ranks and
continues from its lower rung's checkpoint.

    neps-bcast launch --pool 2 examples/pool_promotion.py --trials 8

Successive halving samples configs at 1 epoch and promotes the best to 3 epochs.
`ranks_per_trial` gives the 1-epoch trials one rank and the 3-epoch ones two, so a
promoted trial starts on a group twice the size of the one that trained its first
epoch. Lightning does the rest, as it does outside a search: every trial saves
`last.ckpt` into its own `pipeline_directory`, and a promoted trial resumes with
`ckpt_path=previous_pipeline_directory / "last.ckpt"` (NePS passes the lower rung's
folder). DDP keeps the model and optimizer identical on every rank, so a checkpoint
written by one rank loads on any number of them: the step counter goes on from where
the lower rung stopped. Each rank writes what it saw (world size, the checkpoint it
resumed from, the global step at its start and end) to `pipeline_directory/rank<r>.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    epochs = neps.IntegerFidelity(1, 3)  # rungs of successive halving (eta 3): 1 and 3


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


class StepLog(L.Callback):
    """What this rank saw: the global step when training started (after Lightning
    restored the checkpoint) and when it ended."""

    def __init__(self, path: Path, resumed_from: Path | None) -> None:
        self.path = path
        self.seen: dict[str, object] = {"resumed_from": resumed_from and str(resumed_from)}

    def on_train_start(self, trainer: L.Trainer, _: L.LightningModule) -> None:
        self.seen.update(
            rank=trainer.global_rank, world_size=trainer.world_size, start_step=trainer.global_step
        )

    def on_train_end(self, trainer: L.Trainer, _: L.LightningModule) -> None:
        self.seen.update(end_step=trainer.global_step)
        self.path.write_text(json.dumps(self.seen))


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] ** 2), batch_size=32)


def evaluate_pipeline(
    lr: float, epochs: int, pipeline_directory: Path, previous_pipeline_directory: Path | None
) -> float:
    checkpoint = None
    if previous_pipeline_directory is not None:  # a promotion: go on from the lower rung
        checkpoint = Path(previous_pipeline_directory) / "last.ckpt"
    with neps_bcast.session() as trial:
        log = StepLog(Path(pipeline_directory) / f"rank{trial.rank}.json", checkpoint)
        trainer = L.Trainer(
            accelerator="auto",
            devices=trial.devices,  # this trial's devices: each rank on its own
            strategy="ddp",
            max_epochs=epochs,
            callbacks=[log],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(Regressor(lr), data(0), data(1), ckpt_path=checkpoint)
        trainer.save_checkpoint(Path(pipeline_directory) / "last.ckpt")  # rank 0 writes it
    return float(trainer.callback_metrics["val_loss"].item())


def ranks_per_trial(config: dict[str, object]) -> int:
    """One rank at the lowest rung, two for a promoted (longer) trial."""
    return 1 if int(config["epochs"]) <= 1 else 2  # type: ignore[call-overload]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trials", type=int, default=8, help="trials of the whole search")
    parser.add_argument("--root", default="results/pool_promotion")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning").setLevel(logging.WARNING)
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
