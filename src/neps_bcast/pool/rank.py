"""A pool's warm rank: one device for life, a new DDP group for every trial it is given.

The rank imports the user's script once, then waits (blocked on the launcher's socket,
no CPU) for an order: "rank r of k for trial T, the rendezvous store at port P". It then
looks exactly like a rank torchrun just started (torchrun's variables: ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` = r, ``TORCHELASTIC_USE_AGENT_STORE=True`` with the store
the trial's agent serves), so Lightning, Fabric and PyTorch's tutorial code all form
their group as under torchrun, and neps_bcast's trial protocol is today's
(``follower.run_follower``). Its start is shorter than an external launch's: no meeting
and no handshake, the trial's secret derived from the pool's key and the order
(``Runtime.start_in_pool``). The trial's rank 0
takes the trial from its agent's order (sealed with the pool's key), hands it to its
group, evaluates it and sends the outcome back.

Between two trials (measured, docs/architecture.md): the default group is destroyed
(Lightning reuses one it finds, with the old members), the environment is put back as
the rank started (``seed_everything`` leaves ``PL_GLOBAL_SEED``, which a later Trainer
would re-seed from), and, once the rank is free, what the trial left is freed
(``ddp.teardown.free_what_trials_left``: its model and optimizer state are cyclic
garbage). A rank whose trial did not end cleanly is told to exit by the launcher, which
starts a fresh one. Before its first hello a rank proves its device (``prove_device``):
a device whose rank keeps failing there is retired by the launcher.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from neps_bcast import faults
from neps_bcast.config import Settings
from neps_bcast.ddp.group import names_for_a_new_store
from neps_bcast.ddp.teardown import free_what_trials_left
from neps_bcast.errors import ErrorRecord, FollowerLostError, NepsBcastError, format_message
from neps_bcast.log import logger
from neps_bcast.pool import beats, opening, wire
from neps_bcast.recovery.signals import preemption, stop_signals
from neps_bcast.runtime import Runtime
from neps_bcast.startup.launch import detect
from neps_bcast.transport.auth import Signer, new_secret
from neps_bcast.transport.messages import TrialMessage, decode
from neps_bcast.trial.run import evaluate_once

TORCHRUN_VARIABLES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)


class Recycled(SystemExit):
    """The launcher told this rank to exit (its trial did not end cleanly): the process
    ends here, without running the script's code after ``neps_bcast.run``."""


def trial_environment(order: dict[str, Any]) -> dict[str, str]:
    """torchrun's variables for rank ``order["rank"]`` of a group of ``order["world"]``
    on this node, meeting on the agent's store at ``order["port"]``."""
    rank, world = str(order["rank"]), str(order["world"])
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(order["port"]),
        "RANK": rank,
        "WORLD_SIZE": world,
        "LOCAL_RANK": rank,
        "LOCAL_WORLD_SIZE": world,
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": world,
        "ROLE_NAME": "default",
        "NODE_RANK": "0",
        "TORCHELASTIC_RUN_ID": f"neps_bcast-pool-{order['order']}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


Follow = Callable[..., None]
"""How a rank other than the trial's rank 0 takes part: the follower's role
(``follower.run_follower``), handed in by ``api`` so that the pool sits beneath the
roles it runs."""


def serve(fn: Callable[..., Any], settings: Settings, follow: Follow) -> None:
    """A warm rank's whole life in ``neps_bcast.run``: trials until the launcher says
    the search is over (returns) or that this rank is recycled (``Recycled``)."""
    environ = os.environ
    index = int(environ[wire.ENV_POOL_INDEX])
    key = wire.take_key(environ)
    # Warm before the launcher counts this device free: an external launch's start
    # imports what a trial needs (Lightning is not among it: detection reads the
    # launchers' variables itself).
    detect()
    tag = f"[neps_bcast pool rank on device {index}]"
    prove_device(index)
    freed = free_what_trials_left()  # the first: the heap of the imports frozen
    logger.info("%s ready (%d objects frozen)", tag, freed.froze)
    conn = opening.connect(environ[wire.ENV_POOL], key, "rank", index)
    launcher_pid, _ = opening.peer_credentials(conn.sock)
    verdict = beats.end_silent_launcher(tag)
    member_beats = beats.of_member(
        environ[wire.ENV_POOL], "rank", index, launcher_pid, settings.peer_timeout_s, verdict
    )
    started_with = dict(os.environ)
    try:
        while True:
            order = conn.receive()
            if order.get("op") == "exit":
                logger.info("%s leaving: %s", tag, order.get("why"))
                if order.get("why") != "the search is over":
                    raise Recycled(0)
                return
            if order.get("op") != "order":
                continue
            clean = False
            try:
                os.environ.update(trial_environment(order))
                faults.point("order", trial_id=str(order["trial"]), group_rank=int(order["rank"]))
                clean = _run_order(fn, settings, order, conn, key, follow)
                faults.point("done")
            finally:
                if dist.is_initialized():
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group()
                os.environ.clear()
                os.environ.update(started_with)
                with contextlib.suppress(wire.WireError):
                    conn.send({"op": "free", "order": order["order"], "clean": clean})
            # Free, waiting for its next order: the next trial's clean start, off its
            # critical path (``ddp.teardown.free_what_trials_left``).
            freed = free_what_trials_left()
            logger.info(
                "%s freed what the trial left: %d objects collected in %.1f ms (CPU %.1f ms)",
                tag,
                freed.collected,
                1e3 * freed.wall_s,
                1e3 * freed.cpu_s,
            )
    finally:
        member_beats.leave()
        conn.close()


