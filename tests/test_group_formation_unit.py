"""Unit tests: who forms the default group under an external launch, the names that keep
each trial's group apart on a store that outlives it, the groups kept alive until a
trial ended, and what a retried trial is told (``attempt``, ``resumed_from``).

In one process: a one-rank "external" runtime over a one-rank channel, with real gloo
groups on a ``HashStore`` (the multi-process behaviour is in tests/e2e/test_e2e_tutorial.py).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

import neps_bcast
from neps_bcast.compat import neps_trials
from neps_bcast.compat import torch as tc
from neps_bcast.errors import MessageError, ProtocolError
from neps_bcast.launcher import trial_placement
from neps_bcast.recovery.lease import left_by_earlier_attempts
from neps_bcast.recovery.lease_file import LEASE_FILE, LOCK_FILE
from neps_bcast.runtime import Runtime
from neps_bcast.startup.launch import Launch
from neps_bcast.transport.auth import Signer
from neps_bcast.transport.messages import Phase, Report, TrialMessage, decode, encode
from neps_bcast.trial.run import Outcome, TrialRun, evaluate_once


class OneRankChannel:
    """The control channel of a group of one."""

    group_rank = 0
    world_size = 1

    def broadcast(self, payload: bytes | None) -> bytes:
        assert payload is not None
        return payload

    def allgather(self, payload: bytes) -> list[bytes]:
        return [payload]

    def close(self) -> None:
        pass


@pytest.fixture
def no_group() -> Iterator[None]:
    assert not dist.is_initialized()
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def external_runtime(store: Any) -> Runtime:
    launch = Launch(
        kind="external",
        launcher="torchelastic",
        global_rank=0,
        world_size=1,
        local_rank=0,
        node_rank=0,
        main_address="127.0.0.1",
        main_port=1,
    )
    rt = Runtime(launch, signer=Signer(b"k" * 32))
    rt.link.channel = OneRankChannel()
    rt.link.store = store
    return rt


def message(seq: int = 1, **fields: Any) -> TrialMessage:
    return TrialMessage(
        seq=seq,
        trial_id=str(seq),
        kwargs={"lr": 0.1},
        pipeline_directory=None,
        previous_pipeline_directory=None,
        **fields,
    )


def evaluate(rt: Runtime, fn: Any, m: TrialMessage) -> Outcome:
    """As the leader evaluates a trial: handed over first (to no follower: one rank)."""
    return evaluate_once(rt, fn, m, lambda: setattr(rt.steps, "handed_seq", m.seq))


def gloo_runloops() -> int:
    return sum(
        1
        for task in Path("/proc/self/task").iterdir()
        if (task / "comm").read_text().strip() == "pt_gloo_runloop"
    )


# -- forming the group: the user's, or ours at session() --------------------------------
@pytest.mark.usefixtures("no_group")
def test_the_users_own_group_is_adopted_and_never_formed_twice() -> None:
    """PyTorch's DDP tutorial: init_process_group in the function, then the session."""
    rt = external_runtime(dist.HashStore())
    formed: list[str] = []

    def tutorial(lr: float) -> float:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        formed.append(c10d._get_process_group_name(dist.group.WORLD))
        with neps_bcast.session():
            pass
        dist.destroy_process_group()
        return lr

    with rt.activated():
        first = evaluate(rt, tutorial, message(1))
        second = evaluate(rt, tutorial, message(2))
    assert (first.failures, second.failures) == ([], [])
    assert (first.result, second.result) == (0.1, 0.1)
    assert not rt.owns_group
    assert len(set(formed)) == 2, formed  # each trial's group under a name of its own


@pytest.mark.usefixtures("no_group")
def test_without_a_group_at_session_neps_bcast_forms_one() -> None:
    rt = external_runtime(dist.HashStore())
    seen: list[int] = []

    def uses_a_group(lr: float) -> float:
        with neps_bcast.session():
            seen.append(dist.get_world_size())  # never formed by this code
        return lr

    with rt.activated():
        outcome = evaluate(rt, uses_a_group, message(1))
    assert outcome.failures == []
    assert seen == [1]
    assert rt.owns_group  # and so it is destroyed at the end of run


@pytest.mark.usefixtures("no_group")
def test_the_users_new_group_on_the_group_neps_bcast_formed_works() -> None:
    """The group is formed on a store written in Python (it watches the peers while
    forming); torch keeps only its C++ half, and a new_group after the Python half was
    collected failed with "Not implemented" (the release tests' subgroup trials)."""
    import gc

    rt = external_runtime(dist.HashStore())
    sums: list[float] = []

    def makes_a_subgroup(lr: float) -> float:
        with neps_bcast.session():
            gc.collect()
            group = dist.new_group(ranks=[0], backend="gloo")
            total = torch.ones(1)
            dist.all_reduce(total, group=group)
            sums.append(float(total.item()))
        return lr

    with rt.activated():
        outcome = evaluate(rt, makes_a_subgroup, message(1))
    assert outcome.failures == []
    assert sums == [1.0]


