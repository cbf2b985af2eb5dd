"""Every fault at every step: each cell of tests/sweep/table.py is a real launch.

A cell is a launcher (Lightning ``strategy="ddp"``, or torchrun with a plain DDP loop;
2 ranks, and torchrun on 3 for some steps; real NePS, real gloo), a step of the leader's or the followers' loop and a
fault that lands there (tests/scripts/faults.py hooks the step; the user-shaped script
is otherwise unchanged). Each cell's launch is checked against the table: the fault
fired, the state NePS holds each trial the launch evaluated in, each process's exit
status as the kernel reported it, every process gone within ``BOUND_S`` of the fault
and none left, and no earlier result changed.

The cells of one step run as a chain on one NePS root with one command: the next
cell's launch is the previous one's rerun ("the same command again"). It evaluates the
trials the previous fault left pending first (NePS hands out pending trials before it
samples; one left ``evaluating`` by a killed leader is put back at start-up), each of
which must end a ``success``; its own fault lands on its N-th evaluation. A last launch
without a fault finishes the budget: no trial may then be pending or evaluating, every
retried trial is a success. Steps at the end of a search (``stop``) need the budget
spent in the faulted launch: each of their cells has a root of its own.

``NB_SWEEP_OUT=<file>``: each cell appends what it saw (a JSON line) for the report.
``NB_SWEEP_FAULTS=kill_leader,raise``: only those faults' cells of each chain (to
reproduce one cell; the chain's last run still finishes the budget).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from table import (
    CELLS,
    FAULTS,
    RANKS,
    Expect,
    Fault,
    Point,
    Unreachable,
    bystander,
    expect,
    spec,
)

from harness import (
    LIGHTNING,
    TORCH_DDP,
    Result,
    assert_every_exit_was_heard_as_recorded,
    closed_by_torchrun,
    neps_trials,
    python,
    run,
    torchrun,
)

BOUND_S = 60.0
"""Every process of a launch is gone within this of the fault: no wait involved may be
a timeout (the last resort is seven days)."""

BUDGET = 3 * len(FAULTS) + 4
"""A chain's ``--trials``: each faulted launch spends at most three evaluations, and
the last cells still get theirs."""

FINISHED = ("success", "crashed")
S = frozenset


@dataclass(frozen=True)
class Chain:
    launcher: str
    point: Point
    faults: tuple[Fault, ...]

    @property
    def id(self) -> str:
        return f"{self.launcher}-{self.point.name}"

    @property
    def shares_a_root(self) -> bool:
        return self.point.kind != "end"

    def command(self) -> list[str]:
        trials = BUDGET if self.shares_a_root else self.point.trials
        if self.launcher == "lightning":
            return python(LIGHTNING, "--trials", trials, "--ignore-errors")
        return torchrun(RANKS[self.launcher], TORCH_DDP, "--trials", trials, "--ignore-errors")


ONLY = {f for f in os.environ.get("NB_SWEEP_FAULTS", "").split(",") if f}
assert ONLY <= {f.name for f in FAULTS}, f"NB_SWEEP_FAULTS: unknown {ONLY}"

CHAINS = [
    Chain(
        launcher,
        point,
        tuple(
            f
            for (la, p, f) in CELLS
            if la == launcher and p == point and (not ONLY or f.name in ONLY)
        ),
    )
    for launcher, point in dict.fromkeys((la, p) for la, p, _ in CELLS)
]


def neps_view(root: Path) -> dict[str, tuple[str, Any]]:
    """trial id -> (state, objective) as NePS holds it."""
    if not root.exists():
        return {}
    view = {}
    for tid, t in neps_trials(root).items():
        state = str(getattr(t.metadata.state, "value", t.metadata.state))
        objective = t.report.objective_to_minimize if t.report is not None else None
        view[tid] = (state, objective)
    return view


def handed_order(launch: Result) -> list[str]:
    """The trial ids NePS handed this launch's leader, in order."""
    return [e["trial_id"] for e in launch.of("neps_trial") if e["proc_rank"] == 0]


Statuses = dict[int, int | None]


