"""A pool's agent: one NePS worker without a device (``neps-bcast launch --pool D``).

It is today's leader (``leader.lead``: the root lock, the leases, the settling of every
trial however it ends, the stop signals) except that it does not train: each trial's
size comes from ``ranks_per_trial(config)``, the agent serves the trial's rendezvous
store (as torchrun's agent does) and asks the launcher for that many ranks, and the
trial's rank 0 sends back the outcome. A lost rank puts only this trial back to pending
(``leader.TrialPutBack``); the agent goes on with the next.
"""

from __future__ import annotations

import datetime
import logging
import operator
import os
import pickle
import signal
import uuid
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from neps_bcast import faults
from neps_bcast.compat import neps as neps_compat
from neps_bcast.compat.neps import INJECTED_ARGUMENTS
from neps_bcast.errors import (
    ErrorRecord,
    FollowerLostError,
    NepsBcastError,
    format_message,
)
from neps_bcast.pool import beats, opening, wire
from neps_bcast.recovery.signals import Terminated
from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import TrialMessage, encode
from neps_bcast.transport.store import serve as serve_store
from neps_bcast.trial.run import Outcome

RanksPerTrial = Callable[[dict[str, Any]], int]


def pool_size(environ: Mapping[str, str]) -> int:
    return int(environ[wire.ENV_POOL_SIZE])


def trial_size(
    ranks_per_trial: RanksPerTrial, config: dict[str, Any], size: int, tag: str, when: str = ""
) -> int:
    """``ranks_per_trial(config)``, checked: an int in 1..size, else ``NepsBcastError``
    naming the value, the config and the fix (the trial is recorded crashed with it).
    ``when``: what starts the error's text (the check before the search)."""
    try:
        value = ranks_per_trial(config)
    except Exception as exc:
        raise NepsBcastError(
            format_message(
                tag,
                f"{when}ranks_per_trial raised {type(exc).__name__}: {exc} for the config"
                f" {config}.",
                "make ranks_per_trial return a number of ranks for every config of the space.",
            )
        ) from exc
    try:
        ranks = operator.index(value) if not isinstance(value, bool) else None
    except TypeError:
        ranks = None
    if ranks is None or not 1 <= ranks <= size:
        raise NepsBcastError(
            format_message(
                tag,
                f"{when}ranks_per_trial returned {value!r} for the config {config}; expected an int"
                f" from 1 to {size} (the pool's devices).",
                f"return a whole number of ranks in 1..{size}, or start a larger pool"
                " (neps-bcast launch --pool D).",
            )
        )
    return ranks


def check_up_front(
    ranks_per_trial: RanksPerTrial, pipeline_space: Any, size: int, tag: str
) -> None:
    """``ranks_per_trial`` on the space's corners (``compat.neps.corner_configs``: every
    fidelity at its ends), before the search starts: a rule that gives a trial more
    ranks than the pool has stops every agent at once, naming the config, instead of
    crashing the search's most expensive trials one by one."""
    for config in neps_compat.corner_configs(pipeline_space):
        trial_size(ranks_per_trial, config, size, tag, when="before the search starts: ")


TRIAL_STORE_TIMEOUT = datetime.timedelta(seconds=300)
"""A trial's rendezvous store: torch's default bound on a wait there."""


def trial_store() -> Any:
    """A trial's rendezvous store, served by its agent as torchrun's agent serves one:
    on loopback only (a pool's ranks all run on this host; torch's TCPStore otherwise
    listens on every interface, where another host could overwrite the trial's keys)."""
    return serve_store(TRIAL_STORE_TIMEOUT, loopback=True, multi_tenant=True)


