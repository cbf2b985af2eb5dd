"""The end-to-end test script: a real NePS search, launched as users launch it.

Every rank runs this file (`python search.py`, torchrun, srun-like variables). It is
configured by environment variables so that each test sets only what it varies:

  NB_ROOT         NePS root directory (relative paths resolve against the cwd)
  NB_RECORD       folder where every rank appends what it evaluated (JSON lines)
  NB_TRIALS       total_evaluations_to_spend (default 5)
  NB_DEVICES      Lightning devices (default 2)
  NB_STRATEGY     "ddp" (default), "ddp_spawn", "none" (no Lightning: plain function)
                  or "plain_ddp" (torch DDP loop without Lightning, external launch)
  NB_OPTIMIZER    NePS optimizer (default "random_search")
  NB_SPACE        "basic" (Float log, Integer, Categorical), "fidelity" (+ epochs) or
                  "unpicklable" (+ an Operation whose object cannot be pickled in the
                  trials listed in NB_UNPICKLABLE_SEQS, e.g. "2,3")
  NB_IGNORE_ERRORS  "1" to pass ignore_errors=True
  NB_FAULT        fault injection, e.g. "raise:rank=1:seq=2:where=fit" (see fault());
                  several faults separated by commas
  NB_DESTROY_GROUP  "1": the function calls dist.destroy_process_group() at its end, as
                  PyTorch's DDP tutorial does
  NB_DEVICES_AT   "<seq>:<n>": Lightning devices=<n> in the <seq>-th trial only
  NB_EXTRA_ARGS   "1" to ask for pipeline_directory/previous_pipeline_directory/pipeline_id
  NB_BAD          bad input on one rank: "skip_run:rank=<r>" (that rank never calls
                  neps_bcast.run), "root:rank=<r>", "space:rank=<r>" or
                  "root+space:rank=<r>" (it passes a different root_directory / space)
  NB_MEET         "<dir>:<me>:<other>": in its first trial every rank touches <dir>/<me> and
                  waits (60 s at most) for <dir>/<other>, so two launches overlap for sure

What it records is read back by tests/harness.py.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
import neps
import torch
import torch.distributed as dist
from space_tools import unpicklable_tool
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import neps_bcast

ENV = os.environ
RECORD = Path(ENV["NB_RECORD"]).resolve() if "NB_RECORD" in ENV else None
STRATEGY = ENV.get("NB_STRATEGY", "ddp")
DEVICES = int(ENV.get("NB_DEVICES", "2"))
FAULT = ENV.get("NB_FAULT", "")
SEQ = {"n": 0}
CALLS = {"neps.run": 0, "NePSState.create_or_load": 0}

# Observe (never replace) NePS: count calls, pass through.
_real_run = neps.run


def _counting_run(*args: Any, **kwargs: Any) -> Any:
    CALLS["neps.run"] += 1
    return _real_run(*args, **kwargs)


neps.run = _counting_run
from neps.state import neps_state as _ns  # noqa: E402

_real_col = _ns.NePSState.create_or_load.__func__  # type: ignore[attr-defined]


def _counting_col(cls: Any, *args: Any, **kwargs: Any) -> Any:
    CALLS["NePSState.create_or_load"] += 1
    return _real_col(cls, *args, **kwargs)


_ns.NePSState.create_or_load = classmethod(_counting_col)  # type: ignore[assignment]


def my_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in ENV:
            return int(ENV[name])
    return 0


def record(event: str, **data: Any) -> None:
    if RECORD is None:
        return
    RECORD.mkdir(parents=True, exist_ok=True)
    line = {"event": event, "pid": os.getpid(), "proc_rank": my_rank(), "t": time.time(), **data}
    with (RECORD / f"pid{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def fault(where: str) -> None:
    """NB_FAULT = "<kind>:rank=<r|all>:seq=<n>:where=<point>[:s=<seconds>]", comma-separated.

    kind: raise (ValueError), kill (SIGKILL itself), kill_in (a thread SIGKILLs this
    process <s> seconds later), term_all (SIGTERM itself; with rank=all every rank gets
    one, as SLURM preemption does), int (SIGINT itself), int_group (SIGINT to the whole
    process group, as Ctrl-C in a terminal does), sigkill_leader (a Lightning child
    SIGKILLs its parent, the leader).
    where: before (in the function, before session()), session (first thing inside
    it), fit (Lightning training_step / the DDP loop), after (end of the session
    block), sample (the leader's NePS sampling its next trial; seq = trials done).
    """
    if not FAULT:
        return
    for spec in FAULT.split(","):
        kind, *parts = spec.split(":")
        opts = dict(p.split("=", 1) for p in parts)
        if opts.get("where", "fit") != where:
            continue
        if "rank" in opts and opts["rank"] != "all" and int(opts["rank"]) != my_rank():
            continue
        if "seq" in opts and int(opts["seq"]) != SEQ["n"]:
            continue
        record("fault", kind=kind, where=where, seq=SEQ["n"], rank=my_rank())
        if kind == "raise":
            raise ValueError(f"injected failure on rank {my_rank()} at {where}")
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "kill_in":
            delay = float(opts.get("s", "1"))
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if kind == "term_all":
            os.kill(os.getpid(), signal.SIGTERM)
        if kind == "int":
            os.kill(os.getpid(), signal.SIGINT)
        if kind == "int_group":
            os.killpg(os.getpgrp(), signal.SIGINT)
        if kind == "sigkill_leader":
            os.kill(os.getppid(), signal.SIGKILL)


_real_sample = _ns.NePSState._sample_trial


def _sampling(self: Any, *args: Any, **kwargs: Any) -> Any:
    fault("sample")  # the leader is choosing the next trial; its followers wait for it
    return _real_sample(self, *args, **kwargs)


_ns.NePSState._sample_trial = _sampling  # type: ignore[method-assign]


def devices() -> int:
    at, _, n = ENV.get("NB_DEVICES_AT", "").partition(":")
    return int(n) if at and SEQ["n"] == int(at) else DEVICES


class Model(L.LightningModule):
    def __init__(self, lr: float, hidden: int, activation: str) -> None:
        super().__init__()
        act = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}[activation]
        self.net = nn.Sequential(nn.Linear(4, hidden), act(), nn.Linear(hidden, 1))
        self.lr = lr

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
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


def train(kwargs: dict[str, Any]) -> float:
    epochs = int(kwargs.get("epochs", 1))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices(),
        strategy=STRATEGY,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=kwargs.get("pipeline_directory"),
    )
    prev = kwargs.get("previous_pipeline_directory")
    ckpt = Path(prev) / "last.ckpt" if prev else None
    model = Model(kwargs["lr"], kwargs["hidden"], kwargs["activation"])
    train_dl, val_dl = loaders()
    trainer.fit(model, train_dl, val_dl, ckpt_path=ckpt if ckpt and ckpt.exists() else None)
    if "pipeline_directory" in kwargs:
        trainer.save_checkpoint(Path(kwargs["pipeline_directory"]) / "last.ckpt")
    if STRATEGY == "ddp_spawn":
        return float(trainer.callback_metrics.get("val_loss", torch.tensor(0.0)).item())
    return float(trainer.callback_metrics["val_loss"].item())


def fabric_ddp(kwargs: dict[str, Any]) -> float:
    """Lightning Fabric: strategy="ddp" + fabric.launch() inside the function."""
    fabric = L.Fabric(accelerator="cpu", devices=DEVICES, strategy="ddp")
    fabric.launch()
    model = nn.Sequential(nn.Linear(4, kwargs["hidden"]), nn.ReLU(), nn.Linear(kwargs["hidden"], 1))
    opt = torch.optim.SGD(model.parameters(), lr=kwargs["lr"])
    model, opt = fabric.setup(model, opt)
    train_dl, _ = loaders()
    train_dl = fabric.setup_dataloaders(train_dl)
    loss = torch.zeros(())
    for x, y in train_dl:
        fault("fit")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
    return float(fabric.all_reduce(loss.detach(), reduce_op="mean").item())


def plain_ddp(kwargs: dict[str, Any]) -> float:
    """A plain torch DDP loop (no Lightning) on the group neps_bcast formed."""
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=kwargs["lr"])
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(3):
        fault("fit")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    t = loss.detach().clone()
    dist.all_reduce(t)
    return float(t.item() / dist.get_world_size())


def evaluate(**kwargs: Any) -> float:
    SEQ["n"] += 1
    try:
        fault("before")
        return in_session(kwargs)
    except BaseException as exc:
        # What every rank's session raised (the failing rank's own error, or the
        # TrialFailedError naming it).
        record("raised", seq=SEQ["n"], rank=my_rank(), type=type(exc).__name__, text=str(exc))
        raise


def in_session(kwargs: dict[str, Any]) -> float:
    with neps_bcast.session() as trial:
        record(
            "trial",
            trial_id=trial.id,
            rank=trial.rank,
            world_size=trial.world_size,
            is_leader=trial.is_leader,
            kwargs=kwargs,
            config=trial.config,
            pipeline_directory=trial.pipeline_directory,
            previous_pipeline_directory=trial.previous_pipeline_directory,
            ckpt_exists=bool(
                trial.previous_pipeline_directory
                and (Path(trial.previous_pipeline_directory) / "last.ckpt").exists()
            ),
        )
        fault("session")
        if ENV.get("NB_MEET") and SEQ["n"] == 1:
            meet_dir, me, other = ENV["NB_MEET"].split(":")
            (Path(meet_dir) / me).touch()
            deadline = time.monotonic() + 60
            while not (Path(meet_dir) / other).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # test orchestration only: make two launches overlap
        if STRATEGY == "none":
            loss = float(kwargs["lr"])
        elif STRATEGY == "plain_ddp":
            loss = plain_ddp(kwargs)
        elif STRATEGY == "fabric":
            loss = fabric_ddp(kwargs)
        else:
            loss = train(kwargs)
        record(
            "trained",
            rank=trial.rank,
            world_size_after=dist.get_world_size() if dist.is_initialized() else None,
            loss=loss,
        )
        fault("after")
        if ENV.get("NB_DESTROY_GROUP") == "1" and dist.is_initialized():
            dist.destroy_process_group()
    return loss


def with_dirs(
    lr: float,
    hidden: int,
    activation: str,
    pipeline_directory: Path,
    previous_pipeline_directory: Path | None,
    pipeline_id: str,
    epochs: int = 1,
) -> float:
    return evaluate(
        lr=lr,
        hidden=hidden,
        activation=activation,
        epochs=epochs,
        pipeline_directory=pipeline_directory,
        previous_pipeline_directory=previous_pipeline_directory,
        pipeline_id=pipeline_id,
    )


class Basic(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))


class WithTool(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))
    tool = neps.Operation(operator=unpicklable_tool)


class WithFidelity(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))
    epochs = neps.IntegerFidelity(1, 3)


def main() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format=f"%(asctime)s pid{os.getpid()} %(name)s %(levelname)s: %(message)s",
    )
    logging.getLogger("lightning").setLevel(logging.WARNING)
    space = {"fidelity": WithFidelity, "unpicklable": WithTool}.get(
        ENV.get("NB_SPACE", ""), Basic
    )()
    fn = (
        with_dirs
        if ENV.get("NB_EXTRA_ARGS") == "1" or ENV.get("NB_SPACE") == "fidelity"
        else evaluate
    )
    record("start", argv=sys.argv, cwd=str(Path.cwd()))
    root = ENV.get("NB_ROOT", "results")
    bad, _, bad_rank = ENV.get("NB_BAD", "").partition(":rank=")
    if bad and int(bad_rank) == my_rank():
        if bad == "skip_run":
            record("exit", ok=True, skipped=True, calls=CALLS)
            return
        if "root" in bad.split("+"):
            root += "_elsewhere"
        if "space" in bad.split("+"):
            space = WithFidelity()
    try:
        neps_bcast.run(
            fn,
            pipeline_space=space,
            root_directory=root,
            total_evaluations_to_spend=int(ENV.get("NB_TRIALS", "5")),
            optimizer=ENV.get("NB_OPTIMIZER", "random_search"),
            ignore_errors=ENV.get("NB_IGNORE_ERRORS") == "1",
        )
    except BaseException as exc:
        record("exit", ok=False, error=f"{type(exc).__name__}: {exc}", calls=CALLS)
        raise
    record("exit", ok=True, calls=CALLS)


if __name__ == "__main__":
    main()
