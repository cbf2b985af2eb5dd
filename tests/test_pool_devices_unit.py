"""The pool launcher's bookkeeping of devices, without processes: a device whose rank
fails to start ``DEVICE_START_FAILURES`` times in a row is retired, trials that no
longer fit are refused naming the sizes, and with no device left the launch ends; a
rank's result is moved to the CPU before it is sealed. (End to end, with real ranks
failing at the ``device`` fault point: tests/test_e2e_pool_devices.py.)"""

from __future__ import annotations

import dataclasses
import io
import itertools
import tempfile
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch

from neps_bcast.compat import procfs
from neps_bcast.launcher.processes import Settings
from neps_bcast.pool.devices import DEVICE_START_FAILURES
from neps_bcast.pool.launcher import Pool
from neps_bcast.pool.members import Member, PoolPlan
from neps_bcast.pool.rank import on_cpu

PIDS = itertools.count(10_000_000)  # above any pid_max: never a real process


class FakeProc:
    def __init__(
        self, code: int | None = None, signalled: list[tuple[int, int]] | None = None
    ) -> None:
        self.pid = next(PIDS)
        self.code = code
        self.signalled = signalled if signalled is not None else []
        """Where the signals the launcher sends it through ``Popen`` are recorded."""

    def poll(self) -> int | None:
        return self.code

    def send_signal(self, sig: int) -> None:
        self.signalled.append((self.pid, int(sig)))


class FakeConn:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def send(self, record: dict[str, Any]) -> None:
        self.sent.append(record)

    def close(self) -> None:
        pass


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Pool:
    """A pool of 2 whose ranks never start (each fresh one is a process that exited 1)
    and whose 2 agents are alive; signals it would send are recorded, not sent."""
    plan = PoolPlan(2, None, tmp_path / "script.py", (), tmp_path / "logs")
    p = Pool(plan, Settings(), io.StringIO())
    p.members.path = str(tmp_path / "pool.sock")  # run() would make its private folder
    p.killed_pids = []  # type: ignore[attr-defined]
    monkeypatch.setattr(
        procfs,
        "kill",
        lambda pid, sig=9: p.killed_pids.append((pid, sig)),  # type: ignore[attr-defined]
    )

    def start(role: str, index: int) -> Member:
        proc = FakeProc(1 if role == "rank" else None, p.killed_pids)  # type: ignore[attr-defined]
        member = Member(role, index, proc, tmp_path / "x.log")  # type: ignore[arg-type]
        p.members.of(role)[index] = member
        return member

    monkeypatch.setattr(p.members, "start", start)
    for index in range(2):
        start("rank", index)
        agent = start("agent", index)
        agent.conn = FakeConn()  # type: ignore[assignment]
        agent.said_hello = True
    return p


def ask(p: Pool, agent: int, trial: str, size: int) -> None:
    p._handle(
        p.members.agents[agent],
        {"op": "ask", "order": f"o{trial}", "trial": trial, "size": size, "port": 1, "payload": ""},
    )


def told(p: Pool, agent: int) -> list[dict[str, Any]]:
    return p.members.agents[agent].conn.sent  # type: ignore[union-attr]


def fail_starts(p: Pool, times: int) -> None:
    """Every rank whose process exited (1, before its hello) is reaped ``times`` times; a
    fresh one (exiting 1 again) replaces it unless its device is retired."""
    for _ in range(times):
        p.exits.reap_ranks(0.0)


def test_a_device_is_retired_after_its_rank_failed_to_start_k_times_in_a_row(pool: Pool) -> None:
    pool.members.ranks[0].proc.code = None  # type: ignore[attr-defined]  # device 0's rank is fine
    fail_starts(pool, DEVICE_START_FAILURES - 1)
    assert pool.devices.retired == {}
    fail_starts(pool, 1)
    assert list(pool.devices.retired) == [1]
    text = pool.display.stream.getvalue()  # type: ignore[attr-defined]
    assert (
        "[neps_bcast launch] device 1 is retired: its rank failed to start 3 times in a row"
        " (exit codes 1, 1, 1; expected it to prove its device and say hello); 1 of 2"
        " device(s) left. HINT: see" in text
    ), text
    assert "nvidia-smi" in text
    fail_starts(pool, 1)
    assert pool.members.ranks[1].reaped  # no fresh rank for a retired device
    assert pool.ended is None  # device 0 is left


