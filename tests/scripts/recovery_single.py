"""One NePS worker in one process (no DDP) through ``neps_bcast.run``, for the lease
tests: a trivial function, and a fault in the trial the environment names.

Environment: ``NB_ROOT`` (the NePS root), ``NB_TRIALS`` (the budget), ``NB_FAULT``
(``kill``, ``term`` or ``raise``) and ``NB_FAULT_AT`` (the trial id it fires in, every
time that trial is evaluated), ``NB_LOG`` (JSON lines: one per evaluation).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import neps

import neps_bcast


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)


def evaluate(lr: float, hidden: int, pipeline_directory: Path, pipeline_id: str) -> float:
    with Path(os.environ["NB_LOG"]).open("a") as log:
        line = dict(
            pid=os.getpid(),
            trial_id=pipeline_id,
            lr=lr,
            hidden=hidden,
            pipeline_directory=str(pipeline_directory),
            t=time.time(),
        )
        log.write(json.dumps(line) + "\n")
    if pipeline_id == os.environ.get("NB_FAULT_AT"):
        fault = os.environ.get("NB_FAULT")
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        if fault == "raise":
            raise ValueError(f"injected failure in trial {pipeline_id}")
    return lr


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    neps_bcast.run(
        evaluate,
        pipeline_space=Space(),
        root_directory=os.environ["NB_ROOT"],
        total_evaluations_to_spend=int(os.environ["NB_TRIALS"]),
        optimizer="random_search",
    )
