"""A NePS search of Lightning DDP trials under SLURM, surviving its time limit the way
Lightning users do: ``#SBATCH --signal=USR1@90`` and Lightning's own SLURM auto-requeue
(on SIGUSR1 it saves ``hpc_ckpt_<n>.ckpt`` into the Trainer's ``default_root_dir`` and
requeues the job; the requeued fit resumes from it). ``default_root_dir`` is the trial's
own ``pipeline_directory``, so the requeued job's evaluation of the same trial finds it.

    srun python lightning_slurm.py --devices 2 --root results     # in the sbatch

A fit resumed from a checkpoint saved after its last epoch runs no validation, and
``trainer.callback_metrics`` is then empty: the metric is taken from
``trainer.validate`` in that case.

Test hooks, read from the environment (not part of what a user writes):
``LIGHTNING_RECORD`` (a folder: JSON lines per rank, each fit's global step at its start
and end, each step of a slow trial) and ``LIGHTNING_SLOW`` (a trial id whose first
attempt trains slowly, so that a test can signal the job in its middle).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

ARGS = argparse.Namespace(devices=2, epochs=4)


def record(event: str, **data: Any) -> None:
    folder = os.environ.get("LIGHTNING_RECORD")
    if folder:
        rank = int(os.environ.get("SLURM_PROCID", "0"))
        line = {"event": event, "rank": rank, "pid": os.getpid(), "t": time.time(), **data}
        with (Path(folder) / f"rank{rank}.jsonl").open("a") as f:
            f.write(json.dumps(line, default=str) + "\n")


class Regressor(L.LightningModule):
    def __init__(self, lr: float, slow: bool) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.lr = lr
        self.slow = slow

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        if self.slow:
            record("step", step=self.global_step)
            time.sleep(0.5)  # a long training step
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_start(self) -> None:
        record("fit_start", global_step=self.global_step)

    def on_train_end(self) -> None:
        record("fit_end", global_step=self.global_step)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(320, 8, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] ** 2), batch_size=32)


def evaluate_pipeline(pipeline_directory: Path, lr: float) -> float:
    trainer = L.Trainer(
        devices=ARGS.devices,
        strategy="ddp",
        max_epochs=ARGS.epochs,
        default_root_dir=pipeline_directory,  # where auto-requeue saves, and resumes from
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with neps_bcast.session() as trial:
        slow = trial.id == os.environ.get("LIGHTNING_SLOW") and trial.attempt == 1
        model = Regressor(lr, slow)
        trainer.fit(model, data(0), data(1))
        metrics = trainer.callback_metrics
        if "val_loss" not in metrics:  # resumed after the last epoch: no validation ran
            metrics = trainer.validate(model, data(1), verbose=False)[0]
        record("trained", trial=trial.id, attempt=trial.attempt)
    return float(metrics["val_loss"])


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-4, 1e-1, log=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--root", default="results/lightning_slurm")
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(level=logging.INFO)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
    )


if __name__ == "__main__":
    main()
