"""Forming the user's group for a trial, on the leader's store, by every rank or none.

Two places form it (``ddp.group`` says which launches get which): before a trial, as
the leader said in its hand-over (``reform``: a Lightning launch whose group a failure
or the user's code ended), and at ``session()`` of an external launch where no rank's
code formed one (``form_if_none``). A rank whose forming raises tells the peers that
may wait to form it with this rank (``ddp.forming.abandon``): they raise at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from neps_bcast import faults
from neps_bcast.ddp.forming import abandon
from neps_bcast.errors import ProtocolError, format_message
from neps_bcast.recovery.signals import indivisible
from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import Report
from neps_bcast.transport.store import Keys, prefixed


def reform(rt: Runtime, generation: int) -> None:
    """Every rank before the trial: form the group again as ``generation``."""
    with _abandoned_if_it_raises(rt, Keys.group(generation)):
        faults.point("form", before_function=True)
        assert rt.link.store is not None
        with indivisible():  # a stop waits until formed: no peer left in the rendezvous
            rt.group.reform(rt.link.store, generation, functools.partial(_peers_alive, rt))


def form_if_none(rt: Runtime, seq: int, reports: list[Report]) -> bool:
    """External launches: every rank is in its session; if no rank's code formed a
    group (the user's code forms it later, or uses one without forming it), form
    one now; True when it did. A group that only some ranks formed is an error of the
    user's code."""
    if rt.launch.kind != "external" or rt.link.store is None:
        return False  # Lightning's launches: Lightning forms it; no store: nowhere to form it
    having = [r.group_rank for r in reports if r.has_group]
    if len(having) == len(reports):
        return False
    if having:
        each = ", ".join(
            f"rank {r.group_rank}: {'formed' if r.has_group else 'none'}" for r in reports
        )
        raise ProtocolError(
            format_message(
                rt.tag,
                "at neps_bcast.session() some ranks have a default process group and"
                f" others not; expected the same on every rank, observed {each}.",
                "call dist.init_process_group on every rank before"
                " `with neps_bcast.session()`, or on none (neps_bcast then forms it).",
            )
        )
    with _abandoned_if_it_raises(rt, Keys.trial_group(seq)):
        _form_for_session(rt, seq)
    return True


def _form_for_session(rt: Runtime, seq: int) -> None:
    """Every rank at ``session()`` of trial ``seq``, where none has a group."""
    faults.point("form", before_function=False)
    assert rt.link.store is not None
    with indivisible():  # a stop waits until formed: no peer left in the rendezvous
        rt.group.form_for_session(
            rt.link.store,
            seq,
            rt.settings.backend,
            rt.devices[rt.group_rank] if rt.devices else rt.launch.local_rank,
            functools.partial(_peers_alive, rt),
        )
    rt.owns_group = True


def _peers_alive(rt: Runtime) -> None:
    """Raises the lost-peer error for a rank on this host that is gone (a SIGKILLed
    peer never counts itself in to form the group)."""
    gone = rt.link.peers.describe_lost(rt.link.store, rt.world_size)
    if gone:
        raise rt.lost(RuntimeError("gone while the group was being formed"))


@contextmanager
def _abandoned_if_it_raises(rt: Runtime, key: str) -> Iterator[None]:
    """Form the group under the store prefix ``key``; if anything in it raises, tell
    the peers that may wait to form it with this rank first (they raise at once)."""
    try:
        yield
    except BaseException:
        _abandon(rt, key)
        raise


def _abandon(rt: Runtime, key: str) -> None:
    """This rank failed before forming the group under ``key``: its peers waiting
    to form it raise instead (``ddp.forming.all_or_none``); never raises."""
    if rt.link.store is None:
        return
    try:
        abandon(prefixed(key, rt.link.store))
    except Exception as exc:  # noqa: BLE001 - the rank's own error is the one to report
        rt.log(logging.WARNING, "could not tell the peers not to wait: %s", exc)
