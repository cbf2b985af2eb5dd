"""The pool workload: a hyperband search whose trials train on *simulated* devices.

    neps-bcast launch --pool 8 benchmarks/workloads/pool_sim.py --root R --records REC --expect 16
    neps-bcast launch --groups 2 --nproc-per-group 4 benchmarks/workloads/pool_sim.py \\
        --root R --records REC --expect 8

A rank's "device" is simulated by a stated speedup curve: a trial of e epochs on k ranks
waits (``time.sleep``) ``c * T_EPOCH`` once (``--fixed-epochs`` c, default 0: the trial's
fixed device time that does not parallelize: start, data loading, validation), then per
epoch ``T_EPOCH * (s + (1 - s) / k)`` (``--t-epoch``; Amdahl's law with serial fraction
``s``, ``--serial-fraction``, default 0.1) followed by one tiny gloo ``all_reduce`` (so the
trial's ranks really are one DDP group and stay in step). A rank costs no CPU while its
device works, so 8 devices fit on 2 cores.
The group is formed as in PyTorch's DDP tutorial: ``init_process_group("gloo")`` at the
start of the function, ``destroy_process_group()`` at its end, under torchrun's variables
(``--groups``: torchrun's own; ``--pool``: the ones the pool's rank sets per trial).

The search: NePS ``optimizer=("hyperband", {"eta": 3})`` over one float and the fidelity
``epochs`` = ``neps.IntegerFidelity(1, --max-epochs)`` (default 9: rungs 1, 3, 9),
``--evaluations`` trials in all (``total_evaluations_to_spend``). Under ``--pool`` each
trial is right-sized by its fidelity (``--rule``, default ``1:1,3:2,9:4``: 1 rank up to 1
epoch, 2 up to 3, 4 up to 9; the last bound must reach ``--max-epochs``); under
``--groups`` every trial of a group runs on that group's N ranks.

Memory (``--min-ranks``, same form as ``--rule``, default none: every trial fits on one
rank): a trial of e epochs needs at least that many ranks to fit in its devices' memory.
On fewer, every rank of it raises ``torch.OutOfMemoryError`` at its first step, as a real
trial that does not fit would, so NePS records it crashed: a fixed layout too narrow for
the top rung cannot finish the search (and its crashed trials are no result). A ``--rule``
that gives some trial fewer ranks than its minimum is refused at the start.

Measurement hooks (not what a user writes): every process appends JSON lines to
``<records>/<pid>.jsonl``: ``ready`` once it has imported torch and NePS, and one
``trial`` line per trial it trained (trial id, rank, world size, device, epochs, and the
times it entered the function, started and ended its device work, left the function;
CLOCK_REALTIME). Before ``neps_bcast.run`` every process waits until ``--expect``
processes are ready (a file barrier), so that no trial competes with another process's
imports for the 2 cores: the launch's start-up is measured apart from the search.
Log lines carry their time (``%(created)``): the pool's agents log when a trial asks for
ranks and when it is placed (``trial X runs on device(s) ...``). ``POOL_SIM_DEBUG=1`` in
the environment logs neps_bcast's own steps too (DEBUG). ``--preimport-lightning``: import
Lightning's cluster environments before the barrier (a pool rank otherwise imports them
in its first trial, in ``neps_bcast.startup.launch.detect``).
"""

from __future__ import annotations

import time

SCRIPT_START = time.time()  # before the heavy imports: the process's start-up starts here

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import neps  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import neps_bcast  # noqa: E402

run_search = neps_bcast.run  # the package loads it lazily: imported here, before the barrier

MIN_EPOCHS, ETA = 1, 3
ARGS: argparse.Namespace
Rule = tuple[tuple[int, int], ...]
"""(up to this many epochs, ranks), ascending: a trial gets the ranks of the first bound
its epochs do not exceed."""


def epoch_seconds(ranks: int) -> float:
    """Device time of one epoch on ``ranks`` ranks (Amdahl, serial fraction ``s``)."""
    serial = ARGS.serial_fraction
    return ARGS.t_epoch * (serial + (1 - serial) / ranks)


