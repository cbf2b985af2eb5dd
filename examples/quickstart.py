"""The README's quickstart, as it stands there: NePS searches a small Lightning model
whose every trial is a DDP job on 2 CPU ranks. `python examples/quickstart.py`
(Lightning starts rank 1); results in results/quickstart."""

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast


class Model(L.LightningModule):
    def __init__(self, lr: float, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch, _):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, _):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data() -> DataLoader:
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(x, 2 * x[:, :1] - x[:, 1:2] ** 2), batch_size=32)


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-4, 1e-1, log=True)
    hidden = neps.Integer(4, 64)
    epochs = neps.IntegerFidelity(1, 3)


def evaluate_pipeline(lr: float, hidden: int, epochs: int, pipeline_directory) -> float:
    with neps_bcast.session() as trial:  # every rank, around the distributed work
        trainer = L.Trainer(
            accelerator="cpu",
            devices=trial.devices or 2,  # a pool's (neps-bcast launch --pool D), else 2 ranks
            strategy="ddp",
            max_epochs=epochs,
            default_root_dir=pipeline_directory,
            logger=False,
            enable_progress_bar=False,
        )
        trainer.fit(Model(lr, hidden), data(), data())
    return trainer.callback_metrics["val_loss"].item()


if __name__ == "__main__":
    neps_bcast.run(  # every rank; exactly the arguments of neps.run
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory="results/quickstart",
        total_evaluations_to_spend=4,
        optimizer="hyperband",
    )
