"""What a benchmark run measures: the quick and full settings, the goals, and where results go.

Every number that decides how long a run takes lives here, so a newcomer can see at a
glance what ``make bench`` (quick) and ``make bench-full`` (full) do. The settings are
frozen dataclasses; ``dataclasses.asdict`` of one is the ``config`` block of
``summary_<mode>.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "workloads"
"""The scripts a benchmark launches (one NePS search, or the channel alone, each)."""
RESULTS = HERE / "results"
RAW = RESULTS / "raw"
"""One JSON file per launch (git-ignored): the supervisor's record and the derived result."""

Mode = Literal["quick", "full"]
System = Literal["ours", "builtin"]

SYSTEMS: tuple[System, ...] = ("ours", "builtin")
SYSTEM_LABELS: dict[str, str] = {"ours": "neps_bcast", "builtin": "NePS built-in"}

PAYLOAD_BYTES = (1000, 100_000, 1_000_000)
"""Sizes of the string each trial carries. The first is the plain runs' payload."""

HANDOFF_GOAL_MS: dict[int, float] = {2: 2.0, 8: 10.0}
"""The handoff goal: neps_bcast's median handoff (NePS trial start -> last follower enters) at
most this many ms, by world size."""

STEPS_GOAL_MS: dict[int, float] = {2: 5.0, 8: 10.0}
"""The control-steps goal: neps_bcast's own steps between two trials (NePS's report,
bookkeeping and sampling left out, see ``analysis.control_steps_s``) at most this many ms,
median, by world size."""

BO_GAP_GOAL_MS = 20.0
"""Bayesian optimization: ours may take at most this much longer to the next trial."""

BO_E2E_CPU_GOAL = 0.8
"""End to end under Bayesian optimization: ours may use at most this share of the built-in's
CPU-seconds (and at most its wall time)."""

FOLLOWER_CPU_GOAL_PERCENT: dict[int, float] = {2: 1.0}
"""The waiting goal: follower CPU while the leader holds a trial at most this % of a core, by
world size."""

AUTH_GOAL_PERCENT = 5.0
"""The authentication goal: tagging and checking one 1 KB trial message costs at most this % of
the handoff median, at every world size."""

GROUP_LAYOUTS: tuple[tuple[int, int], ...] = ((2, 2), (1, 4))
"""``neps-bcast launch`` layouts compared (groups, ranks per group): the same 4 ranks as two
NePS workers or as one. The first is the numerator of the row's ratio."""


def layout_key(groups: int, nproc_per_group: int) -> str:
    """ "2x2": the key of a layout in the summary's ``groups`` section."""
    return f"{groups}x{nproc_per_group}"


@dataclass(frozen=True)
class BenchConfig:
    """How much of each measurement one run does (field names = keys of the summary's config)."""

    channel_worlds: tuple[int, ...]
    """World sizes of the channel-alone measurement (no NePS, see channel_bench.py)."""
    channel_reps: int
    """Broadcasts per payload size and world size."""
    hold: float
    """Seconds the leader holds one trial while the followers wait (follower CPU)."""
    plain_worlds: tuple[int, ...]
    """World sizes of the plain-DDP NePS runs (handoff, overhead, follower CPU)."""
    plain_trials: int
    sweep_trials: int
    """Trials of the large-payload runs (100 KB and 1 MB), world 2."""
    e2e_trials: int
    """Trials of one end-to-end Lightning ddp run."""
    e2e_runs: int
    rel_runs: int
    """Extra Lightning runs per system that only count completions and leftovers."""
    rel_trials: int
    bo_trials: int
    """Trials of the Bayesian-optimization run (time to sample the next trial)."""
    bo_e2e_trials: int
    """Trials of one end-to-end Lightning ddp x2 run under Bayesian optimization (seeded)."""
    bo_e2e_runs: int
    """Such runs per system, interleaved."""
    groups_trials: int
    """Trials (budget) of one ``neps-bcast launch`` run, the same for every layout."""
    groups_runs: int
    """Runs per layout of GROUP_LAYOUTS, interleaved."""