def parse_rule(text: str) -> Rule:
    """``1:1,3:2,9:4`` -> ((1, 1), (3, 2), (9, 4))."""
    try:
        rule = tuple(
            (int(bound), int(ranks))
            for bound, ranks in (part.split(":") for part in text.split(","))
        )
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"--rule {text!r}: expected EPOCHS:RANKS,...") from error
    if [bound for bound, _ in rule] != sorted({bound for bound, _ in rule}):
        raise argparse.ArgumentTypeError(f"--rule {text!r}: bounds must ascend")
    return rule


def ranks_for(epochs: int) -> int:
    """The right size of a trial, by its fidelity (``--rule``)."""
    return next(ranks for bound, ranks in ARGS.rule if epochs <= bound)


def min_ranks_for(epochs: int) -> int:
    """The fewest ranks a trial of ``epochs`` fits on (``--min-ranks``; 1 without it)."""
    if ARGS.min_ranks is None:
        return 1
    return next((ranks for bound, ranks in ARGS.min_ranks if epochs <= bound), 1)


def record(event: str, **data: object) -> None:
    folder = Path(ARGS.records)
    line = {"event": event, "pid": os.getpid(), **data}
    with (folder / f"{os.getpid()}.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")


def device_index(trial: neps_bcast.Trial) -> int:
    """This rank's device: the pool's index, or (group, local rank) as group * N + rank."""
    if trial.device is not None:
        return trial.device
    group = int(os.environ.get("NEPS_BCAST_LAUNCH_GROUP", "0"))
    per_group = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return group * per_group + int(os.environ.get("LOCAL_RANK", "0"))


def evaluate_pipeline(x: float, epochs: int) -> float:
    entered = time.time()
    dist.init_process_group("gloo")  # torchrun's variables, as PyTorch's DDP tutorial
    with neps_bcast.session() as trial:
        rank, world = dist.get_rank(), dist.get_world_size()
        needed = min_ranks_for(epochs)
        if world < needed:  # the model and its activations do not fit on `world` devices
            record("oom", trial=trial.id, rank=rank, world=world, epochs=epochs, needs=needed)
            raise torch.OutOfMemoryError(
                f"simulated: a trial of {epochs} epochs needs >= {needed} devices, got {world}"
            )
        seconds = epoch_seconds(world)
        tensor = torch.zeros(1)
        start = time.time()
        time.sleep(ARGS.fixed_epochs * ARGS.t_epoch)  # start, data, validation: not parallel
        for _ in range(epochs):
            time.sleep(seconds)  # the device trains; the rank waits on it, no CPU
            dist.all_reduce(tensor)  # the epoch's gradient exchange, tiny
        end = time.time()
        record(
            "trial",
            trial=trial.id,
            rank=rank,
            world=world,
            device=device_index(trial),
            epochs=epochs,
            attempt=trial.attempt,
            entered=entered,
            start=start,
            end=end,
            left=time.time(),
        )
    dist.destroy_process_group()
    return (x - 0.3) ** 2 + 1.0 / epochs


def make_space(max_epochs: int) -> neps.PipelineSpace:
    class Space(neps.PipelineSpace):
        x = neps.Float(0.0, 1.0)
        epochs = neps.IntegerFidelity(MIN_EPOCHS, max_epochs)

    return Space()


def make_space_without_fidelity() -> neps.PipelineSpace:
    """``--epochs E``: every trial trains E epochs; two floats for the sampler to model."""

    class Space(neps.PipelineSpace):
        x = neps.Float(0.0, 1.0)
        y = neps.Float(0.0, 1.0)

    return Space()


def evaluate_fixed_epochs(x: float, y: float) -> float:
    """``--epochs E`` (no fidelity, e.g. Bayesian optimization): E epochs every trial."""
    return evaluate_pipeline(x + 0.1 * (y - 0.5) ** 2, ARGS.epochs)


def wait_for_everyone(expect: int, timeout_s: float = 900.0) -> None:
    """The start barrier: until ``expect`` processes of the launch wrote ``ready``."""
    folder = Path(ARGS.records) / "ready"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / str(os.getpid())).touch()
    deadline = time.monotonic() + timeout_s
    while sum(1 for _ in folder.iterdir()) < expect:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {sum(1 for _ in folder.iterdir())} of {expect} ready")
        time.sleep(0.05)


