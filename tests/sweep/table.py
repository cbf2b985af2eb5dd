"""Every fault at every step: the table the fault-point sweep checks, and the docs show.

One cell is a launcher, a step (``POINTS``: where in the leader's or the followers'
loop the fault lands) and a fault (``FAULTS``). Its expected outcome (``expect``) comes
from the rules of "How a trial ends" (``ROWS``, the same rows docs/failures.md shows,
generated from here by docs/generate_fault_table.py): which state NePS holds each trial
in after the launch, the exit status the kernel reports for the leader and for the
follower, and whether running the same command again must finish the budget with the
interrupted trial a success. The sweep (tests/sweep/test_sweep.py) runs every reachable
cell; a cell that cannot be reached says why.

Nothing here imports torch, NePS or neps_bcast.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

LAUNCHERS = ("lightning", "torchrun", "torchrun3")
"""``python script.py`` under Lightning ``strategy="ddp"`` (Lightning starts the
follower) and ``torchrun --standalone --nproc-per-node 2`` with a plain DDP loop; and
the same on 3 ranks (``torchrun3``: a second follower, rank 2, looks on)."""

RANKS = {"lightning": 2, "torchrun": 2, "torchrun3": 3}


@dataclass(frozen=True)
class Point:
    name: str
    what: str
    owner: str
    """Who reaches the step: "leader", or "every" rank."""
    kind: str
    """"before" (in the trial, before the hand-over), "trial" (in the trial, the
    followers hold it), "settle" (the leader settles an interrupted trial), "between"
    (the trial ended, NePS records it and samples the next), "end" (the search is over)."""
    trial: int | None = 2
    """The trial (by the leader's order of evaluation) the fault lands in."""
    prelude: str = ""
    """A fault that must come first for the step to be reached at all."""
    trials: int = 3
    """The search's budget (``--trials``)."""


POINTS = (
    Point(
        "orphans",
        "while the leader looks for orphans, before the trial's lease",
        "leader",
        "before",
    ),
    Point("lease", "before the leader takes the trial's lease", "leader", "before"),
    Point("leased", "after the lease is taken, before the hand-over", "leader", "before"),
    Point("handed", "right after the leader handed the trial to the group", "leader", "trial"),
    Point(
        "form",
        "re-forming the group for the trial after a failed one",
        "every",
        "trial",
        trial=3,
        prelude="raise:follower:trial=2:at=fit",
        trials=4,
    ),
    Point("fit", "in the user's function (a training step)", "every", "trial"),
    Point("exchange", "before the trial-end exchange", "every", "trial"),
    Point(
        "settle",
        "while the leader settles an interrupted trial (after SIGTERM to it in fit)",
        "leader",
        "settle",
        prelude="sigterm:leader:trial=2:at=fit",
    ),
    Point("record", "while NePS records the finished trial", "leader", "between"),
    Point("sample", "while NePS samples the next trial", "leader", "between"),
    Point("stop", "at STOP and the goodbye, the search over", "leader", "end", None, trials=2),
)


@dataclass(frozen=True)
class Fault:
    name: str
    what: str
    kind: str
    """tests/scripts/faults.py's KIND."""
    to: str = ""
    """Whom a signal goes to (faults.py's ``to=``); "" for an exception at the step."""


FAULTS = (
    Fault("term_leader", "SIGTERM to the leader", "sigterm", "leader"),
    Fault("term_follower", "SIGTERM to the follower (rank 1)", "sigterm", "follower"),
    Fault(
        "term_all",
        "SIGTERM to every rank at once (preemption), and to the leader again 0-300 ms later"
        " (`scancel` twice)",
        "sigterm2",
        "all",
    ),
    Fault("int_leader", "SIGINT to the leader", "sigint", "leader"),
    Fault("kill_leader", "SIGKILL to the leader", "sigkill", "leader"),
    Fault("kill_follower", "SIGKILL to the follower (rank 1)", "sigkill", "follower"),
    Fault(
        "freeze_leader",
        "the leader frozen (SIGSTOP: a hung node, nothing closes)",
        "sigstop",
        "leader",
    ),
    Fault(
        "freeze_follower",
        "the follower (rank 1) frozen (SIGSTOP: a hung node, nothing closes)",
        "sigstop",
        "follower",
    ),
    Fault(
        "raise", "an exception at the step (the follower's, where every rank reaches it)", "raise"
    ),
)

SILENT_BOUND_S = 3
"""``NEPS_BCAST_PEER_TIMEOUT_S`` in a frozen cell's launch (the default is 30 s)."""


@dataclass(frozen=True)
class Row:
    """A row of "How a trial ends"."""

    key: str
    how: str
    state: str
    next_by: str
    exits: str


ROWS = (
    Row("returns", "the function returns", "`success`", "nobody", "0 at the end of the search"),
    Row(
        "user_error",
        "the user's code raises on any rank (a bad config), or a step of neps_bcast's own"
        " before the trial's result raises",
        "`crashed`, with every rank's error",
        "nobody, never retried (1)",
        "1 (`WorkerRaiseError`); with `ignore_errors=True` the search goes on",
    ),
    Row(
        "preempted",
        "SIGTERM to the launch or to the leader (preemption, `scancel`,"
        " `--signal=TERM@...`), after any handler installed before `run`; a second SIGTERM"
        " while the first is handled is ignored",
        "`pending`",
        "the next leader (2)",
        "143 on every rank that got it (3); a follower the leader stopped: 0",
    ),
    Row(
        "handler_exits",
        "a handler of SIGTERM / SIGUSR1 / SIGUSR2 exits (`--signal=USR1@...`"
        " requeue-and-exit, submitit), or the code exits after such a signal",
        "`pending`",
        "the next leader (2)",
        "the handler's own",
    ),
    Row(
        "follower_terminated",
        "SIGTERM to one follower",
        "`pending`; the leader samples nothing for its broken group",
        "the next leader (2)",
        "follower 143, leader 1 (`FollowerLostError: rank 1 was terminated ...`)",
    ),
    Row(
        "follower_lost",
        "a follower is killed (SIGKILL, the OOM killer) or lost",
        "`pending`; the leader samples nothing for its broken group",
        "the next leader (2)",
        "leader 1 (`FollowerLostError: rank 1 lost: signal 9 (SIGKILL)`)",
    ),
    Row(
        "leader_lost",
        "the leader is killed (SIGKILL, OOM), or NePS's own recording or sampling raises in it",
        "`evaluating` until a leader proves it dead, then `pending`",
        "the next leader on the root, or a running one after its trial; at once on the"
        " same machine",
        "followers 1 (`LeaderLostError`); a leader whose `neps.run` raised: 1, its followers 0",
    ),
    Row(
        "follower_silent",
        "a follower is silent for `NEPS_BCAST_PEER_TIMEOUT_S` (30 s): frozen (SIGSTOP, a"
        " paused VM), its node lost or cut off (no FIN, no RST); tested by the"
        " `freeze_follower` cells, `tests/e2e/test_e2e_silent.py` and the cut-off cells"
        " of `tests/hosts/test_hosts.py`",
        "`pending`; the leader samples nothing for its broken group",
        "the next leader (2)",
        "leader 1 (`FollowerLostError: rank 1 (pid N on host H) silent for 31 s while"
        " ...`); on this host the silent follower is SIGKILLed by its leader (-9)",
    ),
    Row(
        "leader_silent",
        "the leader is silent for `NEPS_BCAST_PEER_TIMEOUT_S` (30 s): frozen, its"
        " node lost or cut off; tested by the `freeze_leader` cells,"
        " `tests/e2e/test_e2e_silent.py` and `tests/hosts/test_hosts.py`'s leader's host"
        " cut off",
        "on this host: as a killed leader (SIGKILLed by a follower); elsewhere: the leader"
        " finds its followers silent and puts the trial back to `pending` itself where it"
        " still reaches the root, else as a lost node",
        "as the row it becomes",
        "followers 1 (`lost the leader: rank 0 ... silent for 31 s while ...`); the leader"
        " -9 on this host, 1 elsewhere",
    ),
    Row(
        "node_lost",
        "the leader's node is lost (power, network, a container on another node); tested"
        " by `tests/hosts/test_hosts.py` (a host cut off) and `tests/test_fencing.py`",
        "`evaluating` until its heartbeat is older than `NEPS_BCAST_LEASE_GRACE_S`, then `pending`",
        "a leader on another host or container, at its start or after its trial",
        "-",
    ),
    Row(
        "retries_spent",
        "an infrastructure row, more than `NEPS_BCAST_MAX_RETRIES` (3) times for one trial",
        "`crashed`, listing every attempt (who, when, how it ended)",
        "nobody",
        "as the row",
    ),
    Row(
        "user_stop",
        "Ctrl-C / SIGINT, `sys.exit` in the function with no stop signal before it: the"
        " user's own stop",
        "`crashed` (`interrupted: ...`)",
        "nobody",
        "1 (-2 where Python re-raises SIGINT on itself)",
    ),
    Row(
        "pool_lost",
        "in a pool (`neps-bcast launch --pool`), a process of one trial is lost: one of its"
        " ranks is killed or terminated, or its agent (the NePS worker) is killed; or one of"
        " them is silent for `NEPS_BCAST_PEER_TIMEOUT_S` (frozen, hung) and SIGKILLed (a"
        " rank by its trial's rank 0 or the launcher, an agent by the launcher)",
        "`pending`; the pool's other trials go on",
        "the same launch, on fresh ranks (a killed agent: the fresh agent the launcher"
        " starts in its place proves the trial's lease dead at its start)",
        "the lost process its signal's; the trial's other ranks 0, 1 where they saw it"
        " lost, or -9 where they still waited for it 10 s later or their agent was lost"
        " (SIGKILLed at once); the launch 0",
    ),
    Row(
        "pool_stopped",
        "SIGTERM or Ctrl-C to a pool's launcher; the launcher killed, or silent for"
        " `NEPS_BCAST_PEER_TIMEOUT_S` (frozen, hung: SIGKILLed by the first of its agents"
        " and ranks that finds it so)",
        "`pending`, every trial running or waiting for ranks",
        "the same command again",
        "the launcher 128 + the signal (143, 130; -9 killed); every agent and rank 143 (a"
        " rank told the search is over first: 0; one with nothing to settle: -15)",
    ),
    Row(
        "between_trials",
        "any of these between two trials (while NePS records the last and samples the"
        " next): the stop waits for the leader's next step",
        "the finished trial as recorded; the next one, if NePS sampled it, as its row says",
        "as the row",
        "as the row",
    ),
)

ROW_KEYS = {row.key for row in ROWS}


@dataclass(frozen=True)
class Expect:
    row: str
    """The row of ``ROWS`` whose rule this cell follows."""
    trials: dict[str, frozenset[str]]
    """Trial id -> the NePS states it may be in after the launch (ids in a fresh root
    are the order NePS sampled them: "1", "2", ...)."""
    leader: frozenset[int]
    """The exit statuses the kernel may report for the leader (-N: signal N)."""
    follower: frozenset[int]
    rerun: bool
    """Running the same command again must finish the budget, every retried trial a
    success."""
    note: str = ""
    goes_on: bool = False
    """The search goes on after the cell's trials: every later trial a success."""
    maybe: frozenset[str] = frozenset()
    """Trial ids of ``trials`` that NePS may not have handed out at all."""


@dataclass(frozen=True)
class Unreachable:
    why: str


S = frozenset


def states(*pairs: tuple[int, str | tuple[str, ...]]) -> dict[str, frozenset[str]]:
    return {str(n): S((s,) if isinstance(s, str) else s) for n, s in pairs}


OK = "success"


OWN_CODE_ONLY = {
    "exchange": "only neps_bcast's exchange runs here, and it raises nothing but a lost"
    " peer (the kill and SIGTERM cells); the user's code raising just before it is the"
    " `fit` cell's",
    "stop": "only neps_bcast's STOP and goodbye run here, and they raise nothing but a lost"
    " peer (the kill and SIGTERM cells)",
}
"""Steps where an exception could only be a bug of neps_bcast's own: no code of the
user's, NePS's or the filesystem's runs there."""


def expect(launcher: str, point: Point, fault: Fault) -> Expect | Unreachable:
    """What one cell must end in, by the rows of "How a trial ends"."""
    if fault.kind == "sigstop":
        # On one host a frozen rank's peer ends it (SIGKILL) once it has been silent for
        # the bound: from then on the cell is the kill cell of the same rank.
        killed = next(f for f in FAULTS if f.name == fault.name.replace("freeze", "kill"))
        base = expect(launcher, point, killed)
        if isinstance(base, Unreachable):
            return base
        row = "leader_silent" if fault.to == "leader" else "follower_silent"
        return replace(base, row=row, note=f"{base.note} (frozen, then SIGKILLed by its peer)")
    if fault.kind == "raise" and point.name in OWN_CODE_ONLY:
        return Unreachable(OWN_CODE_ONLY[point.name])
    n = point.trial or point.trials
    done = [(i, OK) for i in range(1, n)]
    if point.prelude.startswith("raise"):
        done = [(i, OK if i != n - 1 else "crashed") for i in range(1, n)]
    torchrun = launcher.startswith("torchrun")
    # torchrun SIGTERMs every worker still alive once one exits non-zero ("Sending
    # process N closing signal SIGTERM"): a follower told to stop may be caught by it.
    stopped = S({0, -15, 143}) if torchrun else S({0})
    # Lightning turns Ctrl-C in its fit into exit 1; elsewhere Python re-raises SIGINT.
    interrupt_exit = S({1, -2})

    if point.kind == "end":
        every = states(*[(i, OK) for i in range(1, point.trials + 1)])
        return _at_the_end(fault, every, stopped, interrupt_exit, torchrun)

    if point.kind == "settle":
        # The prelude (SIGTERM to the leader in fit) has the trial on its way back to
        # pending; the fault lands while the leader puts it there.
        pending = states(*done, (n, "pending"))
        if fault.name in ("term_leader", "term_all"):
            return Expect("preempted", pending, S({143}), _also(stopped, 143), True)
        if fault.name == "term_follower":
            return Expect("preempted", pending, S({143}), S({0, 143, -15}), True)
        if fault.name == "int_leader":
            return Expect(
                "preempted",
                states(*done, (n, ("evaluating", "pending"))),
                S({143}),
                stopped,
                True,
                "the first stop wins; a Ctrl-C that cuts the settling short leaves the trial"
                " to its lease, which the next start puts back",
            )
        if fault.name == "kill_leader":
            return Expect(
                "leader_lost",
                states(*done, (n, ("evaluating", "pending"))),
                S({-9}),
                S({0, 1}),
                True,
            )
        if fault.name == "kill_follower":
            return Expect("preempted", pending, S({143}), S({-9}), True)
        return Expect(
            "preempted",
            states(*done, (n, ("evaluating", "pending"))),
            S({143}),
            stopped,
            True,
            "a settle that raises is a note on the SIGTERM; the lease puts the trial back",
        )

    if point.kind == "between":
        return _between(point, fault, done, n, stopped, interrupt_exit, torchrun)

    # In the trial: before or after the hand-over.
    handed = point.kind == "trial"
    if fault.name == "term_leader":
        return Expect("preempted", states(*done, (n, "pending")), S({143}), stopped, True)
    if fault.name == "term_all":
        return Expect(
            "preempted", states(*done, (n, "pending")), S({143}), _also(stopped, 143), True
        )
    # Lightning's observer SIGKILLs the leader once a child exited non-zero, after a
    # grace for the leader to settle the trial (10 s): a leader slower to leave is killed.
    observed = S() if torchrun else S({-9})
    if fault.name in ("term_follower", "kill_follower") and point.name == "exchange":
        # At the trial's very end the follower may be lost after the exchange completed
        # the trial on every rank: it is a success, and the next one goes back instead.
        return Expect(
            "follower_terminated" if fault.name == "term_follower" else "follower_lost",
            states(*done, (n, ("pending", OK)), (n + 1, "pending")),
            S({1}) | observed,
            S({143}) if fault.name == "term_follower" else S({-9}),
            True,
            "lost after the trial-end exchange: the trial is complete; the next goes back",
            maybe=S({str(n + 1)}),
        )
    if fault.name == "term_follower":
        return Expect(
            "follower_terminated",
            states(*done, (n, "pending")),
            S({1}) | observed,
            S({143}),
            True,
        )
    if fault.name == "int_leader":
        return Expect("user_stop", states(*done, (n, "crashed")), interrupt_exit, stopped, True)
    if fault.name == "kill_leader":
        return Expect("leader_lost", states(*done, (n, "evaluating")), S({-9}), S({1}), True)
    if fault.name == "kill_follower":
        return Expect(
            "follower_lost", states(*done, (n, "pending")), S({1}) | observed, S({-9}), True
        )
    # raise
    rest = [(i, OK) for i in range(n + 1, point.trials + 1)]
    if point.name == "orphans":
        return Expect(
            "returns",
            states(*done, (n, OK), *rest),
            S({0}),
            S({0}),
            False,
            "a failed look for orphans is logged and tried again before a later trial",
            goes_on=True,
        )
    return Expect(
        "user_error",
        states(*done, (n, "crashed"), *rest),
        S({0}),
        S({0}),
        False,
        "" if handed else "the followers never held the trial",
        goes_on=True,
    )


def _between(
    point: Point,
    fault: Fault,
    done: list[tuple[int, str]],
    n: int,
    stopped: frozenset[int],
    interrupt_exit: frozenset[int],
    torchrun: bool,
) -> Expect:
    """Trial n ended; NePS records it and samples n + 1. A stop waits for the leader's
    next step: n stays as recorded, n + 1 (sampled) goes back as its row says."""
    finished = [*done, (n, OK)]
    nxt = n + 1
    if fault.name == "term_leader":
        return Expect(
            "between_trials", states(*finished, (nxt, "pending")), S({143}), stopped, True
        )
    if fault.name == "term_all":
        return Expect(
            "between_trials",
            states(*finished, (nxt, "pending")),
            S({143}),
            _also(stopped, 143),
            True,
        )
    if fault.name == "term_follower":
        return Expect("between_trials", states(*finished, (nxt, "pending")), S({1}), S({143}), True)
    if fault.name == "int_leader":
        return Expect(
            "between_trials", states(*finished, (nxt, "crashed")), interrupt_exit, stopped, True
        )
    if fault.name == "kill_leader":
        # Killed inside NePS's record: the result of n is lost with the process (no
        # process can record after SIGKILL); n goes back to pending and is evaluated
        # again. Killed later: n is recorded, n + 1 may not be sampled yet.
        if point.name == "record":
            return Expect("leader_lost", states(*done, (n, "evaluating")), S({-9}), S({1}), True)
        return Expect("leader_lost", states(*finished), S({-9}), S({1}), True)
    if fault.name == "kill_follower":
        return Expect("between_trials", states(*finished, (nxt, "pending")), S({1}), S({-9}), True)
    # raise
    if point.name == "record":
        return Expect("leader_lost", states(*done, (n, "evaluating")), S({1}), stopped, True)
    why = {"sample": "NePS samples again after a sampling that raised"}
    return Expect(
        "between_trials",
        states(*finished, *[(i, OK) for i in range(nxt, point.trials + 1)]),
        S({0}),
        S({0}),
        False,
        why[point.name],
        goes_on=True,
    )


GOODBYE = (
    "the leader exits 0 when its STOP reached the follower and only the goodbye was"
    " missing, 1 when STOP found it gone"
)


def _at_the_end(
    fault: Fault,
    every: dict[str, frozenset[str]],
    stopped: frozenset[int],
    interrupt_exit: frozenset[int],
    torchrun: bool,
) -> Expect:
    """The search is over, every trial recorded: nothing is lost whatever comes. A stop
    that lands on the leader waits until its followers are stopped; the exit statuses
    say what came."""
    # Lightning's observer SIGKILLs the leader once a child exited non-zero.
    observed = S() if torchrun else S({-9})
    if fault.name == "term_leader":
        return Expect("preempted", every, S({143}), stopped, False)
    if fault.name == "term_all":
        return Expect("preempted", every, S({143}) | observed, S({143}), False)
    if fault.name == "term_follower":
        return Expect("follower_terminated", every, S({0, 1}) | observed, S({143}), False, GOODBYE)
    if fault.name == "int_leader":
        return Expect("user_stop", every, interrupt_exit, stopped, False)
    if fault.name == "kill_leader":
        return Expect("leader_lost", every, S({-9}), S({1}), False)
    if fault.name == "kill_follower":
        return Expect("follower_lost", every, S({0, 1}) | observed, S({-9}), False, GOODBYE)
    return Expect(
        "leader_lost", every, S({1}), stopped, False, "the followers are stopped all the same"
    )


def _also(codes: frozenset[int], *more: int) -> frozenset[int]:
    return codes | S(more)


def bystander(point: Point, want: Expect, fault: Fault) -> frozenset[int]:
    """The exit statuses of a follower the fault did not name (rank 2 of 3): as the
    follower's, except where one follower was lost; then the leader stops the search
    without a STOP it could send on the broken group, and the bystander, seeing its
    leader gone, exits 1 (``LeaderLostError``), or torchrun closes it first; at the end
    of the search it may have had its STOP (0)."""
    if fault.to == "follower":
        return S({0, 1}) if point.kind == "end" else S({1})
    return want.follower


def spec(point: Point, fault: Fault, ranks: int = 2) -> str:
    """The cell's NB_FAULT (tests/scripts/faults.py). On more than 2 ranks a fault
    "to the follower" goes to rank 1 alone."""
    # Where every rank reaches the step, a signal lands on one rank as the other reaches
    # it (the leader leaves while its follower is at the trial-end exchange), one to
    # every rank as the leader does, and the exception is the follower's.
    follower_reaches = point.owner == "every" and fault.to in ("leader", "")
    who = "follower" if follower_reaches else "leader"
    trial = f":trial={point.trial}" if point.trial is not None else ""
    text = f"{fault.kind}:{who}{trial}:at={point.name}"
    if fault.to:
        text += f":to={'rank1' if fault.to == 'follower' and ranks > 2 else fault.to}"
    if fault.kind == "sigterm2":
        # The second SIGTERM goes to the leader alone: what its handler ignores while it
        # settles the first is the leader's to decide, whoever else was signalled.
        text += f":s={delay(point):g}:again=leader"
    return f"{point.prelude}, {text}" if point.prelude else text


def delay(point: Point) -> float:
    """The second SIGTERM's delay: 0 to 300 ms, spread over the steps."""
    return round(0.3 * POINTS.index(point) / (len(POINTS) - 1), 2)


SWEPT = {
    "torchrun": tuple(p.name for p in POINTS),
    "lightning": ("handed", "form", "fit", "exchange", "settle", "sample", "stop"),
    "torchrun3": ("fit", "exchange", "stop"),
}
"""The steps swept under each launcher: every one under torchrun; under Lightning those
whose path differs there (Lightning forms the group and starts the follower at trial 1,
and its observer ends the launch when a child exits non-zero), plus ``sample`` for the
steps between trials. The others (``orphans``, ``lease``, ``leased``, ``record``) run
the leader's same code while the follower waits in the same receive under either. On 3
ranks, the steps where a second follower is in a collective with the one the fault
names: the user's training step, the trial-end exchange, STOP and the goodbye."""

FROZEN_AT = {
    "torchrun": ("handed", "form", "exchange", "sample", "stop"),
    "lightning": ("handed", "form", "exchange", "sample", "stop"),
    "torchrun3": (),
}
"""The steps where a rank is frozen: every step where a rank can wait on another
(waiting for the next trial while NePS samples, the hand-over, forming the group, the
trial-end exchange, STOP), under both launchers. A frozen rank's cell costs its kill
cell plus the bound (``SILENT_BOUND_S``). Inside the user's training collectives
(``fit``) the same four cells, each with its rerun, are tests/e2e/test_e2e_silent.py's,
which check more (the step, the seconds and the host named): not run twice."""


def on_3_ranks_instead(launcher: str, point: Point, fault: Fault) -> bool:
    """A torchrun cell that its 3-rank twin runs instead: on 3 ranks the fault lands on
    the same leader or follower (rank 1), the table expects the same of both and of the
    launch, and the twin checks a second follower (rank 2) too, so the 2-rank launch
    would check nothing more. Each launch costs ~15 CPU-seconds of imports before any
    trial trains; 22 launches of the sweep's ~200. A frozen rank is swept on 2 ranks."""
    return (
        launcher == "torchrun"
        and point.name in SWEPT["torchrun3"]
        and fault.kind != "sigstop"
        and not isinstance(expect("torchrun3", point, fault), Unreachable)
    )


TWINS = {
    ("orphans", "term_follower"): "lease",
    ("orphans", "kill_follower"): "lease",
    ("record", "term_follower"): "sample",
    ("record", "kill_follower"): "sample",
}
"""Cells that are another step's cell in all but name, so only that one is swept (4
launches of ~15 CPU-seconds each). A fault to the follower at a step only the leader
reaches lands while the follower waits for the next hand-over in the same receive, and
the leader, not signalled, finds it lost at that hand-over: what differs between two
steps is only where the leader is then. While it looks for orphans and just before it
takes the lease it holds no lease yet, so the cells are the same (``leased``, with the
lease to give back, is swept); while NePS records the finished trial and while it
samples the next, the finished trial is recorded either way before the hand-over
(``sample`` is swept). The table expects the same of both."""


def twin_swept(point: Point, fault: Fault) -> bool:
    return (point.name, fault.name) in TWINS


CELLS = [
    (launcher, p, f)
    for launcher in LAUNCHERS
    for p in POINTS
    if p.name in SWEPT[launcher]
    for f in FAULTS
    if f.kind != "sigstop" or p.name in FROZEN_AT[launcher]
    if not isinstance(expect(launcher, p, f), Unreachable)
    if not on_3_ranks_instead(launcher, p, f)
    if not twin_swept(p, f)
]


# -- what runs on every commit, what only in the full sweep ------------------------------
CHECKED_MORE = frozenset(
    {
        ("torchrun", "handed", "term_leader"),
        ("lightning", "sample", "term_follower"),
        ("lightning", "fit", "term_all"),
        ("lightning", "fit", "term_follower"),
        ("lightning", "fit", "kill_follower"),
        ("lightning", "fit", "raise"),
        ("lightning", "fit", "int_leader"),
        ("lightning", "fit", "kill_leader"),
        ("lightning", "sample", "kill_leader"),
    }
)
"""Cells whose launch checks more than the table (test_sweep.py's ``EXTRA``, the checks
of end-to-end launches that ran the same scenario): they run on every commit.
tests/test_fault_points.py checks that every cell of ``EXTRA`` runs on every commit and
that each one named here is in ``EXTRA``."""

LIGHTNING_ONLY_PATHS = Path(__file__).with_name("lightning_only_paths.txt")
"""The files whose code only a Lightning launch reaches (its process observer, the
SIGTERM connector patch, the children it starts, re-forming the group it keeps, a
parent/child peer), and what decides a Lightning cell's outcome (the table, its script,
the pinned Lightning): when one of them changed since the full sweep last passed
(``.ci/full-sweep-at``), .ci/run runs every Lightning cell. The sweep's own checks and
fault hook are every cell's, and the Lightning cells of every commit run them at every
step."""


def lightning_only_paths() -> list[str]:
    """``LIGHTNING_ONLY_PATHS``'s entries (paths from the repository's root)."""
    lines = LIGHTNING_ONLY_PATHS.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def lightning_path(point: Point, fault: Fault) -> str | None:
    """Why a Lightning cell runs on every commit: the code only Lightning reaches there
    (or the checks only its launch makes), None where its torchrun twin runs the same
    code of ours to the same end."""
    if point.name in ("form", "fit"):
        return (
            "Lightning forms the group (the first trial's children, the kept group re-formed)"
            " and runs the user's fit (its SIGTERM connector, Ctrl-C turned into exit 1)"
        )
    if point.kind == "settle":
        return "the settling follows a SIGTERM in fit, which Lightning's connector meets first"
    if fault.to == "follower":
        return "a follower that exits non-zero wakes Lightning's process observer"
    if ("lightning", point.name, fault.name) in CHECKED_MORE:
        return "its launch makes checks of its own (test_sweep.EXTRA)"
    return None


def twin(point: Point, fault: Fault) -> str:
    """The launcher whose cell at the same step and fault the sweep runs on every commit
    in place of a Lightning cell: torchrun, or torchrun on 3 ranks where that runs
    instead of torchrun on 2."""
    if ("torchrun", point, fault) in CELLS:
        return "torchrun"
    assert ("torchrun3", point, fault) in CELLS, (point.name, fault.name)
    return "torchrun3"


FULL_ONLY = {
    (launcher, p, f): twin(p, f)
    for launcher, p, f in CELLS
    if launcher == "lightning" and lightning_path(p, f) is None
}
"""The Lightning cells left to the full sweep (``make test-faults-full``), each with the
launcher of its twin, the cell that runs on every commit: the same step and fault,
expected by the same rule to leave the same trial states and the same rerun (exit
statuses differ only by a launcher's own allowances: torchrun may SIGTERM a follower,
Lightning's observer may SIGKILL the leader). tests/test_fault_points.py checks each."""

CI_CELLS = [cell for cell in CELLS if cell not in FULL_ONLY]
"""``make test-faults``: every (step, fault) pair of the table at least once, and every
Lightning cell that reaches code only Lightning runs."""


# -- the pool: ``neps-bcast launch --pool 2``, trials of 2 ranks ---------------------------
POOL = "pool"
"""``neps-bcast launch --pool 2`` (tests/sweep/pool_fault_search.py): two warm ranks and
two agents (each one NePS worker, no device); every trial takes both ranks, so trials
run one after another, in the order their agents asked. Each trial forms a DDP group of
its own (PyTorch's tutorial), its rank 0 sends the outcome to the agent through the
launcher."""


@dataclass(frozen=True)
class PoolPoint:
    name: str
    what: str
    owner: str
    """Who reaches the step: "rank" (each rank of the trial) or "agent"."""


POOL_POINTS = (
    PoolPoint(
        "order", "a rank has its order for the trial, before the trial's group forms", "rank"
    ),
    PoolPoint("handed", "the trial's rank 0 has handed the trial to its group", "rank"),
    PoolPoint("fit", "in the user's function (a training step)", "rank"),
    PoolPoint("exchange", "before the trial-end exchange", "rank"),
    PoolPoint(
        "done",
        "a rank's part of the trial is over (rank 0: the outcome sent), before it tells"
        " the launcher it is free: between two trials",
        "rank",
    ),
    PoolPoint("lease", "the agent, before it takes the trial's lease", "agent"),
    PoolPoint("ask", "the agent has asked for ranks: the launcher places the trial", "agent"),
    PoolPoint("record", "the agent's NePS records the finished trial", "agent"),
    PoolPoint("sample", "the agent's NePS samples its next trial", "agent"),
    PoolPoint("stop", "an agent's search is over, before it tells the launcher", "agent"),
)


POOL_FAULTS = (
    Fault("kill_r0", "SIGKILL to the trial's rank 0", "sigkill", "leader"),
    Fault("kill_r1", "SIGKILL to the trial's rank 1", "sigkill", "follower"),
    Fault("term_r0", "SIGTERM to the trial's rank 0", "sigterm", "leader"),
    Fault("term_r1", "SIGTERM to the trial's rank 1", "sigterm", "follower"),
    Fault("term_ranks", "SIGTERM to every rank of the trial", "sigterm", "all"),
    Fault("raise", "an exception at the step (rank 1's; the agent's at its steps)", "raise"),
    Fault("kill_agent", "SIGKILL to the trial's agent (its NePS worker)", "sigkill", "agent"),
    Fault(
        "hang",
        "rank 1 hangs in the user's code (a deadlock): only `--trial-time-limit` ends it",
        "hang",
    ),
    Fault(
        "term_launcher",
        "SIGTERM to the launcher (`neps-bcast launch --pool`)",
        "sigterm",
        "launcher",
    ),
    Fault("int_launcher", "SIGINT to the launcher (Ctrl-C)", "sigint", "launcher"),
    Fault(
        "freeze_r1",
        "the trial's rank 1 frozen (SIGSTOP: a hung node, nothing closes)",
        "sigstop",
        "follower",
    ),
    Fault(
        "freeze_agent",
        "the trial's agent frozen (SIGSTOP: hung, nothing closes, no parent-death signal)",
        "sigstop",
        "agent",
    ),
    Fault(
        "freeze_launcher",
        "the launcher frozen (SIGSTOP: hung, its sockets open, no parent-death signal)",
        "sigstop",
        "launcher",
    ),
    Fault(
        "kill_launcher",
        "SIGKILL to the launcher (a crash, the OOM killer): its processes get their"
        " parent-death SIGTERM",
        "sigkill",
        "launcher",
    ),
)
POOL_FAULT = {f.name: f for f in POOL_FAULTS}
POOL_POINT = {p.name: p for p in POOL_POINTS}


@dataclass(frozen=True)
class PoolExpect:
    row: str
    """The row of ``ROWS`` whose rule this cell follows."""
    trial: frozenset[str]
    """The NePS state of the faulted trial once the launch is over."""
    retried: bool
    """The trial was put back (its lease lists one failed attempt) and run again."""
    victim: frozenset[int]
    """The exit statuses of the process(es) the fault signalled, or that raised."""
    peers: frozenset[int]
    """The exit statuses of the trial's other ranks (those it did not name)."""
    launcher: frozenset[int]
    """The launcher's exit status, where the fault decides it (its own launch's)."""
    note: str = ""
    stops: bool = False
    """The fault stops the launch: every trial running or waiting for ranks goes back to
    pending, and the same command again finishes the budget."""


POOL_STOP_EXITS = S({143, 0, -15})
"""A pool's process the launcher stopped: 143 (its SIGTERM handled), 0 where it had left
first (an idle rank told the search is over), or -15 where the SIGTERM found it with
nothing to settle and no handler installed (a rank waiting for an order, an agent past
its search)."""


def pool_expect(point: PoolPoint, fault: Fault) -> PoolExpect | Unreachable:
    """What one pool cell must end in. A fault on one trial's processes touches that
    trial alone: the launch goes on, the trial goes back to pending and the same launch
    evaluates it again on fresh processes (``pool_lost``), except where the user's code
    raised (crashed) or the trial was already complete."""
    agent_fault = fault.to in ("agent", "launcher") or (
        fault.kind == "raise" and point.owner == "agent"
    )
    if point.owner == "agent" and fault.to in ("leader", "follower", "all"):
        return Unreachable(
            "the agent's steps run in the agent; the ranks are idle or in a trial"
            " (the rank steps' cells)"
        )
    if fault.kind == "hang" and point.name != "fit":
        return Unreachable(
            "only the user's code can hang: every wait of neps_bcast's own is bounded"
            if point.owner == "rank"
            else "the agent's steps are NePS's and neps_bcast's, each bounded"
        )
    if fault.kind == "sigstop":
        # Found silent after the bound and SIGKILLed (one host: a frozen process is ours
        # to end): from then on the cell is the kill cell of that process.
        base = pool_expect(point, POOL_FAULT[fault.name.replace("freeze", "kill")])
        if isinstance(base, Unreachable):
            return base
        by = {
            "agent": "the launcher (pool beats)",
            "launcher": "one of its agents or ranks (pool beats)",
        }.get(fault.to, "its trial's rank 0 (or the launcher)")
        return replace(base, note=f"{base.note} (frozen, then SIGKILLed by {by})")
    if fault.kind == "hang":
        return PoolExpect(
            "pool_lost",
            S({OK}),
            True,
            S({-9}),
            S({-9}),
            S({0}),
            "rank 0 waits for rank 1 in DDP's allreduce; past `--trial-time-limit` (30 s"
            " in the sweep) the launcher SIGKILLs both and the trial runs again",
        )
    if fault.kind == "raise" and point.owner == "rank" and point.name != "fit":
        return Unreachable(
            OWN_CODE_ONLY.get(
                point.name,
                "only neps_bcast's own steps run here, and they raise nothing but a lost peer",
            )
        )
    if fault.to == "launcher":
        code = {"sigterm": 143, "sigint": 130, "sigkill": -9}[fault.kind]
        return PoolExpect(
            "pool_stopped",
            S({"pending", OK})
            if point.name in ("stop", "done", "record", "sample")
            else S({"pending"}),
            False,
            S(),
            POOL_STOP_EXITS,
            S({code}),
            {
                "sigint": "the launcher forwards SIGTERM to every agent and rank",
                "sigkill": "every agent and rank gets its parent-death SIGTERM; an agent"
                " that sees the launcher's socket close first puts its trial back too",
            }.get(fault.kind, ""),
            stops=True,
        )
    if agent_fault:
        if fault.kind == "raise" and point.name == "record":
            return PoolExpect(
                "leader_lost",
                S({OK}),
                True,
                S({1}),
                S({0}),
                S({1}),
                "the agent exits 1, the launch's status, and is not replaced (its"
                " failure would recur); the other agent's look for orphans proves the"
                " trial's lease dead and evaluates it again",
            )
        if fault.kind == "raise":
            return PoolExpect(
                "between_trials",
                S({OK}),
                False,
                S({0}),
                S({0}),
                S({0}),
                "NePS samples again after a sampling that raised",
            )
        if point.name in ("record", "sample", "stop"):
            complete = "the trial's result was recorded before" if point.name != "record" else ""
            retried = point.name == "record"
            return PoolExpect(
                "pool_lost",
                S({OK}),
                retried,
                S({-9}),
                S({0}),
                S({0}),
                complete
                or "killed inside NePS's record: the result is lost with"
                " the agent; the fresh agent puts the trial back and it runs again",
            )
        if point.name == "ask":
            return PoolExpect(
                "pool_lost",
                S({OK}),
                True,
                S({-9}),
                S({0, -9}),
                S({0}),
                "a fresh agent takes the killed one's place and puts its trial"
                " back; the trial's ranks, if it was placed, are SIGKILLed at once",
            )
        return PoolExpect(
            "pool_lost",
            S({OK}),
            True,
            S({-9}),
            S({0, -9}) if point.owner == "rank" else S({0}),
            S({0}),
            "a fresh agent takes the killed one's place and puts its trial back; the"
            " trial's ranks, still in it, are SIGKILLed at once (0 where it had ended)",
        )
    # A fault on the trial's ranks.
    if fault.kind == "raise":
        return PoolExpect(
            "user_error",
            S({"crashed"}),
            False,
            S({0}),
            S({0}),
            S({0}),
            "both ranks are recycled (exit 0)",
        )
    if point.name == "done":
        return PoolExpect(
            "returns",
            S({OK}),
            False,
            S({-9}),
            S({0}),
            S({0}),
            "lost after its outcome was sent: the trial is a success; a fresh"
            " rank takes the device",
        )
    victim = S({-9}) if fault.kind == "sigkill" else S({143})
    if fault.to == "all":
        return PoolExpect("pool_lost", S({OK}), True, victim, S(), S({0}))
    if point.name == "order":
        # The other rank waits in the trial's rendezvous for the lost one: the launcher
        # SIGKILLs it after LOST_PEER_GRACE_S (10 s).
        return PoolExpect(
            "pool_lost",
            S({OK}),
            True,
            victim,
            S({-9}),
            S({0}),
            "the other rank, waiting in the rendezvous, is SIGKILLed 10 s later",
        )
    if fault.to == "leader":
        peers = S({1}) if fault.kind == "sigkill" else S({0})
        return PoolExpect("pool_lost", S({OK}), True, victim, peers, S({0}))
    if point.name == "handed":
        # Rank 0 has the trial and goes on into the user's function, whose
        # init_process_group waits for the lost rank 1: SIGKILLed 10 s later.
        return PoolExpect(
            "pool_lost",
            S({OK}),
            True,
            victim,
            S({1, -9}),
            S({0}),
            "rank 0, waiting for rank 1 in the user's init_process_group, is SIGKILLed 10 s later",
        )
    # rank 1 lost: rank 0 sends the outcome (lost), then its STOP to the group fails.
    return PoolExpect(
        "pool_lost",
        S({OK}),
        True,
        victim,
        S({0, 1}),
        S({0}),
        "rank 0 may exit 1: its STOP after the outcome finds rank 1 gone",
    )


def pool_spec(point: PoolPoint, fault: Fault, trial_id: str | None) -> str:
    """The cell's NB_FAULT in a pool (tests/scripts/faults.py): the process that reaches
    the step fires, on trial ``trial_id`` (None: the first to get there), signalling
    itself or the one the fault names."""
    to = fault.to
    if point.owner == "agent":
        who = "agent"
        to = "" if to == "agent" else to
    elif point.name == "handed":
        who = "leader"  # only rank 0 hands the trial over
        to = "" if to == "leader" else to
    elif to == "leader":
        who, to = "leader", ""
    else:
        who = "follower"
        to = "" if to == "follower" else to
    text = f"{fault.kind}:{who}:at={point.name}" + (f":to={to}" if to else "")
    return text + (f":id={trial_id}" if trial_id else "")


POOL_CHAINS: dict[str, tuple[tuple[str, str], ...]] = {
    "ranks": (
        ("order", "kill_r0"),
        ("handed", "kill_r1"),
        ("fit", "term_ranks"),
        ("fit", "raise"),
        ("fit", "hang"),
        ("exchange", "kill_r1"),
        ("done", "kill_r0"),
        ("fit", "freeze_r1"),
        ("fit", "freeze_agent"),
    ),
    "agent": (
        ("ask", "kill_agent"),
        ("fit", "kill_agent"),
        ("record", "raise"),
        ("lease", "kill_agent"),
        ("record", "kill_agent"),
        ("sample", "raise"),
    ),
    "launcher": (
        ("fit", "freeze_launcher"),
        ("fit", "kill_launcher"),
        ("fit", "term_launcher"),
        ("stop", "int_launcher"),
    ),
}
"""The pool's cells, by launch. A fault on one trial's processes leaves the launch
going: the cells of one chain share one launch, each on a trial of its own (trial 2, 3,
... by NePS's id: trial 1 warms the pool). A fault to the launcher ends its launch: its
cells share a root, each launch the previous one's rerun (its first trials are those
the last stop put back), and a last run finishes the budget; the ``stop`` cell, last,
lands once an agent's search is over (the budget spent, the other agent's trial
possibly still running).

Every kind of process and of fault, at every step where it means something different:
rank 0 lost before its group formed and after its outcome was sent, rank 1 lost after
it was handed the trial and at the exchange, the agent killed at each of its steps,
NePS raising as it samples and records, each signal to the launcher, and rank 1, the
agent and the launcher frozen (each found silent and SIGKILLed, then its kill cell)."""

POOL_CELLS = [(POOL_POINT[p], POOL_FAULT[f]) for cells in POOL_CHAINS.values() for p, f in cells]
