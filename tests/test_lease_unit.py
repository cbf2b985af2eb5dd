"""Trial leases (a trial whose worker died is evaluated again, never left evaluating) on
real NePS roots and real processes, one process per worker.

``tests/scripts/recovery_single.py`` is one NePS worker through ``neps_bcast.run`` with
no DDP (a trivial function, so each launch costs only its imports); a fault fires in
the trial the environment names. The DDP launches are in ``tests/e2e/test_e2e_recovery.py``.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import time
from pathlib import Path

import pytest

from harness import neps_trials
from lease_worker import PYTHON, evaluations, states, worker
from neps_bcast.compat.neps import lock_kind
from neps_bcast.config import Settings
from neps_bcast.errors import SettingsError
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.lease_file import (
    LEASE_FILE,
    LOCK_FILE,
    Attempt,
    Lease,
    Owner,
    lease_lock,
    read_lease,
    why_dead,
    write_lease,
)

GRACE = 60.0


def dead_pid() -> int:
    proc = subprocess.Popen([PYTHON, "-c", "pass"])
    proc.wait()
    return proc.pid


# -- who is alive (pure decisions, real processes) ------------------------------------
def test_an_owner_on_this_machine_is_dead_once_its_pid_is_gone_or_reused() -> None:
    me = Owner.me()
    now = time.time()
    mine = Lease("1", me, now - 1000, now - 1000)  # a stale heartbeat does not matter here
    assert why_dead(mine, now - 1000, me, now, GRACE) is None

    gone = Lease("1", Owner(**{**vars(me), "pid": dead_pid()}), now, now)
    assert why_dead(gone, now, me, now, GRACE) == f"its leader ({gone.owner.describe()}) is gone"  # type: ignore[union-attr]

    reused = Lease("1", Owner(**{**vars(me), "start_ticks": me.start_ticks - 1}), now, now)
    reason = why_dead(reused, now, me, now, GRACE)
    assert reason is not None
    assert reason.endswith("that pid is another process now")


def test_an_owner_elsewhere_is_dead_only_after_the_grace_period() -> None:
    me = Owner.me()
    elsewhere = Owner(**{**vars(me), "pid_namespace": "pid:[1]"})  # another container
    assert not me.shares_machine_with(elsewhere)
    now = time.time()
    fresh = Lease("1", elsewhere, now - 500, now - GRACE + 1)
    assert why_dead(fresh, now - 500, me, now, GRACE) is None
    stale = Lease("1", elsewhere, now - 500, now - GRACE - 1)
    assert why_dead(stale, now - 500, me, now, GRACE) == (
        f"no heartbeat from its leader (pid {me.pid} on {me.host}) for 61 s (grace 60 s)"
    )


def test_a_trial_without_a_lease_is_dead_once_neps_started_it_a_grace_period_ago() -> None:
    me, now = Owner.me(), time.time()
    assert why_dead(None, now - GRACE + 1, me, now, GRACE) is None
    reason = why_dead(None, now - GRACE - 1, me, now, GRACE)
    assert reason is not None
    assert reason.startswith("evaluating for 61 s without a lease (grace 60 s)")


@pytest.mark.parametrize("raw", ["-1", "three", "1.5"])
def test_a_bad_retry_limit_names_the_variable(raw: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"NEPS_BCAST_MAX_RETRIES": raw})
    assert f"NEPS_BCAST_MAX_RETRIES={raw!r} is not a whole number >= 0." in str(info.value)
    assert Settings.from_env({"NEPS_BCAST_MAX_RETRIES": "0"}).max_retries == 0
    assert Settings().max_retries == 3


def test_the_heartbeat_renews_the_lease_until_the_trial_ends(tmp_path: Path) -> None:
    # A renewal locks as NePS does, which imports NePS: a leader has it imported, this
    # test alone does not (at load 17 the first import took over 30 s).
    lock_kind()
    leases = Leases(tmp_path, Settings(heartbeat_s=0.05))
    try:
        leases.take("7", tmp_path)
        assert leases.written(30)
        first = read_lease(tmp_path)
        assert first is not None
        assert first.owner == Owner.me()
        deadline = time.monotonic() + 30
        renewed = first
        while renewed.heartbeat == first.heartbeat and time.monotonic() < deadline:
            time.sleep(0.02)  # bounded poll of the file the heartbeat thread writes
            renewed = read_lease(tmp_path) or first
        assert renewed.heartbeat > first.heartbeat
        assert renewed.started == first.started
        leases.drop()
        time.sleep(0.2)  # four heartbeat intervals: none may write after drop()
        stopped = read_lease(tmp_path)
        time.sleep(0.2)
        assert read_lease(tmp_path) == stopped
    finally:
        leases.close()
    assert not list(tmp_path.glob(f"{LEASE_FILE}.*.tmp"))


def test_a_lease_is_written_off_the_takers_thread_and_never_after_its_trial_ended(
    tmp_path: Path,
) -> None:
    """``take`` returns before the lease is on disk (the heartbeat thread writes it);
    a trial dropped before that write never gets it, and the next trial's is written."""
    leases = Leases(tmp_path, Settings(heartbeat_s=30))
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    try:
        with leases.held.io:  # the write waits: as on a busy disk
            assert leases.take("7", first) == 1
            assert read_lease(first) is None
            leases.drop()
        assert leases.written(30)
        time.sleep(0.1)
        assert read_lease(first) is None
        assert leases.take("8", second) == 1
        assert leases.written(30)
        written = read_lease(second)
        assert written is not None
        assert (written.trial_id, written.owner) == ("8", Owner.me())
    finally:
        leases.close()


