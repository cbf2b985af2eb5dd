"""The fence has no holes (``recovery/held_lease.py``, ``recovery/fence.py``,
``recovery/lease.py``): a first lease write that comes late never replaces the lease of
the attempt that took the trial over; a lease that cannot be read refuses the record;
a hand-back leaves a trial another attempt holds. On real lease files, and on a real
NePS root where NePS's own record decides.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from lease_worker import states, worker
from neps_bcast.compat.neps import lock_kind
from neps_bcast.config import Settings
from neps_bcast.recovery.fence import superseded
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.lease_file import (
    LEASE_FILE,
    Attempt,
    Lease,
    Owner,
    read_lease,
    write_lease,
)

ELSEWHERE = Owner("host-a", "another-boot", "pid:[1]", 4242, 7)
WAIT = 30.0


@pytest.fixture
def leases(tmp_path: Path) -> Leases:
    lock_kind()  # the lease lock locks as NePS does (imports NePS)
    return Leases(tmp_path, Settings(heartbeat_s=30.0))


def test_a_late_first_write_never_replaces_the_lease_of_the_attempt_that_took_over(
    leases: Leases, tmp_path: Path
) -> None:
    """The first write waits (a mount that hangs at the trial's start) past the grace:
    another host put the trial back and its rerun holds it as attempt 2. The late write
    finds that under the lease lock, drops this attempt and says so; the rerun's lease
    stays."""
    said: list[str] = []
    leases.held.on_superseded = said.append
    now = time.time()
    late = Attempt(Owner.me(), now - 10, now - 5, "no heartbeat from its leader for 301 s")
    rerun = Lease("7", ELSEWHERE, now, now, (late,), attempt=2)
    try:
        with leases.held.io:  # the heartbeat thread's first write waits here
            assert leases.take("7", tmp_path) == 1
            write_lease(tmp_path, rerun)
        assert leases.written(WAIT)
    finally:
        leases.close()
    assert read_lease(tmp_path) == rerun
    assert said == [superseded("7", 1, rerun)]


def test_a_late_first_write_stops_where_neps_no_longer_holds_the_trial_for_it(
    leases: Leases, tmp_path: Path
) -> None:
    """NePS's own record of the trial decides too: put back to pending (by a look that
    wrote no lease yet), it is no longer this attempt's, and no lease is written."""
    said: list[str] = []
    leases.held.on_superseded = said.append
    try:
        with leases.held.io:
            assert leases.take("7", tmp_path) == 1
            # NePS's record (neps/state/filebased.py writes these keys) after a reset.
            record = {"state": "pending", "evaluating_worker_id": None}
            (tmp_path / "metadata.json").write_text(json.dumps(record))
        assert leases.written(WAIT)
    finally:
        leases.close()
    assert read_lease(tmp_path) is None
    assert len(said) == 1
    assert said[0].endswith("(NePS holds it pending, evaluated by nobody)")


def test_a_first_write_after_this_leader_settled_its_trial_stops_without_a_word(
    leases: Leases, tmp_path: Path
) -> None:
    """A step of the leader's own raised at once (the sweep's ``leased`` x ``raise``): it
    recorded the trial crashed itself before the heartbeat thread wrote the lease. That
    attempt is over and nobody else's: no lease is written, and the leader is not told it
    was superseded (it would exit 1 and stop the search)."""
    said: list[str] = []
    leases.held.on_superseded = said.append
    try:
        with leases.held.io:  # the heartbeat thread's first write waits here
            assert leases.take("7", tmp_path) == 1
            record = {"state": "crashed", "evaluating_worker_id": leases.me.worker_id()}
            (tmp_path / "metadata.json").write_text(json.dumps(record))
        assert leases.written(WAIT)
    finally:
        leases.close()
    assert read_lease(tmp_path) is None
    assert said == []


def test_the_first_write_goes_ahead_where_neps_holds_the_trial_for_this_leader(
    leases: Leases, tmp_path: Path
) -> None:
    """Positive control of the two above: NePS holds it evaluating for this process."""
    said: list[str] = []
    leases.held.on_superseded = said.append
    record = {"state": "evaluating", "evaluating_worker_id": leases.me.worker_id()}
    (tmp_path / "metadata.json").write_text(json.dumps(record))
    try:
        assert leases.take("7", tmp_path) == 1
        assert leases.written(WAIT)
    finally:
        leases.close()
    written = read_lease(tmp_path)
    assert written is not None
    assert (written.owner, written.attempt) == (leases.me, 1)
    assert said == []


def test_a_lease_that_cannot_be_read_refuses_the_record_and_says_why(
    leases: Leases, tmp_path: Path
) -> None:
    try:
        leases.take("7", tmp_path)
        assert leases.written(WAIT)
        assert leases.refuse_record("7") is None  # positive control: its own, readable
        (tmp_path / LEASE_FILE).write_text("{not json")
        why = leases.refuse_record("7")
    finally:
        leases.close()
    assert why is not None
    assert why.startswith(
        "trial 7: this leader's attempt 1 cannot prove it still holds the trial: its lease"
        " cannot be read (JSONDecodeError: "
    )


def test_a_hand_back_leaves_a_trial_that_another_attempt_holds(tmp_path: Path) -> None:
    """A leader hands back its attempt 1 of trial 2 (NePS holds it evaluating): where
    the lease names a later attempt of its own (a pool's agent got the trial again), or
    names nobody after an interruption that already counts attempt 1 (taken over
    elsewhere, and NePS handed it to a worker whose lease is not written yet), the trial
    is left as it is; where the lease is its attempt's, it goes back to pending."""
    assert worker(tmp_path, trials=3, fault="kill", at="2").returncode == -signal.SIGKILL
    root = tmp_path / "root"
    trial_dir = root / "configs" / "config_2"
    (trial_dir / LEASE_FILE).unlink(missing_ok=True)  # as if killed before its lease
    me = Owner.me()
    now = time.time()
    first = Attempt(me, now - 10, now - 5, "preempted")
    held_by = {
        "a later attempt of its own": Lease("2", me, now, now, (first,), attempt=2),
        "nobody, attempt 1 already counted": Lease("2", None, now, now, (first,)),
    }
    became = {}
    for what, lease in held_by.items():
        leases = Leases(root, Settings(heartbeat_s=3600.0, lease_grace_s=4 * 3600.0))
        try:
            assert leases.take("2", trial_dir) == 1
            assert leases.written(WAIT)  # not written: NePS names the killed worker
            write_lease(trial_dir, lease)
            became[what] = leases.give_back("2", trial_dir, "a test's hand-back")
        finally:
            leases.close()
        assert states(tmp_path)["2"] == "evaluating", what
        assert read_lease(trial_dir) == lease, what
        (trial_dir / LEASE_FILE).unlink()
    assert became == {
        "a later attempt of its own": ("left to attempt 2 (this leader's attempt 1 is over)"),
        "nobody, attempt 1 already counted": (
            f"left as it is: attempt 1 was already handed back ({first.describe(1)})"
        ),
    }
    # Positive control: no lease (this attempt's was never written): handed back.
    leases = Leases(root, Settings(heartbeat_s=3600.0, lease_grace_s=4 * 3600.0))
    try:
        assert leases.take("2", trial_dir) == 1
        assert leases.written(WAIT)
        assert leases.give_back("2", trial_dir, "a test's hand-back") == (
            "back to pending (interruption 1 of at most 3 retried)"
        )
    finally:
        leases.close()
    assert states(tmp_path)["2"] == "pending"