QUICK = BenchConfig(
    # Quick stays under ~6 min on 2 cores. Every extra rank costs ~6 CPU-s of imports, so
    # world 4 is left to the full run; world 8 is measured because the handoff goal names it.
    channel_worlds=(2, 8),
    channel_reps=10,
    hold=3.0,
    plain_worlds=(2, 8),
    plain_trials=16,
    sweep_trials=6,
    e2e_trials=20,
    e2e_runs=1,
    rel_runs=1,
    rel_trials=6,
    bo_trials=8,
    bo_e2e_trials=14,
    bo_e2e_runs=2,
    # ~1 min per launch of 4 ranks on 2 cores, most of it the ranks' imports.
    groups_trials=8,
    groups_runs=1,
)

FULL = BenchConfig(
    # 30 Lightning runs per system in all: 3 end-to-end runs + 27 reliability runs.
    channel_worlds=(2, 4, 8),
    channel_reps=100,
    hold=5.0,
    plain_worlds=(2, 4, 8),
    plain_trials=20,
    sweep_trials=20,
    e2e_trials=20,
    e2e_runs=3,
    rel_runs=27,
    rel_trials=6,
    bo_trials=30,
    bo_e2e_trials=14,
    bo_e2e_runs=5,
    groups_trials=8,
    groups_runs=3,
)

CONFIGS: dict[Mode, BenchConfig] = {"quick": QUICK, "full": FULL}


# ----------------------------------------------------------------------------- the pool section
POOL_UTILIZATION_GOAL = 0.95
"""Device utilization (busy device-seconds / (D x search wall)) at least this (issue 36;
the first goal, 90%, was issue 22's)."""
POOL_BOUND_GOAL = 1.05
"""The pool's search wall at most this times its own lower bound (its trials'
device-seconds / D, or its longest trial): what placement loses (issue 36). Issue 22's
goal, 0.67x the best fixed layout's wall, lay below that bound on every curve measured;
the ratio to the best fixed layout is still reported."""
POOL_SCHEDULING_GOAL_MS = 50.0
"""The pool's scheduling cost per trial (placement -> every rank in the function), median,
at most this many ms more than the start cost (a fixed layout's NePS trial start -> every
rank in the function, median over the fixed layouts' trials)."""


@dataclass(frozen=True)
class PoolCurve:
    """One stated speedup curve and search of the pool section (workloads/pool_sim.py's
    arguments): a trial of e epochs on k ranks holds its k devices for
    ``t_epoch * (fixed_epochs + e * (s + (1 - s) / k))`` seconds."""

    name: str
    """A, B: how REPORT.md and the figures name it."""
    max_epochs: int
    """The fidelity ``epochs = neps.IntegerFidelity(1, max_epochs)``, hyperband eta 3."""
    fixed_epochs: float
    """c: device time every trial pays once (start, data, validation), in epochs of one
    rank; it does not parallelize."""
    serial_fraction: float
    """s of Amdahl's law, per epoch."""
    rule: tuple[tuple[int, int], ...]
    """The pool's right-sizing: (up to this many epochs, ranks), ascending."""
    evaluations: int
    """The search's budget, every layout: ``total_evaluations_to_spend``."""
    optimizer: str = "hyperband"
    """NePS's optimizer: hyperband (eta 3, over the fidelity), or one without a fidelity
    (``epochs`` then says every trial's epochs)."""
    epochs: int | None = None
    """No fidelity: every trial trains this many epochs (its size by ``rule``)."""
    more_agents: int = 0
    """Besides ``--pool D``, a pool launch with ``--agents D + more_agents`` (sampling ahead)."""
    fixed: tuple[tuple[int, int], ...] | None = None
    """The fixed layouts (groups, ranks) to compare with; None: every feasible one of D
    (``feasible``)."""
    min_ranks: tuple[tuple[int, int], ...] | None = None
    """A memory model: (up to this many epochs, the fewest ranks such a trial fits on),
    ascending, as ``rule``; a trial given fewer ranks fails as out of memory
    (workloads/pool_sim.py ``--min-ranks``). None: every trial fits on one rank."""

    @property
    def rule_arg(self) -> str:
        """``--rule`` of workloads/pool_sim.py: ``1:1,3:2,9:4``."""
        return ",".join(f"{bound}:{ranks}" for bound, ranks in self.rule)

    @property
    def min_ranks_arg(self) -> str | None:
        """``--min-ranks`` of workloads/pool_sim.py (None: no memory model)."""
        if self.min_ranks is None:
            return None
        return ",".join(f"{bound}:{ranks}" for bound, ranks in self.min_ranks)

    @property
    def widest_minimum(self) -> int:
        """The most ranks any trial of the search needs to fit (1 without a memory model):
        a fixed layout with fewer ranks per group cannot run the top rung."""
        return max((ranks for _, ranks in self.min_ranks or ()), default=1)

    def feasible(self, ranks_per_group: int) -> bool:
        """Whether a fixed layout of groups of ``ranks_per_group`` runs every trial (in a
        fixed layout every trial of a group runs on its N ranks)."""
        return ranks_per_group >= self.widest_minimum

    def ranks_for(self, epochs: int) -> int:
        return next(ranks for bound, ranks in self.rule if epochs <= bound)

    def trial_seconds(self, epochs: int, ranks: int, t_epoch: float) -> float:
        """Device time of a trial of ``epochs`` on ``ranks`` (every rank of it is busy)."""
        s = self.serial_fraction
        return t_epoch * (self.fixed_epochs + epochs * (s + (1 - s) / ranks))


