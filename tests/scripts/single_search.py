"""NePS's own quickstart through ``neps_bcast.run``: one process, no DDP, the loss is the
learning rate. Test hooks as in lightning_search.py."""

from __future__ import annotations

import argparse
import logging

import faults
import neps
import probe

import neps_bcast


class Basic(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))


@probe.evaluation
def evaluate_pipeline(lr: float, hidden: int, activation: str) -> float:
    faults.at("before")
    with neps_bcast.session() as trial:
        probe.trial(trial)
        faults.at("session")
        probe.trained(trial.rank, lr)
        faults.at("after")
    return lr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--root", default="results")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Basic(),
        root_directory=args.root,
        total_evaluations_to_spend=args.trials,
        optimizer="random_search",
    )


if __name__ == "__main__":
    probe.run_script(main)