def test_a_hello_resets_the_count(pool: Pool) -> None:
    pool.members.ranks[0].proc.code = None  # type: ignore[attr-defined]
    fail_starts(pool, DEVICE_START_FAILURES - 1)
    pool.devices.started(1)  # what a hello does
    fail_starts(pool, DEVICE_START_FAILURES - 1)
    assert pool.devices.retired == {}


def test_trials_that_no_longer_fit_are_refused_naming_the_sizes(pool: Pool) -> None:
    pool.members.ranks[0].proc.code = None  # type: ignore[attr-defined]
    ask(pool, 0, "1", 2)  # waits: device 1's rank is not up
    ask(pool, 1, "2", 1)
    fail_starts(pool, DEVICE_START_FAILURES)
    refused = [r for r in told(pool, 0) if "refused" in r]
    assert len(refused) == 1, told(pool, 0)
    assert refused[0]["refused"].startswith(
        "trial 1 needs 2 device(s), but 1 of the pool's 2 are left (device 1: its rank"
        " failed to start 3 times in a row, exit codes 1, 1, 1); expected 2 <= 1. HINT:"
    ), refused
    assert "ranks_per_trial ask for at most 1" in refused[0]["refused"]
    assert told(pool, 1) == []  # a trial of 1 still fits: it waits for device 0
    assert "o2" in pool.trials.orders
    ask(pool, 1, "3", 2)  # asked after the retirement: refused at once
    assert "trial 3 needs 2 device(s)" in told(pool, 1)[-1]["refused"]


def test_with_no_device_left_the_launch_ends_with_exit_1(pool: Pool) -> None:
    ask(pool, 0, "1", 1)
    fail_starts(pool, DEVICE_START_FAILURES)  # both devices' ranks fail each time
    assert sorted(pool.devices.retired) == [0, 1]
    assert (
        "trial 1 needs 1 device(s), but 0 of the pool's 2 are left"
        in (told(pool, 0)[-1]["refused"])
    )
    assert pool.ended is not None
    assert pool.ended.startswith(
        "[neps_bcast launch] no device of the pool is left (device 0: its rank failed to"
        " start 3 times in a row, exit codes 1, 1, 1; device 1: its rank failed to start 3"
        " times in a row, exit codes 1, 1, 1): no trial can run, so the launch ends. HINT:"
    ), pool.ended
    sigterms = {pid for pid, sig in pool.killed_pids if sig == 15}  # type: ignore[attr-defined]
    assert sigterms == {a.proc.pid for a in pool.members.agents.values()}
    assert pool._exit_status() == 1


def test_a_pool_built_and_never_run_leaves_nothing_in_the_temporary_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's private folder (its socket, the beats) is made when it runs and
    removed when it ends; built in __init__, each pool these tests build, and any launch
    that failed between building and running, left one in /tmp (553 in a day here)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    plan = PoolPlan(2, None, tmp_path / "script.py", (), tmp_path / "logs")
    Pool(plan, Settings(), io.StringIO())
    assert list((tmp_path / "tmp").iterdir()) == []


def test_an_agents_environment_hides_every_gpu_and_a_ranks_does_not(tmp_path: Path) -> None:
    plan = PoolPlan(2, ("3", "5"), tmp_path / "script.py", (), tmp_path / "logs")
    p = Pool(plan, Settings(), io.StringIO())
    assert p.members.environment("agent", 0)["CUDA_VISIBLE_DEVICES"] == ""
    assert p.members.environment("rank", 1)["CUDA_VISIBLE_DEVICES"] == "3,5"


