"""Every fault at every step: each cell of tests/sweep/table.py is a real launch.

A cell is a launcher (Lightning ``strategy="ddp"``, or torchrun with a plain DDP loop;
2 ranks, and torchrun on 3 for some steps; real NePS, real gloo), a step of the leader's or the followers' loop and a
fault that lands there (tests/scripts/faults.py hooks the step; the user-shaped script
is otherwise unchanged). Each cell's launch is checked against the table: the fault
fired, the state NePS holds each trial the launch evaluated in, each process's exit
status as the kernel reported it, every process ended on its own after the fault (none
left, no wait ended by its timeout: ``Result.ended_on_their_own``) and no earlier result
changed. Some cells check more (``EXTRA``): the checks of the end-to-end launches that
ran the same scenario before the sweep did (docs/test-tiers.md).

The cells of up to three steps of one launcher (``POINTS_PER_CHAIN``) run as a chain
on one NePS root with one command: the next
cell's launch is the previous one's rerun ("the same command again"). It evaluates the
trials the previous fault left pending first (NePS hands out pending trials before it
samples; one left ``evaluating`` by a killed leader is put back at start-up), each of
which must end a ``success``; its own fault lands on its N-th evaluation. A last launch
finishes the budget: no trial may then be pending or evaluating, every retried trial is
a success. The cells whose fault the search survives (an exception: ``Chain.going``)
land in that last launch, one after another, each in trials of its own. Steps at the end of a search (``stop``) need the budget
spent in the faulted launch: each of their cells has a root of its own.

``NB_SWEEP_OUT=<file>``: each cell appends what it saw (a JSON line) for the report.
``NB_SWEEP_FAULTS=kill_leader,raise``: only those faults' cells of each chain (to
reproduce one cell; the chain's last run still finishes the budget).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from table import (
    CELLS,
    CI_CELLS,
    FAULTS,
    RANKS,
    SILENT_BOUND_S,
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
    raised,
    reports,
    run,
    torchrun,
    trials_by_rank,
)
from neps_bcast.recovery.lease_file import read_lease

POINTS_PER_CHAIN = 3
"""The steps one chain sweeps, one after another on one root: a chain ends with a last
run that finishes its budget, one launch (~15 CPU-seconds of imports) that a longer
chain shares among more cells; three keep the chains about as many as the sweep's
workers need to stay busy to the end."""

FINISHED = ("success", "crashed")
S = frozenset


@dataclass(frozen=True)
class Chain:
    launcher: str
    cells: tuple[tuple[Point, Fault], ...]

    @property
    def points(self) -> tuple[Point, ...]:
        return tuple(dict.fromkeys(p for p, _ in self.cells))

    @property
    def id(self) -> str:
        return f"{self.launcher}-{'+'.join(p.name for p in self.points)}"

    @property
    def shares_a_root(self) -> bool:
        return all(p.kind != "end" for p in self.points)

    @property
    def budget(self) -> int:
        """Its ``--trials``: each faulted launch spends at most its step's search, and
        the last run still has a few to spend after the cells that go on; a step at the
        end of a search, its own."""
        if not self.shares_a_root:
            return self.points[0].trials
        return sum(p.trials for p, _ in self.cells) + 4

    @property
    def stopping(self) -> tuple[tuple[Point, Fault], ...]:
        """The cells whose fault ends their launch: one launch each, in the table's order."""
        return tuple(c for c in self.cells if c not in self.going)

    @property
    def going(self) -> tuple[tuple[Point, Fault], ...]:
        """The cells whose fault does not stop the search (an exception the search
        survives: the trial crashed or the step tried again, every later trial a
        success). On a shared root they land one after another in the chain's last run,
        each in trials of its own, instead of a launch each (~15 CPU-seconds of imports)
        that would only go on to the same end."""
        if not self.shares_a_root:
            return ()
        going = [c for c in self.cells if _goes_on(self.launcher, *c)]
        # A process counts the trials its function ran (faults.py's ``trial=N``). After
        # a trial whose leader raised once it had handed it over, the follower may or may
        # not have run its function: such cells come last, no count depends on them.
        return tuple(sorted(going, key=lambda c: c[0].owner == "leader" and c[0].kind == "trial"))

    def command(self) -> list[str]:
        trials = self.budget
        if self.launcher == "lightning":
            return python(LIGHTNING, "--trials", trials, "--ignore-errors")
        return torchrun(RANKS[self.launcher], TORCH_DDP, "--trials", trials, "--ignore-errors")