CURVE_A = PoolCurve(
    name="A",
    max_epochs=9,
    fixed_epochs=0.0,
    serial_fraction=0.1,
    rule=((1, 1), (3, 2), (9, 4)),
    evaluations=40,
)
"""Amdahl s = 0.1 per epoch, nothing fixed per trial: every wider trial costs more
device-seconds, so one rank per trial is cheapest (the first run's curve, unchanged)."""
CURVE_B = PoolCurve(
    name="B",
    max_epochs=27,
    fixed_epochs=1.0,
    serial_fraction=0.02,
    rule=((3, 1), (9, 2), (27, 8)),
    evaluations=65,
)
"""One epoch-time per trial that does not parallelize, epochs by Amdahl s = 0.02, fidelity
up to 27: the rule was chosen by the calculation in pool_bench.md before measuring. 65
evaluations: one whole hyperband iteration (every bracket once); with 40 (the first
bracket) NePS's 8 workers spent the budget before any trial reached 9 epochs."""
CURVE_C = PoolCurve(
    name="C",
    max_epochs=27,
    fixed_epochs=0.0,
    serial_fraction=0.01,
    rule=((1, 1), (3, 2), (9, 4), (27, 8)),
    evaluations=75,
)
"""Data-parallel scaling as on one NVLink node: nothing fixed per trial, Amdahl s = 0.01,
so a trial on 8 ranks costs 1.07x the device-seconds of one rank; fidelity up to 27, the
top rung on all 8 devices (rule and prediction in pool_bench.md, stated before measuring).
75 evaluations: one whole hyperband iteration (65) plus 10, since 8 workers sample the next
iteration while a rung waits (curve B's pool ran 6 of the iteration's 8 top-rung trials)."""

CURVE_C4 = replace(
    CURVE_C, name="C4", rule=((1, 1), (3, 2), (9, 4), (27, 4)), fixed=((2, 4), (4, 2))
)
"""Curve C with its top rung on 4 ranks instead of 8 (chosen after curve C's run, to test
the advice it led to: keep the widest rung below D so wide trials need not drain the whole
pool); compared with C's two best fixed layouts, 2x4 and 4x2, measured beside it."""

CURVE_BO = PoolCurve(
    name="BO",
    max_epochs=16,
    fixed_epochs=0.0,
    serial_fraction=0.1,
    rule=((16, 1),),
    evaluations=40,
    optimizer="bayesian_optimization",
    epochs=16,
    more_agents=4,
    fixed=((8, 1),),
)
"""Bayesian optimization, no fidelity: every trial 16 epochs on one rank (16 s), so the
pool's D agents take the devices one trial each, as 8 groups of 1 do, and each waits for
its turn at NePS's lock to sample (a GP fit of seconds on 2 cores) while its device idles;
``--agents 12`` samples ahead. Only 8x1 to compare with: the other layouts would run
another search (each trial on more ranks)."""