class Remote:
    """``leader.RunTrial`` for a pool's agent: the trial runs on the ranks the launcher
    gives it; this waits (blocked on the launcher's socket) for their outcome."""

    def __init__(self, conn: wire.Conn, key: str, size: int, ranks_per_trial: RanksPerTrial):
        self.conn = conn
        self.key = key
        self.size = size
        self.ranks_per_trial = ranks_per_trial
        self.stores: dict[str, Any] = {}
        """Each running trial's rendezvous store, served until its ranks are free."""
        self.overwriting = False
        """This agent wipes the root (``may_overwrite``) and has not said it is ready."""

    def may_overwrite(self) -> bool:
        """``overwrite_root_directory=True``: whether this agent is the one that wipes
        the root (``pool.Overwrite``); blocks while another does. Asked before the
        root lock: the one told yes holds it until NePS hands it its first trial."""
        self.conn.send({"op": "may_overwrite"})
        while True:
            record = self.conn.receive()
            if record.get("op") == "overwrite":
                self.overwriting = bool(record.get("yes"))
                return self.overwriting

    def root_ready(self) -> None:
        """The root is wiped and NePS's state is on it: agents waiting may go on."""
        if self.overwriting:
            self.overwriting = False
            self.conn.send({"op": "root_ready"})

    def __call__(self, rt: Runtime, message: TrialMessage) -> Outcome:
        self.root_ready()  # NePS handed out a trial: its state is on disk
        try:
            return self._run(rt, message)
        except wire.WireError as exc:
            # The launcher is gone (SIGKILLed, crashed): its parent-death SIGTERM may come
            # after the end of its socket. Not the user's error: the trial goes back to
            # pending, as for a SIGTERM, and this agent stops (no launcher, no ranks).
            rt.log(logging.ERROR, "the pool's launcher is gone: %s", exc)
            raise Terminated(128 + signal.SIGTERM, f"the pool's launcher lost ({exc})") from exc

    def _run(self, rt: Runtime, message: TrialMessage) -> Outcome:
        config = {k: v for k, v in message.kwargs.items() if k not in INJECTED_ARGUMENTS}
        try:
            ranks = trial_size(self.ranks_per_trial, config, self.size, rt.tag)
        except NepsBcastError as exc:
            return Outcome(None, exc, [ErrorRecord.from_exception(0, exc, pid=os.getpid())])
        order = uuid.uuid4().hex
        store = trial_store()
        self.stores[order] = store
        self.conn.send(
            {
                "op": "ask",
                "order": order,
                "trial": message.trial_id,
                "size": ranks,
                "port": store.port,
                "payload": wire.seal(self.key, "trial", order, encode(message, tag=rt.tag)),
                # Where the launcher writes the trial's placement (``neps-bcast status``).
                "directory": str(message.pipeline_directory or ""),
            }
        )
        faults.point("ask")  # the launcher places the trial now
        rt.log(logging.INFO, "trial %s asks for %d rank(s)", message.trial_id, ranks)
        while True:
            record = self.conn.receive()
            op, about = record.get("op"), record.get("order")
            if op == "released":
                self.stores.pop(str(about), None)
            elif op == "placed" and about == order:
                rt.log(
                    logging.INFO,
                    "trial %s runs on device(s) %s",
                    message.trial_id,
                    ",".join(map(str, record.get("devices", []))),
                )
            elif op == "outcome" and about == order:
                return self._outcome(rt, message, order, record)

    def _outcome(
        self, rt: Runtime, message: TrialMessage, order: str, record: dict[str, Any]
    ) -> Outcome:
        if "refused" in record:
            error = NepsBcastError(format_message(rt.tag, str(record["refused"])))
            return Outcome(None, error, [ErrorRecord.from_exception(0, error, pid=os.getpid())])
        if "lost" in record or "interrupted" in record:
            what = record.get("lost") or f"rank 0 was stopped: {record.get('interrupted')}"
            raise FollowerLostError(
                format_message(
                    rt.tag,
                    f"trial {message.trial_id} lost its ranks: {what}.",
                    "the trial goes back to pending and runs again on fresh ranks; see"
                    " the ranks' logs for what ended them.",
                )
            )
        failures = [ErrorRecord.from_dict(f) for f in record.get("failures", [])]
        result = None
        if not failures:
            result = pickle.loads(wire.unseal(self.key, "result", order, record["result"]))  # noqa: S301 - sealed by the trial's rank 0 with the pool's key
        return Outcome(result, None, failures)

    def close(self) -> None:
        self.stores.clear()
        self.conn.close()


def connect(
    environ: MutableMapping[str, str], ranks_per_trial: RanksPerTrial, bound_s: float
) -> Remote:
    """This agent's connection to the pool's launcher (the key taken out of the
    environment once read), as the executor the leader's loop hands each trial to; from
    then on it beats to the launcher and judges the launcher's beats (``beats``)."""
    index = int(environ[wire.ENV_POOL_INDEX])
    key = wire.take_key(environ)
    conn = opening.connect(environ[wire.ENV_POOL], key, "agent", index)
    launcher_pid, _ = opening.peer_credentials(conn.sock)
    tag = f"[neps_bcast pool agent {index}]"
    verdict = beats.end_silent_launcher(tag)
    beats.of_member(environ[wire.ENV_POOL], "agent", index, launcher_pid, bound_s, verdict)
    return Remote(conn, key, pool_size(environ), ranks_per_trial)