def main() -> None:
    global ARGS  # noqa: PLW0603
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", required=True)
    parser.add_argument("--records", required=True, help="folder for the JSON lines")
    parser.add_argument("--expect", type=int, required=True, help="processes of the launch")
    parser.add_argument("--evaluations", type=int, default=40, help="total_evaluations_to_spend")
    parser.add_argument("--t-epoch", type=float, default=1.0, help="T_EPOCH, seconds")
    parser.add_argument("--serial-fraction", type=float, default=0.1, help="s of Amdahl's law")
    parser.add_argument("--max-epochs", type=int, default=9, help="the fidelity's maximum")
    parser.add_argument(
        "--fixed-epochs",
        type=float,
        default=0.0,
        help="c: device time every trial pays once, in epochs of one rank (not parallel)",
    )
    parser.add_argument(
        "--rule",
        type=parse_rule,
        default=parse_rule("1:1,3:2,9:4"),
        help="pool only: EPOCHS:RANKS,... a trial's ranks by its epochs (first bound not exceeded)",
    )
    parser.add_argument(
        "--min-ranks",
        type=parse_rule,
        default=None,
        help="memory: EPOCHS:RANKS,... the fewest ranks a trial fits on (first bound not"
        " exceeded; beyond the last bound 1); on fewer it fails as out of memory",
    )
    parser.add_argument(
        "--optimizer",
        default="hyperband",
        help="NePS optimizer: hyperband (over the fidelity epochs, eta 3), or one without a"
        " fidelity (e.g. bayesian_optimization, random_search) with --epochs",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="no fidelity: every trial trains this many epochs (its size by --rule)",
    )
    parser.add_argument(
        "--preimport-lightning",
        action="store_true",
        help="import Lightning's cluster environments before the barrier (a Lightning script"
        " has them imported anyway); else a pool rank imports them in its first trial",
    )
    ARGS = parser.parse_args()
    most = ARGS.max_epochs if ARGS.epochs is None else ARGS.epochs
    if ARGS.rule[-1][0] < most:
        parser.error(f"--rule's last bound {ARGS.rule[-1][0]} < the most epochs, {most}")
    short = [e for e in range(MIN_EPOCHS, most + 1) if ranks_for(e) < min_ranks_for(e)]
    if short:
        parser.error(f"--rule gives a trial of {short[0]} epochs fewer ranks than --min-ranks")
    if (ARGS.epochs is None) != (ARGS.optimizer == "hyperband"):
        parser.error("--epochs goes with an optimizer without a fidelity, and only then")
    if ARGS.preimport_lightning:
        import lightning.fabric.plugins.environments  # noqa: F401
    logging.basicConfig(
        level=logging.INFO, format="%(created).6f %(levelname)s %(name)s: %(message)s"
    )
    if os.environ.get("POOL_SIM_DEBUG"):  # neps_bcast's own steps, timed, in the logs
        logging.getLogger("neps_bcast").setLevel(logging.DEBUG)
    Path(ARGS.records).mkdir(parents=True, exist_ok=True)
    imported = time.time()
    wait_for_everyone(ARGS.expect)
    record(
        "ready",
        role=os.environ.get("NEPS_BCAST_POOL_ROLE", "rank"),
        script_start=SCRIPT_START,
        imported=imported,
        released=time.time(),
    )
    in_pool = bool(os.environ.get("NEPS_BCAST_POOL_ROLE"))
    fidelity = ARGS.epochs is None
    run_search(
        evaluate_pipeline if fidelity else evaluate_fixed_epochs,
        pipeline_space=make_space(ARGS.max_epochs) if fidelity else make_space_without_fidelity(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.evaluations,
        optimizer=("hyperband", {"eta": ETA}) if fidelity else ARGS.optimizer,
        # Only a pool takes it (elsewhere every trial has the launch's size).
        **(
            {"ranks_per_trial": lambda config: ranks_for(config.get("epochs", ARGS.epochs))}
            if in_pool
            else {}
        ),
    )


if __name__ == "__main__":
    main()
