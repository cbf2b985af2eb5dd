"""``session()``, leader and follower logic, in one process.

Two kinds of test:
- a real in-process ``neps_bcast.run`` (single process, no DDP) for what NePS records;
- two ranks simulated by two threads over an in-memory channel implementing the
  ``Channel`` protocol, for the per-trial exchanges (session enter / exit, trial end)
  and the leader/follower loop. ``runtime.active()`` is a process global, so each
  thread gets its own through a thread-local (the fake's only patch of the library).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import neps
import pytest
from neps.state.neps_state import NePSState

import neps_bcast
from harness import LAUNCH_VARS
from neps_bcast import runtime
from neps_bcast.compat import neps as neps_compat
from neps_bcast.config import ENV_FIRST_SEQ, ENV_LEADER
from neps_bcast.errors import (
    AuthError,
    NepsBcastError,
    ProtocolError,
    SessionError,
    TrialFailedError,
    TrialMismatchError,
)
from neps_bcast.roles import leader_trial
from neps_bcast.roles.follower import follow
from neps_bcast.startup.launch import Launch
from neps_bcast.transport.auth import Signer, channel_context
from neps_bcast.transport.channel import Channel, ChannelClosedError
from neps_bcast.transport.messages import (
    Phase,
    Ready,
    Report,
    StopMessage,
    TrialMessage,
    decode,
    encode,
)
from neps_bcast.transport.steps import KIND, Steps
from neps_bcast.trial.run import TrialRun


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """An environment without any launcher: neps_bcast.run is a plain neps.run."""
    for name in list(os.environ):
        if name in LAUNCH_VARS or name.startswith(("SLURM_", "NEPS_BCAST_")):
            monkeypatch.delenv(name)


def recorded(root: Path) -> dict[str, Any]:
    return NePSState.create_or_load(path=root, load_only=True).lock_and_read_trials()


# -- session() outside a trial ----------------------------------------------------------


def test_session_outside_run_raises_a_clear_error() -> None:
    with pytest.raises(SessionError) as info, neps_bcast.session():
        pytest.fail("the block must not run")
    text = str(info.value)
    assert isinstance(info.value, NepsBcastError)
    assert "outside neps_bcast.run" in text
    assert "HINT:" in text


def test_session_between_trials_raises_a_clear_error() -> None:
    rt = runtime.Runtime(
        Launch(
            kind="single",
            launcher="none",
            global_rank=0,
            world_size=None,
            local_rank=0,
            node_rank=0,
        )
    )
    with (
        rt.activated(),
        pytest.raises(SessionError, match="between trials") as info,
        neps_bcast.session(),
    ):
        pytest.fail("the block must not run")
    assert "HINT:" in str(info.value)


# -- a real single-process neps_bcast.run ----------------------------------------------


@pytest.mark.usefixtures("single_process")
def test_single_process_trial_fields_match_what_neps_records(tmp_path: Path) -> None:
    seen: list[tuple[neps_bcast.Trial, dict[str, Any]]] = []

    def evaluate(
        lr: float,
        hidden: int,
        pipeline_directory: Path,
        previous_pipeline_directory: Path | None,
        pipeline_id: str,
    ) -> float:
        kwargs = dict(
            lr=lr,
            hidden=hidden,
            pipeline_directory=pipeline_directory,
            previous_pipeline_directory=previous_pipeline_directory,
            pipeline_id=pipeline_id,
        )
        with neps_bcast.session() as trial:
            seen.append((trial, kwargs))
        return lr

    root = tmp_path / "root"
    neps_bcast.run(
        evaluate,
        pipeline_space=Space(),
        root_directory=root,
        optimizer="random_search",
        total_evaluations_to_spend=2,
    )

    trials = recorded(root)
    assert len(seen) == 2
    assert sorted(trials) == sorted(t.id for t, _ in seen)
    for trial, kwargs in seen:
        neps_trial = trials[trial.id]
        assert trial.id == kwargs["pipeline_id"] == neps_trial.id
        assert trial.config == {"lr": kwargs["lr"], "hidden": kwargs["hidden"]}
        assert trial.config == neps_trial.config
        assert trial.rank == 0
        assert trial.world_size is None
        assert trial.is_leader is True
        assert trial.pipeline_directory == Path(neps_trial.metadata.location)
        assert trial.pipeline_directory == kwargs["pipeline_directory"]
        assert trial.previous_pipeline_directory is None
        assert neps_trial.report is not None
        assert neps_trial.report.reported_as == "success"
        with pytest.raises(dataclasses.FrozenInstanceError):
            trial.id = "other"  # type: ignore[misc]

    # After run returned: no trial, no leftovers for a later launch to misread.
    with pytest.raises(SessionError, match=r"outside neps_bcast\.run"), neps_bcast.session():
        pytest.fail("the block must not run")
    assert ENV_LEADER not in os.environ
    assert ENV_FIRST_SEQ not in os.environ
    assert runtime.active() is None


@pytest.mark.usefixtures("single_process")
def test_nested_session_is_recorded_by_neps_as_crashed(tmp_path: Path) -> None:
    inner_ran: list[str] = []

    def evaluate(lr: float, hidden: int) -> float:
        with neps_bcast.session(), neps_bcast.session():
            inner_ran.append("inner")
        return lr

    root = tmp_path / "root"
    neps_bcast.run(
        evaluate,
        pipeline_space=Space(),
        root_directory=root,
        optimizer="random_search",
        total_evaluations_to_spend=2,
        ignore_errors=True,
    )

    assert inner_ran == []
    trials = recorded(root)
    assert len(trials) == 2
    for trial in trials.values():
        assert trial.report is not None
        assert trial.report.reported_as == "crashed"
        assert "already open" in str(trial.report.err)
        assert "HINT:" in str(trial.report.err)


# -- two ranks over an in-memory channel -------------------------------------------------

BOUND_S = 30.0
"""Bound on every wait of the fake group; far above what any test here needs, on a
machine as busy as CI's (5 s was reached once beside three other suites). A wait
that reaches it is recorded as a hang (``FakeGroup.hangs``) and fails the test."""


class FakeGroup:
    """Collectives of ``size`` threads, with the semantics of the gloo channel.

    The n-th collective of every rank meets the n-th of the others. A rank that closes
    its end releases every peer waiting for it at once (``ChannelClosedError``), as a
    closed gloo connection does.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._count = [0] * size
        self._slots: dict[int, dict[int, tuple[str, bytes | None]]] = {}
        self.closed: set[int] = set()
        self.ops: list[tuple[int, str, Any, int]] = []
        """(rank, kind, payload, the collective's number) of every payload sent."""
        self.hangs: list[str] = []
        self.misuse: list[str] = []

    def _collective(self, rank: int, kind: str, payload: bytes | None) -> dict[int, bytes | None]:
        with self._cond:
            if rank in self.closed:
                self.misuse.append(f"rank {rank}: {kind} after close")
                raise ChannelClosedError(f"fake group: rank {rank} closed its end")
            index = self._count[rank]
            self._count[rank] += 1
            slot = self._slots.setdefault(index, {})
            slot[rank] = (kind, payload)
            if payload is not None:
                self.ops.append((rank, kind, payload, index))
            self._cond.notify_all()

            def settled() -> bool:
                return len(slot) == self.size or bool(self.closed - set(slot))

            if not self._cond.wait_for(settled, timeout=BOUND_S):
                missing = sorted(set(range(self.size)) - set(slot))
                self.hangs.append(f"rank {rank} waited in {kind} #{index} for ranks {missing}")
                raise ChannelClosedError(f"fake group: ranks {missing} never came")
            if len(slot) != self.size:
                gone = sorted(self.closed - set(slot))
                raise ChannelClosedError(f"fake group: Connection closed by peer (ranks {gone})")
            kinds = {k for k, _ in slot.values()}
            if len(kinds) > 1:
                self.misuse.append(f"collective #{index}: {sorted(kinds)} on different ranks")
            return {r: p for r, (_, p) in slot.items()}

    def allgather(self, rank: int, payload: bytes) -> list[bytes]:
        out = self._collective(rank, "allgather", payload)
        return [out[r] or b"" for r in range(self.size)]

    def close(self, rank: int) -> None:
        with self._cond:
            self.closed.add(rank)
            self._cond.notify_all()

    def messages(self, rank: int, kind: str) -> list[Any]:
        # Each payload opens only as its sender's message number `index` of the channel
        # (the fake never re-forms the group: generation 0).
        opened = [
            Signer(SECRET).open(channel_context(KIND, sender=rank, seq=index, generation=0), p)
            for r, k, p, index in self.ops
            if r == rank and k == kind and p is not None
        ]
        return [decode(p, tag="test") for p in opened]

    def phases(self, rank: int) -> list[str]:
        """The reports one rank contributed, in order."""
        return [m.phase.value for m in self.messages(rank, "allgather") if isinstance(m, Report)]

    def assert_sane(self) -> None:
        assert not self.hangs, f"a rank waited for a peer that never came: {self.hangs}"
        assert not self.misuse, f"channel misuse: {self.misuse}"