def _goes_on(launcher: str, point: Point, fault: Fault) -> bool:
    want = expect(launcher, point, fault)
    return not isinstance(want, Unreachable) and want.goes_on


ONLY = {f for f in os.environ.get("NB_SWEEP_FAULTS", "").split(",") if f}
assert ONLY <= {f.name for f in FAULTS}, f"NB_SWEEP_FAULTS: unknown {ONLY}"

FULL = os.environ.get("NB_SWEEP_FULL", "") == "1"
"""``make test-faults-full``: every cell of the table (``CELLS``); otherwise, as
``make test-faults`` runs on every commit, ``CI_CELLS`` (table.FULL_ONLY's Lightning
cells left to their torchrun twins)."""
SWEPT_CELLS = CELLS if FULL else CI_CELLS


def chains() -> list[Chain]:
    """Each launcher's steps in the table's order, up to ``POINTS_PER_CHAIN`` a chain; a
    step at the end of a search alone (each of its cells on a root of its own)."""
    found = []
    for launcher in dict.fromkeys(la for la, _, _ in SWEPT_CELLS):
        steps = list(dict.fromkeys(p for la, p, _ in SWEPT_CELLS if la == launcher))
        going = [p for p in steps if p.kind != "end"]
        groups = [going[i : i + POINTS_PER_CHAIN] for i in range(0, len(going), POINTS_PER_CHAIN)]
        groups += [[p] for p in steps if p.kind == "end"]
        for group in groups:
            cells = tuple(
                (p, f)
                for (la, p, f) in SWEPT_CELLS
                if la == launcher and p in group and (not ONLY or f.name in ONLY)
            )
            found.append(Chain(launcher, cells))
    return found


CHAINS = chains()


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
    return check_states(want, after, order) + untouched(before, after, order)


def check_states(
    want: Expect, after: dict[str, tuple[str, Any]], order: list[str], by: int = 0
) -> list[str]:
    """The launch's trials ``by + 1``, ``by + 2``, ... are the table's trials 1, 2, ...
    of ``want`` (all of them, and every later one too where the search goes on)."""
    problems = []
    mine = order[by:] if want.goes_on else order[by : by + len(want.trials)]
    for n, tid in enumerate(mine, start=1):
        allowed = want.trials.get(str(n))
        if allowed is None and want.goes_on and n > len(want.trials):
            allowed = frozenset({"success"})
        state = after.get(tid, ("missing", None))[0]
        if allowed is None:
            problems.append(f"NePS handed a trial {n} ({tid}, now {state}); the table has none")
        elif state not in allowed:
            problems.append(
                f"trial {by + n} of the launch ({tid}) is {state}, want {'|'.join(sorted(allowed))}"
            )
    missing = [n for n in want.trials if int(n) > len(mine) and n not in want.maybe]
    if missing:
        problems.append(
            f"NePS handed {len(mine)} trials ({mine}); the table expects {sorted(want.trials)}"
        )
    return problems


def untouched(
    before: dict[str, tuple[str, Any]], after: dict[str, tuple[str, Any]], order: list[str]
) -> list[str]:
    """Nothing finished before the launch changed, and no trial appeared that NePS did
    not hand the leader."""
    problems = results_lost(before, after)
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