CURVE_D = PoolCurve(
    name="D",
    max_epochs=27,
    fixed_epochs=1.0,
    serial_fraction=0.02,
    rule=((3, 1), (9, 2), (27, 4)),
    evaluations=75,
    min_ranks=((3, 1), (9, 2), (27, 4)),
)
"""Curve B's speedup (one epoch-time per trial that does not parallelize, Amdahl s = 0.02)
with a memory model: a trial of 1 or 3 epochs fits on one device, one of 9 needs 2, one of
27 needs 4 (memory that grows with the fidelity). So only the fixed layouts of >= 4 ranks
per group are feasible (1x8, 2x4), and there every small trial runs 4 or 8 wide; the pool
gives each trial its minimum width (rule and prediction in pool_bench.md, stated before
measuring). 75 evaluations, as curve C (one whole hyperband iteration and 10 of the next)."""


@dataclass(frozen=True)
class PoolConfig:
    """The right-sized pool section (``run.py --full``, or ``--only pool``): per curve, one
    launch per layout, ``neps-bcast launch --pool D`` against every fixed ``--groups G
    --nproc-per-group N`` with G x N = D, on D simulated devices (workloads/pool_sim.py)."""

    devices: int
    """D: simulated devices (CPU ranks whose training steps sleep)."""
    t_epoch: float
    """Seconds of device time of one epoch on one rank."""
    curves: tuple[PoolCurve, ...]
    """The speedup curves and searches, measured one after the other."""
    runs: int
    """Launches per layout and curve, interleaved (medians over them)."""
    deadline_s: float
    """A launch still running after this is killed (and counted as not completed)."""


POOL_CONFIGS: dict[Mode, PoolConfig] = {
    # --only pool (quick): a small pool of 4 to develop with (curve B's widest trials on 4).
    "quick": PoolConfig(
        devices=4,
        t_epoch=0.5,
        curves=(
            PoolCurve("A", 9, 0.0, 0.1, ((1, 1), (3, 2), (9, 4)), 12),
            PoolCurve("B", 27, 1.0, 0.02, ((3, 1), (9, 2), (27, 4)), 12),
            PoolCurve("BO", 8, 0.0, 0.1, ((8, 1),), 12, "bayesian_optimization", 8, 2, ((4, 1),)),
            PoolCurve("C", 27, 0.0, 0.01, ((1, 1), (3, 2), (9, 4), (27, 4)), 12),
            replace(  # the widest minimum 2 of 4 devices: 1x4 and 2x2 feasible, 4x1 not
                CURVE_D,
                rule=((3, 1), (9, 2), (27, 2)),
                evaluations=12,
                min_ranks=((3, 1), (9, 2), (27, 2)),
            ),
        ),
        runs=1,
        deadline_s=420,
    ),
    # make bench-full: curve A 8-17 min on 2 cores (by the load of the machine), most of it
    # the launches' start-up (up to 16 processes importing torch and NePS), left out of every
    # search wall; curves B and C longer (search walls ~50-150 s, calculations in
    # pool_bench.md); curve D 8.5 min (three launches, search walls 72-167 s).
    "full": PoolConfig(
        devices=8,
        t_epoch=1.0,
        # D last: the README's row (where the pool pays)
        curves=(CURVE_A, CURVE_B, CURVE_BO, CURVE_C4, CURVE_C, CURVE_D),
        runs=1,
        deadline_s=900,
    ),
}


def fixed_layouts(devices: int) -> tuple[tuple[int, int], ...]:
    """Every (groups, ranks per group) with groups x ranks = ``devices``, widest group first."""
    return tuple(
        (devices // ranks, ranks) for ranks in range(devices, 0, -1) if devices % ranks == 0
    )