class FakeChannel:
    """One rank's end of a ``FakeGroup``; implements ``neps_bcast.transport.channel.Channel``."""

    def __init__(self, group: FakeGroup, group_rank: int) -> None:
        self.group = group
        self.group_rank = group_rank
        self.world_size = group.size

    def allgather(self, payload: bytes) -> list[bytes]:
        return self.group.allgather(self.group_rank, payload)

    def close(self) -> None:
        self.group.close(self.group_rank)


def test_fake_group_is_a_faithful_channel() -> None:
    # The fake itself: in order, by rank, and a closed peer releases the waiter.
    group = FakeGroup(2)
    a, b = FakeChannel(group, 0), FakeChannel(group, 1)
    channel: Channel = a  # the protocol is satisfied
    assert channel.world_size == 2
    with ThreadPoolExecutor(2) as pool:
        fb = pool.submit(lambda: (b.allgather(b"w1"), b.allgather(b"r1")))
        assert a.allgather(b"x") == [b"x", b"w1"]
        assert a.allgather(b"r0") == [b"r0", b"r1"]
        assert fb.result(timeout=BOUND_S) == ([b"x", b"w1"], [b"r0", b"r1"])
        waiting = pool.submit(b.allgather, b"w2")
        a.close()
        with pytest.raises(ChannelClosedError, match="closed by peer"):
            waiting.result(timeout=BOUND_S)
    assert not group.hangs


