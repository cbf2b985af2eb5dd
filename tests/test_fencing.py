"""One result per trial across hosts: leases judged without comparing two hosts' clocks,
and a leader whose attempt was taken over fenced off (``recovery/lease.py``,
``recovery/hand_back.py``, ``launcher.lease_record.why_dead``). On real lease files; the hosts
with shifted clocks and the zombie are in tests/hosts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from neps_bcast.compat.neps import lock_kind
from neps_bcast.config import Settings
from neps_bcast.recovery.hand_back import HandBack, filesystem_now
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.lease_file import Lease, Owner, read_lease, why_dead, write_lease

GRACE = 60.0
ELSEWHERE = Owner("host-a", "another-boot", "pid:[1]", 4242, 7)
WAIT = 30.0


def remote_lease(heartbeat: float, beats: int = 5) -> Lease:
    return Lease("7", ELSEWHERE, heartbeat - 100, heartbeat, attempt=1, beats=beats)


def test_a_reader_whose_clock_is_ahead_never_takes_a_live_lease_for_stale() -> None:
    """B's clock 10 min ahead: by its own clock the lease is 600 s old, by the
    filesystem's 2 s."""
    now_b = 1_000_600.0
    lease = remote_lease(heartbeat=1_000_000.0)
    assert why_dead(lease, None, Owner.me(), now_b, GRACE, fs_age_s=2.0, unchanged_s=0.0) is None


def test_a_reader_whose_clock_is_behind_takes_a_dead_lease_once_it_has_timed_it() -> None:
    """B's clock 10 min behind: the lease looks 540 s in the future by B's clock; what
    decides is that B saw it unchanged for the grace period on its monotonic clock."""
    now_b = 1_000_000.0 - 600 + 60
    lease = remote_lease(heartbeat=1_000_000.0)
    assert why_dead(lease, None, Owner.me(), now_b, GRACE, fs_age_s=70.0, unchanged_s=10.0) is None
    reason = why_dead(lease, None, Owner.me(), now_b, GRACE, fs_age_s=70.0, unchanged_s=61.0)
    assert reason == "its lease (" + ELSEWHERE.describe() + ") unchanged for 61 s, timed on" + (
        " this host (grace 60 s)"
    )


def test_a_first_look_takes_a_lease_stale_by_both_clocks_at_once() -> None:
    lease = remote_lease(heartbeat=1_000_000.0)
    reason = why_dead(lease, None, Owner.me(), 1_000_100.0, GRACE, fs_age_s=99.0, unchanged_s=0.0)
    assert reason is not None
    assert "for 100 s, 99 s by the filesystem's clock" in reason


def test_the_leaders_look_times_a_lease_on_its_own_clock_and_restarts_on_a_renewal(
    tmp_path: Path,
) -> None:
    from neps_bcast.compat.neps_trials import EvaluatingTrial

    look = HandBack(Owner.me(), Settings())
    trial = EvaluatingTrial("7", tmp_path, None, None)
    lease = remote_lease(heartbeat=1_000_000.0)
    assert look._unchanged_s("7", lease, trial) == 0.0
    time.sleep(0.05)  # the quantity measured: time seen unchanged
    assert look._unchanged_s("7", lease, trial) >= 0.05
    renewed = replace(lease, beats=lease.beats + 1)
    assert look._unchanged_s("7", renewed, trial) == 0.0


def test_the_filesystems_clock_is_read_from_a_file_it_stamped(tmp_path: Path) -> None:
    before = time.time()
    stamped = filesystem_now(tmp_path)
    assert stamped is not None
    assert before - 5 <= stamped <= time.time() + 5


@pytest.fixture
def leases(tmp_path: Path) -> Leases:
    lock_kind()  # the lease lock locks as NePS does (imports NePS)
    return Leases(tmp_path, Settings(heartbeat_s=0.05, lease_grace_s=1.0))


def test_only_the_current_attempts_owner_may_record_the_result(
    leases: Leases, tmp_path: Path
) -> None:
    try:
        assert leases.take("7", tmp_path) == 1
        assert leases.written(WAIT)
        assert leases.refuse_record("7") is None  # positive control: its own attempt
        assert leases.refuse_record("8") is None  # a trial it never leased: not ours
        on_disk = read_lease(tmp_path)
        assert on_disk is not None
        leases.drop()
        write_lease(tmp_path, replace(on_disk, owner=ELSEWHERE, attempt=2))
        why = leases.refuse_record("7")
    finally:
        leases.close()
    assert why == (
        f"trial 7: this leader's attempt 1 was superseded by attempt 2 on"
        f" {ELSEWHERE.describe()} (this host was silent past NEPS_BCAST_LEASE_GRACE_S):"
        " its result is dropped"
    )


