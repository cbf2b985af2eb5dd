"""Every fault at every step of the pool: each cell of tests/sweep/table.py's pool section
is a real ``neps-bcast launch --pool 2`` (two warm ranks, two agents, real NePS, real
gloo groups formed per trial; tests/sweep/pool_fault_search.py).

A fault on one trial's processes (a rank, both ranks, the agent) touches that trial
alone and the launch goes on: the cells of such a chain share one launch, each fault on
a trial of its own (by NePS's id), and the launch itself must finish the budget. Each
cell checks its trial's state and whether it was put back and run again (its lease's
attempts), the exit status of the process(es) the fault hit and of the trial's other
ranks; every other process of the launch exits 0; every rank of a trial got the same
config; nothing is left alive. A fault to the launcher ends its launch: those cells
share a root, the next cell's launch being the previous one's rerun, and a last run
without a fault finishes the budget.

``NB_SWEEP_OUT=<file>``: each cell appends what it saw (a JSON line), as test_sweep.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from extra_checks_e2e import pool_trial_stopped_by_its_time_limit
from table import (
    POOL_CHAINS,
    POOL_FAULT,
    POOL_POINT,
    SILENT_BOUND_S,
    Fault,
    PoolExpect,
    PoolPoint,
    Unreachable,
    pool_expect,
    pool_spec,
)
from test_sweep import check_finished, neps_view, report, results_lost

from harness import PYTHON, Result, assert_every_exit_was_heard_as_recorded, run
from neps_bcast.recovery.lease_file import read_lease

NEPS_BCAST = str(Path(PYTHON).with_name("neps-bcast"))
SCRIPT = Path(__file__).with_name("pool_fault_search.py")
LAUNCH_S = 540.0
"""A chain's one launch: up to nine faults, each costing fresh processes (~7 s of CPU
each to import torch and NePS), on a loaded 2-core machine."""
TRIAL_TIME_LIMIT_S = 30
"""``--trial-time-limit`` of every chain: what ends the ``hang`` cell's trial; far above a
trial's few steps (seconds), even on a loaded 2-core machine."""
S = frozenset


@dataclass(frozen=True)
class PoolChain:
    name: str
    cells: tuple[tuple[PoolPoint, Fault], ...]

    @property
    def stops(self) -> bool:
        """Its faults stop the launch (the launcher's signals)."""
        return any(self.want(i).stops for i in range(len(self.cells)))

    @property
    def budget(self) -> int:
        if self.stops:
            return 4  # the stop cell's launch spends what the earlier ones left
        return len(self.cells) + 2  # trial 1 warms the pool; one after the last fault

    def want(self, i: int) -> PoolExpect:
        want = pool_expect(*self.cells[i])
        assert not isinstance(want, Unreachable), want
        return want

    def trial_id(self, i: int) -> str | None:
        """A cell's trial: NePS's id ``i + 2`` in the chain's one launch; the first to
        come in each launch of a stopping chain."""
        return None if self.stops else str(i + 2)

    def command(self) -> list[str]:
        # A chain that goes on asks NePS to overwrite the root: the launch wipes it once,
        # never again for an agent started in a lost one's place (its trials would go).
        once = [] if self.stops else ["--overwrite"]
        return [
            NEPS_BCAST,
            "launch",
            "--pool",
            "2",
            "--trial-time-limit",
            str(TRIAL_TIME_LIMIT_S),
            str(SCRIPT),
            "--trials",
            str(self.budget),
            *once,
        ]


CHAINS = [
    PoolChain(name, tuple((POOL_POINT[p], POOL_FAULT[f]) for p, f in cells))
    for name, cells in POOL_CHAINS.items()
]


def roles(launch: Result) -> dict[int, str]:
    """pid -> "agent" or "rank", for every process of the pool that started."""
    return {e["pid"]: e["role"] for e in launch.of("pool_member")}


def first_attempt_ranks(launch: Result, trial_id: str) -> list[int]:
    """The pids of the ranks the launcher first gave ``trial_id`` (its first 2 orders)."""
    parts = sorted((e for e in launch.of("pool_trial") if e["trial_id"] == trial_id), key=_t)
    return [e["pid"] for e in parts[:2]]


def _t(e: dict[str, Any]) -> float:
    return float(e["t"])


