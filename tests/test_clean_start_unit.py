"""A trial's clean start (``ddp.teardown``), in a process of its own (it freezes that
process's heap): what an earlier trial left in reference cycles is freed before the next
trial, once per trial, and CUDA is never initialised for it."""

from __future__ import annotations

import subprocess
import sys

CLEAN_START = """
import gc, weakref
import torch
from neps_bcast.ddp import teardown

class Trainer:  # a finished trial: a cycle holding a weight-sized tensor
    pass

def trial():
    t = Trainer()
    t.me = t
    t.weight = torch.zeros(1000, 1000)
    return weakref.ref(t.weight)

gc.disable()  # only the clean start collects here
first = teardown.trial_starts()
assert first is not None and first.froze > 0, first
left = trial()
assert left() is not None  # garbage, but alive until a collection
waiting = teardown.free_what_trials_left()  # a follower, while it waits
assert left() is None and waiting.collected > 0, waiting
assert teardown.trial_starts() is None  # done while waiting: not again
left = trial()
again = teardown.trial_starts()
assert again is not None and again.froze == 0 and left() is None, again
assert not torch.cuda.is_initialized()
print("ok")
"""


def test_a_clean_start_frees_an_earlier_trials_cycles_once_per_trial_without_cuda() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CLEAN_START],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
