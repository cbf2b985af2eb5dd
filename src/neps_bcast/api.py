"""``neps_bcast.run``: the one call every rank makes."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import importlib
import io
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from neps_bcast import leader
from neps_bcast.compat import lightning as lightning_compat
from neps_bcast.compat import neps as neps_compat
from neps_bcast.config import INTERNAL, Settings
from neps_bcast.ddp.group import free_trials_at_exit
from neps_bcast.errors import LeaderLostError, NepsBcastError, format_message
from neps_bcast.follower import follow
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.root_lock import RootGuard
from neps_bcast.recovery.signals import sigterm_raises
from neps_bcast.runtime import Runtime, active
from neps_bcast.startup import external
from neps_bcast.startup.launch import Launch, detect
from neps_bcast.startup.rendezvous import fingerprint
from neps_bcast.transport.auth import Signer, new_secret, secret_from_env


def run(
    evaluate_pipeline: Callable[..., Any] | str, pipeline_space: Any = None, **kwargs: Any
) -> None:
    """Call on every rank with exactly the arguments of ``neps.run``.

    The leader (rank 0) runs ``neps.run``; every follower evaluates the trials its
    leader hands it and returns when the leader's ``neps.run`` returns. A single
    process (no DDP) behaves exactly like ``neps.run``.
    """
    settings = Settings.from_env()
    launch = detect()
    fn = _resolve(evaluate_pipeline, launch)
    rt = Runtime(launch, settings, _signer(launch))
    lightning_compat.sigterm_without_broadcast(lambda: active() is not None)
    atexit.unregister(free_trials_at_exit)  # once, however often run is called
    atexit.register(free_trials_at_exit)
    if launch.kind == "single":
        lightning_compat.before_children_start(_prepare_children)
    with rt.activated():
        if launch.kind == "single":
            _lead(rt, fn, pipeline_space, kwargs)
        elif launch.kind == "lightning_child":
            rt.log(logging.INFO, "Lightning child of the leader at %s", launch.leader_store)
            _follow(rt, fn, first_contact=True)
        else:
            external.start(rt, fingerprint(evaluate_pipeline, pipeline_space, kwargs))
            try:
                if rt.group_rank == 0:
                    _lead(rt, fn, pipeline_space, kwargs)
                else:
                    _follow(rt, fn, first_contact=False)
            finally:
                if rt.owns_group and dist.is_initialized():
                    dist.destroy_process_group()


def _signer(launch: Launch) -> Signer:
    """The search's secret as far as this process knows it at start (see ``auth``)."""
    if launch.kind == "lightning_child":
        assert launch.child_secret is not None  # detect() refuses a child without one
        for name in INTERNAL:  # the user's own subprocesses must not inherit them
            os.environ.pop(name, None)
        return Signer(bytes.fromhex(launch.child_secret))
    return Signer(secret_from_env() or new_secret())


def _prepare_children() -> None:
    rt = active()
    if rt is not None:
        rt.prepare_children()


def _follow(rt: Runtime, fn: Callable[..., Any], *, first_contact: bool) -> None:
    try:
        with sigterm_raises():
            follow(rt, fn, rt.first_contact() if first_contact else None)
    except LeaderLostError:
        _exit_without_collecting()
        raise
    except BaseException:
        # SIGTERM, Ctrl-C, sys.exit, an error of ours: close neps_bcast's own gloo group
        # (the channel) now. Left to the interpreter's finalization, its worker threads
        # can abort the process (see ``group.free_trials_at_exit``); measured: every
        # interrupted follower of the suite's signal tests still held it at exit.
        rt.close()
        raise
    finally:
        rt.link.release_watch()


def _exit_without_collecting() -> None:
    """A follower that lost its leader: its interpreter's exit skips the cyclic garbage
    collection of everything it imported (``_freeze_at_exit``).

    Why: whoever waits for this process (torchrun, srun, a scheduler, the launch's
    last process; Lightning's observer died with the leader) waits for it to be gone,
    and that collection frees every object torch, Lightning and NePS made (about
    470,000, in 4,700 modules): measured on 2 busy cores (load 10), 2.5 to 7 s between
    the follower's last line of Python and the end of its process; 0.5 to 0.7 s with
    it skipped. Registered here, not where the loss was seen: a follower whose own code
    catches the error and goes on is not affected until it exits.
    """
    atexit.unregister(_freeze_at_exit)  # once, however many times a leader was lost
    atexit.register(_freeze_at_exit)


