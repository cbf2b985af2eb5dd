"""What one end-to-end launch does, as typed data.

A test builds a ``Scenario``; the harness puts it in ONE environment variable
(``NB_SCENARIO``, JSON) of the launch; every rank of ``tests/scripts/search.py`` reads
it back into the same dataclasses (``Scenario.from_env``). Nothing here imports torch,
NePS or Lightning: pytest and every rank import this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

ENV = "NB_SCENARIO"

FaultKind = Literal[
    "raise",  # ValueError("injected failure on rank <r> at <where>")
    "kill",  # SIGKILL itself
    "kill_in",  # a thread SIGKILLs this process `seconds` later
    "term",  # SIGTERM itself (rank=None: every rank, as SLURM preemption does)
    "int",  # SIGINT itself
    "int_group",  # SIGINT to the whole process group, as Ctrl-C in a terminal does
    "sigkill_leader",  # a Lightning child SIGKILLs its parent, the leader
    "sleep",  # sleep `seconds` (records "fault" before and "slept" after)
]
Where = Literal[
    "before",  # in the function, before session()
    "session",  # first thing inside session()
    "fit",  # Lightning's training_step / the DDP loop
    "after",  # end of the session block
    "sample",  # the leader's NePS samples its next trial; seq = trials done so far
    "record",  # the leader's NePS records a trial's result; seq = that trial
    "reform",  # right after torch formed the group again for trial seq (init_process_group)
]
Strategy = Literal[
    "ddp",  # Lightning Trainer(strategy="ddp")
    "ddp_spawn",  # Lightning Trainer(strategy="ddp_spawn")
    "none",  # no Lightning, no DDP: the loss is the lr
    "plain_ddp",  # a torch DDP loop on the group neps_bcast formed (external launch)
    "fabric",  # Lightning Fabric, fabric.launch() inside the function
]
SpaceName = Literal[
    "basic",  # Float (log), Integer, Categorical
    "fidelity",  # basic + an IntegerFidelity "epochs"
    "unpicklable",  # basic + an Operation that cannot be pickled in `unpicklable_seqs`
]
EchoOpened = Literal[
    "before_run",  # before neps_bcast.run
    "trial_1",  # first thing in trial 1's session block
    "trial_2",  # in trial 2's session block, before training
]


@dataclass(frozen=True)
class Fault:
    """Something that goes wrong on purpose, at one point of one trial."""

    kind: FaultKind
    where: Where = "fit"
    rank: int | None = None
    """The rank it happens on; None: every rank."""
    seq: int | None = None
    """The trial (1-based, in evaluation order) it happens in; None: every trial."""
    seconds: float = 1.0
    """For "kill_in" and "sleep"."""


@dataclass(frozen=True)
class DevicesAt:
    """Lightning devices=`devices` in the `seq`-th trial only."""

    seq: int
    devices: int


@dataclass(frozen=True)
class BadInput:
    """Bad input on one rank."""

    rank: int
    skip_run: bool = False
    """That rank never calls neps_bcast.run."""
    other_root: bool = False
    """It passes root_directory + "_elsewhere"."""
    other_space: bool = False
    """It passes the fidelity space instead of the basic one."""


@dataclass(frozen=True)
class Meet:
    """In its first trial every rank touches <folder>/<me> and waits (60 s at most) for
    <folder>/<other>, so that two launches overlap for sure."""

    folder: str
    me: str
    other: str


@dataclass(frozen=True)
class Echo:
    """Each rank keeps one TCP connection of its own to an echo server on 127.0.0.1
    and uses it in every trial from the one it was opened in."""

    port: int
    opened: EchoOpened


@dataclass(frozen=True)
class Scenario:
    trials: int = 5
    """total_evaluations_to_spend."""
    devices: int = 2
    """Lightning devices (and Fabric's)."""
    strategy: Strategy = "ddp"
    optimizer: str = "random_search"
    space: SpaceName = "basic"
    unpicklable_seqs: tuple[int, ...] = ()
    """For space="unpicklable": the trials whose Operation cannot be pickled."""
    ignore_errors: bool = False
    faults: tuple[Fault, ...] = ()
    destroy_group: bool = False
    """The function calls dist.destroy_process_group() at its end, as PyTorch's DDP
    tutorial does."""
    devices_at: DevicesAt | None = None
    extra_args: bool = False
    """The function asks for pipeline_directory, previous_pipeline_directory, pipeline_id."""
    bad: BadInput | None = None
    meet: Meet | None = None
    echo: Echo | None = None
    subgroup_timeout_s: float | None = None
    """plain_ddp only: train on a dist.new_group(timeout=...) made inside each trial."""
    chdir_into: str | None = None
    """The function os.chdir()s into a fresh folder under this one at its start."""
    root: str | None = None
    """root_directory (relative: to the launch's cwd); None: the harness chooses."""
    record: str | None = None
    """Folder where every rank appends what happened (JSON lines); set by the harness."""
    log_dir: str | None = None
    """Folder where every rank writes its own log; set by the harness."""

    def to_env(self) -> dict[str, str]:
        return {ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ: os._Environ[str] | dict[str, str] | None = None) -> Scenario:
        raw = (os.environ if environ is None else environ).get(ENV)
        return cls() if raw is None else _scenario(json.loads(raw))


_NESTED: dict[str, Any] = {
    "devices_at": DevicesAt,
    "bad": BadInput,
    "meet": Meet,
    "echo": Echo,
}


def _scenario(data: dict[str, Any]) -> Scenario:
    known = {f.name for f in fields(Scenario)}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{ENV} has unknown fields {sorted(unknown)}")
    values: dict[str, Any] = dict(data)
    for name, kind in _NESTED.items():
        if values.get(name) is not None:
            values[name] = kind(**values[name])
    values["faults"] = tuple(Fault(**f) for f in values.get("faults", ()))
    values["unpicklable_seqs"] = tuple(values.get("unpicklable_seqs", ()))
    return Scenario(**values)