def prove_device(index: int) -> None:
    """Before this rank says hello (and so counts as free): make device ``index`` this
    rank's device for life and allocate a little on it, so that a broken device fails
    here, where the launcher counts failed starts per device and retires one that keeps
    failing (``pool.launcher.DEVICE_START_FAILURES``), instead of failing every trial
    placed on it. On a machine without CUDA there is nothing to prove; the fault point
    ``device`` is reached all the same."""
    faults.point("device", device=index)
    if torch.cuda.is_available():
        torch.cuda.set_device(index)
        torch.ones(1, device="cuda").add_(1)
        torch.cuda.synchronize()


def on_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (in dicts, lists, tuples) moved to the CPU: a
    result holding CUDA tensors (``trainer.callback_metrics`` in an ``info_dict``)
    would make the agent, which has no GPU, create a CUDA context to unpickle it."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        moved = copy.copy(value)  # its own type (a defaultdict keeps its factory)
        for k, v in value.items():
            moved[k] = on_cpu(v)
        return moved
    if isinstance(value, list):
        return [on_cpu(v) for v in value]
    if isinstance(value, tuple):
        items = [on_cpu(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _run_order(
    fn: Callable[..., Any],
    settings: Settings,
    order: dict[str, Any],
    conn: wire.Conn,
    key: str,
    follow: Follow,
) -> bool:
    """This rank's part of one trial; True when it ended cleanly here."""
    names_for_a_new_store()
    # This rank's part, from the order itself; the same variables are in the process's
    # environment only for the user's code (init_process_group, Lightning, Fabric).
    launch = detect(trial_environment(order))
    rt = Runtime(launch, settings, Signer(new_secret()))
    rt.devices = tuple(int(d) for d in order["devices"])
    with rt.activated():
        if launch.kind == "external":
            rt.start_in_pool(
                wire.derive(key, "trial secret", str(order["order"])), str(order["order"])
            )
        try:
            if rt.group_rank == 0:
                return _relay(rt, fn, order, conn, key)
            follow(rt, fn, first_contact=False)
            return True
        finally:
            rt.launcher_store = None


def _relay(
    rt: Runtime, fn: Callable[..., Any], order: dict[str, Any], conn: wire.Conn, key: str
) -> bool:
    """The trial's rank 0: the agent's trial to the group, evaluated, its outcome back."""
    name = str(order["order"])
    message = decode(wire.unseal(key, "trial", name, order["payload"]), tag=rt.tag)
    if not isinstance(message, TrialMessage):
        raise NepsBcastError(f"{rt.tag} the pool's order did not carry a trial")
    with stop_signals():
        rt.seq += 1
        message = dataclasses.replace(message, seq=rt.seq, group_generation=rt.next_generation())

        def hand_over() -> None:
            rt.send(message)
            rt.log(logging.INFO, "trial %s handed to the group", message.trial_id)

        try:
            outcome = evaluate_once(rt, fn, message, hand_over)
        except FollowerLostError as exc:
            _answer(conn, name, {"lost": str(exc)})
            rt.close()
            return False
        except BaseException as exc:
            stop = preemption(exc)
            how = stop.how if stop is not None else f"{type(exc).__name__}: {exc}"
            _answer(conn, name, {"interrupted": how})
            with contextlib.suppress(NepsBcastError):
                rt.shutdown(f"rank 0 stopped: {how}")
            raise
        answer: dict[str, Any] = {"clean": not outcome.failures}
        if outcome.failures:
            answer["failures"] = [dataclasses.asdict(f) for f in outcome.failures]
        else:
            try:
                answer["result"] = sealed_result(
                    key, name, outcome.result, message.trial_id, rt.tag
                )
            except NepsBcastError as exc:  # the trial crashed with it; the ranks are fine
                failure = ErrorRecord.from_exception(0, exc, pid=os.getpid())
                answer["failures"] = [dataclasses.asdict(failure)]
        _answer(conn, name, answer)
        try:
            rt.shutdown(f"trial {message.trial_id} is over")
        except NepsBcastError as exc:  # a peer lost after the outcome: recycled, not raised
            rt.log(logging.WARNING, "the trial's group ended badly: %s", exc)
            return False
        return not outcome.failures


def sealed_result(key: str, order: str, result: Any, trial_id: str, tag: str) -> str:
    """The trial's result for its agent (on the CPU, pickled, sealed), or
    ``NepsBcastError`` naming why it cannot go: it does not pickle, or it is larger than
    the pool relays (``wire.MAX_PAYLOAD``). The trial is then recorded crashed with that
    message, not as a lost rank."""
    hint = (
        "return numbers (a loss, a dict of metrics) and save tensors or models under"
        " pipeline_directory, returning their path if you need it"
    )
    try:
        data = pickle.dumps(on_cpu(result), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise NepsBcastError(
            format_message(
                tag,
                f"trial {trial_id}'s result cannot be sent to its agent: pickling it raised"
                f" {type(exc).__name__}: {exc}.",
                hint,
            )
        ) from exc
    if len(data) > wire.MAX_PAYLOAD:
        raise NepsBcastError(
            format_message(
                tag,
                f"trial {trial_id}'s result is {len(data) / 2**20:.0f} MiB pickled; a pool"
                f" relays at most {wire.MAX_PAYLOAD / 2**20:.0f} MiB to the agent.",
                hint,
            )
        )
    return wire.seal(key, "result", order, data)


def _answer(conn: wire.Conn, order: str, record: dict[str, Any]) -> None:
    with contextlib.suppress(wire.WireError):
        conn.send({"op": "outcome", "order": order, **record})