_LOCAL = threading.local()


@pytest.fixture
def per_thread_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "active", lambda: getattr(_LOCAL, "rt", None))


@pytest.fixture
def trial_ids(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The trial ids the leader's NePS hands out, in order (append before use)."""
    ids: list[str] = []
    handed = iter(range(1000))

    def current_trial() -> neps_compat.NepsTrialInfo:
        trial_id = ids[next(handed)]
        return neps_compat.NepsTrialInfo(trial_id, Path(f"/r/configs/config_{trial_id}"), None)

    monkeypatch.setattr(neps_compat, "current_trial", current_trial)
    return ids


SECRET = b"k" * 32
"""The search's secret, shared by the ranks of a fake group."""


def make_runtimes(size: int) -> tuple[FakeGroup, list[runtime.Runtime]]:
    group = FakeGroup(size)
    rts = []
    for rank in range(size):
        rt = runtime.Runtime(
            Launch(
                kind="external",
                launcher="env",
                global_rank=rank,
                world_size=size,
                local_rank=rank,
                node_rank=0,
                main_address="127.0.0.1",
                main_port=1,
            ),
            signer=Signer(SECRET),
        )
        rt.link.channel = FakeChannel(group, rank)
        rts.append(rt)
    return group, rts


def on_ranks(
    rts: list[runtime.Runtime], bodies: list[Callable[[runtime.Runtime], Any]]
) -> list[Any]:
    """Run ``bodies[r](rts[r])`` in one thread per rank; a result or the exception each."""

    def run(rt: runtime.Runtime, body: Callable[[runtime.Runtime], Any]) -> Any:
        _LOCAL.rt = rt
        try:
            return body(rt)
        finally:
            _LOCAL.rt = None

    with ThreadPoolExecutor(len(rts)) as pool:
        futures = [pool.submit(run, rt, body) for rt, body in zip(rts, bodies, strict=True)]
        outcomes = []
        for f in futures:
            exc = f.exception(timeout=4 * BOUND_S)
            outcomes.append(exc if exc is not None else f.result())
    return outcomes


def lead(
    plan: list[dict[str, Any]], fn: Callable[..., Any]
) -> Callable[[runtime.Runtime], list[Any]]:
    """The leader's side of a search: each trial as neps.run would call it, then STOP."""

    def body(rt: runtime.Runtime) -> list[Any]:
        outcomes: list[Any] = []
        for kwargs in plan:
            try:
                outcomes.append(leader_trial.evaluate_on_group(rt, fn, dict(kwargs), Path("/r")))
            except Exception as exc:  # NePS records it; so do we
                outcomes.append(exc)
        rt.shutdown("the search is over")
        return outcomes

    return body


def following(fn: Callable[..., Any]) -> Callable[[runtime.Runtime], None]:
    return lambda rt: follow(rt, fn, None)


@pytest.mark.usefixtures("per_thread_runtime")
def test_fake_group_follower_evaluates_the_leaders_trials_until_stop(trial_ids: list[str]) -> None:
    group, rts = make_runtimes(2)
    plan = [
        dict(lr=0.1, hidden=2, pipeline_id="1"),
        dict(lr=0.2, hidden=4, pipeline_id="2"),
        dict(lr=0.3, hidden=8, pipeline_id="3"),
    ]
    trial_ids.extend(kw["pipeline_id"] for kw in plan)
    seen: list[tuple[neps_bcast.Trial, dict[str, Any]]] = []
    lock = threading.Lock()

    def evaluate(**kwargs: Any) -> float:
        with neps_bcast.session() as trial, lock:
            seen.append((trial, kwargs))
        return float(kwargs["lr"])

    results, followed = on_ranks(rts, [lead(plan, evaluate), following(evaluate)])
    group.assert_sane()
    assert results == [0.1, 0.2, 0.3]
    assert followed is None
    for rank in (0, 1):
        mine = [(t, kw) for t, kw in seen if t.rank == rank]
        # Exactly the leader's arguments, in the leader's order.
        assert [kw for _, kw in mine] == plan
        for trial, kwargs in mine:
            assert trial.id == kwargs["pipeline_id"]
            assert trial.config == {"lr": kwargs["lr"], "hidden": kwargs["hidden"]}
            assert trial.world_size == 2
            assert trial.is_leader is (rank == 0)
            assert trial.pipeline_directory == Path(f"/r/configs/config_{trial.id}")
            assert trial.previous_pipeline_directory is None
    sent = [m for m in group.messages(0, "allgather") if isinstance(m, TrialMessage | StopMessage)]
    assert [type(m) for m in sent] == [TrialMessage] * 3 + [StopMessage]
    assert [m.seq for m in sent[:3]] == [1, 2, 3]
    # Every rank went through the same exchanges, and both closed their end.
    assert group.phases(0) == group.phases(1)
    assert group.phases(1).count(Phase.SESSION_ENTER.value) == 3
    assert group.phases(1).count(Phase.TRIAL_END.value) == 3
    assert group.closed == {0, 1}
    assert all(rt.link.channel is None for rt in rts)


@pytest.mark.usefixtures("per_thread_runtime")
def test_fake_group_mismatched_trial_ids_raise_on_every_rank() -> None:
    group, rts = make_runtimes(2)
    entered: list[int] = []

    def holding(trial_id: str) -> Callable[[runtime.Runtime], Any]:
        # What leader and follower do with a trial, but each rank holds its own.
        msg = TrialMessage(
            seq=1,
            trial_id=trial_id,
            kwargs={"lr": 0.1},
            pipeline_directory=None,
            previous_pipeline_directory=None,
        )

        def body(rt: runtime.Runtime) -> Any:
            run = TrialRun(rt, msg)
            rt.steps.handed_seq = msg.seq  # as if the leader had handed it over
            error = None
            with run.running():
                try:
                    with neps_bcast.session():
                        entered.append(rt.group_rank)
                except Exception as exc:  # returned to the test
                    error = exc
                run.end(error)
            return error

        return body

    outcomes = on_ranks(rts, [holding("7"), holding("8")])
    group.assert_sane()
    assert entered == [], "no rank may enter the block holding the wrong trial"
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, TrialMismatchError), outcome
        text = str(outcome)
        role = "leader" if rank == 0 else "follower"
        assert text.startswith(f"[neps_bcast rank {rank}/2 {role}]")
        assert "rank 0: trial 7" in text
        assert "rank 1: trial 8" in text
        assert "HINT:" in text
    assert group.phases(0) == group.phases(1)


