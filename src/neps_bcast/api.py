"""``neps_bcast.run``: the one call every rank makes."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from neps_bcast import leader
from neps_bcast.compat import lightning as lightning_compat
from neps_bcast.compat import torch as torch_compat
from neps_bcast.config import INTERNAL, Settings
from neps_bcast.ddp.teardown import free_trials_at_exit
from neps_bcast.errors import NepsBcastError, format_message
from neps_bcast.follower import run_follower
from neps_bcast.log import role_tag
from neps_bcast.runtime import Runtime, active
from neps_bcast.startup import external
from neps_bcast.startup.launch import Launch, detect
from neps_bcast.startup.rendezvous import fingerprint
from neps_bcast.transport.auth import Signer, new_nonce, new_secret, secret_from_env


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
    torch_compat.keep_groups_alive()  # no trial's group is freed inside the user's code
    atexit.unregister(free_trials_at_exit)  # once, however often run is called
    atexit.register(free_trials_at_exit)
    if launch.kind == "single":
        lightning_compat.before_children_start(_prepare_children)
    with rt.activated():
        if launch.kind == "single":
            leader.lead(rt, fn, pipeline_space, kwargs)
        elif launch.kind == "lightning_child":
            rt.log(logging.INFO, "Lightning child of the leader at %s", launch.leader_store)
            run_follower(rt, fn, first_contact=True)
        else:
            started = external.start(
                launch,
                settings,
                rt.link,
                rt.signer,
                fingerprint(evaluate_pipeline, pipeline_space, kwargs),
            )
            rt.group.keep = started.users_group
            rt.launcher_store = started.launcher_store
            rt.observe_group()
            rt.ensure_channel()
            try:
                if rt.group_rank == 0:
                    leader.lead(rt, fn, pipeline_space, kwargs)
                else:
                    run_follower(rt, fn, first_contact=False)
            finally:
                if rt.owns_group and dist.is_initialized():
                    dist.destroy_process_group()
                rt.launcher_store = None


def _signer(launch: Launch) -> Signer:
    """The search's secret and identity as far as this process knows them at start
    (see ``auth``): an external launch agrees on both when its ranks meet."""
    if launch.kind == "lightning_child":
        assert launch.child_secret is not None  # detect() refuses a child without one
        for name in INTERNAL:  # the user's own subprocesses must not inherit them
            os.environ.pop(name, None)
        key, _, search = launch.child_secret.partition(".")
        return Signer(bytes.fromhex(key), bytes.fromhex(search))
    if launch.kind == "external":
        return Signer(new_secret())
    tag = role_tag(launch.global_rank, launch.world_size)
    return Signer(secret_from_env(tag=tag) or new_secret(), new_nonce())


def _prepare_children() -> None:
    rt = active()
    if rt is not None:
        rt.prepare_children()


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
