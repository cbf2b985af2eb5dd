"""A Lightning callback that refuses to train on a group of another size.

Why: after the first trial the DDP group exists, and Lightning reuses any initialized
group without comparing its size with the Trainer's ``devices x num_nodes`` (measured:
a Trainer with ``devices=3`` on trial 2 of a 2-rank search trained on 2 ranks, its
DistributedSampler giving each rank a third of the data and dropping the rest, without
a word). Under torchrun Lightning checks the world size itself; for its own children
it does not.

Registered through Lightning's ``callbacks_factory`` entry points (pyproject.toml), for
both ``lightning.pytorch`` and the standalone ``pytorch_lightning`` package, so the
user's Trainer gets it without a code change; it is added only while
``neps_bcast.run`` is running in this process.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
from typing import Any

import torch.distributed as dist

from neps_bcast import runtime
from neps_bcast.compat import lightning as lightning_compat
from neps_bcast.ddp.teardown import free_trials_at_exit
from neps_bcast.errors import ProtocolError, format_message

_CHECKS: dict[str, type] = {}
DRAIN_TIMEOUT = datetime.timedelta(seconds=60)
"""Bound on the barrier that drains gloo at the end of a ``ddp_spawn`` worker's fit."""


def _new_check(package: str) -> Any:
    """Unpickling: ``ddp_spawn`` sends the Trainer, callbacks included, to its workers."""
    return _check_class(package)()


def _check_class(package: str) -> type:
    """The callback class for one Lightning copy (its Trainer accepts only its own)."""
    if package in _CHECKS:
        return _CHECKS[package]
    pl: Any = importlib.import_module(package)
    strategies: Any = importlib.import_module(f"{package}.strategies")

    class GroupSizeCheck(pl.Callback):  # type: ignore[misc]  # a base class known at run time
        """Raises ``ProtocolError`` at ``setup`` (before any training) on a size mismatch."""

        def __reduce__(self) -> tuple[Any, tuple[str]]:
            return _new_check, (package,)  # a class made here cannot be pickled by name

        def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
            """A ``ddp_spawn`` worker whose fit ended: let gloo's threads finish first.

            Measured (torch 2.13, Python 3.11): a spawned worker exits right after
            Lightning's last metric all-reduce, with its gloo group alive (Lightning
            destroys only NCCL groups at exit). A gloo worker thread then frees that
            work's tensors while the interpreter finalizes, cannot take the GIL, is
            ended by ``pthread_exit`` inside a C++ destructor, and the process aborts
            ("terminate called without an active exception"; pytorch/pytorch#190489).
            One bounded barrier here lets that thread finish while Python is alive,
            and the worker's exit then destroys the group and frees the fit's objects
            before finalization (``group.free_trials_at_exit``, as ``run`` registers
            in the processes it runs in).
            """
            if runtime.active() is not None or not lightning_compat.is_spawn_launcher(
                trainer.strategy, package
            ):
                return
            atexit.unregister(free_trials_at_exit)  # once per worker
            atexit.register(free_trials_at_exit)
            if not (dist.is_available() and dist.is_initialized()):
                return
            if dist.get_backend() != "gloo":
                return
            with contextlib.suppress(Exception):  # a peer gone: nothing left to drain
                dist.barrier(timeout=DRAIN_TIMEOUT)

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            rt = runtime.active()
            if rt is None or not isinstance(trainer.strategy, strategies.ParallelStrategy):
                return
            if not (dist.is_available() and dist.is_initialized()):
                return
            group_size = dist.get_world_size()
            if trainer.world_size == group_size:
                return
            raise ProtocolError(
                format_message(
                    rt.tag,
                    f"the Trainer plans {trainer.world_size} processes (devices="
                    f"{trainer.num_devices} x num_nodes={trainer.num_nodes}), but the DDP"
                    f" group it would train on has {group_size} ranks; Lightning would"
                    f" train on {group_size} ranks and its sampler would drop part of the"
                    " data.",
                    f"every trial must use the {group_size} processes the search started"
                    " with; the number of processes is fixed by the first trial's Trainer"
                    " (or by the launcher).",
                )
            )

    _CHECKS[package] = GroupSizeCheck
    return GroupSizeCheck


def callbacks() -> list[Any]:
    """``lightning.pytorch.callbacks_factory``: the check, inside neps_bcast.run only."""
    return [_check_class("lightning.pytorch")()] if runtime.active() is not None else []


def pytorch_lightning_callbacks() -> list[Any]:
    """``pytorch_lightning.callbacks_factory``: the same for the standalone package."""
    return [_check_class("pytorch_lightning")()] if runtime.active() is not None else []
