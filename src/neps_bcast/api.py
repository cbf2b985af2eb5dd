"""``neps_bcast.run``: the one call every rank makes."""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from neps_bcast import leader
from neps_bcast.errors import LaunchError, NepsBcastError, format_message
from neps_bcast.follower import follow
from neps_bcast.launch import Launch, detect
from neps_bcast.runtime import Runtime

ENV_BACKEND = "NEPS_BCAST_BACKEND"


def run(evaluate_pipeline: Callable[..., Any] | str, pipeline_space: Any = None,
        **kwargs: Any) -> None:
    """Call on every rank with exactly the arguments of ``neps.run``.

    The leader (rank 0) runs ``neps.run``; every follower evaluates the trials its
    leader hands it and returns when the leader's ``neps.run`` returns. A single
    process (no DDP) behaves exactly like ``neps.run``.
    """
    launch = detect()
    fn = _resolve(evaluate_pipeline, launch)
    rt = Runtime(launch)
    with rt.activated():
        if launch.kind == "single":
            _lead(rt, fn, evaluate_pipeline, pipeline_space, kwargs)
        elif launch.kind == "lightning_child":
            rt.log(logging.INFO, "Lightning child of the leader at %s", launch.leader_store)
            follow(rt, fn, rt.first_contact())
        else:
            _start_external(rt)
            try:
                if rt.group_rank == 0:
                    _lead(rt, fn, evaluate_pipeline, pipeline_space, kwargs)
                else:
                    follow(rt, fn, None)
            finally:
                if rt.owns_group and dist.is_initialized():
                    dist.destroy_process_group()


def _lead(rt: Runtime, fn: Callable[..., Any], original: Callable[..., Any] | str,
          pipeline_space: Any, kwargs: dict[str, Any]) -> None:
    import neps

    wrapped = leader.wrap(rt, fn)
    try:
        neps.run(wrapped, pipeline_space, **kwargs)
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


def _backend(launch: Launch) -> str:
    explicit = os.environ.get(ENV_BACKEND)
    if explicit:
        return explicit
    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
        return "nccl"
    return "gloo"


def _start_external(rt: Runtime) -> None:
    """All ranks started together: form the group, then meet on the control channel."""
    launch = rt.launch
    if not dist.is_initialized():
        if launch.main_address is None or launch.main_port is None:
            raise LaunchError(
                format_message(rt.tag, f"{launch.launcher} launch without a rendezvous address.",
                               "set MASTER_ADDR and MASTER_PORT for every rank.")
            )
        # env:// (not tcp://) so that torchrun's agent store is used when it exists.
        os.environ.setdefault("MASTER_ADDR", launch.main_address)
        os.environ.setdefault("MASTER_PORT", str(launch.main_port))
        dist.init_process_group(_backend(launch), init_method="env://",
                                rank=launch.global_rank, world_size=launch.world_size)
        rt.owns_group = True
    rt.observe_group()
    address = None
    if rt.group_rank == 0:
        store = rt.serve()
        address = f"{rt.leader_address()}:{store.port}"
    gloo = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    box: list[Any] = [address]
    dist.broadcast_object_list(box, src=0, group=gloo)
    if gloo is not None:
        dist.destroy_process_group(gloo)
    if rt.group_rank != 0:
        rt.connect(str(box[0]))
    rt.ensure_channel()
