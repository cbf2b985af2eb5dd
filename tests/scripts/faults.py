"""The fault a test asks a search script for, named in the launch's environment.

    NB_FAULT="raise:follower:trial=2"          rank 1 raises in a training step of its 2nd trial
    NB_FAULT="sigterm:all:trial=2, sigterm:leader:trial=2:at=settle"

One fault is ``KIND:WHO[:trial=N][:at=POINT][:s=SECONDS][:until=PATH]``; several are
separated by commas.

- WHO: ``leader`` (rank 0), ``follower`` (rank 1) or ``all``.
- ``trial=N``: the process's N-th evaluation (1-based, in the order it evaluates them; at
  ``sample``: while NePS samples the next one after the N-th). Without it: every trial.
- POINT (``fit`` unless given): where the scripts call ``faults.at(POINT)``: ``before``
  (in the function, before ``session()``), ``session`` (first thing inside it), ``fit`` (a
  training step), ``after`` (the end of the session block); and four points hooked here
  (``install``): ``sample`` (the leader's NePS samples a trial), ``record`` (it records a
  trial's result), ``settle`` (neps_bcast's leader settles an interrupted trial in NePS:
  puts it back to pending or records it crashed), ``reform`` (torch has just formed the
  group again for the trial).
- KIND: ``raise`` (ValueError "injected failure on rank R at POINT"), ``sigkill``,
  ``sigterm``, ``sigint``, ``ctrl_c`` (SIGINT to the whole process group, as a terminal
  sends it), ``sigkill_in`` (a thread SIGKILLs the process ``s`` seconds later),
  ``kill_parent`` (SIGKILL to the parent: a Lightning child kills its leader), ``sleep``
  (``s`` seconds), ``hold`` (waits, 180 s at most, until the file ``until`` exists: a
  path without ``:`` or ``,``). Two
  kinds are asked for by name instead of at a point: ``too_many_devices`` (``devices``:
  the Trainer asks for one device more than the group has) and ``unpicklable``
  (tests/scripts/space_tools.py: NePS builds an argument that cannot be pickled).

Every fault that fires is recorded ("fault": kind, point, trial, rank) before it acts.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probe import SEQ, my_rank, record

WHO = {"leader": 0, "follower": 1, "all": None}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None
    trial: int | None = None
    at: str = "fit"
    seconds: float = 1.0
    until: str = ""


def parse(spec: str) -> list[Fault]:
    faults = []
    for text in filter(None, (part.strip() for part in spec.split(","))):
        kind, who, *options = text.split(":")
        keys = dict(option.split("=", 1) for option in options)
        unknown = set(keys) - {"trial", "at", "s", "until"}
        if who not in WHO or unknown:
            raise ValueError(f"NB_FAULT: cannot read {text!r}")
        trial = int(keys["trial"]) if "trial" in keys else None
        seconds = float(keys.get("s", 1.0))
        faults.append(
            Fault(kind, WHO[who], trial, keys.get("at", "fit"), seconds, keys.get("until", ""))
        )
    return faults


FAULTS = parse(os.environ.get("NB_FAULT", ""))


def _matching(kind: str | None, point: str | None, trial: int) -> list[Fault]:
    return [
        f
        for f in FAULTS
        if (kind is None or f.kind == kind)
        and (point is None or f.at == point)
        and f.rank in (None, my_rank())
        and f.trial in (None, trial)
    ]


def at(point: str) -> None:
    """Inject the faults named for this point, this rank and this trial."""
    for f in _matching(None, point, SEQ["n"]):
        record("fault", kind=f.kind, where=point, seq=SEQ["n"], rank=my_rank())
        if f.kind == "raise":
            raise ValueError(f"injected failure on rank {my_rank()} at {point}")
        if f.kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        if f.kind == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        if f.kind == "ctrl_c":
            os.killpg(os.getpgrp(), signal.SIGINT)
        if f.kind == "sigkill_in":
            threading.Timer(f.seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if f.kind == "kill_parent":
            os.kill(os.getppid(), signal.SIGKILL)
        if f.kind == "sleep":
            time.sleep(f.seconds)  # the fault itself: a slow step, observed from outside
            record("slept", where=point, seq=SEQ["n"], rank=my_rank())
        if f.kind == "hold":
            deadline = time.monotonic() + 180
            while not Path(f.until).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # test orchestration only: released by the test
            record("released", where=point, seq=SEQ["n"], rank=my_rank())


def fires(kind: str, trial: int) -> bool:
    """Whether a fault of ``kind`` is named for ``trial`` on this rank (recorded if so)."""
    if not _matching(kind, None, trial):
        return False
    record("fault", kind=kind, where=kind, seq=trial, rank=my_rank())
    return True


def devices(asked: int) -> int:
    """The devices a Trainer asks for: one more than ``asked`` in a too_many_devices trial."""
    return asked + 1 if fires("too_many_devices", SEQ["n"]) else asked


def install() -> None:
    """Hook the points that lie inside NePS and torch, only when a fault names them."""
    points = {f.at for f in FAULTS}
    if points & {"sample", "record"}:
        _hook_neps()
    if "reform" in points:
        _hook_reform()
    if "settle" in points:
        _hook_settle()


def _hook_settle() -> None:
    from neps_bcast.recovery import settle

    real_trial = settle.trial

    def settling(*args: Any, **kwargs: Any) -> Any:
        at("settle")  # the leader is putting an interrupted trial back, or recording it
        return real_trial(*args, **kwargs)

    settle.trial = settling  # type: ignore[assignment]


def _hook_neps() -> None:
    from neps.state import neps_state as ns

    real_sample = ns.NePSState._sample_trial
    real_report = ns.NePSState._report_trial_evaluation

    def sampling(self: Any, *args: Any, **kwargs: Any) -> Any:
        at("sample")  # the leader is choosing its next trial; its followers wait
        return real_sample(self, *args, **kwargs)

    def reporting(self: Any, *args: Any, **kwargs: Any) -> Any:
        at("record")
        return real_report(self, *args, **kwargs)

    ns.NePSState._sample_trial = sampling  # type: ignore[method-assign]
    ns.NePSState._report_trial_evaluation = reporting  # type: ignore[method-assign]


def _hook_reform() -> None:
    """A ``reform`` fault makes forming the group for its trial fail on its rank after
    the peers' forming worked, leaving torch as a real failure does (seen in CI: "Gloo
    connectFullMesh failed ... Connection closed by peer" on the leader, its follower
    having released the new group at once): no group, and c10d's group counter one up."""
    import torch.distributed as dist

    real_init = dist.init_process_group
    fired: list[int] = []

    def init(*args: Any, **kwargs: Any) -> None:
        real_init(*args, **kwargs)  # the peers' rendezvous completes
        upcoming = SEQ["n"] + 1  # the trial this group is formed for
        if fired or not _matching(None, "reform", upcoming):
            return  # once: a rank whose forming failed did not start that trial
        fired.append(upcoming)
        dist.destroy_process_group()
        try:  # a rendezvous nobody else joins: fails as torch fails, counter and all
            real_init(
                "gloo",
                store=dist.HashStore(),
                rank=0,
                world_size=2,
                timeout=datetime.timedelta(seconds=0.5),
            )
        except Exception:
            pass
        SEQ["n"] += 1
        try:
            at("reform")
        finally:
            SEQ["n"] -= 1

    dist.init_process_group = init
