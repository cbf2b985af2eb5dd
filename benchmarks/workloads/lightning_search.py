"""The end-to-end workload: a NePS search whose trials are Lightning ``strategy="ddp"`` jobs.

    python benchmarks/workloads/lightning_search.py --system ours|builtin --root R --timings T --trials 20

Run as a plain script; Lightning re-runs it, arguments and all, for rank 1 (``devices=2``,
CPU, gloo). ``ours``: every rank calls ``neps_bcast.run`` and trains inside
``neps_bcast.session()``. ``builtin``: every rank calls ``neps.run`` (NePS 0.17's own DDP
mode). Same tiny model, data and optimizer (random search by default, so the optimizer's
own cost stays out of the picture; ``--optimizer bayesian_optimization --seed 0`` for the
end-to-end BO row). Each rank appends ``{"rank", "lr", "t_enter"}`` to
``<timings>/rank<r>.jsonl`` when it enters the trial; the leader adds NePS's ``t_started``
for the trial. The model, data and trainer are shared with ``groups_search.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time
from pathlib import Path

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

ARGS: argparse.Namespace


class Regressor(L.LightningModule):
    """``net`` (8 features -> 1) fitted to ``regression_data`` by SGD."""

    def __init__(self, net: nn.Module, lr: float) -> None:
        super().__init__()
        self.net = net
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def regression_data(size: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(size, 8, generator=generator)
    noise = 0.1 * torch.randn(size, 1, generator=generator)
    return TensorDataset(inputs, (inputs[:, :1] * 2.0 + noise).float())


def ddp_trainer(devices: int) -> L.Trainer:
    """One epoch of ``strategy="ddp"`` on CPU, nothing written, every rank seeded alike."""
    L.seed_everything(0, verbose=False)
    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(4, 32)


def evaluate_pipeline(lr: float, hidden: int) -> float:
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    record: dict[str, object] = {
        "rank": rank,
        "lr": lr,
        "t_enter": time.clock_gettime(time.CLOCK_REALTIME),
    }
    if rank == 0:
        from neps.runtime import get_in_progress_trial

        trial = get_in_progress_trial()
        record.update(trial=trial.id, t_started=trial.metadata.time_started)
    with (Path(ARGS.timings) / f"rank{rank}.jsonl").open("a") as timings:
        timings.write(json.dumps(record) + "\n")
    trainer = ddp_trainer(devices=2)
    with neps_bcast.session() if ARGS.system == "ours" else contextlib.nullcontext():
        trainer.fit(
            Regressor(nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1)), lr),
            DataLoader(regression_data(256, 0), batch_size=64),
            DataLoader(regression_data(128, 1), batch_size=64),
        )
    return float(trainer.callback_metrics["val_loss"].item())


def main() -> None:
    global ARGS  # noqa: PLW0603
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=("ours", "builtin"), required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--timings", required=True)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--optimizer", default="random_search")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed random, numpy and torch on every rank before the search: both systems then"
        " face the same Bayesian optimization problem (benchmarks/studies/bo_gap.md)",
    )
    ARGS = parser.parse_args()
    if ARGS.seed is not None:
        L.seed_everything(ARGS.seed, verbose=False)
    Path(ARGS.timings).mkdir(parents=True, exist_ok=True)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    (neps_bcast.run if ARGS.system == "ours" else neps.run)(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer=ARGS.optimizer,
    )


if __name__ == "__main__":
    main()