@pytest.mark.usefixtures("per_thread_runtime")
def test_fake_group_ranks_at_different_phases_raise_protocol_error(trial_ids: list[str]) -> None:
    # Trial 7: the user's function opens session() on the leader only, so the leader
    # reaches session-enter while the follower returns and reaches trial-end.
    # Trial 8: every rank uses session(): the group must still work.
    group, rts = make_runtimes(2)
    trial_ids.extend(["7", "8"])
    in_session: list[BaseException] = []
    evaluated: list[tuple[int, str]] = []

    def evaluate(**kwargs: Any) -> float:
        rt = runtime.active()
        assert rt is not None
        if kwargs["pipeline_id"] == "8" or rt.group_rank == 0:
            try:
                with neps_bcast.session() as trial:
                    evaluated.append((trial.rank, trial.id))
            except NepsBcastError as exc:
                in_session.append(exc)
                raise
        return 1.0

    plan = [dict(lr=0.1, pipeline_id="7"), dict(lr=0.2, pipeline_id="8")]
    results, followed = on_ranks(rts, [lead(plan, evaluate), following(evaluate)])
    group.assert_sane()

    # session() on the leader raised ProtocolError, naming each rank's phase.
    assert len(in_session) == 1
    assert isinstance(in_session[0], ProtocolError), repr(in_session[0])
    for text in (str(in_session[0]), str(results[0])):
        assert "trial 7" in text
        assert "rank 0 at session-enter" in text
        assert "rank 1 at trial-end" in text
        assert "HINT:" in text
    # NePS gets an error for trial 7 (it records the trial as crashed) ...
    assert isinstance(results[0], NepsBcastError), results[0]
    # ... and the next trial runs on every rank.
    assert results[1] == 1.0
    assert sorted(evaluated) == [(0, "8"), (1, "8")]
    assert followed is None


