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
``NePSState.create_or_load``, every path call this process makes under the NePS root (an
audit hook: opens, listings, mkdir, rename, remove, utime, chmod, glob, shutil's... see
``PATH_ARGS``), and every file under it this process is seen holding open (a thread
that looks at ``/proc/self/fd``: C-level opens raise no audit event). Test
orchestration: ``NB_MEET=<folder>:<me>:<other>`` makes every rank touch
``<folder>/<me>`` in its first trial and wait (60 s at most) for ``<folder>/<other>``,
so that two launches overlap for sure.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import json
import os
import signal
import sys
import threading
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
ROOT_ACCESS: dict[str, Any] = {"count": 0, "paths": [], "fd_count": 0, "fd_paths": []}
"""This process's path calls under the NePS root (the audit hook: ``count`` and the first
20 ``paths``, "<event> <path under the root>"), and the files under it it was seen holding
open (the fd watch: ``fd_count`` and ``fd_paths``, "fd <path>", in every process; a
follower's also in ``count`` and ``paths``)."""


def my_rank() -> int:
    # Only where torch is imported already: a group cannot be initialized otherwise, and
    # importing torch in an atexit handler (the "exit_path" record) fails ("can't
    # register atexit after shutdown").
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
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


def heap(numel: int, where: str) -> None:
    """What this process holds now ("heap"): its live tensors of at least ``numel``
    elements (``gc.get_objects``: a finished trial's model is cyclic garbage until a
    collection, and still counted), its RSS, and where CUDA is initialised the memory
    allocated on its device. Counting collects nothing: it sees what the trial sees."""
    import gc

    import torch

    objects = gc.get_objects()
    big = sum(1 for o in objects if isinstance(o, torch.Tensor) and o.numel() >= numel)
    del objects
    with open("/proc/self/statm") as f:  # noqa: PTH123 - no audit event wanted either way
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    cuda = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    record(
        "heap",
        where=where,
        seq=SEQ["n"],
        big_tensors=big,
        rss=rss,
        cuda_allocated=torch.cuda.memory_allocated() if cuda else None,
        cuda_peak=torch.cuda.max_memory_allocated() if cuda else None,
    )


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


PATH_ARGS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "open": ((0, None),),  # open(), io.open, os.open, pathlib: (path, mode, flags)
    "os.listdir": ((0, None),),
    "os.scandir": ((0, None),),
    "os.mkdir": ((0, 2),),  # (path, mode, dir_fd); os.makedirs too
    "os.rename": ((0, 2), (1, 3)),  # (src, dst, src_dir_fd, dst_dir_fd); os.replace too
    "os.link": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),),  # (src, dst, dir_fd): dst is made; src is only its text
    "os.remove": ((0, 1),),  # (path, dir_fd); os.unlink too
    "os.rmdir": ((0, 1),),
    "os.truncate": ((0, None),),  # (path, length)
    "os.utime": ((0, 3),),  # (path, times, ns, dir_fd); Path.touch too
    "os.chmod": ((0, 2),),
    "os.chown": ((0, 3),),  # os.lchown too
    "os.chdir": ((0, None),),
    "os.listxattr": ((0, None),),
    "os.getxattr": ((0, None),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "os.walk": ((0, None),),  # (top, topdown, onerror, followlinks)
    "os.fwalk": ((0, 4),),  # (top, topdown, onerror, follow_symlinks, dir_fd)
    "glob.glob": ((0, None),),  # (pathname, recursive): the pattern itself
    "pathlib.Path.glob": ((0, None),),  # (self, pattern)
    "pathlib.Path.rglob": ((0, None),),
    "shutil.copyfile": ((0, None), (1, None)),
    "shutil.copymode": ((0, None), (1, None)),
    "shutil.copystat": ((0, None), (1, None)),
    "shutil.copytree": ((0, None), (1, None)),
    "shutil.move": ((0, None), (1, None)),
    "shutil.rmtree": ((0, 1),),  # (path, dir_fd)
    "shutil.chown": ((0, None),),
    "shutil.make_archive": ((0, None), (2, None)),  # (base_name, format, root_dir, base_dir)
    "shutil.unpack_archive": ((0, None), (1, None)),  # (filename, extract_dir, format)
    "tempfile.mkstemp": ((0, None),),
    "tempfile.mkdtemp": ((0, None),),
    "sqlite3.connect": ((0, None),),
}
"""The CPython audit events (3.11) that name a path, as ``event: ((path index, dir_fd
index or None), ...)``: where each path is in the event's arguments, and the ``dir_fd``
it is relative to (-1 or None: the process's cwd). Checked against this interpreter by
tests/test_probe_audit.py. ``os.stat``, ``os.lstat``, ``os.path.exists``/``isdir``/
``isfile``, ``os.access``, ``os.readlink``, ``os.mkfifo``, ``os.mknod`` and
``os.statvfs`` raise no audit event: no hook sees them (the fd watch sees none of them
either: they hold no file open). ``glob.glob/2`` (pattern relative to ``root_dir``) is
read in ``_paths_of``."""
FD_PERIOD = 0.05
"""Seconds between two looks of the fd watch at ``/proc/self/fd`` while this process's
open files change (and after a path call under the root)."""
FD_PERIOD_IDLE = 0.2
"""The longest, reached by doubling while they do not (see ``_watch_fds``)."""


