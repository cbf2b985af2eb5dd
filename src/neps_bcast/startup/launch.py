"""Launch detection: how this process was started and what that makes it.

Three kinds of launch, in the order they are checked:

1. ``lightning_child``: a process that Lightning's subprocess script launcher re-ran
   from the leader's script (``LOCAL_RANK >= 1`` plus the ``NEPS_BCAST_LEADER``
   variable our leader sets before it calls the user's function). Checked first: such a
   child inherits every variable of its leader, including a SLURM or torchrun parent's.
2. ``external``: every rank was started by a launcher (torchrun / torchelastic, SLURM
   ``srun``, or plain ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``).
   TorchElastic comes before SLURM because torchrun is often run inside a SLURM job:
   then the SLURM variables describe the job, not the ranks (Lightning orders its
   detection the same way). ``LAUNCHERS`` reads each launcher's variables, as
   Lightning's ``ClusterEnvironment`` classes and submitit's job environments do,
   without importing Lightning: a plain-DDP or pool rank never asked for it, and its
   import (about a second of CPU, most of it the Trainer that ``lightning/__init__``
   pulls in) was paid by every rank of every launch.
3. ``single``: anything else. This process is a leader; its function may still start
   a DDP group of its own (Lightning ``strategy="ddp"``, ``ddp_spawn``, ``mp.spawn``).

A pool's agent and warm ranks (``neps-bcast launch --pool``) are none of these: the
launcher names them (``pool``), and a warm rank's trial is then an external launch of
its own (``detect`` per trial).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from neps_bcast.config import ENV_CHILD_SECRET, ENV_FIRST_SEQ, ENV_FIRST_TRIAL, ENV_LEADER
from neps_bcast.errors import LaunchError, format_message

LaunchKind = Literal["single", "lightning_child", "external", "pool"]

IDENTITY = {
    "torchelastic": (
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
    ),
    "slurm": ("SLURM_JOB_ID", "SLURM_STEP_ID", "MASTER_ADDR", "MASTER_PORT", "SLURM_NTASKS"),
    "env": ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"),
}
"""The variables every rank of one external launch shares and no other launch has (a
run id, or the rendezvous address only one launch at a time can serve)."""
RANK_VARIABLE = {"torchelastic": "RANK", "slurm": "SLURM_PROCID", "env": "RANK"}
_LOOPBACK = ("127.", "localhost", "::1")


@dataclass(frozen=True)
class LauncherVariables:
    """Where one launcher puts a rank's place: variable names, first match wins."""

    world_size: str
    global_rank: str
    local_rank: str
    node_rank: tuple[str, ...]
    default_address: Callable[[dict[str, str]], str] = lambda env: "127.0.0.1"
    default_port: Callable[[dict[str, str]], int] = lambda env: DEFAULT_PORT


DEFAULT_PORT = 12910
"""Lightning's port when neither MASTER_PORT nor a SLURM job id gives one."""


def _slurm_root_node(env: dict[str, str]) -> str:
    """The first host of ``SLURM_NODELIST`` ('host[5-9],other' -> 'host5'), as Lightning's
    ``SLURMEnvironment.resolve_root_node_address`` reads it."""
    nodes = env.get("SLURM_NODELIST", "127.0.0.1")
    nodes = re.sub(r"\[(.*?)[,-].*\]", "\\1", nodes)  # the first node of every range
    nodes = re.sub(r"\[(.*?)\]", "\\1", nodes)  # a range of one number
    return nodes.split(" ")[0].split(",")[0]


def _slurm_port(env: dict[str, str]) -> int:
    """Lightning's SLURM default: 15000 + the job id's last four digits."""
    job_id = env.get("SLURM_JOB_ID", "")
    return int(job_id[-4:]) + 15000 if job_id[-4:].isdigit() else DEFAULT_PORT


LAUNCHERS = {
    "torchelastic": LauncherVariables("WORLD_SIZE", "RANK", "LOCAL_RANK", ("GROUP_RANK",)),
    "slurm": LauncherVariables(
        "SLURM_NTASKS",
        "SLURM_PROCID",
        "SLURM_LOCALID",
        ("SLURM_NODEID",),
        _slurm_root_node,
        _slurm_port,
    ),
    "env": LauncherVariables("WORLD_SIZE", "RANK", "LOCAL_RANK", ("NODE_RANK",)),
}
"""Each launcher's variables (the ones Lightning's TorchElastic, SLURM and Lightning
cluster environments read); ``tests/test_launch.py`` checks both agree."""


def _which_launcher(env: dict[str, str]) -> str:
    """TorchElastic (``TORCHELASTIC_RUN_ID``: ``torch.distributed.is_torchelastic_launched``),
    then SLURM (``SLURM_NTASKS``, unless the job is an interactive shell named 'bash' or
    'interactive'), then the four variables of a hand-made launch; "none" otherwise."""
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchelastic"
    if "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "slurm"
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return "env"
    return "none"


@dataclass(frozen=True)
class Launch:
    kind: LaunchKind
    launcher: str
    global_rank: int
    world_size: int | None
    local_rank: int
    node_rank: int
    main_address: str | None = None
    main_port: int | None = None
    leader_store: str | None = None
    first_seq: int | None = None
    first_trial: str | None = None
    child_secret: str | None = None
    identity: tuple[tuple[str, str], ...] = ()
    """External launches: ``IDENTITY``'s variables with this process's values."""
    rank_variable: str | None = None
    """External launches: the variable that holds a rank's global rank."""
    is_single_node: bool | None = None
    """What the launcher's own variables say: every rank on this node (True), several
    nodes (False), or nothing (None)."""


