"""A NePS search over Lightning DDP trials, for launchers that start every rank:
torchrun (one or several nodes) and SLURM's srun.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_ddp.py --devices 2
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint $HOST0:29400 --rdzv-id hpo1 \\
        examples/torchrun_ddp.py --devices 4 --num-nodes 2
    srun python examples/torchrun_ddp.py --devices 4 --num-nodes 2     # see slurm.sbatch

The Trainer forms the process group in trial 1 (or finds the one neps_bcast formed at
``session()``) and reuses it. `devices * num_nodes` must equal the launcher's world size
(Lightning checks it). Under SLURM, Lightning's auto-requeue (``--signal=USR1@90``, see
slurm_usr1.sbatch) saves ``hpc_ckpt_<n>.ckpt`` into ``default_root_dir``, here the trial's
own directory, and the requeued job's fit of the same trial resumes from it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

ARGS = argparse.Namespace(devices=2, num_nodes=1)


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


def evaluate_pipeline(pipeline_directory: Path, lr: float, hidden: int) -> float:
    trainer = L.Trainer(
        devices=ARGS.devices,
        num_nodes=ARGS.num_nodes,
        strategy="ddp",
        max_epochs=2,
        default_root_dir=pipeline_directory,  # SLURM auto-requeue saves and resumes here
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with neps_bcast.session():
        model = Regressor(lr, hidden)
        trainer.fit(model, data(0), data(1))
        metrics = trainer.callback_metrics
        if "val_loss" not in metrics:  # resumed from a checkpoint of its end: no validation
            metrics = trainer.validate(model, data(1), verbose=False)[0]
    return float(metrics["val_loss"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--root", default="results/torchrun")
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning").setLevel(logging.WARNING)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
    )


if __name__ == "__main__":
    main()