def test_a_lease_that_could_not_be_written_is_written_at_the_next_heartbeat(
    tmp_path: Path,
) -> None:
    """A failed first write is tried again every heartbeat period, as a failed renewal
    is (else a leader elsewhere would take the running trial over after the grace)."""
    leases = Leases(tmp_path, Settings(heartbeat_s=0.05))
    trial_dir = tmp_path / "not yet"
    try:
        leases.take("7", trial_dir)  # the write fails: no such directory
        assert not leases.written(0.2)  # four heartbeat periods, still failing
        trial_dir.mkdir()
        assert leases.written(30)
        written = read_lease(trial_dir)
        assert written is not None
        assert (written.trial_id, written.owner) == ("7", Owner.me())
    finally:
        leases.close()


# -- real NePS roots, real workers -----------------------------------------------------
def test_a_killed_worker_s_trial_is_evaluated_again_by_the_next_run(tmp_path: Path) -> None:
    first = worker(tmp_path, trials=4, fault="kill", at="2")
    assert first.returncode == -signal.SIGKILL, first.stdout[-3000:]
    assert states(tmp_path) == {"1": "success", "2": "evaluating"}
    killed_pid = next(e["pid"] for e in evaluations(tmp_path) if e["trial_id"] == "2")
    # The heartbeat thread writes the lease beside the hand-over: the kill inside the
    # trial may come before it (seen under load), and the lease then names nobody yet.
    lease = read_lease(tmp_path / "root" / "configs" / "config_2")
    assert lease is None or (lease.owner is not None and lease.owner.pid == killed_pid)

    again = worker(tmp_path, trials=4)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "orphaned trial 2 (its leader (pid" in again.stdout
    assert states(tmp_path) == dict.fromkeys(("1", "2", "3", "4"), "success")
    evaluated = evaluations(tmp_path)
    twice = [e for e in evaluated if e["trial_id"] == "2"]
    assert len(twice) == 2
    assert twice[0]["pid"] == killed_pid != twice[1]["pid"]
    for key in ("lr", "hidden", "pipeline_directory"):
        assert twice[0][key] == twice[1][key]
    # The orphan was taken before NePS sampled anything new.
    second_run = [e["trial_id"] for e in evaluated if e["pid"] == twice[1]["pid"]]
    assert second_run == ["2", "3", "4"]
    history = read_lease(tmp_path / "root" / "configs" / "config_2")
    assert history is not None
    assert [a.owner.pid for a in history.attempts] == [killed_pid]


def test_sigterm_puts_the_trial_back_and_the_rerun_needs_no_ignore_errors(tmp_path: Path) -> None:
    first = worker(tmp_path, trials=3, fault="term", at="2")
    assert first.returncode == 128 + signal.SIGTERM, first.stdout[-3000:]
    assert "exit code 143 asks to requeue" in first.stdout
    assert states(tmp_path) == {"1": "success", "2": "pending"}
    again = worker(tmp_path, trials=3)
    assert again.returncode == 0, again.stdout[-3000:]
    assert states(tmp_path) == dict.fromkeys(("1", "2", "3"), "success")


def test_past_the_retry_limit_the_trial_is_crashed_with_its_history(tmp_path: Path) -> None:
    limit = {"NEPS_BCAST_MAX_RETRIES": "1"}
    pids = []
    for _ in range(2):  # killed in trial 2, then killed again in its retry
        run = worker(tmp_path, trials=3, fault="kill", at="2", **limit)
        assert run.returncode == -signal.SIGKILL, run.stdout[-3000:]
        pids.append(evaluations(tmp_path)[-1]["pid"])
    last = worker(tmp_path, trials=3, **limit)
    assert "orphaned trial 2" in last.stdout
    assert "recorded crashed after 2 interruptions" in last.stdout
    trials = neps_trials(tmp_path / "root")
    assert trials["2"].metadata.state.value == "crashed"
    text = str(trials["2"].report.err)
    assert text.startswith(
        "neps_bcast: trial 2 was interrupted 2 times by infrastructure failures"
        " (NEPS_BCAST_MAX_RETRIES=1): attempt 1 (pid "
    )
    for n, pid in enumerate(pids, 1):
        assert f"attempt {n} (pid {pid} on " in text
    assert text.count("is gone") == 2
    # NePS's own rule for a root holding a crashed trial (its default ignore_errors=False).
    assert last.returncode == 1
    assert [e["trial_id"] for e in evaluations(tmp_path)].count("2") == 2