def test_a_result_is_moved_to_the_cpu_keeping_its_shape() -> None:
    Pair = namedtuple("Pair", "a b")
    t = torch.ones(2, requires_grad=True)
    moved = on_cpu({"loss": 1.5, "metrics": {"val": t}, "seq": [t, (t, "x")], "pair": Pair(t, 2)})
    assert moved["loss"] == 1.5
    assert moved["metrics"]["val"].device.type == "cpu"
    assert not moved["metrics"]["val"].requires_grad  # detached: no graph pickled
    assert isinstance(moved["seq"][1], tuple)
    assert moved["seq"][1][1] == "x"
    assert isinstance(moved["pair"], Pair)
    assert moved["pair"].b == 2


def test_a_fresh_rank_on_a_lost_trials_device_is_not_taken_for_the_trials_rank_0(
    pool: Pool,
) -> None:
    """Trial 2 lost its rank 0 (device 0); a fresh rank took device 0 and is idle; then
    the trial's rank 1 is lost too. The launcher reads the trial's own rank 0 for its last
    words, never the fresh one (which has none, and whose connection must stay open)."""
    p = pool
    old0, old1 = p.members.ranks[0], p.members.ranks[1]
    for rank in (old0, old1):
        rank.proc.code = None  # type: ignore[attr-defined]
        p.trials.placement.set_available(rank.index, True)
    ask(p, 0, "2", 2)
    p.trials.place(0.0)
    order = p.trials.orders["o2"]
    assert order.members == [old0, old1]
    old0.proc.code = -9  # type: ignore[attr-defined]
    p.endings.rank_lost(order, old0, -9, 0.0)
    fresh = Member("rank", 0, FakeProc(None), Path("x.log"))  # type: ignore[arg-type]
    fresh.conn = FakeConn()  # type: ignore[assignment]
    fresh.conn.feed = lambda: pytest.fail("the fresh rank was read for the trial")  # type: ignore[union-attr]
    p.members.ranks[0] = fresh
    old1.proc.code = -9  # type: ignore[attr-defined]
    p.endings.rank_lost(order, old1, -9, 1.0)
    assert fresh.conn is not None and not fresh.retiring
    lost = [r for r in told(p, 0) if r.get("op") == "outcome"]
    assert len(lost) == 1 and "rank 0 of trial 2" in lost[0]["lost"], lost
    assert p.trials.placement._mean_duration(2) is None  # a lost trial's run is no duration


def _placed_on_both(p: Pool, agent: int, trial: str) -> list[Member]:
    ranks = [p.members.ranks[0], p.members.ranks[1]]
    for rank in ranks:
        rank.proc.code = None  # type: ignore[attr-defined]
        p.trials.placement.set_available(rank.index, True)
    ask(p, agent, trial, 2)
    p.trials.place(0.0)
    return ranks


def test_an_agent_that_failed_is_not_replaced_and_decides_the_exit_status(pool: Pool) -> None:
    """A failure with an exit code (the rule refused up front, a script error, NePS's
    WorkerRaiseError) would recur in a fresh agent: none is started."""
    failed = pool.members.agents[0]
    failed.proc.code = 1  # type: ignore[attr-defined]
    pool.exits.reap_agents()
    assert pool.members.agents[0] is failed
    assert pool.exits.agent_lives.restarts == {}
    assert pool.exits.agent_lives.failed == [(0, 1)]
    text = pool.display.stream.getvalue()  # type: ignore[attr-defined]
    assert "agent 0 failed (exit 1); the others go on." in text, text
    assert "pending" not in text
    assert pool._exit_status() == 1


def test_an_agent_killed_by_a_signal_is_replaced(pool: Pool) -> None:
    killed = pool.members.agents[1]
    killed.proc.code = -9  # type: ignore[attr-defined]
    pool.exits.reap_agents()
    assert pool.members.agents[1] is not killed
    assert pool.exits.agent_lives.restarts == {1: 1}
    assert pool.exits.agent_lives.failed == []
    assert "agent 1 was killed by SIGKILL: a fresh one takes its place" in (
        pool.display.stream.getvalue()  # type: ignore[attr-defined]
    )


