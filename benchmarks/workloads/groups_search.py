"""The groups workload: a NePS search whose trials are Lightning ``strategy="ddp"`` jobs,
run by ``neps-bcast launch`` as K groups of N ranks on one root directory.

    neps-bcast launch --groups 2 --nproc-per-group 2 benchmarks/workloads/groups_search.py --root R --trials 8
    neps-bcast launch --groups 1 --nproc-per-group 4 benchmarks/workloads/groups_search.py --root R --trials 8

Every rank of every group runs this script (torchrun's variables; the Trainer takes its size
from LOCAL_WORLD_SIZE). Each trial is the same fixed amount of training whatever the layout:
one epoch over ``SAMPLES`` samples in global batches of ``GLOBAL_BATCH`` (each rank gets
``GLOBAL_BATCH / N`` of a batch, so every rank takes SAMPLES / GLOBAL_BATCH = 128 steps),
a fixed-width MLP (8-256-256-1), CPU, gloo; only the learning rate is searched (random
search), so no trial costs more than another. Sized so that a trial takes seconds, not the
~0.2 s of a 16-step trial, whose throughput is mostly Lightning's per-fit set-up. The
timings are NePS's own (``time_started`` / ``time_end`` in each trial's ``metadata.json``);
this script records nothing itself. Model, data and trainer: ``lightning_search.py``'s.
"""

from __future__ import annotations

import argparse
import logging
import os

import neps
from lightning_search import Regressor, ddp_trainer, regression_data
from torch import nn
from torch.utils.data import DataLoader

import neps_bcast

SAMPLES = 8192
GLOBAL_BATCH = 64
HIDDEN = 256


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)


def evaluate_pipeline(lr: float) -> float:
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = ddp_trainer(devices=ranks)
    with neps_bcast.session():
        layers = (nn.Linear(8, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        trainer.fit(
            Regressor(nn.Sequential(*layers, nn.Linear(HIDDEN, 1)), lr),
            DataLoader(regression_data(SAMPLES, 0), batch_size=GLOBAL_BATCH // ranks),
            DataLoader(regression_data(SAMPLES // 4, 1), batch_size=GLOBAL_BATCH // ranks),
        )
    return float(trainer.callback_metrics["val_loss"].item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--trials", type=int, default=8, help="trials of all groups together")
    args = parser.parse_args()
    # INFO: the launcher's status lines count the trials from the leaders' log lines.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("lightning").setLevel(logging.WARNING)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer="random_search",
    )


if __name__ == "__main__":
    main()
