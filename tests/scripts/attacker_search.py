"""The search the outsider attacks: a user's Lightning DDP script, launched as users do.

    python attacker_search.py                                  # Lightning starts rank 1
    torchrun --standalone --nproc-per-node 2 attacker_search.py
    srun python attacker_search.py                             # 2 tasks, SLURM's variables

Three trials of a small regressor on 2 ranks (gloo, CPU). Trial 2 fails on rank 1
(``injected failure on rank 1``), so that a failure is published on the error board and
the group released while the outsider writes; NePS goes on (``ignore_errors``). Every
process appends what happened to ``$NB_RECORD_DIR/<pid>.jsonl`` (start, each trial with
what the function returned, exit with its code and error) and logs neps_bcast at INFO to
``$NB_LOG_DIR/<pid>.log``; the NePS root is ``$NB_ROOT``. Its last atexit handler
records ("at_exit") which of what its trials made (the DDP wrapper, the trial's process
group) is still alive there, left to the interpreter's finalization.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import lightning as L
import neps
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

RECORD = Path(os.environ["NB_RECORD_DIR"])
TRIALS = 3
FAILING_TRIAL = "2"


def rank_guess() -> tuple[int, str]:
    """This process's rank as its launcher gave it, and the variable that said so."""
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]), name
    return 0, "none"


def record(event: str, **fields: Any) -> None:
    line = {"event": event, "t": time.time(), "pid": os.getpid(), **fields}
    with (RECORD / f"{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")


TRIAL_OBJECTS: list[tuple[str, weakref.ref[Any]]] = []
"""What this process's trials made that must be gone when it ends."""


def left_to_finalization() -> None:
    """Registered before ``neps_bcast.run`` (so it runs after its handlers): what is
    alive here is freed by the interpreter's finalization, where a gloo group aborts."""
    if TRIAL_OBJECTS:
        alive = sorted({kind for kind, ref in TRIAL_OBJECTS if ref() is not None})
        record("at_exit", trial_objects_alive=alive, trial_objects_seen=len(TRIAL_OBJECTS))


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 8)


class Regressor(L.LightningModule):
    def __init__(self, lr: float, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(
        self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
    ) -> torch.Tensor:
        if batch_idx == 0:
            TRIAL_OBJECTS.append(("DDP wrapper", weakref.ref(self.trainer.strategy.model)))
            TRIAL_OBJECTS.append(("process group", weakref.ref(dist.group.WORLD)))
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data() -> DataLoader[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, x[:, :1] * 2), batch_size=16)


def evaluate_pipeline(lr: float, hidden: int) -> float:
    trainer = L.Trainer(
        devices=2,
        strategy="ddp",
        accelerator="cpu",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with neps_bcast.session() as trial:
        if trial.id == FAILING_TRIAL and trial.rank == 1:
            raise ValueError("injected failure on rank 1")
        trainer.fit(Regressor(lr, hidden), data())
        result = float(trainer.callback_metrics["train_loss"].item())
        record("trial", rank=trial.rank, trial_id=trial.id, config=trial.config, result=result)
    return result


def main() -> int:
    log_dir = Path(os.environ["NB_LOG_DIR"])
    handler = logging.FileHandler(log_dir / f"{os.getpid()}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
    logging.getLogger().addHandler(handler)
    logging.getLogger("neps_bcast").setLevel(logging.INFO)
    rank, rank_from = rank_guess()
    record("start", rank=rank, rank_from=rank_from)
    atexit.register(left_to_finalization)
    code, error = 0, None
    try:
        neps_bcast.run(
            evaluate_pipeline,
            pipeline_space=Space(),
            root_directory=os.environ["NB_ROOT"],
            total_evaluations_to_spend=TRIALS,
            optimizer="random_search",
            ignore_errors=True,
        )
    except Exception as exc:
        code, error = 1, f"{type(exc).__name__}: {exc}"
        logging.getLogger("neps_bcast").error("%s", traceback.format_exc())
    record("exit", rank=rank, code=code, error=error)
    handler.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
