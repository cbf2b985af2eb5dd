"""Freeing what trials leave: a trial's finished frames when the group is released, what
earlier trials left before the next one starts (``free_what_trials_left``), and the
group itself at exit, while the interpreter is fully alive.

Why a module of its own: ``ddp.group`` (releasing), every rank between two trials
(``trial.evaluate_once``, a waiting follower or pool rank) and every process that ran
trials (``neps_bcast.run``, a ``ddp_spawn`` worker) need it, and what it frees is the
same: a finished trial's Trainer, model, DDP wrapper and optimizer state are cyclic
garbage, and with them the trial's gloo group and its device memory.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist

from neps_bcast.compat.torch import empty_cuda_cache, release_destroyed_groups


def drop_finished_frames(exc: BaseException | None) -> None:
    """Clear the local variables of every finished frame that ``exc`` and the errors
    chained to it (``__cause__``, ``__context__``) still hold.

    A trial's frames hold its Trainer, model and DDP wrapper, and through them the
    trial's process group. Lightning turns Ctrl-C into ``SystemExit`` inside its
    ``except KeyboardInterrupt``, so the training loop's frames hang off the chained
    error, not off the one that is raised. The tracebacks keep their file and line
    numbers, so the error still prints in full.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if exc.__traceback__ is not None:
            traceback.clear_frames(exc.__traceback__)  # skips frames still running
        exc = exc.__cause__ or exc.__context__


def free_trials_at_exit() -> None:
    """``atexit``: destroy the group and free what the trials made, while the
    interpreter is fully alive.

    Why: a gloo process group freed by the interpreter's finalization can abort the
    process after its last line of Python: a worker thread cannot take the GIL, is
    ended by ``pthread_exit`` inside a C++ destructor, and the process dies with
    "terminate called without an active exception" (pytorch/pytorch#190489, #179291).
    Lightning destroys its group at exit for NCCL only, so a gloo group stays in torch's
    registry, and the DDP wrapper of the last trial (a reference cycle with its Trainer)
    holds it until the garbage collector runs. Measured with the suite's probe (an
    ``atexit`` record of what is still alive): without this, every rank of a plain
    Lightning search and every ``ddp_spawn`` worker left its group or DDP wrapper to
    finalization. Frames of an uncaught error pin them too, through ``sys.last_*``
    (finalization sets those to None first anyway; this only does it before the
    collection). Costs one full collection, about 0.2 s on an idle core with torch,
    Lightning and NePS imported.
    """
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if getattr(sys, name, None) is not None:
            setattr(sys, name, None)
    if dist.is_available() and dist.is_initialized():
        # Lightning destroys its group at exit for NCCL only; a gloo group left in
        # torch's registry is freed by finalization, with the same abort.
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    gc.collect()
    release_destroyed_groups()  # after the collection: no DDP Reducer frees a group last


@dataclass(frozen=True)
class Freed:
    """What ``free_what_trials_left`` did, and what it cost."""

    collected: int
    """Objects the collection found unreachable (the earlier trials' cycles)."""
    wall_s: float
    cpu_s: float
    """CPU time of this thread (the collection runs in it)."""
    froze: int
    """Objects moved out of the collector's reach at the first call (0 later)."""


_STATE = {"clean": False, "frozen": False}
"""``clean``: freed since the last trial started (a waiting rank did it); ``frozen``:
the heap of the process before its first trial was frozen (``gc.freeze``)."""


def free_what_trials_left() -> Freed:
    """Free what earlier trials left on this rank, before the next one starts: one
    collection of the cyclic garbage, the destroyed groups released, and CUDA's cached
    blocks returned to the device where CUDA is initialised (never initialised here).

    Why: every rank runs trials back to back in one process, and a finished trial's
    model, gradients and optimizer state are cyclic garbage (Trainer <-> LightningModule,
    DDP's reducer) that Python frees only when its object counts trigger a collection; a
    few huge tensors never do. Measured (docs/architecture.md, "A clean start for every
    trial"): a 6000 x 6000 Linear with Adam left 4 more weight-sized tensors alive at
    each trial's start (RSS 499 MB -> 4.5 GB in 8 trials), and on an H200 a trial with a
    124.5 GB peak left 20.7 GB allocated when the next one started; with a collection at
    each trial's start, none.

    The first call collects, then freezes what is left (``gc.freeze``): the heap of the
    imports (torch, Lightning, NePS: about 470,000 objects), which lives as long as the
    process. A full collection that walks it costs ~140 ms of CPU per trial (measured on
    an idle core, Lightning heap); with it frozen, ~5 ms. Objects of the trials are made
    after it, so the collector still sees every one of them.
    """
    wall, cpu = time.perf_counter(), time.thread_time()
    collected = gc.collect()
    froze = 0
    if not _STATE["frozen"]:
        gc.freeze()
        froze = gc.get_freeze_count()
        _STATE["frozen"] = True
    release_destroyed_groups()
    empty_cuda_cache()
    _STATE["clean"] = True
    return Freed(collected, time.perf_counter() - wall, time.thread_time() - cpu, froze)


def trial_starts() -> Freed | None:
    """A trial starts on this rank: free what earlier trials left, unless this rank did
    it since the last trial started (a follower does it while it waits); what it did."""
    freed = None if _STATE["clean"] else free_what_trials_left()
    _STATE["clean"] = False
    return freed
