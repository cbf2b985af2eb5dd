"""A user's NePS search whose trials train a plain torch DDP loop (no Lightning), started
by an external launcher: every rank runs this script, and the loop trains on the default
group neps_bcast forms at ``session()`` (the script forms none).

    torchrun --standalone --nproc-per-node 2 torch_ddp_search.py --trials 6
    torchrun --standalone --nproc-per-node 2 torch_ddp_search.py --destroy-group

``--destroy-group``: the function ends with ``dist.destroy_process_group()``, as PyTorch's
DDP tutorial does; ``--subgroup-timeout S``: each trial trains on a
``dist.new_group(timeout=S)`` of its own; ``--tag-host``: the result also names the host
that produced it (its ``info_dict``, which NePS keeps as the report's ``extra``), so a
test of several hosts on one root can tell whose evaluation NePS recorded. Test hooks as
in lightning_search.py.
"""

from __future__ import annotations

import argparse
import logging
import socket
from datetime import timedelta

import faults
import neps
import probe
import torch
import torch.distributed as dist
import tracker
from torch import nn

import neps_bcast

ARGS = argparse.Namespace()


class Basic(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))


def train(lr: float) -> float:
    group = None
    if ARGS.subgroup_timeout is not None:
        group = dist.new_group(
            ranks=list(range(dist.get_world_size())),
            timeout=timedelta(seconds=ARGS.subgroup_timeout),
            backend="gloo",
        )
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for _ in range(3):
        faults.at("fit")
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return float(total.item() / dist.get_world_size())


@probe.evaluation
def evaluate_pipeline(lr: float, hidden: int, activation: str) -> float | dict[str, object]:
    faults.at("before")
    with neps_bcast.session() as trial:
        probe.trial(trial)
        tracker.log_trial(trial.rank)
        faults.at("session")
        loss = train(lr)
        probe.trained(trial.rank, loss)
        faults.at("after")
        if ARGS.destroy_group and dist.is_initialized():
            dist.destroy_process_group()
    if ARGS.tag_host:
        return {"objective_to_minimize": loss, "info_dict": {"host": socket.gethostname()}}
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--root", default="results")
    parser.add_argument("--ignore-errors", action="store_true")
    parser.add_argument("--destroy-group", action="store_true")
    parser.add_argument("--subgroup-timeout", type=float)
    parser.add_argument("--tag-host", action="store_true", help="the result names its host")
    parser.add_argument("--tracker", type=int, help="the tracker's port on 127.0.0.1")
    parser.add_argument("--tracker-from", default="before_run")
    parser.parse_args(namespace=ARGS)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    tracker.configure(ARGS.tracker, ARGS.tracker_from)
    tracker.connect_if("before_run", probe.my_rank())
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Basic(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
        ignore_errors=ARGS.ignore_errors,
    )


if __name__ == "__main__":
    probe.run_script(main)
