"""A rank's failure in a trial, and how every other rank of the trial learns it.

The rank whose code raised publishes its error on the trial's error board (in the
leader's store) and releases the user's group (``release_group``: only the connections
that lead to the group's ranks are shut), so that peers blocked in its collectives fail
at once instead of after the group's timeout; it then reads what its peers published.
Which failure is only a consequence of another (a peer's closed connection, a forming
abandoned), and the texts that name each rank's failure, are decided here too.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

from neps_bcast.compat.torch import is_peer_closed
from neps_bcast.ddp.forming import FormingAbandoned
from neps_bcast.ddp.group import group_connections
from neps_bcast.errors import ErrorRecord, ProtocolError, failure_text, format_message
from neps_bcast.recovery.signals import Terminated
from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import Report
from neps_bcast.transport.store import ErrorBoard


def record(rt: Runtime, exc: BaseException) -> ErrorRecord:
    """This rank's failure as every rank will see it: a consequence of another rank's
    (``secondary``) or its own, a scheduler's stop (``preempted``) or not."""
    return ErrorRecord.from_exception(
        rt.group_rank,
        exc,
        pid=os.getpid(),
        secondary=isinstance(exc, FormingAbandoned)
        or is_peer_closed(exc, group_released=rt.group.broken),
        preempted=isinstance(exc, Terminated),
    )


def release_group(rt: Runtime, exc: BaseException | None = None) -> None:
    """Release the user's group (a rank failed): only its own connections are shut."""
    try:
        rt.observe_group()
    except Exception:  # noqa: BLE001 - releasing must go on whatever the group is
        rt.log(logging.DEBUG, "could not observe the group before releasing it")
    store_port = {rt.link.store.port} if rt.group_rank == 0 and rt.link.store else set()

    def connections() -> set[int]:
        others = rt.link.peers.group(rt.link.store, rt.world_size)
        return group_connections(others, rt.link.own, store_port)

    rt.group.release(connections, exc)


def board(rt: Runtime) -> ErrorBoard | None:
    """The error board of this run's trials (None: no store, no peers to tell)."""
    store = rt.link.store
    return ErrorBoard(store, rt.signer) if store is not None else None


def publish(rt: Runtime, on: ErrorBoard, seq: int, failure: ErrorRecord) -> None:
    """Publish this rank's ``failure`` in trial ``seq``."""
    with _leader_lost_if_follower(rt):
        on.publish(seq, failure)


def published(rt: Runtime, seq: int) -> list[ErrorRecord]:
    """Every failure the ranks published in trial ``seq``."""
    on = board(rt)
    if on is None or rt.world_size is None:
        return []
    with _leader_lost_if_follower(rt):
        return on.read(seq, rt.world_size)


@contextmanager
def _leader_lost_if_follower(rt: Runtime) -> Iterator[None]:
    """A follower that cannot reach the board in the leader's store has lost its leader."""
    try:
        yield
    except Exception as exc:
        if rt.group_rank != 0:
            raise rt.lost(exc) from exc
        raise


def mismatch(rt: Runtime, trial_id: str, reports: list[Report]) -> ErrorRecord:
    """The failure of ranks that reached different points of the trial, each named."""
    where = ", ".join(f"rank {r.group_rank} at {r.phase.value}" for r in reports)
    text = format_message(
        rt.tag,
        f"the ranks reached different points of trial {trial_id}: {where}.",
        "call neps_bcast.session() on every rank, once per trial, or on none.",
    )
    return ErrorRecord.from_exception(rt.group_rank, ProtocolError(text), pid=os.getpid())


def failed_text(rt: Runtime, records: list[ErrorRecord], trial_id: str) -> str:
    return format_message(rt.tag, failure_text(records, trial_id))
