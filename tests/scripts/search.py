"""The end-to-end test script: a real NePS search, launched as users launch it.

Every rank runs this file (`python search.py`, torchrun, srun-like variables). What it
does is one ``scenario.Scenario``, read from the ``NB_SCENARIO`` environment variable
(tests/scenario.py documents every field). What happened is recorded by ``probe`` (JSON
lines per process) and read back by tests/harness.py: "start", "trial", "trained",
"raised", "fault", "exit" (with the exit code, on every rank), and more.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import neps
import probe
import torch.distributed as dist
import workload
from probe import SCENARIO, SEQ, fault, my_rank, record
from space_tools import unpicklable_tool

import neps_bcast
import neps_bcast.runtime


def evaluate(**kwargs: Any) -> float:
    SEQ["n"] += 1
    probe.arm_stack_dump()
    try:
        if SCENARIO.chdir_into:
            os.chdir(tempfile.mkdtemp(prefix=f"trial{SEQ['n']}_", dir=SCENARIO.chdir_into))
            record("chdir", seq=SEQ["n"], cwd=str(Path.cwd()))
        fault("before")
        return in_session(kwargs)
    except BaseException as exc:
        # What every rank's session raised (the failing rank's own error, or the
        # TrialFailedError naming it).
        record("raised", seq=SEQ["n"], rank=my_rank(), type=type(exc).__name__, text=str(exc))
        raise
    finally:
        probe.arm_stack_dump()


def watch_the_channel() -> None:
    """neps_bcast's own gloo group, the control channel (no local of a trial's frame
    may hold it: a failed trial's traceback keeps those frames)."""
    rt = neps_bcast.runtime.active()
    channel = getattr(rt.link.channel, "_pg", None) if rt is not None else None
    if channel is not None:
        probe.outlives_its_trial(channel, "control channel")


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
        watch_the_channel()
        workload.echo_open(f"trial_{SEQ['n']}", trial.rank)
        workload.echo_use(trial.rank)
        fault("session")
        meet = SCENARIO.meet
        if meet is not None and SEQ["n"] == 1:
            (Path(meet.folder) / meet.me).touch()
            deadline = time.monotonic() + 60
            while not (Path(meet.folder) / meet.other).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # test orchestration only: make two launches overlap
        if SCENARIO.strategy == "none":
            loss = float(kwargs["lr"])
        elif SCENARIO.strategy == "plain_ddp":
            loss = workload.plain_ddp(kwargs)
        elif SCENARIO.strategy == "fabric":
            loss = workload.fabric(kwargs)
        else:
            loss = workload.lightning(kwargs, trial.id)
        record(
            "trained",
            rank=trial.rank,
            world_size_after=dist.get_world_size() if dist.is_initialized() else None,
            loss=loss,
        )
        fault("after")
        if SCENARIO.destroy_group and dist.is_initialized():
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
    probe.observe_neps()
    probe.observe_reform()
    space = {"fidelity": WithFidelity, "unpicklable": WithTool}.get(SCENARIO.space, Basic)()
    fn = with_dirs if SCENARIO.extra_args or SCENARIO.space == "fidelity" else evaluate
    root = SCENARIO.root or "results"
    record("start", argv=sys.argv, cwd=str(Path.cwd()), root=str(Path(root).resolve()))
    probe.watch_root(Path(root))
    bad = SCENARIO.bad
    if bad is not None and bad.rank == my_rank():
        if bad.skip_run:
            record("skipped_run")
            return
        if bad.other_root:
            root += "_elsewhere"
        if bad.other_space:
            space = WithFidelity()
    workload.echo_open("before_run", my_rank())
    neps_bcast.run(
        fn,
        pipeline_space=space,
        root_directory=root,
        total_evaluations_to_spend=SCENARIO.trials,
        optimizer=SCENARIO.optimizer,
        ignore_errors=SCENARIO.ignore_errors,
    )


if __name__ == "__main__":
    probe.log_to_own_file()
    try:
        main()
    except BaseException as exc:
        probe.record_exit(exc)
        raise
    probe.record_exit(None)
