"""Externally launched ranks meet before anything else happens.

torchrun, ``srun`` and plain ``RANK``/``WORLD_SIZE`` launches start every rank at once.
Before the DDP group is formed (``init_process_group`` blocks until every rank comes,
for 30 minutes by default) the ranks meet on the launcher's rendezvous store with a
bound of their own:

1. each rank checks in;
2. a rank that does not come within ``NEPS_BCAST_JOIN_TIMEOUT_S`` is named, on every
   rank that did come.

Nothing else is read from that store: anyone who reaches its port can write it. Once
the group exists, the ranks compare a fingerprint of their ``neps_bcast.run``
arguments over it (``startup/handshake.py`` gathers them, ``compare`` raises the same
error on every rank, listing each rank's value).

The store is the one an ``env://`` ``init_process_group`` then uses: torchrun's agent
store when torchrun says to reuse it (``TORCHELASTIC_USE_AGENT_STORE=True``), otherwise
a ``TCPStore`` that rank 0 serves at ``MASTER_ADDR:MASTER_PORT``, as torch's ``env://``
does, and as torch does it ``multi_tenant``: a group the user's code forms there later
shares this server (a second server on the port would fail with "address in use").
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import socket
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from neps_bcast.compat import torch as tc
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.log import role_tag
from neps_bcast.startup.launch import Launch

FINGERPRINT_KWARGS = (
    "root_directory",
    "optimizer",
    "total_evaluations_to_spend",
    "total_cost_to_spend",
    "overwrite_root_directory",
)
"""The ``neps.run`` arguments that must agree on every rank (plus the space and function)."""

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _describe(value: Any) -> str:
    """A text that is equal on two ranks exactly when they were given the same thing."""
    if value is None or isinstance(value, str | int | float | bool):
        return repr(value)
    get_attrs = getattr(value, "get_attrs", None)
    if callable(get_attrs):  # a NePS PipelineSpace: its parameters, not its identity
        parts = []
        for name, param in sorted(get_attrs().items()):
            fields = getattr(param, "__dict__", {})
            inner = ", ".join(f"{k}={_describe(v)}" for k, v in sorted(fields.items()))
            parts.append(f"{name}={type(param).__qualname__}({inner})")
        return f"{type(value).__qualname__}({', '.join(parts)})"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}:{value.__qualname__}"
    if isinstance(value, list | tuple):
        return f"{type(value).__name__}({', '.join(_describe(v) for v in value)})"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(f"{k!r}: {_describe(v)}" for k, v in sorted(value.items(), key=str))
            + "}"
        )
    return _ADDRESS.sub("", repr(value))


def fingerprint(
    evaluate_pipeline: Any, pipeline_space: Any, kwargs: dict[str, Any]
) -> dict[str, str]:
    """What every rank of one group must agree on, as comparable text."""
    found = {
        "evaluate_pipeline": _describe(evaluate_pipeline),
        "pipeline_space": _describe(pipeline_space),
    }
    for name in FINGERPRINT_KWARGS:
        if name in kwargs:
            found[name] = _describe(kwargs[name])
    return {name: _compact(text) for name, text in found.items()}


LONGEST_DESCRIPTION = 400
"""Longer descriptions travel as their start and a digest (a space with 1 MB choices
must not make a 1 MB start-up record)."""


def _compact(text: str) -> str:
    """``text``, or its start and a digest: equal exactly when the texts are."""
    if len(text) <= LONGEST_DESCRIPTION:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:32]
    return f"{text[:120]}... ({len(text)} characters, sha256 {digest})"


def rendezvous_store(
    launch: Launch, timeout: datetime.timedelta, agent_serves: bool | None = None
) -> tc.Store:
    """The store every rank of this launch can reach (see the module docstring).
    ``agent_serves``: the launcher's agent serves it (None: as torchrun says, by
    ``TORCHELASTIC_USE_AGENT_STORE``; a pool's trial passes True)."""
    assert launch.main_address is not None
    assert launch.main_port is not None
    use_agent_store = (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        if agent_serves is None
        else agent_serves
    )
    is_server = launch.global_rank == 0 and not use_agent_store
    try:
        return tc.TCPStore(
            launch.main_address,
            launch.main_port,
            is_master=is_server,
            wait_for_workers=False,
            timeout=timeout,
            multi_tenant=True,
        )
    except Exception as exc:
        seconds = timeout.total_seconds()
        if is_server:
            what = (
                f"cannot serve the rendezvous store at {launch.main_address}:"
                f"{launch.main_port}: {type(exc).__name__}: {exc}."
            )
            hint = (
                "pick a free MASTER_PORT (another job may be using this one) and an"
                " address of this node for MASTER_ADDR."
            )
        else:
            owner = "torchrun's agent" if use_agent_store else "rank 0"
            what = (
                f"cannot reach the rendezvous store of {owner} at {launch.main_address}:"
                f"{launch.main_port} within {seconds:.0f} s; expected {owner} to serve it,"
                f" observed {type(exc).__name__}: {exc}."
            )
            hint = (
                "check that rank 0 was started and calls neps_bcast.run, and that"
                " MASTER_ADDR/MASTER_PORT name rank 0's node and a port it can open"
                f" (bound: NEPS_BCAST_JOIN_TIMEOUT_S={seconds:.0f})."
            )
        raise LaunchError(format_message(_tag(launch), what, hint)) from exc


