"""A Lightning callback that refuses to train on a group of another size.

Why: after the first trial the DDP group exists, and Lightning reuses any initialized
group without comparing its size with the Trainer's ``devices x num_nodes`` (measured:
a Trainer with ``devices=3`` on trial 2 of a 2-rank search trained on 2 ranks, its
DistributedSampler giving each rank a third of the data and dropping the rest, without
a word). Under torchrun Lightning checks the world size itself; for its own children
it does not.

Registered through Lightning's ``lightning.pytorch.callbacks_factory`` entry point
(pyproject.toml), so the user's Trainer gets it without a code change; it is added
only while ``neps_bcast.run`` is running in this process.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy

from neps_bcast import runtime
from neps_bcast.errors import ProtocolError, format_message


class GroupSizeCheck(Callback):
    """Raises ``ProtocolError`` at ``setup`` (before any training) on a size mismatch."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        rt = runtime.active()
        if rt is None or not isinstance(trainer.strategy, ParallelStrategy):
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
                f"{trainer.num_devices} x num_nodes={trainer.num_nodes}), but the DDP group"
                f" it would train on has {group_size} ranks; Lightning would train on"
                f" {group_size} ranks and its sampler would drop part of the data.",
                f"every trial must use the {group_size} processes the search started with;"
                " the number of processes is fixed by the first trial's Trainer (or by the"
                " launcher).",
            )
        )


def callbacks() -> list[Any]:
    """Lightning's ``callbacks_factory`` entry point: the check, inside neps_bcast.run only."""
    return [GroupSizeCheck()] if runtime.active() is not None else []
