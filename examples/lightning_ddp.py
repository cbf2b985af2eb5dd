"""A real NePS search whose trials are Lightning `strategy="ddp"` jobs on CPU ranks.

    python examples/lightning_ddp.py --devices 2 --trials 10 --root results/demo

Every rank runs this script (Lightning re-runs it for ranks 1..N-1); only rank 0
talks to NePS. Each trial trains a small MLP on a synthetic regression task with
DDP over gloo and returns its validation loss.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast


class Regressor(L.LightningModule):
    def __init__(self, lr: float, hidden: int, activation: str) -> None:
        super().__init__()
        act = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}[activation]
        self.net = nn.Sequential(nn.Linear(8, hidden), act(), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :1] * 2.0 - x[:, 1:2] ** 2 + 0.1 * torch.randn(n, 1, generator=g)).float()
    return TensorDataset(x, y)


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-4, 1e-1, log=True)
    hidden = neps.Integer(4, 64)
    activation = neps.Categorical(("relu", "tanh", "gelu"))
    epochs = neps.IntegerFidelity(1, 4)


DEVICES = int(os.environ.get("DEMO_DEVICES", "2"))


def evaluate_pipeline(
    lr: float,
    hidden: int,
    activation: str,
    epochs: int,
    pipeline_directory: Path,
    previous_pipeline_directory: Path | None,
) -> dict[str, float]:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        strategy="ddp",
        max_epochs=epochs,
        default_root_dir=pipeline_directory,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Multi-fidelity: a promoted trial continues from the checkpoint that its lower
    # fidelity saved, on every rank alike.
    previous = previous_pipeline_directory / "last.ckpt" if previous_pipeline_directory else None
    with neps_bcast.session():
        trainer.fit(
            Regressor(lr, hidden, activation),
            DataLoader(data(512, 0), batch_size=64),
            DataLoader(data(256, 1), batch_size=64),
            ckpt_path=previous if previous is not None and previous.exists() else None,
        )
        trainer.save_checkpoint(pipeline_directory / "last.ckpt")  # rank 0 writes
    return {
        "objective_to_minimize": float(trainer.callback_metrics["val_loss"].item()),
        "cost": float(epochs),
    }


def main() -> None:
    global DEVICES  # noqa: PLW0603
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=DEVICES)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--root", default="results/demo")
    parser.add_argument("--optimizer", default="hyperband")
    args = parser.parse_args()
    DEVICES = args.devices
    os.environ["DEMO_DEVICES"] = str(args.devices)  # Lightning's children re-run this script
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning").setLevel(logging.WARNING)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer=args.optimizer,
    )
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("RANK", "0")) == 0:
        print_results(Path(args.root))  # the leader: followers have no results to show


def print_results(root: Path) -> None:
    import pandas as pd

    full = pd.read_csv(root / "summary" / "full.csv")
    wanted = [
        "id",
        "objective_to_minimize",
        "config.lr",
        "config.hidden",
        "config.activation",
        "config.epochs",
        "state",
    ]
    columns = [c for c in wanted if c in full.columns]
    table = full[columns].sort_values("objective_to_minimize")
    print(f"\nNePS results ({len(full)} trials, best first), from {root}/summary/full.csv:")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))


if __name__ == "__main__":
    main()