def test_a_user_exception_is_crashed_and_never_retried(tmp_path: Path) -> None:
    first = worker(tmp_path, trials=3, fault="raise", at="2")
    assert first.returncode == 1
    assert states(tmp_path) == {"1": "success", "2": "crashed"}
    again = worker(tmp_path, trials=3)
    assert "orphaned" not in again.stdout
    assert states(tmp_path)["2"] == "crashed"
    assert [e["trial_id"] for e in evaluations(tmp_path)].count("2") == 1
    lease = read_lease(tmp_path / "root" / "configs" / "config_2")
    assert lease is None or lease.attempts == ()  # None: it raised before the lease's write


def test_a_renewal_never_writes_its_owner_back_over_a_takeover(tmp_path: Path) -> None:
    """The heartbeat reads, checks and writes under the lease's lock, which every
    takeover takes too: while the test holds that lock (as a takeover does), no renewal
    can land; after the takeover, the renewal sees the new owner and stops, and the
    history the takeover wrote stays."""
    leases = Leases(tmp_path, Settings(heartbeat_s=0.01))
    other = dataclasses.replace(Owner.me(), host="elsewhere", pid=1)
    try:
        leases.take("7", tmp_path)
        assert leases.written(30)
        with lease_lock(tmp_path):
            taken = read_lease(tmp_path)
            assert taken is not None
            attempt = Attempt(taken.owner, taken.started, taken.heartbeat, "test takeover")  # type: ignore[arg-type]
            write_lease(tmp_path, dataclasses.replace(taken, owner=other, attempts=(attempt,)))
        # The heartbeat keeps ticking (every 10 ms); once it saw the takeover it stops.
        deadline = time.monotonic() + 30
        while leases.held.held() is not None and time.monotonic() < deadline:
            time.sleep(0.01)  # a bounded poll of the heartbeat thread's state
        assert leases.held.held() is None
        after = read_lease(tmp_path)
        assert after is not None and after.owner == other
        assert [a.how for a in after.attempts] == ["test takeover"]
    finally:
        leases.close()


def test_the_lease_lock_refuses_a_planted_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    (tmp_path / LOCK_FILE).symlink_to(target)
    with (
        pytest.raises(OSError, match=r"Too many levels of symbolic links|ELOOP"),
        lease_lock(tmp_path),
    ):
        pass
    assert not target.exists()


def test_a_leader_s_worker_id_names_its_process_and_nothing_else_parses() -> None:
    me = Owner.me()
    assert Owner.from_worker_id(me.worker_id()) == me
    for other in (None, "", "worker_0", "neps_bcast-x-1@h/b/n", "my-own-worker"):
        assert Owner.from_worker_id(other) is None


def test_a_trial_without_a_lease_is_dead_at_once_when_neps_names_a_dead_leader_here() -> None:
    me, now = Owner.me(), time.time()
    gone = Owner(**{**vars(me), "pid": dead_pid()})
    assert why_dead(None, now, me, now, GRACE, gone.worker_id()) == (
        f"its leader ({gone.describe()}) is gone, before it leased the trial"
    )
    released = Lease("1", None, now - 5, now - 5)  # put back to pending before
    assert why_dead(released, now, me, now, GRACE, gone.worker_id()) is not None
    # Alive (this process), on another machine, or a worker id not ours: the grace rule.
    assert why_dead(None, now, me, now, GRACE, me.worker_id()) is None
    elsewhere = Owner(**{**vars(gone), "boot_id": "another-boot"})
    assert why_dead(None, now, me, now, GRACE, elsewhere.worker_id()) is None
    assert why_dead(None, now, me, now, GRACE, "worker_0") is None


def test_a_leader_killed_before_its_lease_is_found_through_neps_s_worker_record(
    tmp_path: Path,
) -> None:
    assert worker(tmp_path, trials=3, fault="kill", at="2").returncode == -signal.SIGKILL
    trial_dir = tmp_path / "root" / "configs" / "config_2"
    # As if killed between NePS's "evaluating" and the lease (the heartbeat thread may
    # not have written it yet anyway: the kill is inside the trial).
    (trial_dir / LEASE_FILE).unlink(missing_ok=True)
    worker_id = neps_trials(tmp_path / "root")["2"].metadata.evaluating_worker_id
    assert Owner.from_worker_id(worker_id) is not None, worker_id
    leases = Leases(tmp_path / "root", Settings(heartbeat_s=3600.0, lease_grace_s=4 * 3600.0))
    assert leases.recover_orphans() == ["2: back to pending (interruption 1 of at most 3 retried)"]
    result = worker(tmp_path, trials=3)
    assert result.returncode == 0, result.stderr[-2000:]
    assert states(tmp_path) == {"1": "success", "2": "success", "3": "success"}
