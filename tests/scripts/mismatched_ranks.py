"""A search script whose ranks disagree, as a user's script can by mistake (a branch on
the rank, a config file read per node). Run under torchrun; rank 1 does what
``--rank1`` says: ``skips-run`` (it returns without calling ``neps_bcast.run``) or
``other-arguments`` (it calls it with another root directory and another search space).
"""

from __future__ import annotations

import argparse
import logging
import os

import neps
import probe

import neps_bcast


class Basic(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))


class WithFidelity(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))
    epochs = neps.IntegerFidelity(1, 3)


@probe.evaluation
def evaluate_pipeline(lr: float, hidden: int, activation: str, epochs: int = 1) -> float:
    with neps_bcast.session() as trial:
        probe.trial(trial)
    return lr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default="results")
    parser.add_argument("--rank1", choices=("skips-run", "other-arguments"), required=True)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    root, space = args.root, Basic()
    if os.environ["RANK"] == "1" and args.rank1 == "skips-run":
        probe.record("skipped_run")
        return
    if os.environ["RANK"] == "1" and args.rank1 == "other-arguments":
        root, space = root + "_elsewhere", WithFidelity()
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=space,
        root_directory=root,
        total_evaluations_to_spend=5,
        optimizer="random_search",
    )


if __name__ == "__main__":
    probe.run_script(main)
