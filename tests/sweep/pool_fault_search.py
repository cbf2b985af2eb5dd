"""The pool's cells of the fault sweep: a search whose every trial takes 2 ranks of a
pool, PyTorch's DDP tutorial inside the function, with the test scripts' probe and
fault hooks (tests/scripts/probe.py, faults.py).

    neps-bcast launch --pool 2 pool_fault_search.py --trials 6
    neps-bcast launch --pool 2 pool_fault_search.py --session-forms-group

On a pool of 2, trials of 2 ranks run one after another: the two agents each hold one,
the launcher places them in the order asked.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import faults
import neps
import probe
import torch
import torch.distributed as dist
from torch import nn

import neps_bcast

ARGS = argparse.Namespace()


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)


@probe.evaluation
def evaluate_pipeline(lr: float) -> float:
    if not ARGS.session_forms_group:
        dist.init_process_group("gloo")  # torchrun's variables, as the tutorial
    with neps_bcast.session() as trial:
        probe.trial(trial)
        probe.record("environment", pool_key="NEPS_BCAST_POOL_KEY" in os.environ)
        model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        torch.manual_seed(0)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        loss = torch.zeros(())
        for _ in range(3):
            faults.at("fit")
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
        probe.trained(trial.rank, float(loss))
        del model, opt
    if not ARGS.session_forms_group:
        dist.destroy_process_group()
    return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--root", default="results")
    parser.add_argument(
        "--session-forms-group",
        action="store_true",
        help="no init_process_group in the function: neps_bcast.session() forms the group",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="overwrite_root_directory=True: the launch wipes the root once, not each agent",
    )
    parser.parse_args(namespace=ARGS)
    role = os.environ.get("NEPS_BCAST_POOL_ROLE", "")
    probe.record("pool_member", role=role, index=os.environ.get("NEPS_BCAST_POOL_INDEX"))
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        overwrite_root_directory=ARGS.overwrite,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
        ignore_errors=True,
        ranks_per_trial=lambda config: 2,
    )


if __name__ == "__main__":
    probe.run_script(main)