@pytest.mark.usefixtures("per_thread_runtime")
def test_fake_group_error_on_one_rank_reaches_the_leader(trial_ids: list[str]) -> None:
    group, rts = make_runtimes(2)
    trial_ids.extend(["1", "2", "3"])
    evaluated: list[tuple[int, str]] = []

    def evaluate(**kwargs: Any) -> float:
        with neps_bcast.session() as trial:
            evaluated.append((trial.rank, trial.id))
            if trial.id == "2" and trial.rank == 1:
                raise ValueError("follower fails trial 2")
        return float(kwargs["lr"])

    plan = [
        dict(lr=0.1, pipeline_id="1"),
        dict(lr=0.2, pipeline_id="2"),
        dict(lr=0.3, pipeline_id="3"),
    ]
    results, followed = on_ranks(rts, [lead(plan, evaluate), following(evaluate)])
    group.assert_sane()
    assert results[0] == 0.1
    # The leader's NePS gets the follower's error, naming the rank and its error.
    assert isinstance(results[1], TrialFailedError), results[1]
    text = str(results[1])
    assert "trial 2 failed on rank 1: rank 1: ValueError: follower fails trial 2" in text
    assert "--- traceback of rank 1" in text
    # The follower reported instead of raising, and the group went on to trial 3.
    assert followed is None
    assert results[2] == 0.3
    assert sorted(evaluated) == sorted((r, t) for r in (0, 1) for t in ("1", "2", "3"))