def attempts(root: Path, trial_id: str) -> int:
    """The failed attempts the trial's lease lists (0: it ran once)."""
    lease = read_lease(root / "configs" / f"config_{trial_id}")
    return 0 if lease is None else len(lease.attempts)


def same_config_on_every_rank(launch: Result) -> list[str]:
    """Every rank that evaluated a trial got the config its agent was handed."""
    configs: dict[str, set[str]] = {}
    for e in launch.of("trial"):
        configs.setdefault(e["trial_id"], set()).add(repr(sorted(e["config"].items())))
    return [
        f"trial {tid} ran with different configs: {c}" for tid, c in configs.items() if len(c) > 1
    ]


def statuses(
    launch: Result,
    allowed: dict[int, frozenset[int]],
    default: frozenset[int],
    stopped: bool = False,
) -> list[str]:
    """Every process of the pool exited as ``allowed`` names it, else within ``default``.
    ``stopped``: the launcher forwarded a SIGTERM, or died so that every process got its
    parent-death SIGTERM. Either may reach a process whose script already ended in its
    interpreter's finalization: -15 whatever its "exit" record said (0 for a script that
    returned; 1 for one that saw the launcher's socket close before that signal came, as
    the kernel closes a dead process's files before it signals its children)."""
    problems = []
    kinds = roles(launch)
    if sorted(set(kinds.values())) != ["agent", "rank"]:
        problems.append(f"the pool's processes were not seen start: {kinds}")
    for pid, status in launch.os_exits.items():
        want = allowed.get(pid, default)
        if status not in want:
            problems.append(
                f"{kinds.get(pid, '?')} pid {pid} exited {status}, want one of {sorted(want)}"
            )
    if launch.left_alive:
        problems.append(f"processes left alive: {launch.left_alive}")
    changed = {e["pid"]: e["code"] for e in launch.of("exit") if e["predicted"] != e["code"]}
    try:
        assert_every_exit_was_heard_as_recorded(launch)
    except AssertionError as exc:
        signalled_late = set(changed.values()) == {-15} and "no exit" not in str(exc)
        if not (stopped and signalled_late):
            problems.append(str(exc).split("; logs:")[0])
    return problems


def fired(launch: Result, point: PoolPoint, trial_id: str | None) -> dict[str, Any] | None:
    return next(
        (
            e
            for e in launch.of("fault")
            if e.get("where") == point.name and (trial_id is None or e.get("trial_id") == trial_id)
        ),
        None,
    )


def run_going_on(chain: PoolChain, tmp_path: Path) -> tuple[list[str], Result]:
    """The chain's one launch, every fault on its own trial; the launch goes on."""
    root = tmp_path / "results"
    specs = [pool_spec(p, f, chain.trial_id(i)) for i, (p, f) in enumerate(chain.cells)]
    # A frozen rank is found silent after NEPS_BCAST_PEER_TIMEOUT_S: short in its chain
    # (every other trial of the launch then shows that busy ranks are never taken for it).
    frozen = any(fault.kind == "sigstop" for _, fault in chain.cells)
    env = {"NEPS_BCAST_PEER_TIMEOUT_S": str(SILENT_BOUND_S)} if frozen else {}
    launch = run(
        chain.command(), tmp_path, name="faults", fault=", ".join(specs), timeout=LAUNCH_S, env=env
    )
    after = neps_view(root)
    problems: list[str] = []
    allowed: dict[int, frozenset[int]] = {}
    launcher_codes = {0}
    for i, (point, fault) in enumerate(chain.cells):
        want, tid = chain.want(i), chain.trial_id(i)
        assert tid is not None
        head = f"pool-{point.name}-{fault.name} (trial {tid}, {specs[i]}), row {want.row!r}"
        found: list[str] = []
        event = fired(launch, point, tid)
        if event is None:
            found.append("the fault never fired: the cell did not test")
        else:
            victims = [event["pid"]] if fault.kind == "raise" else event["pids"]
            for pid in victims:
                allowed[pid] = want.victim
            if fault.to != "launcher":
                for pid in first_attempt_ranks(launch, tid):
                    allowed.setdefault(pid, want.peers)
        state = after.get(tid, ("missing", None))[0]
        if state not in want.trial:
            found.append(f"trial {tid} is {state}, want {'|'.join(sorted(want.trial))}")
        tries = attempts(root, tid)
        if tries != (1 if want.retried else 0):
            found.append(
                f"trial {tid}'s lease lists {tries} failed attempts, want"
                f" {1 if want.retried else 0} ({'put back and run again' if want.retried else 'ran once'})"
            )
        if (point.name, fault.name) == ("fit", "hang") and event is not None:
            # The checks of the e2e launch this cell replaced: the limit ended the attempt.
            found += pool_trial_stopped_by_its_time_limit(
                launch, root, tid, first_attempt_ranks(launch, tid), TRIAL_TIME_LIMIT_S
            )
        launcher_codes |= set(want.launcher)
        report(
            {
                "cell": f"pool-{point.name}-{fault.name}",
                "spec": specs[i],
                "row": want.row,
                "ok": not found,
                "problems": found,
                "trial": [tid, state, tries],
            }
        )
        problems += [f"{head}: {p}" for p in found]
    problems += statuses(launch, allowed, S({0}))
    want_rc = max(launcher_codes)  # an agent that failed (1) decides it; else 0
    if launch.returncode != want_rc:
        problems.append(f"the launcher exited {launch.returncode}, want {want_rc}")
    problems += same_config_on_every_rank(launch)
    problems += [f"{chain.name}: {p}" for p in check_finished({}, after, chain.budget)]
    return problems, launch