def _int_env(name: str, env: dict[str, str]) -> int:
    raw = env.get(name, "")
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(
            format_message(
                "neps_bcast launch",
                f"environment variable {name}={raw!r} is not an integer.",
                f"unset {name} or set it to this process's value as the launcher would.",
            )
        ) from None


def detect(environ: dict[str, str] | None = None) -> Launch:
    """Work out the kind of launch from the environment (``os.environ`` by default)."""
    env = dict(os.environ if environ is None else environ)
    local_rank = _int_env("LOCAL_RANK", env) if "LOCAL_RANK" in env else 0

    if ENV_LEADER in env and local_rank >= 1 and "TORCHELASTIC_RUN_ID" not in env:
        return _lightning_child(env, local_rank)

    launcher = _which_launcher(env)
    if launcher != "none":
        names = LAUNCHERS[launcher]
        world_size = _int_env(names.world_size, env)
        global_rank = _int_env(names.global_rank, env)
        cluster_local = _int_env(names.local_rank, env) if names.local_rank in env else 0
        node_rank = next((_int_env(name, env) for name in names.node_rank if env.get(name)), 0)
        address = env.get("MASTER_ADDR") or names.default_address(env)
        port = _int_env("MASTER_PORT", env) if "MASTER_PORT" in env else names.default_port(env)

    if launcher != "none" and world_size > 1:
        if not 0 <= global_rank < world_size:
            raise LaunchError(
                format_message(
                    "neps_bcast launch",
                    f"{launcher} launch gives rank {global_rank} outside a world of size"
                    f" {world_size}.",
                    "check the launcher's RANK/WORLD_SIZE (or SLURM_PROCID/SLURM_NTASKS).",
                )
            )
        return Launch(
            kind="external",
            launcher=launcher,
            global_rank=global_rank,
            world_size=world_size,
            local_rank=cluster_local,
            node_rank=node_rank,
            main_address=address,
            main_port=port,
            identity=tuple((name, env[name]) for name in IDENTITY[launcher] if name in env),
            rank_variable=RANK_VARIABLE[launcher],
            is_single_node=_single_node(launcher, env, address, world_size),
        )

    if local_rank >= 1:
        raise LaunchError(
            format_message(
                f"neps_bcast rank ?/? (LOCAL_RANK={local_rank})",
                f"this process has LOCAL_RANK={local_rank} but neither a launcher"
                f" (torchrun, srun, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) nor the"
                f" {ENV_LEADER} variable a neps_bcast leader gives Lightning's children."
                " Calling NePS here would start a second, unrelated NePS worker.",
                "call neps_bcast.run before any trainer.fit (Lightning's children are"
                " started by the first fit and must inherit the leader's environment),"
                " or launch with torchrun / srun.",
            )
        )
    if "NODE_RANK" in env and env["NODE_RANK"] not in ("", "0"):
        raise LaunchError(
            format_message(
                "neps_bcast launch",
                f"NODE_RANK={env['NODE_RANK']} without torchrun or srun: Lightning's"
                " manual multi-node launch is not supported.",
                "launch several nodes with torchrun (--nnodes, c10d rendezvous) or srun.",
            )
        )
    return Launch(
        kind="single", launcher=launcher, global_rank=0, world_size=None, local_rank=0, node_rank=0
    )


def _single_node(launcher: str, env: dict[str, str], address: str, world_size: int) -> bool | None:
    """Whether the launcher's variables put every rank on this node (None: they do not say)."""
    if address.startswith(_LOOPBACK):
        return True  # a rank on another node could not reach rank 0 there
    if launcher == "slurm":
        nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or ""
        return nodes == "1" if nodes.isdigit() else None
    local = env.get("LOCAL_WORLD_SIZE", "")
    return int(local) == world_size if local.isdigit() else None


def _lightning_child(env: dict[str, str], local_rank: int) -> Launch:
    node_rank = _int_env("NODE_RANK", env) if "NODE_RANK" in env else 0
    if node_rank != 0:
        raise LaunchError(
            format_message(
                f"neps_bcast rank ?/? (LOCAL_RANK={local_rank}, NODE_RANK={node_rank})",
                "Lightning's subprocess launcher started this process on node"
                f" {node_rank}: manual multi-node Lightning launches are not supported.",
                "launch several nodes with torchrun (--nnodes, c10d rendezvous) or srun.",
            )
        )
    if any(name not in env for name in (ENV_FIRST_SEQ, ENV_FIRST_TRIAL, ENV_CHILD_SECRET)):
        raise LaunchError(
            format_message(
                f"neps_bcast rank {local_rank}/? follower",
                f"{ENV_LEADER} is set but {ENV_FIRST_SEQ}, {ENV_FIRST_TRIAL} or"
                f" {ENV_CHILD_SECRET} is missing, so this process cannot know which trial"
                " to start with or check that it comes from its leader.",
                "do not set NEPS_BCAST_* variables by hand; let neps_bcast.run set them.",
            )
        )
    world = _int_env("WORLD_SIZE", env) if "WORLD_SIZE" in env else None
    return Launch(
        kind="lightning_child",
        launcher="lightning",
        global_rank=local_rank,
        world_size=world,
        local_rank=local_rank,
        node_rank=0,
        main_address=env.get("MASTER_ADDR"),
        main_port=_int_env("MASTER_PORT", env) if "MASTER_PORT" in env else None,
        leader_store=env[ENV_LEADER],
        first_seq=_int_env(ENV_FIRST_SEQ, env),
        first_trial=env[ENV_FIRST_TRIAL],
        child_secret=env[ENV_CHILD_SECRET],
    )


def pool_member() -> Launch:
    """A pool's agent or warm rank before any trial: not a rank of any group yet (an
    agent never is), and not a leader whose function Lightning could spawn from."""
    return Launch(
        kind="pool", launcher="pool", global_rank=0, world_size=None, local_rank=0, node_rank=0
    )