def _freeze_at_exit() -> None:
    """Flush every open file, then freeze every object out of the garbage collector.

    Runs as the first atexit handler (the last registered): every other handler runs
    after it as usual (logging's shutdown flushes and closes its handlers), so do the
    flush of stdout and stderr and the exit code. What changes: objects left in
    reference cycles at exit are not finalized (Python never promises that), and those
    include the globals of any module defining a function, ``__main__`` among them. So
    the one thing that finalization would have saved, the buffered data of a file the
    user's code never closed, is flushed here. Nothing is read from an object but its
    type before it is known to be a file (some module proxies warn on any access).
    """
    for obj in gc.get_objects():
        if issubclass(type(obj), _FILES):
            stream = cast(io.IOBase, obj)
            with contextlib.suppress(Exception):  # closed, detached, a reader gone
                if not stream.closed and stream.writable():
                    stream.flush()
    gc.freeze()


_FILES = (io.BufferedIOBase, io.TextIOBase, io.RawIOBase)


def _lead(rt: Runtime, fn: Callable[..., Any], pipeline_space: Any, kwargs: dict[str, Any]) -> None:
    import neps

    # Absolute from the start: the user's function may chdir, and the trial is recorded
    # (by NePS, or by us after an interrupt) in the root the search started in.
    root = Path(kwargs.get("root_directory", neps_compat.ROOT_DIRECTORY_DEFAULT)).resolve()
    kwargs = {**kwargs, "root_directory": root}
    # Every NePS lock taken in this process, by us or by NePS before neps.run sets it, is
    # the kind neps.run uses (a flock does not exclude another worker's lockf).
    neps_compat.use_neps_locking()
    guard = RootGuard(root, rt.settings.root_lock_timeout_s)
    leases = Leases(root, rt.settings)

    @functools.wraps(fn)
    def first_trial_releases(*args: Any, **fn_kwargs: Any) -> Any:
        guard.release()  # NePS gave us a trial: the state on disk is complete
        return fn(*args, **fn_kwargs)

    wrapped = leader.wrap(rt, first_trial_releases, root, leases)
    if rt.launch.kind == "single":  # Lightning may spawn children, watched by its observer
        lightning_compat.before_observer_kills(lambda: leader.let_leader_record(rt, root, leases))
    try:
        with sigterm_raises():
            guard.acquire()
            try:
                overwrite = bool(kwargs.get("overwrite_root_directory"))
                space = guard.prepare(pipeline_space, overwrite)
                if not overwrite:
                    # Before NePS samples: trials whose leader died go back to pending,
                    # and NePS hands out pending trials before sampling new ones.
                    leases.recover_orphans()
                neps.run(wrapped, space, **kwargs)
            finally:
                leases.close()
                guard.release()
                rt.settled.set()
    except leader.SearchAborted as aborted:
        with contextlib.suppress(Exception):
            rt.close()
        raise aborted.error from None
    except BaseException as exc:
        try:
            rt.shutdown(f"the leader's neps.run raised {type(exc).__name__}: {exc}")
        except NepsBcastError as stop_error:
            rt.log(logging.ERROR, "could not stop the followers: %s", stop_error)
        raise
    rt.shutdown("the search is over (the leader's neps.run returned)")
    rt.log(logging.INFO, "done")


def _resolve(evaluate_pipeline: Callable[..., Any] | str, launch: Launch) -> Callable[..., Any]:
    if callable(evaluate_pipeline):
        return evaluate_pipeline
    tag = f"neps_bcast rank {launch.global_rank}"
    if isinstance(evaluate_pipeline, str) and ":" in evaluate_pipeline:
        module_name, _, name = evaluate_pipeline.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError) as exc:
            raise NepsBcastError(
                format_message(
                    tag,
                    f"evaluate_pipeline={evaluate_pipeline!r} cannot be loaded on this"
                    f" rank: {type(exc).__name__}: {exc}.",
                    "pass the function itself, or a 'module:function' importable on"
                    " every rank (check PYTHONPATH and the working directory).",
                )
            ) from exc
        if callable(target):
            return target  # type: ignore[no-any-return]
    raise NepsBcastError(
        format_message(
            tag,
            f"evaluate_pipeline must be a function or a 'module:function' string, got"
            f" {evaluate_pipeline!r}.",
            "pass the function you want every rank to evaluate.",
        )
    )
