"""What the test scripts record for tests/harness.py, kept out of the user-shaped code.

A script calls ``run_script(main)`` once, decorates its evaluate function with
``@evaluation`` and calls ``trial(trial)`` first thing in ``neps_bcast.session()``; the
rest is automatic. Every process appends JSON lines to ``$NB_RECORD_DIR/pid<pid>.jsonl``
and sends its stdout and stderr to ``$NB_LOG_DIR/rank<r>.pid<pid>.log``. Events:

- "start" (argv, cwd, root) and "exit" (the exit code the script ends with, and this
  process's calls into NePS and accesses under the NePS root);
- "trial" (what this rank evaluates: trial id, rank, world size, the exact keyword
  arguments its function got), "trained" (after training: world size, loss), "step"
  (a model's first training step, in the process that trains it), "raised" (what the
  rank's evaluation raised), "chdir" (the function moved to another folder);
- "at_exit" (what a trial made that is still alive in the last atexit handler);
- "fault", "slept", "released": tests/scripts/faults.py.

Observers count (never replace) what NePS is asked to do: calls of ``neps.run`` and
``NePSState.create_or_load``, and every file this process opens or lists under the NePS
root (an audit hook). Test orchestration: ``NB_MEET=<folder>:<me>:<other>`` makes every
rank touch ``<folder>/<me>`` in its first trial and wait (60 s at most) for
``<folder>/<other>``, so that two launches overlap for sure.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import json
import os
import signal
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

RECORD = Path(os.environ["NB_RECORD_DIR"]).resolve() if os.environ.get("NB_RECORD_DIR") else None
SEQ = {"n": 0}
"""Trials this process has started evaluating (1-based once the first starts)."""
KWARGS: dict[str, Any] = {}
"""The keyword arguments of the evaluation in progress."""
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


def run_script(main: Callable[[], object]) -> None:
    """Run a search script's ``main`` under the probe: own log, observers, faults armed,
    "start" and "exit" records."""
    import faults

    log_to_own_file()
    _observe_neps()
    faults.install()
    root = _root_argument()
    record("start", argv=sys.argv, cwd=str(Path.cwd()), root=str(root.resolve()))
    _watch(root)
    try:
        main()
    except BaseException as exc:
        _record_exit(exc)
        raise
    _record_exit(None)


def evaluation(fn: Callable[..., float]) -> Callable[..., float]:
    """Decorate an evaluate function: counts this process's trials and records what each
    raised (the failing rank's own error, or the TrialFailedError naming it).
    ``functools.wraps`` keeps the signature NePS reads."""

    @functools.wraps(fn)
    def evaluate(**kwargs: Any) -> float:
        SEQ["n"] += 1
        KWARGS.clear()
        KWARGS.update(kwargs)
        arm_stack_dump()
        try:
            return fn(**kwargs)
        except BaseException as exc:
            record("raised", seq=SEQ["n"], rank=my_rank(), type=type(exc).__name__, text=str(exc))
            raise
        finally:
            arm_stack_dump()

    return evaluate


def trial(t: Any) -> None:
    """First thing inside ``neps_bcast.session()``: what this rank evaluates."""
    previous = t.previous_pipeline_directory
    record(
        "trial",
        trial_id=t.id,
        rank=t.rank,
        world_size=t.world_size,
        is_leader=t.is_leader,
        kwargs=KWARGS,
        config=t.config,
        pipeline_directory=t.pipeline_directory,
        previous_pipeline_directory=previous,
        ckpt_exists=bool(previous and (Path(previous) / "last.ckpt").exists()),
    )
    _watch_the_channel()
    if os.environ.get("NB_MEET") and SEQ["n"] == 1:
        folder, me, other = os.environ["NB_MEET"].split(":")
        (Path(folder) / me).touch()
        deadline = time.monotonic() + 60
        while not (Path(folder) / other).exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # test orchestration only: make two launches overlap


def trained(rank: int, loss: float) -> None:
    import torch.distributed as dist

    size = dist.get_world_size() if dist.is_initialized() else None
    record("trained", rank=rank, world_size_after=size, loss=loss)


STEPPED: weakref.WeakSet[Any] = weakref.WeakSet()
"""The models whose first training step was seen."""


def training_step(module: Any, trial_id: str) -> None:
    """In a LightningModule's training_step: its first step, in the process that trains
    it (under ddp_spawn: a spawned one), is recorded, and what holds the gloo group's
    threads is watched: the group, and the DDP wrapper whose reducer holds it even once
    the group is destroyed. (The model itself may outlive the trial harmlessly: a
    ddp_spawn worker's arguments hold it.)"""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if module in STEPPED:
        return
    STEPPED.add(module)
    record("step", trial_id=trial_id, rank=module.global_rank)
    wrapper = module.trainer.strategy.model
    if isinstance(wrapper, DistributedDataParallel):
        outlives_its_trial(wrapper, "DDP wrapper")
    if dist.is_initialized():
        outlives_its_trial(dist.group.WORLD, "process group")


def log_to_own_file() -> None:
    """Send this process's stdout and stderr (fds 1 and 2) to a log of its own."""
    if not os.environ.get("NB_LOG_DIR"):
        return
    folder = Path(os.environ["NB_LOG_DIR"])
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


def _root_argument() -> Path:
    """The NePS root the script was given (``--root``), as the harness reads it too."""
    argv = sys.argv[1:]
    return Path(argv[argv.index("--root") + 1]) if "--root" in argv else Path("results")


def _observe_neps() -> None:
    """Count calls of ``neps.run`` and ``NePSState.create_or_load`` (pass-through)."""
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


def _watch(root: Path) -> None:
    """An audit hook: count this process's opens and listings under ``root``, and record
    every change of directory (a user's function may move)."""
    root_str = str(root.resolve())
    prefix = root_str + os.sep

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event == "os.chdir":
            record("chdir", seq=SEQ["n"], cwd=os.path.abspath(os.fsdecode(args[0])))  # noqa: PTH100
            return
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


def _watch_the_channel() -> None:
    """neps_bcast's own gloo group, the control channel (no local of a trial's frame
    may hold it: a failed trial's traceback keeps those frames)."""
    import neps_bcast.runtime

    rt = neps_bcast.runtime.active()
    channel = getattr(rt.link.channel, "_pg", None) if rt is not None else None
    if channel is not None:
        outlives_its_trial(channel, "control channel")


TRIAL_OBJECTS: list[tuple[str, weakref.ref[Any]]] = []
"""What a trial made that must be gone when the process ends (its DDP wrapper, its group)."""


def outlives_its_trial(obj: Any, kind: str) -> None:
    """Watch ``obj``: the "at_exit" record says whether it was still alive then.

    A trial's DDP wrapper holds the trial's process group (its reducer does, even once
    the group is destroyed); one still alive at exit is freed by the interpreter's
    finalization, when gloo's worker threads can no longer take the GIL (SIGABRT,
    "terminate called without an active exception"; pytorch/pytorch#190489 and pytorch/pytorch#179291).
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


def _exit_code(exc: BaseException | None) -> int:
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


def _record_exit(exc: BaseException | None) -> None:
    code = _exit_code(exc)
    record(
        "exit",
        code=code,
        ok=code == 0,
        error=None if exc is None else f"{type(exc).__name__}: {exc}",
        calls=CALLS,
        root_access=ROOT_ACCESS,
    )