def run_cell(
    chain: Chain, point: Point, fault: Fault, tmp_path: Path, i: int
) -> tuple[list[str], str]:
    want = expect(chain.launcher, point, fault)
    assert not isinstance(want, Unreachable), want
    cwd = tmp_path if chain.shares_a_root else tmp_path / f"own{i}"
    cwd.mkdir(exist_ok=True)
    root = cwd / "results"
    before = neps_view(root)
    text = spec(point, fault, RANKS[chain.launcher])
    silent = {"NEPS_BCAST_PEER_TIMEOUT_S": str(SILENT_BOUND_S)} if fault.kind == "sigstop" else {}
    assert (point, fault) not in chain.going, "a cell that goes on lands in the last run"
    launch = run(
        chain.command(),
        tmp_path,
        name=f"{i:02d}-{point.name}-{fault.name}",
        cwd=cwd,
        fault=text,
        env=silent,
    )
    fired = [e for e in launch.of("fault") if e.get("where") == point.name]
    since = min((e["t"] for e in fired), default=None)
    gone_s = None if since is None else launch.gone_at - since
    problems = fault_checks(chain, point, fault, launch, fired[:1], since)
    problems += check_exits(chain.launcher, want, launch, others_want=bystander(point, want, fault))
    after = neps_view(root)
    order = handed_order(launch)
    problems += check_trials(want, before, after, order)
    leader, follower, others = statuses_by_role(launch)
    report(
        {
            "cell": f"{chain.launcher}-{point.name}-{fault.name}",
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
    head = f"{chain.launcher}-{point.name}-{fault.name} ({text}), row {want.row!r}"
    return [f"{head}: {p}" for p in problems], launch.tail(40) if problems else ""


@pytest.mark.timeout(5400)  # a chain is up to ~30 launches, each bounded by its own deadline
@pytest.mark.parametrize("chain", CHAINS, ids=[c.id for c in CHAINS])
def test_every_fault_at_the_step(chain: Chain, tmp_path: Path) -> None:
    problems: list[str] = []
    logs: list[str] = []
    for i, (point, fault) in enumerate(chain.stopping, start=1):
        found, tail = run_cell(chain, point, fault, tmp_path, i)
        problems += found
        if tail:
            logs.append(tail)
        if any("never fired" in p for p in found) and chain.shares_a_root:
            break  # the search ran on to its budget: the later cells would test nothing
    else:
        problems += last_run(chain, tmp_path, logs)
    assert not problems, "\n".join(problems) + "\n" + "\n".join(logs[-3:])


def fault_checks(
    chain: Chain,
    point: Point,
    fault: Fault,
    launch: Result,
    fired: list[dict[str, Any]],
    since: float | None,
) -> list[str]:
    """The cell's fault fired (its first record, or none), every process ended by its
    own path from ``since`` on (given whenever it fired), and the cell's EXTRA checks."""
    if not fired:
        return [f"the fault never fired at {point.name}: the cell did not test"]
    assert since is not None
    problems = []
    try:
        launch.ended_on_their_own(since)
    except AssertionError as exc:
        problems.append(str(exc).split(" records from ")[0])
    check = EXTRA.get((chain.launcher, point.name, fault.name))
    if check is not None:
        problems += check(launch, fired[0])
    return problems


def runs_no_function(launcher: str, point: Point, want: Expect) -> bool:
    """The cell's faulted trial is counted by no rank (faults.py counts the trials whose
    function a process ran): its leader's step raised before the hand-over (the
    followers never held it), or, under Lightning, a rank raised while the group formed
    again, which each rank does there before its function runs (seen in the records)."""
    assert point.trial is not None
    crashed = want.trials[str(point.trial)] == S({"crashed"})
    return crashed and (point.kind == "before" or (launcher, point.name) == ("lightning", "form"))


def shifted(text: str, by: int) -> str:
    """A cell's faults, each ``trial=N`` moved ``by`` evaluations later."""
    return re.sub(r"trial=(\d+)", lambda m: f"trial={int(m.group(1)) + by}", text)


def last_run(chain: Chain, tmp_path: Path, logs: list[str]) -> list[str]:
    """The same command once more: it finishes the budget. It first evaluates the trials
    the last stopping cell left pending (each a success), then the cells that go on
    (``Chain.going``), each in trials of its own, their faults shifted there, and spends
    the rest of the budget (each trial a success)."""
    if not chain.shares_a_root:
        return []
    root = tmp_path / "results"
    before = neps_view(root)
    retries = sum(1 for state, _ in before.values() if state not in FINISHED)
    plan = []
    at, lag = retries, 0
    for point, fault in chain.going:
        want = expect(chain.launcher, point, fault)
        assert isinstance(want, Expect) and point.trial is not None
        plan.append((point, fault, want, at, at - lag))
        at += len(want.trials)
        if runs_no_function(chain.launcher, point, want):
            lag += 1
    spent = sum(1 for state, _ in before.values() if state in FINISHED)
    assert at <= chain.budget - spent, f"{chain.id}: its budget leaves too few for its cells"
    text = ", ".join(shifted(spec(p, f, RANKS[chain.launcher]), by) for p, f, _, _, by in plan)
    last = run(chain.command(), tmp_path, name="last", fault=text)
    after = neps_view(root)
    order = handed_order(last)
    problems: list[str] = []
    found = check_finished(before, after, chain.budget)
    found += check_exits(chain.launcher, ALL_ZERO, last, last=True, others_want=S({0}))
    found += [
        f"trial {n} of the launch ({tid}) is {after.get(tid, ('missing',))[0]}, want success"
        for n, tid in enumerate(order, start=1)
        if not any(at < n <= at + len(want.trials) for _, _, want, at, _ in plan)
        and after.get(tid, ("missing",))[0] != "success"
    ]
    if plan:  # the records of a launch without a fault name no trial handed out
        found += untouched(before, after, order)
    problems += [f"{chain.id}, the last run: {p}" for p in found]
    for point, fault, want, at, by in plan:
        problems += going_cell(chain, point, fault, want, at, by, last, after, order)
    if problems:
        logs.append(last.tail(40))
    return problems


def going_cell(
    chain: Chain,
    point: Point,
    fault: Fault,
    want: Expect,
    at: int,
    by: int,
    launch: Result,
    after: dict[str, tuple[str, Any]],
    order: list[str],
) -> list[str]:
    """A cell of the last run: its fault fired at its step in its own trials (the
    launch's ``at + 1``, ...; its processes' count of the trials they ran, ``by + 1``,
    ...), which are as the table says; the launch ended on its own; its EXTRA checks."""
    assert point.trial is not None
    fired = [
        # EXTRA's checks read the trial's place in the launch's order as its ``seq``
        dict(e, seq=e["seq"] + at - by)
        for e in launch.of("fault")
        if e.get("where") == point.name and e.get("seq") == point.trial + by
    ]
    last = max((e["t"] for e in launch.of("fault")), default=None)
    problems = fault_checks(chain, point, fault, launch, fired[:1], last if fired else None)
    problems += check_states(replace(want, goes_on=False), after, order, at)
    report(
        {
            "cell": f"{chain.launcher}-{point.name}-{fault.name}",
            "spec": shifted(spec(point, fault, RANKS[chain.launcher]), by),
            "row": want.row,
            "ok": not problems,
            "problems": problems,
            "launcher_rc": launch.returncode,
            "handed": [(tid, after.get(tid, ("missing",))[0]) for tid in order],
        }
    )
    head = f"{chain.launcher}-{point.name}-{fault.name} (in the last run, trials {at + 1}-"
    head += f"{at + len(want.trials)}), row {want.row!r}"
    return [f"{head}: {p}" for p in problems]


ALL_ZERO = Expect("returns", {}, S({0}), S({0}), False)


# ---------------------------------------------------------------- EXTRA: cells that check more
# The end-to-end launches that ran these cells' scenarios before (a Lightning search,
# 2 ranks, the fault in fit of its 2nd trial or while its NePS samples the 3rd) are gone
# from tests/e2e; what they checked beyond the table is checked here, on the cell's own
# launch (docs/test-tiers.md lists each).

ABORTED = ("terminate called", "Fatal Python error", "Aborted", "core dumped")
GLOO_CLOSED = r"RuntimeError: \[[^\]]*gloo/transport/tcp/pair\.cc:\d+\] Connection closed by peer \[127\.0\.0\.1\]:\d+\. [^\n]*"
TERMINATED = (
    r"\n--- traceback of rank 1 \(pid {pid1}\) ---\nTraceback \(most recent call last\):\n"
    r".*\n[\w.]*Terminated: 143\n"
)
"""Rank 1's traceback, ending in its Terminated: 143. Its frames are wherever the signal
found it: the leader sends it from its own step (the removed launch's follower signalled
itself, so its traceback ran through ``faults.at("fit")``)."""
RAISED = {
    # fault -> each rank's (what its evaluation raised, that error's whole text)
    "term_all": {0: ("Terminated", "143"), 1: ("Terminated", "143")},
    # One rank only: Lightning's own SIGTERM handler would broadcast on the group from
    # inside the handler and hang every rank.
    "term_follower": {
        0: (
            "TrialFailedError",
            r"\[neps_bcast rank 0/2 leader\] trial {tid} failed on rank 1: rank 1: Terminated:"
            r" 143\. Caused by it: rank 0: " + GLOO_CLOSED + TERMINATED,
        ),
        1: ("Terminated", "143"),
    },
    # The follower names the leader's error, then stops when its leader says so.
    "int_leader": {
        0: ("SystemExit", "1"),
        1: (
            "TrialFailedError",
            r"\[neps_bcast rank 1/2 follower\] trial {tid} failed on rank 0: rank 0:"
            r" SystemExit: 1\. Caused by it: rank 1: " + GLOO_CLOSED + r"\n"
            r"--- traceback of rank 0 \(pid {pid0}\) ---\n.*\nSystemExit: 1\n",
        ),
    },
}
NEPS_TEXT = {"int_leader": r"interrupted: SystemExit 1"}
"""NePS's whole error text for the faulted trial, where it is recorded crashed."""


def signal_in_fit(fault: str) -> Any:
    """A signal in fit: what each rank raised, NePS's text, and a clean interpreter end."""

    def check(launch: Result, fired: dict[str, Any]) -> list[str]:
        problems = []
        seq = fired["seq"]
        pids = {f"pid{e['proc_rank']}": e["pid"] for e in launch.of("start")}
        leader = trials_by_rank(launch.events).get(0, [])
        tid = leader[seq - 1][0] if len(leader) >= seq else "?"
        by_rank = raised(launch, seq)
        if sorted(by_rank) != [0, 1]:
            problems.append(f"ranks that raised in trial {tid}: {sorted(by_rank)}, want [0, 1]")
        for rank, (kind, pattern) in RAISED[fault].items():
            got = by_rank.get(rank)
            want = pattern.format(tid=tid, **pids)
            if got is None or got["type"] != kind or not re.fullmatch(want, got["text"], re.DOTALL):
                problems.append(f"rank {rank} raised {got}, want {kind}: {want!r}")
        if fault in NEPS_TEXT:
            text = reports(launch.root).get(int(tid), ("", "", ""))[2] if tid != "?" else ""
            if not re.fullmatch(NEPS_TEXT[fault], text, re.DOTALL):
                problems.append(f"NePS's text for trial {tid}: {text!r}, want {NEPS_TEXT[fault]!r}")
        leader_exit = launch.exits.get(0)
        if leader_exit is None or leader_exit["ok"]:
            problems.append(f"the leader's exit record {leader_exit}: want one not ok")
        return problems + clean_interpreter_ends(launch)

    return check


def clean_interpreter_ends(launch: Result) -> list[str]:
    """Both ranks watched their trials' objects (the positive control), none was left to
    the interpreter's finalization, and no rank aborted at exit (an abort comes after the
    exit record, in the rank's own log)."""
    problems = []
    at_exit = {e["proc_rank"]: e for e in launch.of("at_exit")}
    if sorted(at_exit) != [0, 1] or not all(e["trial_objects_seen"] > 0 for e in at_exit.values()):
        problems.append(f"the ranks' at_exit records: {at_exit}, want both watching objects")
    problems += [
        f"rank {rank} left {e['trial_objects_alive']} to the interpreter's finalization"
        for rank, e in at_exit.items()
        if e["trial_objects_alive"]
    ]
    problems += [
        f"{name}'s log says {marker!r}: it aborted at exit"
        for name, log in launch.rank_logs.items()
        for marker in ABORTED
        if marker in log
    ]
    return problems


def survivor_exit(launch: Result, rank: int, error: str) -> tuple[dict[str, Any] | None, list[str]]:
    """The rank that outlived its SIGKILLed peer: the only exit record (the killed one
    writes none), code 1, raising an error that starts with ``error``."""
    exits = launch.exits
    record = exits.get(rank)
    role = "leader" if rank == 0 else "follower"
    if sorted(exits) != [rank] or record is None:
        return None, [f"exit records by rank {sorted(exits)}, want the {role}'s only"]
    if record["code"] != 1 or not str(record["error"]).startswith(error):
        return record, [f"the {role}'s exit {record['code']} {record['error']!r}"]
    return record, []


def leader_killed(launch: Result, fired: dict[str, Any]) -> list[str]:
    """The follower exits 1 raising LeaderLostError naming it, says so in its log, and
    leaves by the exit that skips the final collection (the probe's "exit_path")."""
    follower, problems = survivor_exit(launch, 1, "LeaderLostError: [neps_bcast rank 1/")
    if follower is None:
        return problems
    lost = [
        line
        for line in launch.log.splitlines()
        if "[neps_bcast rank 1/" in line
        and ("lost the leader (rank 0)" in line or "cannot reach the leader's store" in line)
    ]
    if not lost:
        problems.append("the follower never logged that it lost its leader")
    paths = [e for e in launch.of("exit_path") if e["pid"] == follower["pid"]]
    if len(paths) != 1 or paths[0]["gc_frozen"] <= 0:
        problems.append(f"the follower's exit path {paths}: want the final collection skipped")
    return problems


def handed_at(launch: Result, fired: dict[str, Any]) -> str:
    """The id of the trial the fault landed in (the ``seq``-th NePS handed the leader)."""
    order = handed_order(launch)
    return order[fired["seq"] - 1] if len(order) >= fired["seq"] else "?"


def follower_killed(launch: Result, fired: dict[str, Any]) -> list[str]:
    """The SIGKILLed follower recorded no exit; the leader exits 1 raising
    FollowerLostError that names rank 1."""
    prefix = "FollowerLostError: [neps_bcast rank 0/2 leader] rank 1 lost: "
    return survivor_exit(launch, 0, prefix)[1]


def follower_terminated(launch: Result, fired: dict[str, Any]) -> list[str]:
    """The signal in fit's checks, and the leader's exit names the follower's SIGTERM in
    its trial."""
    problems = signal_in_fit("term_follower")(launch, fired)
    tid = handed_at(launch, fired)
    error = str((launch.exits.get(0) or {}).get("error"))
    if f"rank 1 was terminated (Terminated: 143) in trial {tid}" not in error:
        problems.append(f"the leader's exit error {error!r} does not name rank 1's SIGTERM")
    return problems


def interrupted_after_hand_over(launch: Result, fired: dict[str, Any]) -> list[str]:
    """The leader left right after it handed the trial over, its follower already on its
    way into the trial's first meeting: the follower ends that trial naming the leader's
    SIGTERM, and neither rank ran the user's function for it."""
    tid = handed_at(launch, fired)
    problems = []
    ended = (
        rf"rank 1/2 follower\] trial {re.escape(tid)} raised TrialFailedError: .*failed on"
        r" rank 0: rank 0: Terminated"
    )
    if not re.search(ended, launch.log):
        problems.append(f"the follower never ended trial {tid} naming the leader's SIGTERM")
    ran = sorted(e["rank"] for e in launch.of("trial") if e["trial_id"] == tid)
    if ran:
        problems.append(f"trial {tid} ran in the user's function on ranks {ran}")
    return problems


def user_error_not_retried(launch: Result, fired: dict[str, Any]) -> list[str]:
    """A user's exception is the trial's own failure: evaluated once on both ranks, its
    lease lists no interrupted attempt, nothing is taken for an orphan, and no process
    left its trials to the interpreter's finalization."""
    tid = handed_at(launch, fired)
    problems = []
    ranks = sorted(e["rank"] for e in launch.of("trial") if e["trial_id"] == tid)
    if ranks != [0, 1]:
        problems.append(f"trial {tid} evaluated on ranks {ranks}, want once on [0, 1]")
    lease = read_lease(launch.root / "configs" / f"config_{tid}")
    if lease is None or lease.attempts != ():
        problems.append(f"trial {tid}'s lease {lease}: want one with no interrupted attempt")
    if f"orphaned trial {tid} " in launch.log:
        problems.append(f"trial {tid} was taken for an orphan")
    problems += [
        f"pid {e['pid']} left {e['trial_objects_alive']} to the interpreter's finalization"
        for e in launch.of("at_exit")
        if e["trial_objects_alive"]
    ]
    return problems


def follower_stopped_waiting(launch: Result, fired: dict[str, Any]) -> list[str]:
    """A follower SIGTERMed while it waits for the next trial evaluates nothing after."""
    late = [e["trial_id"] for e in launch.of("trial") if e["rank"] == 1 and e["t"] > fired["t"]]
    return [f"the follower evaluated {late} after its SIGTERM"] if late else []


EXTRA = {
    ("torchrun", "handed", "term_leader"): interrupted_after_hand_over,
    ("lightning", "sample", "term_follower"): follower_stopped_waiting,
    ("lightning", "fit", "term_all"): signal_in_fit("term_all"),
    ("lightning", "fit", "term_follower"): follower_terminated,
    ("lightning", "fit", "kill_follower"): follower_killed,
    ("lightning", "fit", "raise"): user_error_not_retried,
    ("lightning", "fit", "int_leader"): signal_in_fit("int_leader"),
    ("lightning", "fit", "kill_leader"): leader_killed,
    ("lightning", "sample", "kill_leader"): leader_killed,
}