def _trial_message(seq: int = 1, trial_id: str = "7") -> TrialMessage:
    return TrialMessage(
        seq=seq,
        trial_id=trial_id,
        kwargs={"lr": 0.1},
        pipeline_directory=None,
        previous_pipeline_directory=None,
    )


@pytest.mark.usefixtures("per_thread_runtime")
@pytest.mark.parametrize("follower_at", ["session-enter", "trial-end"])
def test_a_leader_that_stops_between_its_steps_never_hangs_its_followers(
    follower_at: str,
) -> None:
    """The leader hands a trial over and then stops without evaluating it (an interrupt
    between its two steps) while the follower is in that trial's session entry, or
    already at its end (it raised before its session). Both meet in the same kind of
    step: the follower learns the search is over where it expected the trial's
    meeting, and both finish at once (the fake group records any wait that never
    ends as a hang)."""
    group, rts = make_runtimes(2)
    entered: list[int] = []

    def leader_body(rt: runtime.Runtime) -> None:
        rt.send(_trial_message())
        rt.shutdown("the leader was interrupted")

    def evaluate(**kwargs: Any) -> None:
        if follower_at == "trial-end":
            raise ValueError("before the session")
        with neps_bcast.session():
            entered.append(1)

    outcomes = on_ranks(rts, [leader_body, following(evaluate)])
    group.assert_sane()
    assert outcomes == [None, None]
    assert entered == []
    assert group.closed == {0, 1}


@pytest.mark.usefixtures("per_thread_runtime")
def test_ranks_at_different_steps_raise_on_every_rank_instead_of_waiting() -> None:
    """The leader at a trial's end while its follower waits for the next trial (a bug
    the protocol must detect, not wait out): both raise ``ProtocolError`` naming what
    the other was doing."""
    group, rts = make_runtimes(2)

    def leader_body(rt: runtime.Runtime) -> BaseException | None:
        rt.steps.handed_seq = 1
        run = TrialRun(rt, _trial_message())
        try:
            with run.running():
                run.end(None)
        except ProtocolError as exc:
            return exc
        return None

    def follower_body(rt: runtime.Runtime) -> BaseException | None:
        try:
            rt.receive()
        except ProtocolError as exc:
            return exc
        return None

    lead_error, follow_error = on_ranks(rts, [leader_body, follower_body])
    assert not group.hangs
    assert isinstance(lead_error, ProtocolError)
    assert "rank 1 was waiting for the next trial" in str(lead_error)
    assert isinstance(follow_error, ProtocolError)
    assert "waited for the next trial while rank 0 was at trial 7's trial-end" in str(follow_error)