def _watch(root: Path) -> None:
    """Count this process's path calls under ``root``: an audit hook (every event of
    ``PATH_ARGS``) and a thread that watches this process's open files (``_watch_fds``);
    record every change of directory (a user's function may move).

    A path is resolved as the call meant it: against the process's cwd at the time of
    the event (or the folder of its ``dir_fd`` where the event names one and
    ``/proc/self/fd`` can tell which), and counted when it is the root or under it,
    spelt as given (``root``, absolute) or through its symlinks resolved. File
    descriptors given as paths are ignored (their open was seen). The "open" event does
    not carry ``os.open``'s ``dir_fd``: such a relative open is resolved against the cwd
    (``shutil.rmtree``'s own are under the tree its event names). The hook never raises
    (but for the "chdir" record, as before): whatever it cannot read, it skips."""
    roots = _root_spellings(root)
    look_now = _watch_fds(roots)

    def hook(event: str, args: tuple[Any, ...]) -> None:
        spec = PATH_ARGS.get(event)
        if spec is None and event != "glob.glob/2":
            return
        if event == "os.chdir" and not isinstance(args[0], int):  # os.fchdir: an int
            record("chdir", seq=SEQ["n"], cwd=os.path.abspath(os.fsdecode(args[0])))  # noqa: PTH100
        try:
            for path in _paths_of(event, args, spec or ()):
                rel = _under(path, roots)
                if rel is not None:
                    _count(ROOT_ACCESS, "count", "paths", f"{event} {rel}")
                    look_now()
        except Exception:
            pass

    sys.addaudithook(hook)


def _root_spellings(root: Path) -> tuple[str, ...]:
    """The root as given (made absolute) and with its symlinks resolved (as
    ``/proc/self/fd`` shows open files)."""
    given = os.path.abspath(root)  # noqa: PTH100
    return tuple(dict.fromkeys((str(root.resolve()), given)))


def _paths_of(
    event: str, args: tuple[Any, ...], spec: tuple[tuple[int, int | None], ...]
) -> list[str]:
    """The absolute paths an audit event names (see ``PATH_ARGS``)."""
    if event == "glob.glob/2":  # (pathname, recursive, root_dir, dir_fd)
        if args[2] is None:
            return []  # the same pattern's "glob.glob" event was seen
        base = _resolve(args[2], args[3])
        return [] if base is None else [os.path.join(base, os.fsdecode(args[0]))]  # noqa: PTH118
    paths = []
    for at, dir_fd_at in spec:
        if at < len(args):
            dir_fd = args[dir_fd_at] if dir_fd_at is not None and dir_fd_at < len(args) else None
            path = _resolve(args[at], dir_fd)
            if path is not None:
                paths.append(path)
    return paths


def _resolve(target: Any, dir_fd: Any) -> str | None:
    """``target`` (str, bytes, PathLike) made absolute: against ``dir_fd``'s folder if it
    is an open fd, else the cwd; None for an fd or anything else, or a ``dir_fd`` whose
    folder cannot be read."""
    if not isinstance(target, (str, bytes, os.PathLike)):
        return None  # an fd (its open was seen), or None
    path = os.fsdecode(target)
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):  # noqa: PTH117
        try:
            base = os.readlink(f"/proc/self/fd/{dir_fd}")  # noqa: PTH115 - no audit event
        except OSError:
            return None
        path = os.path.join(base, path)  # noqa: PTH118
    return os.path.abspath(path)  # noqa: PTH100 - cheap, no I/O


def _under(path: str, roots: tuple[str, ...]) -> str | None:
    """``path`` relative to the root if it is the root or under it, else None."""
    for root in roots:
        if path == root or path.startswith(root + os.sep):
            return os.path.relpath(path, root)
    return None


def _count(access: dict[str, Any], count: str, paths: str, what: str) -> None:
    """One more access: counted, and its path kept among the first 20. No lock: the
    hook runs in any thread (a lock held across a fork would hang the child's hook);
    under the GIL a race can at worst lose an increment, never leave a seen access at 0."""
    access[count] += 1
    if len(access[paths]) < 20:
        access[paths].append(what)


