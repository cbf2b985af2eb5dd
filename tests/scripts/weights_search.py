"""A search whose trials each train a weight-sized model: one ``size x size`` Linear with
Adam, under Lightning ``strategy="ddp"``. What each trial leaves behind is what the next
one finds on its rank.

    python weights_search.py --devices 2 --trials 4 --size 3000        # Lightning ddp x2
    neps-bcast launch --pool 2 weights_search.py --pool-ranks 2 --trials 4 --size 3000
    python weights_search.py --accelerator gpu --devices 1 --size 60000  # most of a GPU

Test hooks (tests/scripts/probe.py): at each trial's function start and after its fit,
every rank records the tensors it holds of at least the weight's size, its RSS and, on
a GPU, the memory allocated there ("heap"); ``NB_BROKEN_DEVICES`` (a pool: device
indexes, or ``all``) makes those devices fail at the library's ``device`` fault point,
every time their rank starts; ``NB_WAIT_FOR`` holds each trial until a log says
something (``wait_for_text``); ``--oom-trial N`` makes the N-th trial ask its device
for far more memory than it has.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import time
from pathlib import Path

import lightning as L
import neps
import probe
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

ARGS = argparse.Namespace()


class Model(L.LightningModule):
    def __init__(self, size: int, lr: float) -> None:
        super().__init__()
        self.size = size
        self.lr = lr
        self.net: nn.Linear | None = None

    def configure_model(self) -> None:
        # Made on the trial's device (Lightning's init context): a GPU-sized weight
        # never passes through the host's memory.
        if self.net is None:
            self.net = nn.Linear(self.size, self.size)

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        assert self.net is not None
        return self.net(batch[0]).pow(2).mean()

    def validation_step(self, batch: list[torch.Tensor], _: int) -> None:
        assert self.net is not None
        self.log("val_loss", self.net(batch[0]).pow(2).mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-4, 1e-2, log=True)


@probe.evaluation
def evaluate_pipeline(lr: float) -> float:
    probe.heap(ARGS.size * ARGS.size, "start")
    wait_for_text()
    with neps_bcast.session() as trial:
        probe.trial(trial)
        if probe.SEQ["n"] == ARGS.oom_trial:
            # Far more than any card holds (2 TiB): CUDA's OutOfMemoryError.
            torch.empty(2**41, dtype=torch.uint8, device=f"cuda:{torch.cuda.current_device()}")
        devices = trial.devices if trial.devices is not None else ARGS.devices
        trainer = L.Trainer(
            accelerator=ARGS.accelerator,
            devices=devices,
            strategy="ddp",
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        data = TensorDataset(torch.randn(16, ARGS.size, generator=torch.Generator().manual_seed(0)))
        trainer.fit(Model(ARGS.size, lr), DataLoader(data, batch_size=8), DataLoader(data))
        loss = float(trainer.callback_metrics["val_loss"].item())
        probe.heap(ARGS.size * ARGS.size, "trained")
        probe.trained(trial.rank, loss)
    return loss


def wait_for_text() -> None:
    """``NB_WAIT_FOR=PATH::TEXT`` (test orchestration only): every trial waits, 180 s at
    most, until the file PATH holds TEXT (the search outlasts a device's retirement)."""
    if not os.environ.get("NB_WAIT_FOR"):
        return
    path, text = os.environ["NB_WAIT_FOR"].split("::", 1)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if text in Path(path).read_text(errors="replace"):
                return
        time.sleep(0.1)  # a bounded poll of a log file, not synchronization of ranks


def break_devices(broken: str) -> None:
    """``NB_BROKEN_DEVICES``: the devices named fail at the library's ``device`` point
    (the rank proves its device there, before it says hello), every time."""
    from neps_bcast import faults

    def fail(name: str, context: object) -> None:
        device = dict(context)["device"]  # type: ignore[call-overload]
        if broken == "all" or str(device) in broken.split(" "):
            probe.record("fault", kind="broken_device", where=name, device=device)
            raise RuntimeError(f"device {device} is broken (injected at the device point)")

    faults.arm(fail, ["device"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--size", type=int, default=3000)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--root", default="results")
    parser.add_argument("--pool-ranks", type=int, help="under neps-bcast launch --pool")
    parser.add_argument("--oom-trial", type=int, default=0)
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    logging.getLogger("lightning").setLevel(logging.WARNING)
    if os.environ.get("NB_BROKEN_DEVICES"):
        break_devices(os.environ["NB_BROKEN_DEVICES"])
    pool = {"ranks_per_trial": lambda config: ARGS.pool_ranks} if ARGS.pool_ranks else {}
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
        ignore_errors=True,
        **pool,
    )


if __name__ == "__main__":
    probe.run_script(main)
