"""Unit tests: stop signals chain to the handlers already installed, and a scheduler's
stop (SIGTERM, or the job's own handler of its time-limit signal exiting) becomes
``Terminated`` whoever handled it; a plain ``sys.exit`` and Ctrl-C stay the user's stop.

Real signals, sent by this process to itself (pytest runs tests in the main thread).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from neps_bcast.recovery import signals
from neps_bcast.recovery.signals import Terminated, preemption, stop_signals


@pytest.fixture(autouse=True)
def default_handlers() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in signals.STOP_SIGNALS}
    for s in signals.STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)
    for _ in range(1000):  # the handler runs at the next bytecode boundary
        pass


def test_a_sigterm_handler_installed_before_still_runs_and_sigterm_raises_143() -> None:
    ran: list[int] = []
    signal.signal(signal.SIGTERM, lambda s, _f: ran.append(s))
    with stop_signals(), pytest.raises(Terminated) as info:
        send(signal.SIGTERM)
    assert ran == [signal.SIGTERM]
    assert info.value.code == 143
    assert info.value.how == "SIGTERM"
    assert preemption(info.value) is info.value


def test_without_a_handler_sigterm_raises_143_and_the_default_comes_back() -> None:
    with stop_signals(), pytest.raises(Terminated) as info:
        send(signal.SIGTERM)
    assert info.value.code == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored after the block


def test_a_previous_sigterm_handler_that_exits_is_a_stop_with_its_exit_code() -> None:
    """submitit's SIGTERM handler only logs; a user's may call sys.exit(0)."""

    def exits(_s: int, _f: Any) -> None:
        sys.exit(0)

    signal.signal(signal.SIGTERM, exits)
    with stop_signals(), pytest.raises(Terminated) as info:
        send(signal.SIGTERM)
    assert info.value.code == 0
    assert info.value.how == "SystemExit(0) in the SIGTERM handler"


def test_a_second_sigterm_while_stopping_is_ignored() -> None:
    with stop_signals():
        with pytest.raises(Terminated):
            send(signal.SIGTERM)
        send(signal.SIGTERM)  # must not raise: the first stop is being recorded


def test_an_ignored_sigterm_stays_ignored() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with stop_signals():
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        send(signal.SIGTERM)


def test_no_usr1_handler_is_installed_where_there_is_none() -> None:
    """Lightning installs its SLURM auto-requeue handler only where USR1 has none."""
    with stop_signals():
        assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL
        assert callable(signal.getsignal(signal.SIGTERM))  # positive control: ours


def test_a_usr1_handler_installed_before_runs_and_a_later_exit_is_a_stop() -> None:
    """The user's handler sets a flag; the training loop sees it, saves, requeues and
    exits (the most common shape): that exit is the scheduler's stop."""
    flag: list[int] = []
    signal.signal(signal.SIGUSR1, lambda s, _f: flag.append(s))
    with stop_signals():
        send(signal.SIGUSR1)
        assert flag == [signal.SIGUSR1]
        try:
            sys.exit(0)
        except SystemExit as exc:
            stop = preemption(exc)
    assert stop is not None
    assert stop.code == 0
    assert stop.how == "SystemExit(0) after SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL  # the user's is back


def test_a_usr2_handler_installed_before_that_exits_is_a_stop() -> None:
    """submitit's: checkpoint, requeue, sys.exit(-1) on rank 0."""

    def checkpoint_and_requeue(_s: int, _f: Any) -> None:
        sys.exit(-1)

    signal.signal(signal.SIGUSR2, checkpoint_and_requeue)
    with stop_signals(), pytest.raises(Terminated) as info:
        send(signal.SIGUSR2)
    assert info.value.code == -1
    assert info.value.how == "SystemExit(-1) in the SIGUSR2 handler"


def test_a_sigterm_while_the_users_usr1_handler_requeues_waits_for_its_exit() -> None:
    """``scontrol requeue`` inside the user's USR1 handler makes SLURM SIGTERM the job at
    once, often before the handler's ``sys.exit(0)``: the user's SIGTERM handler runs
    (as it would without us), the USR1 handler runs to its end, and its exit is the stop
    (CI's real-SLURM run: the SIGTERM raised inside the handler, which never exited)."""
    ran: list[str] = []
    signal.signal(signal.SIGTERM, lambda _s, _f: ran.append("TERM handler"))

    def requeue_and_exit(_s: int, _f: Any) -> None:
        ran.append("USR1 handler")
        send(signal.SIGTERM)  # scontrol requeue: SLURM's SIGTERM lands in here
        ran.append("requeued")
        sys.exit(0)

    signal.signal(signal.SIGUSR1, requeue_and_exit)
    with stop_signals():
        with pytest.raises(Terminated) as info:
            send(signal.SIGUSR1)
        send(signal.SIGTERM)  # SLURM's SIGTERM after the exit: ignored, as any second one
        with signals.indivisible():  # nothing held is raised again at a later step
            pass
    assert ran == ["USR1 handler", "TERM handler", "requeued"]
    assert info.value.code == 0
    assert info.value.how == "SystemExit(0) in the SIGUSR1 handler"