def _watch_fds(roots: tuple[str, ...]) -> Callable[[], None]:
    """A daemon thread that looks at this process's open files and counts each one under
    the root it sees newly: C-level opens (libc, C++, a C extension's fopen) raise no
    audit event. Every process counts them in ``fd_count`` (the first 20 in
    ``fd_paths``, "fd <path>"); a follower also in ``count`` and ``paths``, as the
    hook's. Returns ``look_now``: the hook calls it on every path call under the root
    (the audit event comes just before the call), so that the leader's own opens of
    NePS's files, the positive control, are looked at while NePS holds them.

    When: every ``FD_PERIOD`` (50 ms) while the open files change, the period doubling
    up to ``FD_PERIOD_IDLE`` (200 ms) while they do not; a change, or ``look_now``,
    brings it back to 50 ms. So a file held open over 200 ms is seen, a shorter one
    may be missed: this is sampling. Why not 50 ms always: it runs in every process, and
    a follower waiting for its leader must stay under 1% of a core
    (tests/e2e/test_e2e_lightning.py, read in 10 ms clock ticks over 4 s). A look costs
    200-300 us of CPU on 2 busy cores (listing and ``fstat`` of 17 fds, cold caches);
    measured at load 5-12, such a follower used 0.25-1.0% of a core without the watch
    (5 runs), 1.25% with looks every 50 ms (3 runs), 0.5-0.75% as here (3 runs); a
    process that holds 15 fds and sleeps, 0.02%, 0.6-0.8% and 0.2%.

    A look lists ``/proc/self/fd`` through a folder fd held open and ``fstat``s each fd;
    only an fd whose (number, device, inode) is new since the last look has its path
    read (``readlink``). Stopped and joined by an atexit handler (at once), so it is
    gone before the interpreter's finalization."""
    wake = threading.Lock()  # held; released to wake the thread (a timed acquire costs
    wake.acquire()  # less than Event.wait: measured 0.16% vs 0.25% of a core at 50 ms)
    stopping: list[bool] = []
    fd_dir = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)  # not inherited
    known: dict[tuple[str, int, int], str | None] = {}
    """Each open file of the last look: its path under the root, else None."""

    def look() -> bool:
        """Count the newly seen files under the root; whether any open file changed."""
        now: dict[tuple[str, int, int], str | None] = {}
        for name in os.listdir(fd_dir):  # noqa: PTH208 - an fd
            try:
                st = os.fstat(int(name))
                key = (name, st.st_dev, st.st_ino)
                now[key] = known[key] if key in known else _under(readlink(name), roots)
            except OSError:
                continue  # closed since the listing (the listing's own fd among them)
            if key not in known and now[key] is not None:
                what = f"fd {now[key]}"
                _count(ROOT_ACCESS, "fd_count", "fd_paths", what)
                if _rank_now() != 0:
                    _count(ROOT_ACCESS, "count", "paths", what)
        changed = now.keys() != known.keys()
        known.clear()
        known.update(now)
        return changed

    def readlink(name: str) -> str:
        return os.readlink(name, dir_fd=fd_dir)

    def watch() -> None:
        period = FD_PERIOD
        while True:
            try:
                changed = look()
            except Exception:
                changed = True  # /proc unreadable: the next look, soon
            period = FD_PERIOD if changed else min(2 * period, FD_PERIOD_IDLE)
            if wake.acquire(timeout=period):
                period = FD_PERIOD  # look_now
            if stopping:
                os.close(fd_dir)
                return

    def look_now() -> None:
        with contextlib.suppress(RuntimeError):  # released already: a look is due
            wake.release()

    thread = threading.Thread(target=watch, name="probe-fd-watch", daemon=True)
    thread.start()

    def stop_watching() -> None:
        stopping.append(True)
        look_now()
        thread.join(timeout=1.0)

    atexit.register(stop_watching)
    return look_now


def _rank_now() -> int:
    """``my_rank()`` from any thread, never raising nor importing torch: torch.distributed
    not yet imported has formed no group."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:
        pass
    for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK"):
        if name in os.environ:
            try:
                return int(os.environ[name])
            except ValueError:
                return 1  # unreadable: counted as a follower's
    return 0


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


def _exit_path() -> None:
    """Which way this interpreter leaves (registered at import, so it runs after every
    handler neps_bcast registers): ``gc_frozen`` counts the objects frozen out of the
    final collection, non-zero once a follower's ``_freeze_at_exit``
    (neps_bcast.roles.follower) ran. A test checks that the fast exit path ran instead of
    timing the exit, which a loaded machine stretches (2.5 to 7 s at load 10)."""
    import gc

    record("exit_path", gc_frozen=gc.get_freeze_count())


atexit.register(_exit_path)


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
    torch = sys.modules.get("torch")
    record(
        "exit",
        code=code,
        cuda_visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_initialized=bool(torch is not None and torch.cuda.is_initialized()),
        pool_role=os.environ.get("NEPS_BCAST_POOL_ROLE"),
        ok=code == 0,
        error=None if exc is None else f"{type(exc).__name__}: {exc}",
        calls=CALLS,
        root_access={k: list(v) if isinstance(v, list) else v for k, v in ROOT_ACCESS.items()},
    )  # a copy: the fd watch may count on while it is written
