"""The training a trial does in search.py: Lightning, Fabric or a plain DDP loop, on a
tiny regression problem; and the user's own TCP connection (issue 9)."""

from __future__ import annotations

import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from probe import SCENARIO, SEQ, fault, outlives_its_trial, record
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self, lr: float, hidden: int, activation: str, trial_id: str) -> None:
        super().__init__()
        act = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}[activation]
        self.net = nn.Sequential(nn.Linear(4, hidden), act(), nn.Linear(hidden, 1))
        self.lr = lr
        self.trial_id = trial_id
        self.stepped = False

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        if not self.stepped:  # the process that trains (ddp_spawn: a spawned one)
            self.stepped = True
            record("step", trial_id=self.trial_id, rank=self.global_rank)
            # What holds a gloo group's threads: the group, and the DDP wrapper whose
            # reducer holds it even once the group is destroyed. (The model itself may
            # outlive the trial harmlessly: a ddp_spawn worker's arguments hold it.)
            wrapper = self.trainer.strategy.model
            if isinstance(wrapper, DistributedDataParallel):
                outlives_its_trial(wrapper, "DDP wrapper")
            if dist.is_initialized():
                outlives_its_trial(dist.group.WORLD, "process group")
        fault("fit")
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def loaders() -> tuple[DataLoader, DataLoader]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    ds = TensorDataset(x, y)
    return DataLoader(ds, batch_size=16), DataLoader(ds, batch_size=32)


def devices() -> int:
    at = SCENARIO.devices_at
    return at.devices if at is not None and SEQ["n"] == at.seq else SCENARIO.devices


def lightning(kwargs: dict[str, Any], trial_id: str) -> float:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices(),
        strategy=SCENARIO.strategy,
        max_epochs=int(kwargs.get("epochs", 1)),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=kwargs.get("pipeline_directory"),
    )
    prev = kwargs.get("previous_pipeline_directory")
    ckpt = Path(prev) / "last.ckpt" if prev else None
    model = Model(kwargs["lr"], kwargs["hidden"], kwargs["activation"], trial_id)
    train_dl, val_dl = loaders()
    trainer.fit(model, train_dl, val_dl, ckpt_path=ckpt if ckpt and ckpt.exists() else None)
    if "pipeline_directory" in kwargs:
        trainer.save_checkpoint(Path(kwargs["pipeline_directory"]) / "last.ckpt")
    if SCENARIO.strategy == "ddp_spawn":
        # The spawned ranks trained (their "step" records say so); the metric may not
        # come back to this process.
        return float(trainer.callback_metrics.get("val_loss", torch.tensor(0.0)).item())
    return float(trainer.callback_metrics["val_loss"].item())


def fabric(kwargs: dict[str, Any]) -> float:
    """Lightning Fabric: strategy="ddp" + fabric.launch() inside the function."""
    fab = L.Fabric(accelerator="cpu", devices=SCENARIO.devices, strategy="ddp")
    fab.launch()
    model = nn.Sequential(nn.Linear(4, kwargs["hidden"]), nn.ReLU(), nn.Linear(kwargs["hidden"], 1))
    opt = torch.optim.SGD(model.parameters(), lr=kwargs["lr"])
    model, opt = fab.setup(model, opt)
    train_dl, _ = loaders()
    train_dl = fab.setup_dataloaders(train_dl)
    loss = torch.zeros(())
    for x, y in train_dl:
        fault("fit")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fab.backward(loss)
        opt.step()
    return float(fab.all_reduce(loss.detach(), reduce_op="mean").item())


def plain_ddp(kwargs: dict[str, Any]) -> float:
    """A plain torch DDP loop (no Lightning) on the group neps_bcast formed, or on a
    ``dist.new_group`` made here (``SCENARIO.subgroup_timeout_s``)."""
    group = None
    if SCENARIO.subgroup_timeout_s is not None:
        group = dist.new_group(
            ranks=list(range(dist.get_world_size())),
            timeout=timedelta(seconds=SCENARIO.subgroup_timeout_s),
            backend="gloo",
        )
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=kwargs["lr"])
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(3):
        fault("fit")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t, group=group)
    return float(t.item() / dist.get_world_size())


ECHO: dict[str, socket.socket] = {}


def echo_open(when: str, rank: int) -> None:
    """Open this rank's own connection to the echo server, if the scenario says now."""
    if SCENARIO.echo is None or SCENARIO.echo.opened != when:
        return
    sock = socket.create_connection(("127.0.0.1", SCENARIO.echo.port), timeout=10)
    ECHO["sock"] = sock
    record("echo_open", rank=rank, seq=SEQ["n"], local_port=sock.getsockname()[1])


def echo_use(rank: int) -> None:
    """One round trip on the connection; records whether it worked (never raises)."""
    sock = ECHO.get("sock")
    if sock is None:
        return
    line = f"rank {rank} trial {SEQ['n']}\n"
    try:
        sock.sendall(line.encode())
        got = b""
        while not got.endswith(b"\n"):
            chunk = sock.recv(256)
            if not chunk:
                raise ConnectionError("closed by the server")
            got += chunk
        ok, error = got.decode() == line, None if got.decode() == line else f"got {got!r}"
    except OSError as exc:
        ok, error = False, f"{type(exc).__name__}: {exc}"
    record("echo", rank=rank, seq=SEQ["n"], ok=ok, error=error)