def test_a_sigterm_while_a_usr1_handler_that_returns_runs_is_raised_after_it() -> None:
    """Lightning's auto-requeue handler saves, runs ``scontrol requeue`` and returns,
    leaving the stop to SLURM's SIGTERM: raised once the handler is done."""
    ran: list[str] = []

    def save_and_requeue(_s: int, _f: Any) -> None:
        ran.append("saving")
        send(signal.SIGTERM)
        ran.append("requeued")

    signal.signal(signal.SIGUSR1, save_and_requeue)
    with stop_signals(), pytest.raises(Terminated) as info:
        send(signal.SIGUSR1)
    assert ran == ["saving", "requeued"]
    assert (info.value.code, info.value.how) == (143, "SIGTERM")


def test_a_usr1_handler_installed_inside_the_trial_that_exits_is_a_stop() -> None:
    """Installed after run started (inside the function): not chained, so told from
    the traceback, which passes through the handler."""

    def requeue_and_exit(_s: int, _f: Any) -> None:
        sys.exit(3)

    with stop_signals():
        signal.signal(signal.SIGUSR1, requeue_and_exit)
        try:
            send(signal.SIGUSR1)
        except SystemExit as exc:
            stop = preemption(exc)
        else:
            pytest.fail("the handler did not exit")
    assert stop is not None
    assert stop.code == 3
    assert stop.how == "SystemExit(3) in the SIGUSR1 handler"


def test_sys_exit_without_a_stop_signal_and_ctrl_c_stay_the_users_stop() -> None:
    with stop_signals():
        with pytest.raises(SystemExit) as info:
            sys.exit(1)
        assert preemption(info.value) is None
        assert preemption(KeyboardInterrupt()) is None
        assert preemption(ValueError("a bad config")) is None


def test_a_ctrl_c_while_waiting_is_raised_at_the_next_step_not_inside_neps() -> None:
    """Between trials (NePS records the last and samples the next) Ctrl-C waits, as a
    SIGTERM does: raised inside NePS's report it would leave the finished trial
    "evaluating". The positive control: outside the wait, Ctrl-C raises at once."""
    with stop_signals():
        signals.wait_with_sigterm()
        send(signal.SIGINT)  # must not raise here
        with pytest.raises(KeyboardInterrupt):
            signals.raise_waiting_sigterm()
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_and_a_ctrl_c_while_waiting_raise_the_sigterm() -> None:
    """A scheduler's stop comes first: the trial goes back to pending, not crashed."""
    with stop_signals():
        signals.wait_with_sigterm()
        send(signal.SIGINT)
        send(signal.SIGTERM)
        with pytest.raises(Terminated):
            signals.raise_waiting_sigterm()
        signals.raise_waiting_sigterm()  # nothing left waiting


def test_leaving_on_a_stop_a_second_sigterm_cannot_change_the_exit_code() -> None:
    """The process leaves with the first stop's 143 (a requeue): a second SIGTERM on the
    way out (scancel twice, torchrun closing its workers) must not end it with -15. The
    positive control: a block left without a stop gives SIGTERM back to the default."""
    with pytest.raises(Terminated), stop_signals():
        send(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with stop_signals():
        pass
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize(
    ("signum", "raised"),
    [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)],
    ids=["sigterm", "ctrl_c"],
)
def test_a_stop_inside_a_control_step_is_raised_once_the_step_is_whole(
    signum: int, raised: type[BaseException]
) -> None:
    """A control step is several collectives: a rank that left between two of them left
    its peer in the second and itself in its next step's first, both blocked for the
    last-resort bound. The step's rest runs, then the stop is raised."""
    done: list[str] = []

    def step() -> None:
        with signals.indivisible():
            send(signum)
            done.append("the step's second collective")

    with stop_signals(), pytest.raises(raised):
        step()
    assert done == ["the step's second collective"]


def test_a_stop_inside_a_step_while_the_leader_waits_keeps_waiting() -> None:
    """Between trials a stop waits for the leader's next step, control step or not."""
    with stop_signals():
        signals.wait_with_sigterm()
        with signals.indivisible():
            send(signal.SIGTERM)
        with pytest.raises(Terminated):
            signals.raise_waiting_sigterm()


@pytest.mark.parametrize(
    ("signum", "kind"), [(signal.SIGTERM, "Terminated"), (signal.SIGINT, "KeyboardInterrupt")]
)
def test_a_stop_while_a_trial_is_settled_waits_until_it_is_and_the_original_wins(
    tmp_path: Any, signum: int, kind: str
) -> None:
    """torchrun SIGTERMs the leader once a follower is SIGKILLed; landing while the
    leader put the trial back, it left the trial "evaluating" (the fault sweep, 3 ranks,
    trial-end exchange)."""
    from pathlib import Path

    from neps_bcast.compat.neps import NepsTrialInfo
    from neps_bcast.errors import FollowerLostError
    from neps_bcast.recovery import settle

    given_back: list[str] = []

    class Leases:
        def give_back(self, trial_id: str, directory: Path, why: str) -> str:
            send(signum)
            given_back.append(trial_id)
            return "back to pending"

    lost = FollowerLostError("rank 1 lost: signal 9 (SIGKILL)")
    info = NepsTrialInfo("7", Path(tmp_path), None)
    with stop_signals():
        settle.trial(info, Path(tmp_path), Leases(), lost)  # type: ignore[arg-type]
    assert given_back == ["7"]
    assert any(kind in note for note in getattr(lost, "__notes__", [])), lost
