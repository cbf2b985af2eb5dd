"""What every rank of search.py records, and the faults it injects.

Records are JSON lines, one file per process, in the scenario's record folder; the
harness reads them back. Observers count (never replace) what NePS is asked to do:
calls of ``neps.run`` and ``NePSState.create_or_load``, and every file this process
opens or lists under the NePS root (an audit hook).
"""

from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: scenario.py

from scenario import Scenario

SCENARIO = Scenario.from_env()
RECORD = Path(SCENARIO.record).resolve() if SCENARIO.record else None
SEQ = {"n": 0}
"""Trials this process has started evaluating (1-based once the first starts)."""
CALLS = {"neps.run": 0, "NePSState.create_or_load": 0}
ROOT_ACCESS: dict[str, Any] = {"count": 0, "paths": []}
"""Opens and listings under the NePS root by this process (the first 20 paths)."""


def my_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def record(event: str, **data: Any) -> None:
    if RECORD is None:
        return
    RECORD.mkdir(parents=True, exist_ok=True)
    line = {"event": event, "pid": os.getpid(), "proc_rank": my_rank(), "t": time.time(), **data}
    with (RECORD / f"pid{os.getpid()}.jsonl").open("a") as f:
        f.write(json.dumps(line, default=str) + "\n")


def log_to_own_file() -> None:
    """Send this process's stdout and stderr (fds 1 and 2) to a log of its own."""
    if not SCENARIO.log_dir:
        return
    folder = Path(SCENARIO.log_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{my_rank()}.pid{os.getpid()}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    arm_stack_dump()


def arm_stack_dump() -> None:
    """SIGUSR1 writes every thread's stack to this log (the harness sends it to a launch
    that overran). Armed again around every trial: Lightning's fit saves every signal's
    Python-level handler and restores them at its end, which resets faulthandler's
    C-level one to the default (measured: no dump after a fit, the process just died),
    while faulthandler still counts it registered (so ``register`` alone would not
    install it again)."""
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def fault(where: str) -> None:
    """Inject the scenario's faults that match this point, rank and trial."""
    for f in SCENARIO.faults:
        if f.where != where:
            continue
        if f.rank is not None and f.rank != my_rank():
            continue
        if f.seq is not None and f.seq != SEQ["n"]:
            continue
        record("fault", kind=f.kind, where=where, seq=SEQ["n"], rank=my_rank())
        if f.kind == "raise":
            raise ValueError(f"injected failure on rank {my_rank()} at {where}")
        if f.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f.kind == "kill_in":
            threading.Timer(f.seconds, os.kill, (os.getpid(), signal.SIGKILL)).start()
        if f.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        if f.kind == "int":
            os.kill(os.getpid(), signal.SIGINT)
        if f.kind == "int_group":
            os.killpg(os.getpgrp(), signal.SIGINT)
        if f.kind == "sigkill_leader":
            os.kill(os.getppid(), signal.SIGKILL)
        if f.kind == "sleep":
            time.sleep(f.seconds)  # the fault itself: a slow step, observed from outside
            record("slept", where=where, seq=SEQ["n"], rank=my_rank())


def observe_reform() -> None:
    """Hook torch's ``init_process_group``: a "reform" fault makes forming the group for
    trial ``seq`` fail on one rank after its peers' forming worked, leaving torch as a
    real failure does (seen in CI: "Gloo connectFullMesh failed ... Connection closed by
    peer" on the leader, its follower having released the new group at once): no
    group, and c10d's group counter one up."""
    import datetime

    import torch.distributed as dist

    real_init = dist.init_process_group
    fired = []

    def init(*args: Any, **kwargs: Any) -> None:
        real_init(*args, **kwargs)  # the peers' rendezvous completes
        matches = [f for f in SCENARIO.faults if f.where == "reform" and f.rank == my_rank()]
        if fired or not any(f.seq == SEQ["n"] + 1 for f in matches):
            return  # once: a rank whose forming failed did not start that trial
        fired.append(SEQ["n"] + 1)
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
        SEQ["n"] += 1  # the trial this group is formed for
        try:
            fault("reform")
        finally:
            SEQ["n"] -= 1

    dist.init_process_group = init


def observe_neps() -> None:
    """Count calls into NePS and hook the points faults can fire at (pass-through)."""
    import neps
    from neps.state import neps_state as ns

    real_run = neps.run

    def counting_run(*args: Any, **kwargs: Any) -> Any:
        CALLS["neps.run"] += 1
        return real_run(*args, **kwargs)

    neps.run = counting_run

    real_col = ns.NePSState.create_or_load.__func__  # type: ignore[attr-defined]

    def counting_col(cls: Any, *args: Any, **kwargs: Any) -> Any:
        CALLS["NePSState.create_or_load"] += 1
        return real_col(cls, *args, **kwargs)

    ns.NePSState.create_or_load = classmethod(counting_col)  # type: ignore[assignment]

    real_sample = ns.NePSState._sample_trial

    def sampling(self: Any, *args: Any, **kwargs: Any) -> Any:
        fault("sample")  # the leader is choosing the next trial; its followers wait
        return real_sample(self, *args, **kwargs)

    ns.NePSState._sample_trial = sampling  # type: ignore[method-assign]

    real_report = ns.NePSState._report_trial_evaluation

    def reporting(self: Any, trial: Any, *args: Any, **kwargs: Any) -> Any:
        record("recording", trial_id=trial.id, seq=SEQ["n"])
        fault("record")
        return real_report(self, trial, *args, **kwargs)

    ns.NePSState._report_trial_evaluation = reporting  # type: ignore[method-assign]


def watch_root(root: Path) -> None:
    """Count this process's opens and listings under ``root`` (an audit hook)."""
    root_str = str(root.resolve())
    prefix = root_str + os.sep

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event not in ("open", "os.listdir", "os.scandir"):
            return
        try:
            target = args[0]
            if not isinstance(target, (str, bytes, os.PathLike)):
                return  # a file descriptor
            path = os.path.abspath(os.fsdecode(target))  # noqa: PTH100 - cheap, no I/O
            if path == root_str or path.startswith(prefix):
                ROOT_ACCESS["count"] += 1
                if len(ROOT_ACCESS["paths"]) < 20:
                    ROOT_ACCESS["paths"].append(f"{event} {os.path.relpath(path, root_str)}")
        except Exception:
            pass

    sys.addaudithook(hook)


TRIAL_OBJECTS: list[tuple[str, weakref.ref[Any]]] = []
"""What a trial made that must be gone when the process ends (its DDP wrapper, its group)."""


def outlives_its_trial(obj: Any, kind: str) -> None:
    """Watch ``obj``: the "at_exit" record says whether it was still alive then.

    A trial's DDP wrapper holds the trial's process group (its reducer does, even once
    the group is destroyed); one still alive at exit is freed by the interpreter's
    finalization, when gloo's worker threads can no longer take the GIL (SIGABRT, "terminate called without an active
    exception"; pytorch/pytorch#190489, #179291).
    """
    TRIAL_OBJECTS.append((kind, weakref.ref(obj)))


def _left_to_finalization() -> None:
    """The last atexit handler (registered at import, before any of neps_bcast's): what
    a trial made and is still alive here, reachable or garbage in a cycle, is freed by
    the interpreter's finalization. Not collected first: that would hide it."""
    if TRIAL_OBJECTS:
        alive = sorted({kind for kind, ref in TRIAL_OBJECTS if ref() is not None})
        record("at_exit", trial_objects_alive=alive, trial_objects_seen=len(TRIAL_OBJECTS))


atexit.register(_left_to_finalization)


def exit_code(exc: BaseException | None) -> int:
    """The exit code the interpreter will end with for ``exc`` escaping main()."""
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    if isinstance(exc, KeyboardInterrupt):
        return -signal.SIGINT  # Python re-raises SIGINT on itself
    return 1


def record_exit(exc: BaseException | None) -> None:
    code = exit_code(exc)
    record(
        "exit",
        code=code,
        ok=code == 0,
        error=None if exc is None else f"{type(exc).__name__}: {exc}",
        calls=CALLS,
        root_access=ROOT_ACCESS,
    )