@pytest.mark.parametrize("code", [-9, 1])
def test_a_lost_agents_running_trial_has_its_ranks_stopped_at_once(pool: Pool, code: int) -> None:
    """Nobody can take the trial's outcome and it runs again in the same directory: its
    ranks get SIGKILL at once, not after the lost-peer grace."""
    ranks = _placed_on_both(pool, 0, "2")
    pool.members.agents[0].proc.code = code  # type: ignore[attr-defined]
    pool.exits.reap_agents()
    assert sorted(pool.killed_pids) == sorted((r.proc.pid, 9) for r in ranks)  # type: ignore[attr-defined]
    said = pool.display.stream.getvalue()  # type: ignore[attr-defined]
    assert (
        f"trial 2: its agent 0 {'was killed by SIGKILL' if code < 0 else 'exited with code 1'}"
        in said
    )


def test_an_agent_that_ended_after_its_outcome_leaves_its_ranks_to_finish(pool: Pool) -> None:
    ranks = _placed_on_both(pool, 0, "2")
    ranks[0].conn = FakeConn()  # type: ignore[assignment]
    pool._handle(ranks[0], {"op": "outcome", "order": "o2", "result": "", "clean": True})
    pool.members.agents[0].proc.code = 0  # type: ignore[attr-defined]
    pool.exits.reap_agents()
    assert pool.killed_pids == []  # type: ignore[attr-defined]


def test_a_stopping_launch_leaves_a_lost_agents_ranks_to_their_sigterm(pool: Pool) -> None:
    _placed_on_both(pool, 0, "2")
    pool.supervisor.stop_deadline = 100.0
    pool.members.agents[0].proc.code = 143  # type: ignore[attr-defined]
    pool.exits.reap_agents()
    assert pool.killed_pids == []  # type: ignore[attr-defined]


def overwrite_answers(p: Pool, agent: int) -> list[bool]:
    return [r["yes"] for r in told(p, agent) if r.get("op") == "overwrite"]


def test_the_root_is_overwritten_once_per_launch(pool: Pool) -> None:
    """``overwrite_root_directory=True``: the first agent to ask wipes the root; the
    others wait until it says the root is ready, then go on without wiping, and so does
    an agent started later in the agent's place."""
    pool._handle(pool.members.agents[0], {"op": "may_overwrite"})
    pool._handle(pool.members.agents[1], {"op": "may_overwrite"})
    assert overwrite_answers(pool, 0) == [True]
    assert overwrite_answers(pool, 1) == []  # waits: agent 0 holds the root
    pool._handle(pool.members.agents[0], {"op": "root_ready"})
    assert overwrite_answers(pool, 1) == [False]
    pool.members.agents[1].proc.code = -9  # type: ignore[attr-defined]
    pool.exits.reap_agents()
    fresh = pool.members.agents[1]
    fresh.conn = FakeConn()  # type: ignore[assignment]
    pool._handle(fresh, {"op": "may_overwrite"})
    assert overwrite_answers(pool, 1) == [False]


def test_an_agent_lost_before_the_root_was_ready_passes_the_overwrite_on(pool: Pool) -> None:
    pool._handle(pool.members.agents[0], {"op": "may_overwrite"})
    pool._handle(pool.members.agents[1], {"op": "may_overwrite"})
    pool.members.agents[0].proc.code = -9  # type: ignore[attr-defined]
    pool.exits.reap_agents()
    assert overwrite_answers(pool, 1) == [True]


