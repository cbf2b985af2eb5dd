"""The script `neps-bcast launch` runs in tests/e2e/test_e2e_launch.py: a Lightning ddp search.

Every rank of every group runs it under the launcher's torchrun. It appends JSON lines
to ``$LAUNCH_RECORD_DIR/<pid>.jsonl``: "start", "trial" (inside ``session()``: trial id,
kwargs, RANK, the group the launcher set in NEPS_BCAST_LAUNCH_GROUP and its launch id,
CUDA_VISIBLE_DEVICES, SLURM_PROCID,
torchrun's restart count), "training" (first training step), "exit" (exit code).
Faults come from the environment only:

- ``LAUNCH_KILL=group,rank,seq,flag``: that rank of that group SIGKILLs itself in its
  group's trial number ``seq`` (in the first training step), once: it creates ``flag``
  first, so the restarted group does not do it again.
- ``LAUNCH_RESTARTED=flag``: a rank started by a restart of its group creates ``flag`` in
  its first training step;
  ``LAUNCH_WAIT_RESTART=group``: that group's ranks, in every training step before then,
  wait (bounded, 120 s) until ``flag`` exists: so the restarted group evaluates
  a trial however long its restart takes on a loaded machine.
- ``LAUNCH_MEET=folder,count``: in its first trial, every rank waits (bounded, 120 s)
  until ranks of ``count`` different launches (launcher processes) are in theirs.
- ``LAUNCH_HOLD_S=s``: every rank stays ``s`` seconds in the first training step of
  every trial (the workload of a long trial), so a signal lands in the middle of one.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import neps
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

RECORD = Path(os.environ["LAUNCH_RECORD_DIR"]) / f"{os.getpid()}.jsonl"
SEQ = {"n": 0}
EXIT = {"code": 0}


def record(event: str, **fields: Any) -> None:
    line = {
        "event": event,
        "t": time.time(),
        "pid": os.getpid(),
        "rank": int(os.environ.get("RANK", "-1")),
        "group": os.environ.get("NEPS_BCAST_LAUNCH_GROUP"),
        "launch": os.environ.get("NEPS_BCAST_LAUNCH_ID"),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "-1")),
        **fields,
    }
    with RECORD.open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-4, 1e-1, log=True)
    hidden = neps.Integer(4, 32)


class Tiny(L.LightningModule):
    def __init__(self, lr: float, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        if index == 0:
            first_step()
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def first_step() -> None:
    record("training", seq=SEQ["n"])
    kill = os.environ.get("LAUNCH_KILL")
    if kill:
        group, rank, seq, flag = kill.split(",")
        mine = (group, int(rank), int(seq)) == (
            os.environ.get("NEPS_BCAST_LAUNCH_GROUP"),
            int(os.environ["RANK"]),
            SEQ["n"],
        )
        if mine and not Path(flag).exists():
            Path(flag).touch()
            record("kill", seq=SEQ["n"])
            os.kill(os.getpid(), signal.SIGKILL)
    restarted = os.environ.get("LAUNCH_RESTARTED")
    if restarted and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) > 0:
        Path(restarted).touch()
    elif restarted and os.environ.get("LAUNCH_WAIT_RESTART") == os.environ.get(
        "NEPS_BCAST_LAUNCH_GROUP"
    ):
        deadline = time.monotonic() + 120
        while not Path(restarted).exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # test orchestration: wait for the other group's restart
        record("waited", seq=SEQ["n"], restarted=Path(restarted).exists())
    meet = os.environ.get("LAUNCH_MEET")
    if meet and SEQ["n"] == 1:
        # Every launch's first trial waits (bounded, 120 s) until each of the `count`
        # launches is in its first trial, so they share the search however long one
        # takes to import on a loaded machine.
        folder, count = meet.rsplit(",", 1)
        Path(folder, f"{os.environ['NEPS_BCAST_LAUNCH_ID']}.{os.getpid()}").touch()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            launches = {p.name.split(".")[0] for p in Path(folder).iterdir()}
            if len(launches) >= int(count):
                break
            time.sleep(0.05)  # test orchestration: make the launches overlap
        record("met", seq=SEQ["n"], launches=len(launches))
    hold = float(os.environ.get("LAUNCH_HOLD_S", "0"))
    if hold:
        time.sleep(hold)  # the workload of a long trial


def loader(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] - x[:, 1:2]), batch_size=16)


def evaluate(lr: float, hidden: int) -> float:
    SEQ["n"] += 1
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with neps_bcast.session() as trial:
        record(
            "trial",
            seq=SEQ["n"],
            trial_id=trial.id,
            group_rank=trial.rank,
            kwargs={"lr": lr, "hidden": hidden},
            cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        )
        trainer.fit(Tiny(lr, hidden), loader(0), loader(1))
    return float(trainer.callback_metrics["val_loss"].item())


def on_exit() -> None:
    record("exit", code=EXIT["code"])


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning").setLevel(logging.WARNING)
    record(
        "start",
        cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        slurm_procid=os.environ.get("SLURM_PROCID"),
        master_port=os.environ.get("MASTER_PORT"),
    )
    atexit.register(on_exit)
    try:
        neps_bcast.run(
            evaluate,
            pipeline_space=Space(),
            root_directory=os.environ["LAUNCH_ROOT"],
            total_evaluations_to_spend=int(os.environ.get("LAUNCH_TRIALS", "6")),
            optimizer="random_search",
            ignore_errors=True,
        )
    except SystemExit as exc:
        EXIT["code"] = exc.code if isinstance(exc.code, int) else 1
        raise
    except BaseException:
        EXIT["code"] = 1
        raise


if __name__ == "__main__":
    sys.exit(main())
