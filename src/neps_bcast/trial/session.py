"""``session()``: the block every rank runs its distributed work in."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neps_bcast import runtime as _runtime
from neps_bcast.compat.torch import is_second_default_group
from neps_bcast.errors import NepsBcastError, SessionError, format_message
from neps_bcast.trial.run import running


@dataclass(frozen=True)
class Trial:
    """The trial this rank is evaluating, as seen from inside ``session()``."""

    id: str
    config: dict[str, Any] = field(hash=False)
    rank: int
    world_size: int | None
    is_leader: bool
    pipeline_directory: Path | None
    previous_pipeline_directory: Path | None
    attempt: int = 1
    """1 for the trial's first evaluation; n + 1 when n interruptions (preemption, a time
    limit, a lost rank) put it back to pending before. The same on every rank."""
    resumed_from: Path | None = None
    """On a retry, the trial's directory when an earlier attempt left files there (its
    checkpoint, if it wrote one), else None: resume from it. The same on every rank,
    decided by the leader (a follower need not see the leader's filesystem)."""
    devices: int | list[int] | None = None
    """Under ``neps-bcast launch --pool``: what to give ``Trainer(devices=...)`` or
    ``Fabric(devices=...)`` so that each rank uses its own device: the trial's GPU
    indexes in rank order, or on CPU the number of ranks. None outside a pool."""
    device: int | None = None
    """Under ``neps-bcast launch --pool``: this rank's own device index (plain DDP:
    ``torch.device("cuda", trial.device)``); None outside a pool."""


@contextmanager
def session() -> Iterator[Trial]:
    """Run the distributed part of a trial on every rank of the group.

    Yields the ``Trial``. Guarantees: every rank in the block holds the same trial (a
    disagreement raises on every rank, naming each rank's trial id); an exception on
    any rank surfaces on every rank as ``TrialFailedError`` naming the failing rank and
    its error, and the leader's NePS records the trial as crashed with that text.
    """
    rt = _runtime.active()
    run = running(rt) if rt is not None else None
    if rt is None or run is None:
        where = "outside neps_bcast.run" if rt is None else "between trials"
        raise SessionError(
            format_message(
                f"neps_bcast pid {os.getpid()}",
                f"neps_bcast.session() was used {where}: there is no trial to run.",
                "use it inside the evaluate_pipeline function that you pass to"
                " neps_bcast.run(...), on every rank.",
            )
        )
    if run.in_session:
        raise SessionError(
            format_message(
                rt.tag,
                "neps_bcast.session() is already open on this rank.",
                "open one session per trial; do not nest them.",
            )
        )
    run.enter_session()
    message = run.message
    trial = Trial(
        id=message.trial_id,
        config=run.config,
        rank=rt.group_rank,
        world_size=rt.world_size,
        is_leader=rt.group_rank == 0,
        pipeline_directory=message.pipeline_directory,
        previous_pipeline_directory=message.previous_pipeline_directory,
        attempt=message.attempt,
        resumed_from=message.resumed_from,
        devices=_devices(rt.devices),
        device=rt.devices[rt.group_rank] if rt.devices is not None else None,
    )
    try:
        yield trial
    except BaseException as exc:
        run.in_session = False
        if isinstance(exc, NepsBcastError) and run.mine is not None:
            raise  # already reported by this rank
        if run.formed_group and is_second_default_group(exc):
            exc = _init_inside_session(rt.tag, exc)
        records = run.fail(exc)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: reported, and they keep their meaning
        raise run.failed_error(records) from exc
    run.in_session = False


def _devices(devices: tuple[int, ...] | None) -> int | list[int] | None:
    """A pool trial's ``Trial.devices``: GPU indexes, or on CPU how many ranks (Lightning's
    CPU accelerator takes a number of processes, not a list)."""
    if devices is None:
        return None
    import torch

    return list(devices) if torch.cuda.is_available() else len(devices)


def _init_inside_session(tag: str, exc: BaseException) -> SessionError:
    """The user's init_process_group met the group neps_bcast formed at this session."""
    error = SessionError(
        format_message(
            tag,
            "dist.init_process_group was called inside neps_bcast.session(), where"
            " neps_bcast had formed the default group because no rank had one when the"
            f" session began; torch refuses a second one ({type(exc).__name__}: {exc}).",
            "call dist.init_process_group before `with neps_bcast.session()` (the session"
            " then uses your group), or not at all (your code then uses the one neps_bcast"
            " forms).",
        )
    )
    error.__cause__ = exc
    return error