def test_a_silent_connection_holds_up_neither_the_loop_nor_a_members_opening(
    pool: Pool, tmp_path: Path
) -> None:
    """A process that connects to the pool's socket and says nothing: the launcher's
    loop goes on (the opening is driven by its select, not waited on), a member that
    connects after it is welcomed, and the silent one is dropped at its deadline."""
    import os
    import socket
    import threading

    from neps_bcast.pool import opening

    pool.server.bind(pool.members.path)
    pool.server.listen(4)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(pool.members.path)
    accepting = threading.Thread(target=lambda: pool.members.accept(pool.server), daemon=True)
    accepting.start()
    accepting.join(10)
    assert not accepting.is_alive(), "the launcher waited on a silent connection"
    pool.members.agents[1].conn = None  # only real connections in the loop's select
    agent = pool.members.agents[0]
    agent.conn, agent.said_hello = None, False
    agent.proc.pid = os.getpid()  # type: ignore[misc]  # this test's process is agent 0
    joined: dict[str, Any] = {}
    member = threading.Thread(
        target=lambda: joined.update(
            conn=opening.connect(pool.members.path, pool.members.key, "agent", 0)
        ),
        daemon=True,
    )
    member.start()
    for _ in range(200):
        if agent.said_hello:
            break
        pool._wait(0.05)
    member.join(10)
    assert agent.said_hello and "conn" in joined
    assert len(pool.members.openings) == 1  # the silent one, still within its deadline
    pool.members.expire(pool.members.openings[0].deadline)
    assert pool.members.openings == []
    assert "did not prove the pool's key in time" in pool.display.stream.getvalue()  # type: ignore[attr-defined]
    assert silent.recv(1) == b""  # closed by the launcher
    joined["conn"].close()
    silent.close()
    pool.server.close()


def test_a_trial_past_its_time_limit_has_its_ranks_stopped_and_is_reported_lost(
    pool: Pool,
) -> None:
    """``--trial-time-limit``: counted from the placement; the ranks are SIGKILLed and
    the agent hears the trial lost, naming the limit (it goes back to pending)."""
    pool.trials.plan = dataclasses.replace(pool.trials.plan, trial_time_limit_s=30.0)
    ranks = _placed_on_both(pool, 0, "2")
    pool.trials.orders["o2"].placed_at = 100.0
    pool.endings.end_overdue(129.0)
    assert pool.killed_pids == []  # type: ignore[attr-defined]
    pool.endings.end_overdue(130.0)
    assert sorted(pool.killed_pids) == sorted((r.proc.pid, 9) for r in ranks)  # type: ignore[attr-defined]
    for rank in ranks:
        rank.proc.code = -9  # type: ignore[attr-defined]
    pool.exits.reap_ranks(131.0)
    lost = [r for r in told(pool, 0) if r.get("op") == "outcome"]
    assert len(lost) == 1, told(pool, 0)
    assert lost[0]["lost"] == (
        "trial 2: still running 30 s after it was placed (--trial-time-limit)"
    ), lost
    assert "o2" not in pool.trials.orders  # released: its devices get fresh ranks


def test_a_trial_with_an_outcome_or_without_a_limit_is_never_stopped(pool: Pool) -> None:
    _placed_on_both(pool, 0, "2")
    pool.trials.orders["o2"].placed_at = 0.0
    pool.endings.end_overdue(1e9)  # no limit
    pool.trials.plan = dataclasses.replace(pool.trials.plan, trial_time_limit_s=1.0)
    pool.trials.orders["o2"].answered = True
    pool.endings.end_overdue(1e9)
    assert pool.killed_pids == []  # type: ignore[attr-defined]


def test_the_status_line_says_why_devices_are_not_free(pool: Pool) -> None:
    """A pool starting up (ranks not yet said hello) or replacing ranks is not a stalled
    one: the status line says which devices are starting, leaving or retired."""
    for rank in pool.members.ranks.values():
        rank.proc.code = None  # type: ignore[attr-defined]
    assert pool.trials.status().startswith("pool: 0 of 2 devices free (2 starting); running:")
    pool.members.ranks[0].said_hello = True
    pool.trials.placement.set_available(0, True)
    pool.members.ranks[1].said_hello, pool.members.ranks[1].retiring = True, True
    assert pool.trials.status().startswith("pool: 1 of 2 devices free (1 leaving); running:")
    pool.devices.retired[1] = "its rank failed to start"
    assert "pool: 1 of 2 devices free (1 retired);" in pool.trials.status()
