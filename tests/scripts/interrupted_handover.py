"""A plain-DDP search under torchrun, with one fault hook: the leader gets SIGTERM right
after it handed trial ``--fault-at`` to its group, before it evaluates that trial itself.

What a user writes is the first half (``evaluate_pipeline`` and ``neps_bcast.run``); the
hook below it is the test's, and it is the only line that reaches into neps_bcast:
it wraps the leader's hand-over so that the signal lands exactly between two of the
leader's control steps (the window a real preemption hits once in many trials).

    torchrun --standalone --nproc-per-node 2 interrupted_handover.py --root R --fault-at 2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import neps
import torch
import torch.distributed as dist

import neps_bcast


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)


def evaluate_pipeline(lr: float) -> float:
    with neps_bcast.session() as trial:
        value = torch.tensor([lr])
        dist.all_reduce(value)  # every rank trains the same trial
        record("trial", trial_id=trial.id)
    return float(value)


def record(event: str, **fields: object) -> None:
    line = {"event": event, "rank": int(os.environ.get("RANK", "0")), "t": time.time(), **fields}
    with (Path(ARGS.root + ".events") / f"rank{line['rank']}.jsonl").open("a") as out:
        out.write(json.dumps(line) + "\n")


def sigterm_after_handing_over(seq: int) -> None:
    """The test's fault hook (see the module docstring)."""
    from neps_bcast.runtime import Runtime
    from neps_bcast.transport.messages import TrialMessage

    send = Runtime.send

    def send_then_sigterm(self: Runtime, message: object) -> None:
        send(self, message)  # type: ignore[arg-type]
        if isinstance(message, TrialMessage) and message.seq == seq:
            record("fault", seq=seq)
            os.kill(os.getpid(), signal.SIGTERM)

    Runtime.send = send_then_sigterm  # type: ignore[method-assign]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--fault-at", type=int, default=0)
    ARGS = parser.parse_args()
    Path(ARGS.root + ".events").mkdir(parents=True, exist_ok=True)
    if ARGS.fault_at:
        sigterm_after_handing_over(ARGS.fault_at)
    neps_bcast.run(
        evaluate_pipeline,
        pipeline_space=Space(),
        root_directory=ARGS.root,
        total_evaluations_to_spend=ARGS.trials,
        optimizer="random_search",
    )
    record("returned")
