"""``session()``: the block every rank runs its distributed work in."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from neps_bcast import runtime as _runtime
from neps_bcast.errors import (
    NepsBcastError,
    ProtocolError,
    SessionError,
    TrialFailedError,
    TrialMismatchError,
    format_message,
)
from neps_bcast.messages import Phase, Report


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


@contextmanager
def session() -> Iterator[Trial]:
    """Run the distributed part of a trial on every rank of the group.

    Yields the ``Trial``. Guarantees: every rank in the block holds the same trial (a
    disagreement raises on every rank, naming each rank's trial id); an exception on
    any rank surfaces on every rank as ``TrialFailedError`` naming the failing rank and
    its error, and the leader's NePS records the trial as crashed with that text.
    """
    rt = _runtime.active()
    ctx = rt.current if rt is not None else None
    if rt is None or ctx is None:
        where = "outside neps_bcast.run" if rt is None else "between trials"
        raise SessionError(
            format_message(
                f"neps_bcast pid {os.getpid()}",
                f"neps_bcast.session() was used {where}: there is no trial to run.",
                "use it inside the evaluate_pipeline function that you pass to"
                " neps_bcast.run(...), on every rank.",
            )
        )
    if ctx.in_session:
        raise SessionError(
            format_message(
                rt.tag,
                "neps_bcast.session() is already open on this rank.",
                "open one session per trial; do not nest them.",
            )
        )
    message = ctx.message
    reports = rt.exchange(Phase.SESSION_ENTER, ctx, None)
    if reports is not None:
        _check_entry(rt, ctx, reports)
    rt.observe_group()
    trial = Trial(
        id=message.trial_id,
        config=ctx.config,
        rank=rt.group_rank,
        world_size=rt.world_size,
        is_leader=rt.group_rank == 0,
        pipeline_directory=message.pipeline_directory,
        previous_pipeline_directory=message.previous_pipeline_directory,
    )
    ctx.in_session = True
    try:
        yield trial
    except BaseException as exc:
        ctx.in_session = False
        if isinstance(exc, NepsBcastError) and ctx.mine is not None:
            raise  # already reported by this rank
        records = rt.fail(ctx, exc)
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt, SystemExit: reported, and they keep their meaning
        raise TrialFailedError(
            format_message(rt.tag, _runtime.failure_text(records, message.trial_id))
        ) from exc
    ctx.in_session = False


def _check_entry(rt: _runtime.Runtime, ctx: _runtime.TrialContext, reports: list[Report]) -> None:
    if any(r.phase == Phase.TRIAL_END for r in reports):
        # A peer already finished this trial (it failed before its session, or it
        # uses none): this exchange was its trial end, and it is ours too.
        ctx.end_reports = reports
        records = _runtime.sort_records([r.error for r in reports if r.error is not None])
        if records:
            raise TrialFailedError(
                format_message(rt.tag, _runtime.failure_text(records, ctx.message.trial_id))
            )
        raise ProtocolError(rt.mismatch_record(reports, ctx).message)
    if any(r.phase != Phase.SESSION_ENTER for r in reports):
        raise ProtocolError(rt.mismatch_record(reports, ctx).message)
    if len({(r.seq, r.trial_id) for r in reports}) > 1:
        each = ", ".join(f"rank {r.group_rank}: trial {r.trial_id}" for r in reports)
        raise TrialMismatchError(
            format_message(
                rt.tag,
                f"the ranks hold different trials ({each}).",
                "this is a bug in neps_bcast or a rank started outside"
                " it; please report it with every rank's log.",
            )
        )
