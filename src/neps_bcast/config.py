"""Every ``NEPS_BCAST_*`` environment variable, read at call time into one frozen object.

Why one module: a setting read at import time cannot be changed by a test or a user
after ``import neps_bcast``, and a name spelled in two modules drifts. Each variable is
listed once in ``VARIABLES`` (name, kind, default, meaning), parsed and checked here
only; docs/configuration.md is generated from this list.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from neps_bcast.errors import SettingsError, format_message

ENV_LEADER = "NEPS_BCAST_LEADER"
"""Internal: ``host:port`` of the leader's store, set by the leader for Lightning's children."""
ENV_FIRST_SEQ = "NEPS_BCAST_FIRST_SEQ"
"""Internal: sequence number of the trial a Lightning child evaluates first."""
ENV_FIRST_TRIAL = "NEPS_BCAST_FIRST_TRIAL"
"""Internal: the private file holding the trial a Lightning child evaluates first."""
ENV_CHILD_SECRET = "NEPS_BCAST_CHILD_SECRET"  # noqa: S105 - a variable name, not a secret
"""Internal: the search's secret and identity (``<key hex>.<search hex>``), for
Lightning's children only (removed once they joined)."""
INTERNAL = (ENV_LEADER, ENV_FIRST_SEQ, ENV_FIRST_TRIAL, ENV_CHILD_SECRET)


Kind = Literal["seconds", "count", "text"]


@dataclass(frozen=True)
class Variable:
    name: str
    field: str
    default: str | None
    meaning: str
    kind: Kind = "seconds"


VARIABLES = (
    Variable(
        "NEPS_BCAST_JOIN_TIMEOUT_S",
        "join_timeout_s",
        "300",
        "how long ranks wait for each other to start (and to reach the channel)",
    ),
    Variable(
        "NEPS_BCAST_WAIT_TIMEOUT_S",
        "wait_timeout_s",
        str(7 * 24 * 3600),
        "last-resort bound on one control-channel wait while every peer is alive",
    ),
    Variable(
        "NEPS_BCAST_CONNECT_TIMEOUT_S",
        "connect_timeout_s",
        "30",
        "bound on reaching the leader's store once its address is known",
    ),
    Variable(
        "NEPS_BCAST_ROOT_LOCK_TIMEOUT_S",
        "root_lock_timeout_s",
        "600",
        "bound on waiting for another worker to finish creating the NePS root",
    ),
    Variable(
        "NEPS_BCAST_BACKEND",
        "backend",
        None,
        "backend of the group neps_bcast forms for external launches when the user's"
        " code has formed none by session() (default: nccl with GPUs, else gloo)",
        "text",
    ),
    Variable(
        "NEPS_BCAST_LEADER_ADDR",
        "leader_addr",
        None,
        "address other nodes use to reach the leader (default: the address that routes"
        " to MASTER_ADDR)",
        "text",
    ),
    Variable(
        "NEPS_BCAST_PEER_TIMEOUT_S",
        "peer_timeout_s",
        "30",
        "how long a rank of a trial's group, or a process of a pool (its launcher, an"
        " agent, a rank), may stay silent (frozen, hung, its node lost or cut off: no beat,"
        " no answer) before its peers treat it as lost; sized for the longest stall of a"
        " healthy rank (docs/failures.md)",
    ),
    Variable(
        "NEPS_BCAST_TRIAL_TIME_LIMIT_S",
        "trial_time_limit_s",
        None,
        "a trial still running this long after its leader took it is ended on every rank"
        " and goes back to pending (a hang where every rank is alive, e.g. a deadlock in"
        " the user's code; retried up to NEPS_BCAST_MAX_RETRIES); unset: no limit",
    ),
    Variable(
        "NEPS_BCAST_HEARTBEAT_S",
        "heartbeat_s",
        "30",
        "how often a leader renews the lease of the trial it evaluates (one small write);"
        " must be less than a third of NEPS_BCAST_LEASE_GRACE_S",
    ),
    Variable(
        "NEPS_BCAST_LEASE_GRACE_S",
        "lease_grace_s",
        "300",
        "how old a lease's heartbeat must be before another host takes the trial over",
    ),
    Variable(
        "NEPS_BCAST_MAX_RETRIES",
        "max_retries",
        "3",
        "how often a trial interrupted by an infrastructure failure goes back to pending"
        " before it is recorded crashed (0: never)",
        "count",
    ),
)


@dataclass(frozen=True)
class Settings:
    join_timeout_s: float = 300.0
    wait_timeout_s: float = 7 * 24 * 3600.0
    connect_timeout_s: float = 30.0
    root_lock_timeout_s: float = 600.0
    backend: str | None = None
    leader_addr: str | None = None
    peer_timeout_s: float = 30.0
    trial_time_limit_s: float | None = None
    heartbeat_s: float = 30.0
    lease_grace_s: float = 300.0
    max_retries: int = 3

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Every setting from the environment, each checked; ``SettingsError`` names the
        first bad one and its fix."""
        env = os.environ if environ is None else environ
        values = {var.field: _parse(var, env.get(var.name) or var.default) for var in VARIABLES}
        settings = cls(**values)  # type: ignore[arg-type]  # each value has its field's type
        settings.check()
        return settings

    def check(self) -> None:
        """The rules between settings (each value alone is checked when it is read)."""
        if not self.heartbeat_s < self.lease_grace_s / 3:
            raise SettingsError(
                format_message(
                    "neps_bcast settings",
                    f"NEPS_BCAST_HEARTBEAT_S={self.heartbeat_s:g} is not less than a third of"
                    f" NEPS_BCAST_LEASE_GRACE_S={self.lease_grace_s:g}: a live trial on"
                    " another host would look dead between two heartbeats.",
                    "make the heartbeat shorter or the grace longer, e.g."
                    f" NEPS_BCAST_HEARTBEAT_S={self.lease_grace_s / 10:g}.",
                )
            )


def _parse(var: Variable, raw: str | None) -> float | int | str | None:
    if raw is None or var.kind == "text":
        return raw
    if var.kind == "count":
        try:
            count = int(raw)
        except ValueError:
            count = -1
        if count < 0:
            raise SettingsError(
                format_message(
                    "neps_bcast settings",
                    f"{var.name}={raw!r} is not a whole number >= 0.",
                    f"unset {var.name} (default {var.default}) or set it to a count, e.g. 5.",
                )
            )
        return count
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise SettingsError(
            format_message(
                "neps_bcast settings",
                f"{var.name}={raw!r} is not a positive number of seconds.",
                f"unset {var.name} (default {var.default}) or set it to seconds, e.g. 60.",
            )
        )
    return seconds
