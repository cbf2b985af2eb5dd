"""``neps_bcast.run``: the one call every rank makes."""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from neps_bcast import _dist, _lightning_compat, _neps_compat, leader, rendezvous
from neps_bcast.errors import LaunchError, NepsBcastError, format_message
from neps_bcast.follower import follow
from neps_bcast.launch import Launch, detect
from neps_bcast.rendezvous import fingerprint
from neps_bcast.root_guard import RootGuard
from neps_bcast.runtime import Runtime, active

ENV_BACKEND = "NEPS_BCAST_BACKEND"


def run(
    evaluate_pipeline: Callable[..., Any] | str, pipeline_space: Any = None, **kwargs: Any
) -> None:
    """Call on every rank with exactly the arguments of ``neps.run``.

    The leader (rank 0) runs ``neps.run``; every follower evaluates the trials its
    leader hands it and returns when the leader's ``neps.run`` returns. A single
    process (no DDP) behaves exactly like ``neps.run``.
    """
    launch = detect()
    fn = _resolve(evaluate_pipeline, launch)
    rt = Runtime(launch)
    _lightning_compat.sigterm_without_broadcast(lambda: active() is not None)
    with rt.activated():
        if launch.kind == "single":
            _lead(rt, fn, pipeline_space, kwargs)
        elif launch.kind == "lightning_child":
            rt.log(logging.INFO, "Lightning child of the leader at %s", launch.leader_store)
            try:
                with _sigterm_raises():
                    follow(rt, fn, rt.first_contact())
            finally:
                rt.release_watch()
        else:
            _start_external(rt, fingerprint(evaluate_pipeline, pipeline_space, kwargs))
            try:
                if rt.group_rank == 0:
                    _lead(rt, fn, pipeline_space, kwargs)
                else:
                    try:
                        with _sigterm_raises():
                            follow(rt, fn, None)
                    finally:
                        rt.release_watch()
            finally:
                if rt.owns_group and dist.is_initialized():
                    dist.destroy_process_group()


def _lead(
    rt: Runtime,
    fn: Callable[..., Any],
    pipeline_space: Any,
    kwargs: dict[str, Any],
) -> None:
    import neps

    root = Path(kwargs.get("root_directory", _neps_compat.ROOT_DIRECTORY_DEFAULT))
    guard = RootGuard(root, rt.tag)

    @functools.wraps(fn)
    def first_trial_releases(*args: Any, **fn_kwargs: Any) -> Any:
        guard.release()  # NePS gave us a trial: the state on disk is complete
        return fn(*args, **fn_kwargs)

    wrapped = leader.wrap(rt, first_trial_releases, root)
    if rt.launch.kind == "single":  # Lightning may spawn children, watched by its observer
        _lightning_compat.before_observer_kills(lambda: leader.let_leader_record(rt, root))
    try:
        with _sigterm_raises():
            guard.acquire()
            try:
                space = guard.prepare(pipeline_space, bool(kwargs.get("overwrite_root_directory")))
                neps.run(wrapped, space, **kwargs)
            finally:
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


class Terminated(SystemExit):
    """SIGTERM (e.g. SLURM preemption) turned into an exception, so the trial is recorded."""


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
    ):
        yield
        return

    def handler(signum: int, _frame: object) -> None:
        raise Terminated(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


def _backend(launch: Launch) -> str:
    explicit = os.environ.get(ENV_BACKEND)
    if explicit:
        return explicit
    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        return "nccl"
    return "gloo"


def _start_external(rt: Runtime, mine: dict[str, str]) -> None:
    """All ranks started together: meet (bounded), form the group, join the channel.

    The ranks first meet on the launcher's rendezvous store: a rank that never calls
    ``neps_bcast.run`` is named within ``NEPS_BCAST_JOIN_TIMEOUT_S`` instead of hanging
    in ``init_process_group``, and ranks given different arguments fail on every rank
    before trial 1. The default group is then formed on that same store (Lightning,
    Fabric and plain DDP code find it and reuse it), and the leader publishes the
    address of its control store there for the followers.
    """
    launch = rt.launch
    if dist.is_initialized():
        rt.observe_group()
        store: _dist.Store | None = None
    else:
        if launch.main_address is None or launch.main_port is None:
            raise LaunchError(
                format_message(
                    rt.tag,
                    f"{launch.launcher} launch without a rendezvous address.",
                    "set MASTER_ADDR and MASTER_PORT for every rank.",
                )
            )
        assert launch.world_size is not None  # external launches always know it
        store = rendezvous.rendezvous_store(launch)
        meeting = rendezvous.meet(launch, store, mine)
        backend = _backend(launch)
        rt.log(logging.DEBUG, "forming the DDP group (%s)", backend)
        dist.init_process_group(
            backend,
            store=_dist.PrefixStore(f"{meeting.prefix}/pg", store),
            rank=launch.global_rank,
            world_size=launch.world_size,
        )
        rt.owns_group = True
        rt.observe_group()
        store = _dist.PrefixStore(meeting.prefix, store)
    if store is not None:
        if rt.group_rank == 0:
            control = rt.serve()
            store.set("leader", f"{rt.leader_address()}:{control.port}")
        else:
            rt.connect(store.get("leader").decode())
    else:
        # The user formed the group before neps_bcast.run: hand the address over on it.
        address = None
        if rt.group_rank == 0:
            address = f"{rt.leader_address()}:{rt.serve().port}"
        gloo = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
        box: list[Any] = [address]
        dist.broadcast_object_list(box, src=0, group=gloo)
        if gloo is not None:
            dist.destroy_process_group(gloo)
        if rt.group_rank != 0:
            rt.connect(str(box[0]))
    rt.ensure_channel()
