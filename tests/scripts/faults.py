"""The fault a test asks a search script for, named in the launch's environment.

    NB_FAULT="raise:follower:trial=2"          rank 1 raises in a training step of its 2nd trial
    NB_FAULT="sigterm:all:trial=2, sigterm:leader:trial=2:at=settle"

One fault is ``KIND:WHO[:trial=N][:at=POINT][:to=WHOM][:s=SECONDS][:until=PATH][:mb=MB]``;
several are separated by commas.

- WHO: ``leader`` (rank 0), ``follower`` (rank 1) or ``all``. In a pool
  (``neps-bcast launch --pool``): the trial's group rank 0 or 1 or every rank of the
  trial, or ``agent`` (the NePS worker that holds the trial; never a rank).
- ``trial=N``: the process's N-th evaluation (1-based, in the order it evaluates them; at
  ``sample``: while NePS samples the next one after the N-th). Without it: every trial.
- POINT (``fit`` unless given): where the scripts call ``faults.at(POINT)``: ``before``
  (in the function, before ``session()``), ``session`` (first thing inside it), ``fit`` (a
  training step), ``after`` (the end of the session block); and the library's own fault
  points (``neps_bcast.faults.POINTS``, armed by ``install``): ``sample`` (the leader's NePS
  samples a trial), ``record`` (it records a trial's result), ``settle`` (neps_bcast's
  leader settles an interrupted trial in NePS: puts it back to pending or records it
  crashed), the control steps of neps_bcast's own loops (tests/sweep/table.py names
  each): ``lease`` and ``leased`` (the leader, before and after it takes the trial's
  lease), ``handed`` (the leader, right after it handed the trial to the group),
  ``exchange`` (every rank, before the trial-end exchange), ``orphans`` (the leader,
  before it looks for orphans, before the trial's lease), ``form`` (every rank, before
  the group is formed again for the trial), and ``stop`` (the leader, before it sends
  STOP at the end of the search); and one hooked in torch: ``reform`` (torch has just
  formed the group again for the trial).
- ``id=T`` (a pool): the trial NePS calls ``T``, whichever processes run it; in a pool
  every fault fires at most once per launch (a fresh rank started after a fault counts
  its trials from 1 again), the first time a process of its role reaches the point
  (for that trial, with ``id``). The pool's own points (the library's too): ``order`` (a rank
  got its order for a trial, before it joins the group), ``done`` (a rank's part of the
  trial is over, the outcome sent, before it tells the launcher it is free), ``ask``
  (the agent asked the launcher for ranks: the launcher places the trial), ``stop``
  (the agent, its search over, before it tells the ranks).
- ``to=WHOM`` (a signal kind only): the process at the point signals ``leader``,
  ``follower`` or ``all`` (every rank of that role, the others first), or ``rankN``
  (that one rank, of several followers) instead of itself, read from the launch's
  "start" records: a fault that lands on one process while another is at a step. In a
  pool: the trial's ranks by group rank (its "pool_trial" records), ``agent`` (the
  agent that holds the trial) or ``launcher`` (the pool's launcher, every process's
  parent).
- KIND: ``raise`` (ValueError "injected failure on rank R at POINT"), ``sigkill``,
  ``sigterm``, ``sigterm2`` (SIGTERM, and a second one ``s`` seconds later, from a thread started
  first, to ``again=WHOM`` where given, else to the same processes),
  ``sigint``, ``sigstop`` (the process frozen: what a hung node looks like to its peers;
  nothing sends SIGCONT), ``gil`` (the main thread holds the GIL for ``s`` seconds in
  one C call), ``ctrl_c`` (SIGINT to the whole process group, as a terminal
  sends it), ``sigkill_in`` (a thread SIGKILLs the process ``s`` seconds later),
  ``kill_parent`` (SIGKILL to the parent: a Lightning child kills its leader), ``sleep``
  (``s`` seconds), ``hang`` (waits for ever: what only the launcher's
  ``--trial-time-limit`` ends), ``hold`` (waits, 180 s at most, until the file ``until``
  exists: a path without ``:`` or ``,``), ``save`` (a checkpoint: ``torch.save`` of a
  tensor of ``mb`` MB into a file beside the records, synced to disk, then removed;
  "saved" records its seconds). Two
  kinds are asked for by name instead of at a point: ``too_many_devices`` (``devices``:
  the Trainer asks for one device more than the group has) and ``unpicklable``
  (tests/scripts/space_tools.py: NePS builds an argument that cannot be pickled).

Every fault that fires is recorded ("fault": kind, point, trial, rank, and the pids it
signals) before it acts; a fault fires at most once per trial in a process.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probe import SEQ, my_rank, record

AGENT = -1
WHO = {"leader": 0, "follower": 1, "all": None, "agent": AGENT}
TO = ("leader", "follower", "all", "agent", "launcher")
POOL_ROLE = os.environ.get("NEPS_BCAST_POOL_ROLE")
"""``agent`` or ``rank`` in a process of a pool (the launcher's variable), else None."""
CURRENT: dict[str, Any] = {"id": None, "rank": None}
"""A pool process: the trial it is at (NePS's id) and its group rank in it (a rank)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None
    trial: int | None = None
    at: str = "fit"
    seconds: float = 1.0
    until: str = ""
    to: str = ""
    """Whom a signal kind signals: "" (this process), "leader", "follower", "all" or
    "rankN" (the one process of group rank N); in a pool also "agent", "launcher"."""
    trial_id: str | None = None
    """A pool: the NePS trial id the fault lands in (None: the first that comes)."""
    mb: int = 0
    """``save``: the size of the tensor saved, in MB."""
    again: str = ""
    """``sigterm2``: whom the second SIGTERM goes to (as ``to``; "": the same)."""


def parse(spec: str) -> list[Fault]:
    faults = []
    for text in filter(None, (part.strip() for part in spec.split(","))):
        kind, who, *options = text.split(":")
        keys = dict(option.split("=", 1) for option in options)
        unknown = set(keys) - {"trial", "at", "s", "until", "to", "id", "mb", "again"}
        to = keys.get("to", "leader")
        if who not in WHO or unknown or not (to in TO or _RANK_N.fullmatch(to)):
            raise ValueError(f"NB_FAULT: cannot read {text!r}")
        trial = int(keys["trial"]) if "trial" in keys else None
        seconds = float(keys.get("s", 1.0))
        at_point = keys.get("at", "fit")
        faults.append(
            Fault(
                kind,
                WHO[who],
                trial,
                at_point,
                seconds,
                keys.get("until", ""),
                keys.get("to", ""),
                keys.get("id"),
                int(keys.get("mb", 0)),
                keys.get("again", ""),
            )
        )
    return faults


_RANK_N = re.compile(r"rank(\d+)")

FAULTS = parse(os.environ.get("NB_FAULT", ""))
FIRED: set[tuple[int, int]] = set()
"""(fault index, trial) pairs that fired in this process: each fires once per trial."""


def _matching(kind: str | None, point: str | None, trial: int) -> list[Fault]:
    return [f for _, f in _indexed(kind, point, trial)]


def _indexed(kind: str | None, point: str | None, trial: int) -> list[tuple[int, Fault]]:
    return [
        (i, f)
        for i, f in enumerate(FAULTS)
        if (kind is None or f.kind == kind)
        and (point is None or f.at == point)
        and _is_me(f)
        and (f.trial in (None, trial) if POOL_ROLE is None else _this_trial(f))
    ]


def _is_me(f: Fault) -> bool:
    if POOL_ROLE is None:
        return f.rank in (None, my_rank())
    if f.rank == AGENT:
        return POOL_ROLE == "agent"
    rank = CURRENT["rank"] if CURRENT["rank"] is not None else my_rank()
    return POOL_ROLE == "rank" and f.rank in (None, rank)


def _this_trial(f: Fault) -> bool:
    return f.trial_id in (None, CURRENT["id"])


def _first_in_the_launch(i: int) -> bool:
    """A pool: claim fault ``i`` for this launch (a file under the records); False when
    another process (or an earlier rank on this device) fired it already."""
    from probe import RECORD

    assert RECORD is not None, "a pool's fault needs NB_RECORD_DIR"
    RECORD.mkdir(parents=True, exist_ok=True)
    try:
        os.close(os.open(RECORD / f"fired-{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


SIGNALS = {
    "sigterm": signal.SIGTERM,
    "sigint": signal.SIGINT,
    "sigkill": signal.SIGKILL,
    "sigstop": signal.SIGSTOP,
}


def at(point: str, upcoming: bool = False) -> None:
    """Inject the faults named for this point, this rank and this trial (``upcoming``:
    a step of a trial before its function is called, while SEQ still counts the last)."""
    seq = SEQ["n"] + 1 if upcoming else SEQ["n"]
    for i, f in _indexed(None, point, seq):
        if (i, seq) in FIRED or (POOL_ROLE is not None and not _first_in_the_launch(i)):
            continue
        FIRED.add((i, seq))
        targets = _pids(f.to) if f.to else [os.getpid()]
        record(
            "fault",
            kind=f.kind,
            where=point,
            seq=seq,
            rank=my_rank(),
            to=f.to,
            pids=targets,
            trial_id=CURRENT["id"],
            role=POOL_ROLE,
        )
        if f.kind == "raise":
            raise ValueError(f"injected failure on rank {my_rank()} at {point}")
        if f.kind in SIGNALS:
            for pid in targets:
                os.kill(pid, SIGNALS[f.kind])
        if f.kind == "sigterm2":
            # The timer first: a process that signals itself may not outlive the call.
            second = _pids(f.again) if f.again else targets
            again = threading.Timer(f.seconds, _signal_all, (second, signal.SIGTERM))
            again.daemon = True
            again.start()
            for pid in targets:
                os.kill(pid, signal.SIGTERM)
        if f.kind == "ctrl_c":
            os.killpg(os.getpgrp(), signal.SIGINT)
        if f.kind == "sigkill_in":
            threading.Timer(f.seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if f.kind == "kill_parent":
            os.kill(os.getppid(), signal.SIGKILL)
        if f.kind == "gil":
            # A long C call that never lets go of the GIL (as pickling a huge checkpoint
            # does): libc's sleep called through PyDLL, which keeps the GIL held.
            ctypes.PyDLL(None).usleep(int(f.seconds * 1_000_000))
            record("held_gil", where=point, seq=SEQ["n"], rank=my_rank(), s=f.seconds)
        if f.kind == "sleep":
            time.sleep(f.seconds)  # the fault itself: a slow step, observed from outside
            record("slept", where=point, seq=SEQ["n"], rank=my_rank())
        if f.kind == "hang":
            threading.Event().wait()  # never set: a deadlock in the user's code
        if f.kind == "save":
            _save(f.mb, point)
        if f.kind == "hold":
            deadline = time.monotonic() + 180
            while not Path(f.until).exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # test orchestration only: released by the test
            record("released", where=point, seq=SEQ["n"], rank=my_rank())


def _save(mb: int, point: str) -> None:
    """A long checkpoint write: ``torch.save`` of ``mb`` MB, flushed and synced."""
    import tempfile

    import torch
    from probe import RECORD

    folder = RECORD if RECORD is not None else Path(tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"save-{os.getpid()}-{SEQ['n']}.pt"
    tensor = torch.full((mb * 1_000_000 // 4,), 1.0)
    started = time.monotonic()
    with path.open("wb") as file:
        torch.save(tensor, file)
        file.flush()
        os.fsync(file.fileno())
    took = time.monotonic() - started
    size = path.stat().st_size
    path.unlink()
    record("saved", where=point, seq=SEQ["n"], rank=my_rank(), bytes=size, s=took)


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass  # gone already: the first signal ended it
    record("fault", kind="second signal", rank=my_rank(), pids=pids)


def _pids(whom: str) -> list[int]:
    """The pids of the launch's ranks of one role (this process's last), from their
    "start" records: ``leader`` (rank 0), ``follower`` (every other rank), ``all``,
    ``rankN`` (rank N alone)."""
    from probe import RECORD

    assert RECORD is not None, "a fault with to= needs NB_RECORD_DIR"
    if POOL_ROLE is not None:
        return _pool_pids(whom)
    ranks: dict[int, int] = {}
    for path in RECORD.glob("pid*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                ranks[event["pid"]] = event["proc_rank"]
    return _choose(ranks, whom)


def _choose(ranks: dict[int, int], whom: str) -> list[int]:
    """The pids of ``ranks`` (pid -> rank) that ``whom`` names, this process last."""
    one = _RANK_N.fullmatch(whom)
    chosen = [
        pid
        for pid, rank in ranks.items()
        if (
            rank == int(one.group(1)) if one else whom == "all" or (rank == 0) == (whom == "leader")
        )
    ]
    return sorted(chosen, key=lambda pid: pid == os.getpid())


def _pool_pids(whom: str) -> list[int]:
    """A pool: the processes of this process's trial (``CURRENT``) by their role in it,
    from the launch's "pool_trial" (a rank's part of a trial) and "neps_trial" (the
    agent's trial) records; ``launcher``: the parent of every pool process."""
    from probe import RECORD

    assert RECORD is not None
    if whom == "launcher":
        return [os.getppid()]
    ranks: dict[int, int] = {}
    agents: list[int] = []
    for path in RECORD.glob("pid*.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            if event.get("trial_id") != CURRENT["id"]:
                continue
            if event["event"] == "pool_trial":
                ranks[event["pid"]] = event["group_rank"]
            elif event["event"] == "neps_trial":
                agents.append(event["pid"])
    if whom == "agent":
        return agents[-1:]
    return _choose(ranks, whom)


def fires(kind: str, trial: int) -> bool:
    """Whether a fault of ``kind`` is named for ``trial`` on this rank (recorded if so)."""
    if not _matching(kind, None, trial):
        return False
    record("fault", kind=kind, where=kind, seq=trial, rank=my_rank())
    return True


def devices(asked: int) -> int:
    """The devices a Trainer asks for: one more than ``asked`` in a too_many_devices trial."""
    return asked + 1 if fires("too_many_devices", SEQ["n"]) else asked


TRACE = bool(os.environ.get("NB_TRACE_POINTS"))
"""Arm every library point and record each one a process reaches ("point": its name):
tests/test_fault_points.py proves one launch reaches every point the sweep names."""


def install() -> None:
    """Arm the library's fault points (``neps_bcast.faults``) that a fault names, and
    hook the one that lies in torch (``reform``)."""
    if not FAULTS and not TRACE:
        return
    from neps_bcast import faults as points

    named = {f.at for f in FAULTS}
    armed = (named & set(points.POINTS)) | {"evaluate"}
    if POOL_ROLE == "rank":
        armed |= {"order", "done"}
    points.arm(_traced if TRACE else _on_point, {points.EVERY} if TRACE else armed)
    if "reform" in named:
        _hook_reform()


def _traced(name: str, context: Any) -> None:
    record("point", name=name, role=POOL_ROLE)
    _on_point(name, context)


UPCOMING = {"orphans", "lease", "leased", "handed"}
"""The library's points that a trial reaches before its function is called (while SEQ
still counts the trial before): ``form`` says so itself (``before_function``)."""


def _on_point(name: str, context: Any) -> None:
    """The library reached point ``name``: record what the fault checks need, and land
    the faults named for it. ``evaluate``: each trial NePS hands to this leader
    ("neps_trial": its id, in order), so a test maps the N-th evaluation to NePS's id
    even when the fault lands before the user's function runs; a pool's agent is at
    that trial now. ``order``/``done``: a pool rank's part of a trial ("pool_trial")."""
    if name == "evaluate":
        record("neps_trial", trial_id=str(context["trial_id"]))
        CURRENT["id"] = str(context["trial_id"])
        return
    if name == "order":
        CURRENT.update(id=str(context["trial_id"]), rank=int(context["group_rank"]))
        record("pool_trial", trial_id=CURRENT["id"], group_rank=CURRENT["rank"])
    if name == "record" and POOL_ROLE is not None:
        CURRENT["id"] = str(context["trial_id"])
    if name == "ask" and POOL_ROLE != "agent":
        return
    upcoming = bool(context.get("before_function", name in UPCOMING))
    try:
        at(name, upcoming)
    finally:
        if name == "done":
            CURRENT.update(id=None, rank=None)


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
