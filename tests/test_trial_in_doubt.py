"""No search ends with a trial in doubt (``recovery/in_doubt.py``, ``roles/leader.py``).

A worker started right after a host died reaches NePS's budget while that host's trial
is still ``evaluating`` under its lease: before it ends, it waits until the lease is
renewed (its owner lives) or until it has timed the grace period without a renewal,
then takes the trial over and runs it. In this process, with real NePS on a real root
and ``neps_bcast.run`` as one process (no DDP); the dead host is a lease naming another
machine, never renewed, and the live one a thread renewing it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import neps
import pytest

import neps_bcast
from harness import neps_trials
from neps_bcast.compat.neps_run import forget_current_trial
from neps_bcast.recovery.lease_file import Lease, Owner, read_lease, write_lease

ELSEWHERE = Owner("host-a", "another-boot", "pid:[1]", 4242, 7)
"""The leader of another host (another boot id: its pid cannot be looked up here)."""
BUDGET = 3
GRACE_S, HEARTBEAT_S = 3.0, 0.5
HANG_S = 120.0
"""Only a hang detector: a busy machine must not fail a correct run."""


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)


def states_of(root: Path) -> dict[str, str]:
    return {tid: str(t.metadata.state.value) for tid, t in neps_trials(root).items()}


class HostDied(BaseException):
    """The other host's leader vanishes mid-trial: NePS leaves the trial evaluating."""


def other_hosts_search(root: Path) -> Path:
    """What the other host left: trial 1 ``evaluating`` under its lease, trials 2 and 3
    run by a worker that then ended (the budget of 3 counts trial 1 as spent). Returns
    trial 1's directory."""

    def dies(lr: float, pipeline_directory: Path, pipeline_id: str) -> float:
        now = time.time()
        write_lease(pipeline_directory, Lease(pipeline_id, ELSEWHERE, now, now, attempt=1))
        raise HostDied

    def trains(lr: float) -> float:
        return lr

    options: dict[str, Any] = dict(
        pipeline_space=Space(),
        root_directory=root,
        total_evaluations_to_spend=BUDGET,
        optimizer="random_search",
    )
    with pytest.raises(HostDied):
        neps.run(dies, worker_id=ELSEWHERE.worker_id(), **options)
    forget_current_trial()  # NePS keeps a trial left by a BaseException set until then
    neps.run(trains, worker_id="the-worker-that-ended", **options)
    assert states_of(root) == {"1": "evaluating", "2": "success", "3": "success"}
    return root / "configs" / "config_1"


def renew(trial_dir: Path) -> None:
    """The owner's heartbeat: the lease rewritten, one more beat."""
    lease = read_lease(trial_dir)
    assert lease is not None
    write_lease(trial_dir, replace(lease, heartbeat=time.time(), beats=lease.beats + 1))


def this_worker(root: Path, monkeypatch: pytest.MonkeyPatch, grace_s: float) -> list[str]:
    """``neps_bcast.run`` on ``root`` with the same budget; the trials it evaluated."""
    monkeypatch.setenv("NEPS_BCAST_LEASE_GRACE_S", str(grace_s))
    monkeypatch.setenv("NEPS_BCAST_HEARTBEAT_S", str(HEARTBEAT_S))
    evaluated: list[str] = []

    def evaluate(lr: float, pipeline_id: str) -> float:
        evaluated.append(pipeline_id)
        return lr

    neps_bcast.run(
        evaluate,
        pipeline_space=Space(),
        root_directory=root,
        total_evaluations_to_spend=BUDGET,
        optimizer="random_search",
    )
    return evaluated


def test_a_worker_takes_over_a_dead_hosts_trial_before_it_ends_and_runs_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "root"
    trial_dir = other_hosts_search(root)
    renew(trial_dir)  # its last heartbeat, just now: fresh at this worker's first look
    caplog.set_level(logging.INFO, logger="neps_bcast")
    started = time.monotonic()
    evaluated = this_worker(root, monkeypatch, GRACE_S)
    took_s = time.monotonic() - started
    assert evaluated == ["1"]
    assert states_of(root) == dict.fromkeys(("1", "2", "3"), "success")
    lease = read_lease(trial_dir)
    assert lease is not None
    assert (lease.owner, lease.attempt) == (Owner.me(), 2)
    assert [a.owner for a in lease.attempts] == [ELSEWHERE]
    assert "unchanged for" in lease.attempts[0].how  # timed here, not by two clocks
    waiting = [r.getMessage() for r in caplog.records if "can prove" in r.getMessage()]
    assert len(waiting) == 1  # one line
    assert waiting[0].endswith(
        "this worker's search is over, but trial 1 is evaluating under the lease of"
        f" {ELSEWHERE.describe()}, which it can prove neither alive nor dead yet: waiting"
        f" until it is renewed, or at most {GRACE_S + HEARTBEAT_S:.1f} s"
        " (NEPS_BCAST_LEASE_GRACE_S + NEPS_BCAST_HEARTBEAT_S), then taking it over"
    )
    assert "trial(s) 1 taken over: this worker runs them before it ends" in caplog.text
    assert took_s < HANG_S


def test_a_worker_whose_trial_in_doubt_is_renewed_ends_without_waiting_out_the_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Positive control: the owner lives (a thread renews its lease as its heartbeat
    would); the worker ends as it did before, once it saw a renewal, long before the
    grace period, and leaves the trial to its owner."""
    root = tmp_path / "root"
    trial_dir = other_hosts_search(root)
    grace_s = 60.0
    stop = threading.Event()

    def owner_lives() -> None:
        while not stop.wait(HEARTBEAT_S / 5):  # the owner's own heartbeat period
            renew(trial_dir)

    renewer = threading.Thread(target=owner_lives, daemon=True)
    renew(trial_dir)
    caplog.set_level(logging.INFO, logger="neps_bcast")
    renewer.start()
    try:
        started = time.monotonic()
        evaluated = this_worker(root, monkeypatch, grace_s)
        took_s = time.monotonic() - started
    finally:
        stop.set()
        renewer.join(timeout=HANG_S)
    assert evaluated == []
    assert states_of(root)["1"] == "evaluating"
    assert "waiting until it is renewed" in caplog.text
    assert (
        f"trial 1: its lease changed ({ELSEWHERE.describe()}): its owner lives and will finish it"
    ) in caplog.text
    assert "taken over" not in caplog.text
    assert took_s < grace_s