def test_the_public_names_stay_themselves_once_every_submodule_is_imported() -> None:
    """A submodule named like a public name replaces it on the package when something
    imports it first (a user's type hint, a pickle that names a class in it): a requeued
    submitit job found ``neps_bcast.session`` to be a module and every trial failed with
    "'module' object is not callable"."""
    code = (
        "import importlib, pkgutil, neps_bcast\n"
        "for m in pkgutil.walk_packages(neps_bcast.__path__, 'neps_bcast.'):\n"
        "    if not m.name.startswith('neps_bcast.launcher.'):\n"
        "        importlib.import_module(m.name)\n"
        "from neps_bcast.trial.session import Trial, session\n"
        "from neps_bcast.api import run\n"
        "assert (neps_bcast.session, neps_bcast.Trial, neps_bcast.run) == (session, Trial, run), "
        "(neps_bcast.session, neps_bcast.Trial, neps_bcast.run)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


class Replaying:
    """A channel whose every step returns the frames it is given (an outsider's replay)."""

    world_size = 2

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def allgather(self, payload: bytes) -> list[bytes]:
        return self.frames

    def close(self) -> None: ...


def test_a_step_replayed_from_another_step_rank_or_generation_is_refused() -> None:
    """Each step's tag binds its number, the slot's rank and the group generation."""
    signer = Signer(SECRET)

    def frame(message: Any, sender: int, step: int, generation: int = 0) -> bytes:
        context = channel_context(KIND, sender=sender, seq=step, generation=generation)
        return signer.sign(context, encode(message, tag="t"))

    trial = _trial_message(seq=1)
    channel = Replaying()
    follower = Steps(1, signer, lambda: 0)
    step_0 = [frame(trial, 0, 0), frame(Ready(1), 1, 0)]
    channel.frames = step_0
    assert follower.next_message(channel, "t") == trial  # the positive control
    for replayed in (
        step_0,  # step 0's frames again at step 1
        [frame(Ready(1), 1, 1), frame(trial, 0, 1)],  # each frame in the other rank's slot
        [frame(trial, 0, 1, generation=1), frame(Ready(1), 1, 1, generation=1)],
    ):
        channel.frames = replayed
        with pytest.raises(AuthError, match="refused the value under 'channel/step'"):
            follower.next_message(channel, "t")


def test_a_follower_acts_on_the_leaders_slot_and_the_leader_checks_every_slot() -> None:
    """At a hand-over a follower reads only the leader's message (nothing in another
    follower's slot is acted on); the leader authenticates every follower's."""
    signer = Signer(SECRET)

    def frame(message: Any, sender: int) -> bytes:
        context = channel_context(KIND, sender=sender, seq=0, generation=0)
        return signer.sign(context, encode(message, tag="t"))

    trial = _trial_message(seq=1)
    channel = Replaying()
    channel.frames = [frame(trial, 0), frame(Ready(1), 1), frame(Ready(1), 1)]
    assert Steps(1, signer, lambda: 0).next_message(channel, "t") == trial
    with pytest.raises(AuthError, match="refused the value under 'channel/step'"):
        Steps(0, signer, lambda: 0).hand_over(channel, trial, "t")
    channel.frames = [frame(trial, 0), frame(Ready(1), 1), frame(Ready(2), 2)]
    Steps(0, signer, lambda: 0).hand_over(channel, trial, "t")  # the positive control


LOST_LEADER_EXIT = """
import sys
from neps_bcast.roles import follower


class Meta(type):
    def __eq__(cls, other):  # so its classes cannot be hashed
        return cls is other


class Odd(metaclass=Meta):
    pass


class Holder:
    pass


odd = Odd()
holder = Holder()
holder.me = holder  # a cycle: only the interpreter's final collection would close it
holder.file = open(sys.argv[1], "w", buffering=1 << 20)
holder.file.write("every byte " * 1000)
del holder
follower._exit_without_collecting()
"""


@pytest.mark.parametrize("times", [1, 2])
def test_a_follower_that_lost_its_leader_exits_with_every_file_flushed(
    tmp_path: Path, times: int
) -> None:
    """Its exit freezes every object out of the final collection (fast) and first flushes
    every open file, here one that only a reference cycle held, next to objects of a
    class whose metaclass makes classes unhashable; registering it twice runs it once."""
    out = tmp_path / "unclosed.txt"
    code = LOST_LEADER_EXIT + "follower._exit_without_collecting()\n" * (times - 1)
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert out.read_text() == "every byte " * 1000


def test_a_file_frozen_by_a_trials_clean_start_is_still_flushed_at_a_followers_exit(
    tmp_path: Path,
) -> None:
    """The first clean start freezes the heap (``teardown.free_what_trials_left``): a file
    alive then, and left in a reference cycle later, is out of ``gc.get_objects``' reach
    unless the exit unfreezes it first."""
    out = tmp_path / "unclosed.txt"
    code = LOST_LEADER_EXIT.replace(
        "del holder\n",
        "from neps_bcast.ddp import teardown\nassert teardown.free_what_trials_left().froze\n"
        "del holder\n",
    )
    assert code != LOST_LEADER_EXIT
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_text() == "every byte " * 1000
