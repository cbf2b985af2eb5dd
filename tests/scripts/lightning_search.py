"""A user's NePS search over Lightning ``strategy="ddp"`` trials, as the README's quickstart.

    python lightning_search.py --devices 2 --trials 5     # Lightning starts the other ranks
    torchrun --standalone --nproc-per-node 2 lightning_search.py --devices 2 --trials 5
    srun python lightning_search.py --devices 2 --trials 5

The test hooks are one line each: ``probe`` records what each rank did (its
``@probe.evaluation`` decorator, ``probe.trial``, ``probe.trained``,
``probe.training_step``; tests/scripts/probe.py), ``faults.at(POINT)`` marks where the
fault the test names in ``NB_FAULT`` may strike (tests/scripts/faults.py), and
``tracker`` is the user's own connection (tests/scripts/tracker.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

import faults
import lightning as L
import neps
import probe
import torch
import tracker
from space_tools import unpicklable_tool
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

ARGS = argparse.Namespace()


class Model(L.LightningModule):
    def __init__(self, lr: float, hidden: int, activation: str, trial_id: str) -> None:
        super().__init__()
        act = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}[activation]
        self.net = nn.Sequential(nn.Linear(4, hidden), act(), nn.Linear(hidden, 1))
        self.lr = lr
        self.trial_id = trial_id

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        probe.training_step(self, self.trial_id)
        faults.at("fit")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    return DataLoader(data, batch_size=16), DataLoader(data, batch_size=32)


class Basic(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))


class WithFidelity(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))
    epochs = neps.IntegerFidelity(1, 3)


class WithTool(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))
    tool = neps.Operation(operator=unpicklable_tool)


@probe.evaluation
def evaluate_pipeline(
    lr: float, hidden: int, activation: str, epochs: int = 1, tool: object = None
) -> float:
    """The quickstart's function (``tool``: WithTool's Operation, unused)."""
    return evaluate(lr, hidden, activation, epochs)


@probe.evaluation
def evaluate_with_checkpoints(
    lr: float,
    hidden: int,
    activation: str,
    pipeline_directory: Path,
    previous_pipeline_directory: Path | None,
    pipeline_id: str,
    epochs: int = 1,
) -> float:
    """Multi-fidelity: NePS passes the trial's folder and the one it continues from
    (because the signature names them); the Trainer resumes from the latter's checkpoint
    and saves its own in the former."""
    return evaluate(lr, hidden, activation, epochs, pipeline_directory, previous_pipeline_directory)


def evaluate(
    lr: float,
    hidden: int,
    activation: str,
    epochs: int,
    pipeline_directory: Path | None = None,
    previous_pipeline_directory: Path | None = None,
) -> float:
    if ARGS.chdir_into:  # a function that works in a scratch folder of its own
        os.chdir(tempfile.mkdtemp(prefix="trial", dir=ARGS.chdir_into))
    faults.at("before")
    with neps_bcast.session() as trial:
        probe.trial(trial)
        tracker.log_trial(trial.rank)
        faults.at("session")
        trainer = L.Trainer(
            accelerator="cpu",
            devices=faults.devices(ARGS.devices),
            strategy=ARGS.strategy,
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=pipeline_directory,
        )
        checkpoint = None
        if previous_pipeline_directory is not None:
            checkpoint = Path(previous_pipeline_directory) / "last.ckpt"
        trainer.fit(
            Model(lr, hidden, activation, trial.id),
            *loaders(),
            ckpt_path=checkpoint if checkpoint and checkpoint.exists() else None,
        )
        if pipeline_directory is not None:
            trainer.save_checkpoint(Path(pipeline_directory) / "last.ckpt")
        if ARGS.strategy == "ddp_spawn":  # the metric may not come back to this process
            loss = float(trainer.callback_metrics.get("val_loss", torch.tensor(0.0)).item())
        else:
            loss = float(trainer.callback_metrics["val_loss"].item())
        probe.trained(trial.rank, loss)
        faults.at("after")
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--root", default="results")
    parser.add_argument("--optimizer", default="random_search")
    parser.add_argument("--space", choices=("basic", "fidelity", "tool"), default="basic")
    parser.add_argument("--ignore-errors", action="store_true")
    parser.add_argument(
        "--with-dirs",
        action="store_true",
        help="evaluate_with_checkpoints (NePS passes pipeline_directory & co.); implied by"
        " --space fidelity",
    )
    parser.add_argument("--strategy", choices=("ddp", "ddp_spawn"), default="ddp")
    parser.add_argument("--chdir-into", help="each trial moves into a new folder under this one")
    parser.add_argument("--tracker", type=int, help="the tracker's port on 127.0.0.1")
    parser.add_argument("--tracker-from", default="trial_1")
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    logging.getLogger("lightning").setLevel(logging.WARNING)
    tracker.configure(ARGS.tracker, ARGS.tracker_from)
    tracker.connect_if("before_run", probe.my_rank())
    space = {"basic": Basic, "fidelity": WithFidelity, "tool": WithTool}[ARGS.space]()
    with_dirs = ARGS.with_dirs or ARGS.space == "fidelity"
    neps_bcast.run(
        evaluate_with_checkpoints if with_dirs else evaluate_pipeline,
        pipeline_space=space,
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer=ARGS.optimizer,
        ignore_errors=ARGS.ignore_errors,
    )


if __name__ == "__main__":
    probe.run_script(main)
