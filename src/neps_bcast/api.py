"""``neps_bcast.run``: the one call every rank makes."""

from __future__ import annotations

import atexit
import importlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from neps_bcast.compat import lightning as lightning_compat
from neps_bcast.compat import torch as torch_compat
from neps_bcast.config import INTERNAL, Settings
from neps_bcast.ddp.teardown import free_trials_at_exit
from neps_bcast.errors import NepsBcastError, format_message
from neps_bcast.log import role_tag
from neps_bcast.pool import agent as pool_agent
from neps_bcast.pool import rank as pool_rank
from neps_bcast.pool import wire
from neps_bcast.roles import leader
from neps_bcast.roles.follower import run_follower
from neps_bcast.runtime import Runtime, active
from neps_bcast.startup.launch import Launch, detect, pool_member
from neps_bcast.startup.rendezvous import fingerprint
from neps_bcast.transport.auth import Signer, new_nonce, new_secret, secret_from_env


def run(
    evaluate_pipeline: Callable[..., Any] | str,
    pipeline_space: Any = None,
    *,
    ranks_per_trial: Callable[[dict[str, Any]], int] | None = None,
    **kwargs: Any,
) -> None:
    """Call on every rank with exactly the arguments of ``neps.run``.

    The leader (rank 0) runs ``neps.run``; every follower evaluates the trials its
    leader hands it and returns when the leader's ``neps.run`` returns. A single
    process (no DDP) behaves exactly like ``neps.run``.

    ``ranks_per_trial``: under ``neps-bcast launch --pool D`` only, how many ranks
    (devices) a trial gets, from its config (fidelity included): an int in 1..D.
    """
    settings = Settings.from_env()
    role = os.environ.get(wire.ENV_POOL_ROLE)
    _check_ranks_per_trial(ranks_per_trial, role)
    if role is not None:
        _run_in_pool(role, evaluate_pipeline, pipeline_space, kwargs, ranks_per_trial, settings)
        return
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
            rt.start_external(fingerprint(evaluate_pipeline, pipeline_space, kwargs))
            try:
                if rt.group_rank == 0:
                    leader.lead(rt, fn, pipeline_space, kwargs)
                else:
                    run_follower(rt, fn, first_contact=False)
            finally:
                if rt.owns_group and dist.is_initialized():
                    dist.destroy_process_group()
                rt.launcher_store = None


def _check_ranks_per_trial(ranks_per_trial: object, role: str | None) -> None:
    """Up front, on every process: a pool needs the function, only a pool takes it."""
    tag = "neps_bcast"
    if ranks_per_trial is not None and not callable(ranks_per_trial):
        raise NepsBcastError(
            format_message(
                tag,
                f"ranks_per_trial must be a function of the config, got {ranks_per_trial!r}.",
                "pass e.g. ranks_per_trial=lambda config: 1 if config['epochs'] <= 3 else 4.",
            )
        )
    if ranks_per_trial is not None and role is None:
        raise NepsBcastError(
            format_message(
                tag,
                "ranks_per_trial was given, but this process is not part of a pool: every"
                " trial of a torchrun, srun or Lightning launch has that launch's size.",
                "launch with neps-bcast launch --pool D SCRIPT (D devices, trials of 1..D"
                " ranks each), or drop ranks_per_trial.",
            )
        )
    if role == "agent" and ranks_per_trial is None:
        raise NepsBcastError(
            format_message(
                tag,
                "neps-bcast launch --pool started this search, but neps_bcast.run was not"
                " given ranks_per_trial: the pool cannot know how many ranks a trial gets.",
                "pass ranks_per_trial=lambda config: ... (an int in 1..D for every config),"
                " e.g. ranks_per_trial=lambda config: 1.",
            )
        )


def _run_in_pool(
    role: str,
    evaluate_pipeline: Callable[..., Any] | str,
    pipeline_space: Any,
    kwargs: dict[str, Any],
    ranks_per_trial: Callable[[dict[str, Any]], int] | None,
    settings: Settings,
) -> None:
    """``neps-bcast launch --pool``: an agent (a NePS worker without a device: the
    leader's loop, each trial handed to the ranks the launcher gives it,
    ``pool.agent.Remote``) or a warm rank (``pool.rank.serve``: trial after trial, rank
    0 of each leading it as a leader does, the others following)."""
    launch = pool_member()
    fn = _resolve(evaluate_pipeline, launch)
    lightning_compat.sigterm_without_broadcast(lambda: active() is not None)
    torch_compat.keep_groups_alive()
    atexit.unregister(free_trials_at_exit)
    atexit.register(free_trials_at_exit)
    if role != "agent":
        pool_rank.serve(fn, settings, follow=run_follower)
        return
    assert ranks_per_trial is not None  # checked up front
    remote = pool_agent.connect(os.environ, ranks_per_trial, settings.peer_timeout_s)
    rt = Runtime(launch, settings, Signer(new_secret()))
    pool_agent.check_up_front(ranks_per_trial, pipeline_space, remote.size, rt.tag)
    if kwargs.get("overwrite_root_directory"):
        kwargs = {**kwargs, "overwrite_root_directory": remote.may_overwrite()}
    with rt.activated():
        try:
            leader.lead(rt, fn, pipeline_space, kwargs, run_trial=remote)
            remote.root_ready()  # a search that ended without a trial
        finally:
            remote.close()


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