def test_a_leader_finds_at_its_next_heartbeat_that_its_trial_was_taken_over(
    leases: Leases, tmp_path: Path
) -> None:
    said: list[str] = []
    heard = threading.Event()

    def superseded(line: str) -> None:
        said.append(line)
        heard.set()

    leases.held.on_superseded = superseded
    try:
        leases.take("7", tmp_path)
        assert leases.written(WAIT)
        on_disk = read_lease(tmp_path)
        assert on_disk is not None
        taken_over = Lease("7", None, on_disk.started, on_disk.heartbeat, on_disk.attempts)
        write_lease(tmp_path, taken_over)
        assert heard.wait(WAIT)
    finally:
        leases.close()
    assert said == [
        "trial 7: this leader's attempt 1 was superseded by a leader's look for orphans,"
        " which put it back to pending (this host was silent past"
        " NEPS_BCAST_LEASE_GRACE_S): its result is dropped"
    ]


def test_each_renewal_counts_a_beat_and_the_lease_names_its_attempt(
    leases: Leases, tmp_path: Path
) -> None:
    try:
        leases.take("7", tmp_path)
        assert leases.written(WAIT)
        deadline = time.monotonic() + WAIT
        while (read_lease(tmp_path) or remote_lease(0, beats=0)).beats < 3:
            assert time.monotonic() < deadline, "fewer than 3 renewals"
            time.sleep(0.02)  # bounded poll of the file the heartbeat thread writes
        lease = read_lease(tmp_path)
    finally:
        leases.close()
    assert lease is not None
    assert lease.attempt == 1


def test_a_lease_an_older_neps_bcast_wrote_still_reads(tmp_path: Path) -> None:
    old = '{"trial_id": "7", "owner": null, "started": 1.0, "heartbeat": 2.0}'
    assert Lease.from_json(old) == Lease("7", None, 1.0, 2.0)


def test_status_shows_a_leaders_clock_that_is_off_the_filesystems(tmp_path: Path) -> None:
    """Leases never compare two hosts' clocks; status shows one that is off: the
    heartbeat a leader wrote by its clock against the lease file's mtime."""
    from neps_bcast.launcher.search_status import TrialStatus, _clock_offset
    from neps_bcast.launcher.search_text import _heartbeat

    write_lease(tmp_path, remote_lease(heartbeat=time.time() + 600))
    offset = _clock_offset(tmp_path, remote_lease(heartbeat=time.time() + 600))
    assert offset is not None
    assert 590 < offset < 610
    shown = _heartbeat(TrialStatus("7", "evaluating", 1, heartbeat_age_s=2.0, clock_offset_s=600))
    assert shown == "2s ago (its clock +600 s off the filesystem's)"


def test_a_leaders_own_hand_back_is_never_fenced(leases: Leases, tmp_path: Path) -> None:
    """Its own hand-back records a crash past the retry limit through NePS's recording:
    the lease it just released (owner: nobody) must not make the fence refuse it."""
    from neps_bcast.recovery import hand_back

    try:
        leases.take("7", tmp_path)
        assert leases.written(WAIT)
        on_disk = read_lease(tmp_path)
        assert on_disk is not None
        write_lease(tmp_path, Lease("7", None, on_disk.started, on_disk.heartbeat))
        assert leases.refuse_record("7") is not None  # positive control: fenced
        with hand_back._handing_back():
            assert leases.refuse_record("7") is None
    finally:
        leases.close()


def test_a_lease_that_cannot_be_read_is_not_taken_for_a_takeover(
    leases: Leases, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A torn or unreadable lease (a flaky mount) is tried again at the next heartbeat;
    only a lease that names another owner, or none, stops the leader."""
    said: list[str] = []
    leases.held.on_superseded = said.append
    try:
        leases.take("7", tmp_path)
        assert leases.written(WAIT)
        (tmp_path / ".neps_bcast_lease.json").write_text("{not json")
        deadline = time.monotonic() + WAIT
        while "could not renew the lease" not in caplog.text:
            assert time.monotonic() < deadline, "no renewal was tried"
            time.sleep(0.02)  # bounded poll of the heartbeat thread's log
    finally:
        leases.close()
    assert said == []