@pytest.mark.usefixtures("no_group")
def test_init_inside_the_session_after_neps_bcast_formed_the_group_names_the_fix() -> None:
    rt = external_runtime(dist.HashStore())

    def init_inside(lr: float) -> float:
        with neps_bcast.session():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return lr

    with rt.activated():
        outcome = evaluate(rt, init_inside, message(1))
    assert len(outcome.failures) == 1
    text = outcome.failures[0].message
    assert text.startswith(
        "[neps_bcast rank 0/1 leader] dist.init_process_group was called inside"
        " neps_bcast.session(), where neps_bcast had formed the default group"
    ), text
    assert tc.SECOND_DEFAULT_GROUP in text
    assert "HINT: call dist.init_process_group before `with neps_bcast.session()`" in text


def test_a_group_on_some_ranks_only_is_refused_naming_each_rank() -> None:
    rt = external_runtime(dist.HashStore())
    reports = [
        Report(0, Phase.SESSION_ENTER, 1, "1", None, True),
        Report(1, Phase.SESSION_ENTER, 1, "1", None, False),
    ]
    with pytest.raises(ProtocolError) as info:
        TrialRun(rt, message(1))._form_group_if_none(reports)
    assert (
        "some ranks have a default process group and others not; expected the same on"
        " every rank, observed rank 0: formed, rank 1: none." in str(info.value)
    )
    assert "HINT: call dist.init_process_group on every rank" in str(info.value)


# -- torch's private names, pinned -------------------------------------------------------
@pytest.mark.usefixtures("no_group")
def test_name_next_group_names_the_default_group() -> None:
    tc.name_next_group(4242)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert c10d._get_process_group_name(dist.group.WORLD) == "4242"
    dist.destroy_process_group()
    assert c10d._world.group_count == 0  # torch's reset: the next would be "0" again


@pytest.mark.usefixtures("no_group")
def test_a_second_default_group_is_told_by_torchs_text() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match=tc.SECOND_DEFAULT_GROUP) as info:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert tc.is_second_default_group(info.value)
    assert not tc.is_second_default_group(ValueError("another error"))


@pytest.mark.usefixtures("no_group")
def test_a_destroyed_group_is_kept_alive_until_released() -> None:
    """Its gloo worker threads are the sign of life (the group's C++ side)."""
    tc.keep_groups_alive()
    tc.keep_groups_alive()  # once per process, however often called
    tc.release_destroyed_groups()  # what earlier tests in this process destroyed
    assert isinstance(c10d._pg_map, dict)
    before = gloo_runloops()
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )
    dist.all_reduce(torch.ones(2))
    assert gloo_runloops() > before  # positive control: the group has threads
    dist.destroy_process_group()
    assert gloo_runloops() > before  # kept: destroyed, but not yet freed
    assert tc.release_destroyed_groups() == 1
    assert gloo_runloops() == before  # freed, threads joined
    assert tc.release_destroyed_groups() == 0


def test_neps_trial_files_are_the_ones_neps_writes() -> None:
    assert neps_trials.trial_files() == {
        "config.yaml",
        "report.yaml",
        "metadata.json",
        "previous_trial_id.txt",
    }


# -- what a retried trial is told --------------------------------------------------------
def test_resumed_from_is_the_directory_only_on_a_retry_that_left_files(tmp_path: Path) -> None:
    trial_dir = tmp_path / "config_2"
    trial_dir.mkdir()
    ours = [LEASE_FILE, f"{LEASE_FILE}.host.1.tmp", LOCK_FILE, trial_placement.PLACEMENT_FILE]
    for name in [*neps_trials.trial_files(), *ours]:
        (trial_dir / name).write_text("")
    assert left_by_earlier_attempts(trial_dir, attempt=2) is None  # only NePS's and ours
    (trial_dir / "checkpoint.pt").write_bytes(b"state")
    assert left_by_earlier_attempts(trial_dir, attempt=1) is None  # a first attempt
    assert left_by_earlier_attempts(trial_dir, attempt=2) == trial_dir
    assert left_by_earlier_attempts(tmp_path / "gone", attempt=2) is None