@dataclass(frozen=True)
class Meeting:
    """What the ranks learned when they met."""

    prefix: str
    """Key prefix of this launch attempt on the rendezvous store."""


def meet(launch: Launch, store: tc.Store, timeout: datetime.timedelta) -> Meeting:
    """Check in and wait (bounded) for every rank; reads nothing back."""
    attempt = "/".join(
        (
            os.environ.get("TORCHELASTIC_RUN_ID", "none"),
            os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
        )
    )
    prefix = f"neps_bcast/meet/{attempt}"
    base = tc.PrefixStore(prefix, store)
    me = {"pid": os.getpid(), "host": socket.gethostname()}
    base.set(f"in/{launch.global_rank}", json.dumps(me))
    _wait_all(
        launch,
        base,
        "in",
        timeout,
        failure="did not call neps_bcast.run",
        hint="call neps_bcast.run on every rank (the same script and arguments"
        " everywhere), before any other torch.distributed call.",
    )
    return Meeting(prefix)


def compare(tag: str, raw: list[dict[str, Any]]) -> None:
    """Every rank's fingerprint (by rank, gathered over the group) must be the same;
    the error lists each rank's value of every name that differs."""
    world = len(raw)
    names = sorted({name for r in raw for name in r} - {"pid", "host", "challenge"})
    differ = [name for name in names if len({r.get(name, "<missing>") for r in raw}) > 1]
    if differ:
        lines = "; ".join(
            f"{name}: "
            + ", ".join(f"rank {r}: {raw[r].get(name, '<missing>')}" for r in range(world))
            for name in differ
        )
        raise LaunchError(
            format_message(
                tag,
                f"the ranks called neps_bcast.run with different arguments; expected the"
                f" same {', '.join(differ)} on all {world} ranks, observed {lines}.",
                "every rank must run the same script with the same neps_bcast.run"
                " arguments (a relative root_directory is fine: only the leader uses it);"
                " check per-rank environment variables and command lines.",
            )
        )


def _wait_all(
    launch: Launch,
    base: tc.Store,
    what: str,
    timeout: datetime.timedelta,
    *,
    failure: str,
    hint: str,
) -> None:
    assert launch.world_size is not None
    keys = [f"{what}/{r}" for r in range(launch.world_size)]
    try:
        base.wait(keys, timeout)  # blocks in the store server: no polling
        return
    except dist.DistStoreError as exc:
        if "timeout" not in str(exc).lower():
            raise _lost(launch, exc) from exc
    except dist.DistNetworkError as exc:
        raise _lost(launch, exc) from exc
    missing = [r for r in range(launch.world_size) if not base.check([keys[r]])]
    came = [r for r in range(launch.world_size) if r not in missing]
    raise LaunchError(
        format_message(
            _tag(launch),
            f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of"
            f" {launch.world_size} {failure} within {timeout.total_seconds():.0f} s;"
            f" expected ranks 0..{launch.world_size - 1}, observed only"
            f" {', '.join(map(str, came))}.",
            f"{hint} The bound is NEPS_BCAST_JOIN_TIMEOUT_S.",
        )
    )


def _lost(launch: Launch, exc: BaseException) -> LaunchError:
    return LaunchError(
        format_message(
            _tag(launch),
            f"lost the rendezvous store during the startup check: {type(exc).__name__}: {exc}.",
            "rank 0 (or torchrun's agent) exited; see its log for the first error.",
        )
    )


def _tag(launch: Launch) -> str:
    return role_tag(launch.global_rank, launch.world_size)