def run_stopping(chain: PoolChain, tmp_path: Path) -> tuple[list[str], list[Result]]:
    """One launch per cell on one root, each the previous one's rerun; a last run."""
    root = tmp_path / "results"
    problems: list[str] = []
    launches: list[Result] = []
    for i, (point, fault) in enumerate(chain.cells):
        want = chain.want(i)
        spec = pool_spec(point, fault, None)
        before = neps_view(root)
        frozen = (
            {"NEPS_BCAST_PEER_TIMEOUT_S": str(SILENT_BOUND_S)} if fault.kind == "sigstop" else {}
        )
        launch = run(
            chain.command(),
            tmp_path,
            name=f"{i:02d}-{point.name}-{fault.name}",
            fault=spec,
            env=frozen,
        )
        launches.append(launch)
        after = neps_view(root)
        found: list[str] = []
        event = fired(launch, point, None)
        if event is None:
            found.append("the fault never fired: the cell did not test")
        else:
            try:  # why it ended, not how long it took (a hang detector only)
                launch.ended_on_their_own(event["t"])
            except AssertionError as exc:
                found.append(str(exc).split("; records from")[0])
        if event is not None and event.get("trial_id") in after:
            state = after[event["trial_id"]][0]
            if state not in want.trial:
                found.append(
                    f"trial {event['trial_id']} is {state}, want {'|'.join(sorted(want.trial))}"
                )
        left = {t: s for t, (s, _) in after.items() if s not in ("success", "pending")}
        if left:
            found.append(f"trials neither finished nor pending: {left}")
        found += results_lost(before, after)
        found += statuses(launch, {}, want.peers, stopped=True)
        if launch.returncode not in want.launcher:
            found.append(
                f"the launcher exited {launch.returncode}, want one of {sorted(want.launcher)}"
            )
        found += same_config_on_every_rank(launch)
        report(
            {
                "cell": f"pool-{point.name}-{fault.name}",
                "spec": spec,
                "row": want.row,
                "ok": not found,
                "problems": found,
                "launcher_rc": launch.returncode,
            }
        )
        problems += [
            f"pool-{point.name}-{fault.name} ({spec}), row {want.row!r}: {p}" for p in found
        ]
    before = neps_view(root)
    last = run(chain.command(), tmp_path, name="last")
    launches.append(last)
    found = check_finished(before, neps_view(root), chain.budget)
    found += statuses(last, {}, S({0}))
    if last.returncode != 0:
        found.append(f"the launcher exited {last.returncode}, want 0")
    problems += [f"{chain.name}, the last run: {p}" for p in found]
    return problems, launches


@pytest.mark.timeout(1200)  # one launch of up to nine faults, or five launches of one
@pytest.mark.parametrize("chain", CHAINS, ids=[f"pool-{c.name}" for c in CHAINS])
def test_every_fault_on_the_pool(chain: PoolChain, tmp_path: Path) -> None:
    if chain.stops:
        problems, launches = run_stopping(chain, tmp_path)
    else:
        problems, launch = run_going_on(chain, tmp_path)
        launches = [launch]
    tails = "\n".join(launch.tail(30) for launch in launches[-2:]) if problems else ""
    assert not problems, "\n".join(problems) + "\n" + tails
