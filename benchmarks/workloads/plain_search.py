"""One rank of the plain-DDP workload (no Lightning): a NePS search with a trivial trial.

Started by ``plain_launch.py`` with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set, as
torchrun would. ``--system ours``: every rank calls ``neps_bcast.run``. ``--system builtin``:
every rank calls plain ``neps.run`` (NePS 0.17's own DDP mode: rank > 0 polls the NePS
state on disk; it needs NEPS_DDP_TRIAL_ID for its first trial, which the launcher sets).

Each rank appends one JSON line per trial to ``<timings>/rank<r>.jsonl`` when it enters
the trial function (CLOCK_REALTIME: all ranks share one clock). The leader also records
when NePS marked the trial as started (``t_started``: the leader holds the trial), and
waits until every follower entered the trial (what a DDP collective would do), and when
NePS called and got back from its ``evaluate_trial`` (``t_call``, ``t_return``): what lies
between those and the trial function's own start and end is the system's control steps;
what lies outside them (NePS's report, its bookkeeping, its sampling) is NePS's alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

import neps

import neps_bcast

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
ARGS: argparse.Namespace
COUNT = 0


def now() -> float:
    return time.clock_gettime(time.CLOCK_REALTIME)


def log(record: dict[str, object]) -> None:
    path = Path(ARGS.timings) / f"rank{RANK}.jsonl"
    with path.open("a") as timings:
        timings.write(json.dumps(record) + "\n")


def wait_for_followers(x: float) -> None:
    deadline = time.monotonic() + ARGS.barrier_timeout
    todo = set(range(1, WORLD))
    while todo:
        for rank in sorted(todo):
            path = Path(ARGS.timings) / f"rank{rank}.jsonl"
            if path.exists() and f'"x": {x!r}' in path.read_text():
                todo.discard(rank)
        if not todo:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"followers {sorted(todo)} never started trial x={x}")
        time.sleep(0.002)


def evaluate_pipeline(x: float, payload: str = "") -> float:
    global COUNT  # noqa: PLW0603
    t_enter = now()
    record: dict[str, object] = {"rank": RANK, "x": x, "t_enter": t_enter, "payload": len(payload)}
    if RANK == 0:
        from neps.runtime import get_in_progress_trial

        trial = get_in_progress_trial()
        record.update(trial=trial.id, t_started=trial.metadata.time_started)
    log(record)
    with neps_bcast.session() if ARGS.system == "ours" else contextlib.nullcontext():
        if RANK == 0:
            COUNT += 1
            wait_for_followers(x)
            if ARGS.hold > 0 and COUNT in ARGS.hold_trials:
                hold_start = now()
                time.sleep(ARGS.hold)
                log({"rank": 0, "hold": [hold_start, now()], "x": x})
            log({"rank": 0, "x": x, "t_exit": now()})
    return (x - 0.3) ** 2


def time_neps_evaluate_trial() -> None:
    """On the leader: log when NePS's worker loop calls ``evaluate_trial`` and gets back
    (it calls the evaluation function, ours or the user's, inside it)."""
    import neps.runtime

    evaluate_trial = neps.runtime.evaluate_trial

    def timed(trial: Any, **kwargs: Any) -> Any:
        t_call = now()
        try:
            return evaluate_trial(trial, **kwargs)
        finally:
            log({"rank": 0, "trial": trial.id, "t_call": t_call, "t_return": now()})

    neps.runtime.evaluate_trial = timed  # type: ignore[assignment]


def space(payloads: list[int]) -> neps.PipelineSpace:
    attrs: dict[str, object] = {"x": neps.Float(0.0, 1.0)}
    if payloads:
        # The trial's arguments carry a string of this many bytes: the handoff moves it.
        # (A Categorical needs two choices: one size gets two strings of that size.)
        attrs["payload"] = neps.Categorical(
            tuple("p" * size for size in payloads)
            + (("q" * payloads[0],) if len(payloads) == 1 else ())
        )
    return type("Space", (neps.PipelineSpace,), attrs)()


def seed_everything(seed: int) -> None:
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main() -> None:
    global ARGS  # noqa: PLW0603
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=("ours", "builtin"), required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--timings", required=True)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--optimizer", default="random_search")
    parser.add_argument("--payloads", default="")
    parser.add_argument("--hold", type=float, default=0.0)
    parser.add_argument(
        "--hold-trials",
        type=lambda text: {int(trial) for trial in text.split(",") if trial},
        default=set(),
    )
    parser.add_argument("--barrier-timeout", type=float, default=180.0)
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed random, numpy and torch on every rank first: both systems then face the"
        " same search (Bayesian optimization samples the same configs with the same work)",
    )
    ARGS = parser.parse_args()
    if ARGS.seed is not None:
        seed_everything(ARGS.seed)
    payloads = [int(size) for size in ARGS.payloads.split(",") if size]
    if RANK == 0:
        time_neps_evaluate_trial()
    (neps_bcast.run if ARGS.system == "ours" else neps.run)(
        evaluate_pipeline,
        pipeline_space=space(payloads),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer=ARGS.optimizer,
    )


if __name__ == "__main__":
    main()