def statuses_by_role(launch: Result) -> tuple[Statuses, Statuses, Statuses]:
    """pid -> the kernel's exit status, for the leader's (rank 0), the follower's (rank
    1) and any other follower's processes."""
    rank_of = {e["pid"]: e["proc_rank"] for e in launch.of("start")}
    exits = launch.os_exits.items()
    leader = {p: s for p, s in exits if rank_of.get(p) == 0}
    follower = {p: s for p, s in exits if rank_of.get(p) == 1}
    others = {p: s for p, s in exits if rank_of.get(p, 0) > 1}
    return leader, follower, others


def check_exits(
    launcher: str, want: Expect, launch: Result, last: bool = False, others_want: frozenset = S()
) -> list[str]:
    """``last``: the chain's last run, whose leader may find the budget spent and start
    no follower (Lightning starts one only in a trial). ``others_want``: the statuses of
    the followers the fault did not name (3 ranks)."""
    problems = []
    leader, follower, others = statuses_by_role(launch)
    if last and not follower and launcher == "lightning":
        follower = {0: 0}
    for role, got, allowed, count in (
        ("leader", leader, want.leader, 1),
        ("follower", follower, want.follower, 1),
        ("other follower", others, others_want, RANKS[launcher] - 2),
    ):
        if len(got) != count:
            problems.append(f"{len(got)} {role} processes started: {got}")
        for pid, status in got.items():
            if status in allowed or (status in (143, -15) and closed_by_torchrun(launch, pid)):
                continue
            problems.append(f"{role} (pid {pid}) exited {status}, want one of {sorted(allowed)}")
    statuses = [*leader.values(), *follower.values(), *others.values()]
    if launcher == "lightning":
        want_rc = next(iter(leader.values()), None)
    else:
        want_rc = 0 if statuses and all(s == 0 for s in statuses) else 1
    if launch.returncode != want_rc:
        problems.append(f"the launcher exited {launch.returncode}, want {want_rc}")
    if launch.left_alive:
        problems.append(f"processes left alive: {launch.left_alive}")
    try:
        assert_every_exit_was_heard_as_recorded(launch)
    except AssertionError as exc:
        problems.append(str(exc).split("; logs:")[0])
    return problems


def check_trials(
    want: Expect,
    before: dict[str, tuple[str, Any]],
    after: dict[str, tuple[str, Any]],
    order: list[str],
) -> list[str]:
    """The trials this launch was handed (its N-th is the table's trial N) are as the
    table says; nothing finished before changed; nothing else appeared."""
    problems = []
    for n, tid in enumerate(order, start=1):
        allowed = want.trials.get(str(n))
        if allowed is None and want.goes_on and n > len(want.trials):
            allowed = frozenset({"success"})
        state = after.get(tid, ("missing", None))[0]
        if allowed is None:
            problems.append(f"NePS handed a trial {n} ({tid}, now {state}); the table has none")
        elif state not in allowed:
            problems.append(
                f"trial {n} of the launch ({tid}) is {state}, want {'|'.join(sorted(allowed))}"
            )
    missing = [n for n in want.trials if int(n) > len(order) and n not in want.maybe]
    if missing:
        problems.append(
            f"NePS handed {len(order)} trials ({order}); the table expects {sorted(want.trials)}"
        )
    problems += results_lost(before, after)
    appeared = set(after) - set(before) - set(order)
    if appeared:
        problems.append(f"trials {sorted(appeared)} appeared but were never handed to the leader")
    return problems


def results_lost(
    before: dict[str, tuple[str, Any]], after: dict[str, tuple[str, Any]]
) -> list[str]:
    """Every trial finished before a launch is as it was after it."""
    return [
        f"trial {tid} was {state} ({objective}), now {after.get(tid)}: a result lost"
        for tid, (state, objective) in before.items()
        if state in FINISHED and after.get(tid) != (state, objective)
    ]