@pytest.mark.usefixtures("no_group")
def test_the_session_tells_which_attempt_and_where_to_resume_from(tmp_path: Path) -> None:
    rt = external_runtime(dist.HashStore())
    trials: list[neps_bcast.Trial] = []

    def pipeline(lr: float) -> float:
        with neps_bcast.session() as trial:
            trials.append(trial)
        return lr

    with rt.activated():
        evaluate(rt, pipeline, message(1))
        evaluate(rt, pipeline, message(2, attempt=3, resumed_from=tmp_path))
    assert [(t.attempt, t.resumed_from) for t in trials] == [(1, None), (3, tmp_path)]


def test_attempt_resumed_from_and_has_group_travel_in_the_messages(tmp_path: Path) -> None:
    sent = message(4, attempt=2, resumed_from=tmp_path)
    assert decode(encode(sent, tag="t"), tag="t") == sent
    report = Report(1, Phase.SESSION_ENTER, 4, "4", None, True)
    assert decode(encode(report, tag="t"), tag="t") == report
    bad = encode(message(4, attempt=0), tag="t")
    with pytest.raises(MessageError, match="an attempt must be a positive integer"):
        decode(bad, tag="t")


# -- every rank enters torch's rendezvous, or none does ---------------------------------
def _store_pair() -> tuple[dist.TCPStore, dist.TCPStore]:
    """Two ranks' clients of one real TCPStore (each rank has its own connection)."""
    timeout = datetime.timedelta(seconds=60)
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False)
    return server, dist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timeout)


def _arrive_in_thread(store: Any, key: str) -> tuple[Any, list[BaseException | None]]:
    import threading

    from neps_bcast.ddp.forming import all_or_none
    from neps_bcast.transport.store import prefixed

    got: list[BaseException | None] = []

    def arrive() -> None:
        try:
            all_or_none(prefixed(key, store), 2)
            got.append(None)
        except BaseException as exc:
            got.append(exc)

    thread = threading.Thread(target=arrive)
    thread.start()
    return thread, got


def test_forming_goes_ahead_once_every_rank_arrived() -> None:
    from neps_bcast.ddp.forming import abandon, all_or_none
    from neps_bcast.transport.store import prefixed

    server, client = _store_pair()
    thread, got = _arrive_in_thread(client, "pg/1")
    all_or_none(prefixed("pg/1", server), 2)
    thread.join(timeout=60)
    assert got == [None]
    abandon(prefixed("pg/1", server))  # too late to abandon: it changes nothing
    assert server.get("pg/1/neps_bcast/go") == b"form"


def test_a_rank_that_will_not_form_frees_its_waiting_peer_at_once() -> None:
    from neps_bcast.ddp.forming import FormingAbandoned, abandon
    from neps_bcast.transport.store import prefixed

    server, client = _store_pair()
    thread, got = _arrive_in_thread(client, "pg/2")
    abandon(prefixed("pg/2", server))
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert len(got) == 1 and isinstance(got[0], FormingAbandoned), got
    assert "a peer did not come to form the trial's DDP group" in str(got[0])


def _second_look_finds_rank_1_gone() -> tuple[list[float], Any]:
    looks: list[float] = []

    def peers_alive() -> None:
        looks.append(1.0)
        if len(looks) == 2:  # the second look finds a peer gone (SIGKILLed)
            raise RuntimeError("rank 1 lost: signal 9 (SIGKILL)")

    return looks, peers_alive


def test_a_rank_waiting_for_its_peers_to_form_checks_they_live() -> None:
    from neps_bcast.ddp.forming import WatchedStore, all_or_none
    from neps_bcast.transport.store import prefixed

    server, _ = _store_pair()
    looks, peers_alive = _second_look_finds_rank_1_gone()
    with pytest.raises(RuntimeError, match="rank 1 lost"):
        all_or_none(WatchedStore(prefixed("pg/3", server), peers_alive), 2)
    assert len(looks) == 2


def test_torchs_rendezvous_on_a_watched_store_raises_for_a_lost_peer() -> None:
    # The peer counted itself in and was killed before it published its address:
    # torch's own rendezvous would wait for it for its whole timeout (30 min).
    from neps_bcast.compat import torch as torch_compat
    from neps_bcast.ddp.forming import WatchedStore
    from neps_bcast.transport.store import prefixed

    server, _ = _store_pair()
    looks, peers_alive = _second_look_finds_rank_1_gone()
    try:
        with pytest.raises(RuntimeError, match="rank 1 lost"):
            dist.init_process_group(
                "gloo",
                store=WatchedStore(prefixed("pg/4", server), peers_alive),
                rank=0,
                world_size=2,
            )
    finally:
        torch_compat.reset_group_names()
    assert len(looks) == 2
    assert not dist.is_initialized()