def check_finished(
    before: dict[str, tuple[str, Any]], after: dict[str, tuple[str, Any]], budget: int
) -> list[str]:
    """The last launch (no fault): the budget spent, no trial pending or evaluating."""
    problems = []
    left = {t: s for t, (s, _) in after.items() if s not in FINISHED}
    if left:
        problems.append(f"after the last run, trials not finished: {left}")
    spent = sum(1 for s, _ in after.values() if s in FINISHED)
    if spent < budget:
        problems.append(f"after the last run {spent} trials finished, budget {budget}")
    problems += results_lost(before, after)
    return problems


def report(seen: dict[str, Any]) -> None:
    if os.environ.get("NB_SWEEP_OUT"):
        with Path(os.environ["NB_SWEEP_OUT"]).open("a") as out:
            out.write(json.dumps(seen) + "\n")


def run_cell(chain: Chain, fault: Fault, tmp_path: Path, i: int) -> tuple[list[str], str]:
    want = expect(chain.launcher, chain.point, fault)
    assert not isinstance(want, Unreachable), want
    cwd = tmp_path if chain.shares_a_root else tmp_path / f"own{i}"
    cwd.mkdir(exist_ok=True)
    root = cwd / "results"
    before = neps_view(root)
    text = spec(chain.point, fault, RANKS[chain.launcher])
    launch = run(chain.command(), tmp_path, name=f"{i:02d}-{fault.name}", cwd=cwd, fault=text)
    problems = []
    fired = [e for e in launch.of("fault") if e.get("where") == chain.point.name]
    if not fired:
        problems.append(f"the fault never fired at {chain.point.name}: the cell did not test")
    since = min((e["t"] for e in fired), default=None)
    gone_s = None if since is None else launch.gone_at - since
    if gone_s is not None and gone_s >= BOUND_S:
        problems.append(f"gone {gone_s:.1f} s after the fault (bound {BOUND_S:g} s)")
    problems += check_exits(
        chain.launcher, want, launch, others_want=bystander(chain.point, want, fault)
    )
    after = neps_view(root)
    order = handed_order(launch)
    problems += check_trials(want, before, after, order)
    leader, follower, others = statuses_by_role(launch)
    report(
        {
            "cell": f"{chain.id}-{fault.name}",
            "spec": text,
            "row": want.row,
            "ok": not problems,
            "problems": problems,
            "leader": list(leader.values()),
            "followers": [*follower.values(), *others.values()],
            "launcher_rc": launch.returncode,
            "gone_s": None if gone_s is None else round(gone_s, 2),
            "handed": [(tid, after.get(tid, ("missing",))[0]) for tid in order],
        }
    )
    head = f"{chain.id}-{fault.name} ({text}), row {want.row!r}"
    return [f"{head}: {p}" for p in problems], launch.tail(40) if problems else ""


@pytest.mark.timeout(3600)  # a chain is up to ten launches, each bounded by its own deadline
@pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])
def test_every_fault_at_the_step(chain: Chain, tmp_path: Path) -> None:
    problems: list[str] = []
    logs: list[str] = []
    for i, fault in enumerate(chain.faults, start=1):
        found, tail = run_cell(chain, fault, tmp_path, i)
        problems += found
        if tail:
            logs.append(tail)
        if any("never fired" in p for p in found) and chain.shares_a_root:
            break  # the search ran on to its budget: the later cells would test nothing
    else:
        problems += last_run(chain, tmp_path, logs)
    assert not problems, "\n".join(problems) + "\n" + "\n".join(logs[-3:])


def last_run(chain: Chain, tmp_path: Path, logs: list[str]) -> list[str]:
    """The same command once more, without a fault: it finishes the budget."""
    problems: list[str] = []
    if chain.shares_a_root:
        root = tmp_path / "results"
        before = neps_view(root)
        last = run(chain.command(), tmp_path, name="last")
        found = check_finished(before, neps_view(root), BUDGET)
        found += check_exits(chain.launcher, ALL_ZERO, last, last=True, others_want=S({0}))
        problems += [f"{chain.id}, the last run: {p}" for p in found]
        if found:
            logs.append(last.tail(40))
    return problems


ALL_ZERO = Expect("returns", {}, S({0}), S({0}), False)
