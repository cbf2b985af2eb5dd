"""The signals a scheduler stops a job with: chained to the handlers already there, and
the running trial put back to pending whoever handled them.

SLURM ends a job with SIGTERM (preemption, ``scancel``, ``scontrol requeue``, the time
limit) and, when asked (``--signal=USR1@90``; submitit asks for USR2), first with a
signal of the user's choice, which the job's own handler answers by saving a checkpoint,
requeuing the job and exiting. Neither is the trial's fault: the trial goes back to
pending and the requeued job evaluates it first. Inside ``neps_bcast.run``:

- SIGTERM raises ``Terminated`` (a ``SystemExit`` with code 128 + 15, "requeue me"),
  after the handler installed before ``run`` (submitit's, the user's, Lightning's) has
  run: chained, never replaced. Python's default would end the process at once and
  leave the trial "evaluating". Only the first stop counts: a second SIGTERM (``scancel``
  twice, a launcher forwarding it again) arriving while the trial is recorded is
  ignored, so the record is not cut short. While NePS's own code runs between two
  trials, or starts (its state written file by file in place), the stop waits for our
  next step (``wait_with_sigterm``).
- A handler of SIGUSR1 or SIGUSR2 installed before ``run`` is chained the same way (so
  its signal is noted); none is installed where there is none (Lightning installs its
  SLURM auto-requeue handler only where no USR1 handler exists). A chained handler runs
  whole: the SIGTERM that its own ``scontrol requeue`` brings, landing inside it, is held
  until it ends, and its ``sys.exit`` (if it exits) is the stop.
- A ``SystemExit`` that ends a trial after such a signal arrived in this process, or
  that was raised inside the handler of one (installed whenever, by whomever), is a
  stop by the scheduler: it becomes ``Terminated`` with the exit code the user's code
  chose (``preemption``). A ``sys.exit`` without a stop signal stays the user's own
  stop, and so does Ctrl-C.
- Ctrl-C (SIGINT) waits too while NePS's own code runs between two trials, for the same
  reason: a ``KeyboardInterrupt`` raised inside NePS's report would leave the finished
  trial "evaluating" and its result lost. It is raised at the leader's next step, as
  it is; everywhere else SIGINT is left to the handler already installed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import signal
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
"""What a scheduler stops a job with (SIGTERM always; USR1/USR2 with ``--signal``)."""


class Terminated(SystemExit):
    """A stop by the scheduler (SIGTERM, or a job's own handler of its time-limit
    signal exiting), turned into an exception, so the trial is put back to pending."""

    def __init__(self, code: Any, how: str = "SIGTERM") -> None:
        super().__init__(code)
        self.how = how
        """What stopped it: "SIGTERM", or e.g. "SystemExit(0) in the SIGUSR1 handler"."""


class _State:
    """This process's stop signals (signals are handled in the main thread only)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        """Stop signals that arrived while a handler of ours was installed."""
        self.stopping = False
        """A stop was raised: later SIGTERMs are ignored."""
        self.waiting = False
        """A stop waits for ``raise_waiting_sigterm`` instead of raising."""
        self.pending: Terminated | None = None
        """The stop that came while waiting."""
        self.interrupted = False
        """A Ctrl-C (SIGINT) came while waiting."""
        self.holding = 0
        """Inside a control step (``indivisible``): a stop is raised when it ends."""


_STATE = _State()


def wait_with_sigterm() -> None:
    """From now on a SIGTERM (or Ctrl-C) waits for ``raise_waiting_sigterm`` instead of
    raising.

    For the leader while NePS's own code runs between two trials (it records the
    finished trial, then samples the next), and while it stops its followers at the
    end: NePS catches only ``Exception``, so a ``Terminated`` raised there would skip
    its record and leave the trial "evaluating". The signal is raised at our next step
    instead: when NePS hands over the next trial (which then goes back to pending), or
    once the followers are stopped.
    """
    _STATE.waiting = True


def raise_waiting_sigterm() -> None:
    """Stop waiting; raise the SIGTERM that came while waiting, if one did, else the
    Ctrl-C (a ``KeyboardInterrupt``); a scheduler's stop comes first."""
    _STATE.waiting = False
    _raise_held()


@contextlib.contextmanager
def indivisible() -> Iterator[None]:
    """A control step runs whole: a stop (SIGTERM, Ctrl-C) that lands between its
    collectives is raised when the step ends (or waits on, while the leader waits).

    Why: a step is several gloo operations (each follower's frame to the leader, then
    the leader's frames to each follower, twice for a long message), and a Python signal
    handler runs between any two of them (a blocking wait returns first: gloo does not
    check for signals). A rank that left a step after its gather and before its broadcast
    (the step's two halves then) left its peer in that broadcast and itself in its next
    step's gather: both alive, both blocked until the seven-day bound (the fault-point
    sweep found it: SIGTERM to the leader while its follower was at the trial-end
    exchange). Deferring costs nothing in reaction time: the handler cannot run before
    the blocking wait returns anyway.
    """
    _STATE.holding += 1
    try:
        yield
    finally:
        _STATE.holding -= 1
        if not _STATE.holding and not _STATE.waiting:
            _raise_held()


def _raise_held() -> None:
    pending, _STATE.pending = _STATE.pending, None
    interrupted, _STATE.interrupted = _STATE.interrupted, False
    if pending is not None:
        raise pending
    if interrupted:
        raise KeyboardInterrupt


def _stop(stop: Terminated) -> None:
    """Raise ``stop`` now, or keep it for ``raise_waiting_sigterm`` while waiting (or
    for the end of the control step it landed in)."""
    _STATE.stopping = True
    if _STATE.waiting or _STATE.holding:
        _STATE.pending = stop
        return
    _STATE.pending = None  # one held while a handler ran is this same stop
    raise stop


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Inside the block, SIGTERM raises ``Terminated`` after the handler already installed
    has run, the handlers of SIGUSR1/SIGUSR2 already installed are chained, and SIGINT's
    (Python's, or the user's) is chained so that it can wait (``wait_with_sigterm``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STATE.received.clear()
    _STATE.stopping = False
    _STATE.waiting, _STATE.pending, _STATE.interrupted = False, None, False
    _STATE.holding = 0
    installed: dict[int, tuple[Any, Callable[[int, Any], None]]] = {}
    previous_int = signal.getsignal(signal.SIGINT)
    if callable(previous_int):  # not where SIGINT is ignored or left to the OS
        installed[signal.SIGINT] = (previous_int, _interrupt(previous_int))
        signal.signal(signal.SIGINT, installed[signal.SIGINT][1])
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if signum == signal.SIGTERM and previous == signal.SIG_IGN:
            continue  # the user ignores SIGTERM on purpose
        if signum != signal.SIGTERM and not callable(previous):
            continue
        ours = _chained(signum, previous)
        signal.signal(signum, ours)
        installed[signum] = (previous, ours)
    leaving_on_a_stop = False
    try:
        yield
    except Terminated:
        leaving_on_a_stop = True
        raise
    finally:
        for number, (previous, ours) in installed.items():
            if signal.getsignal(number) is ours:  # unless someone replaced ours since
                signal.signal(number, previous)
        if leaving_on_a_stop and signal.SIGTERM in installed:
            # The process is on its way out with the first stop's exit code (143 asks
            # to be requeued): a second SIGTERM (scancel twice, torchrun closing its
            # workers) must not end it with -15 on the way.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _STATE.waiting, _STATE.pending, _STATE.interrupted = False, None, False


def _interrupt(previous: Callable[[int, Any], Any]) -> Callable[[int, Any], None]:
    """Ctrl-C: noted while the leader waits between trials, else the handler before ours
    (Python's raises ``KeyboardInterrupt``)."""

    def handler(received: int, frame: types.FrameType | None) -> None:
        if _STATE.waiting or _STATE.holding:
            _STATE.interrupted = True
            return
        previous(received, frame)

    handler.neps_bcast_chained = previous  # type: ignore[attr-defined]  # for tests and debugging
    return handler


def _chained(signum: int, previous: Any) -> Callable[[int, Any], None]:
    name = signal.Signals(signum).name

    def handler(received: int, frame: types.FrameType | None) -> None:
        _STATE.received.append(received)
        if received == signal.SIGTERM and _STATE.stopping:
            return  # a second SIGTERM must not interrupt the recording of the first
        # The handler before ours runs whole: a stop signalled while it runs (the SIGTERM
        # of the `scontrol requeue` it is waiting for) is held until it ends, as inside
        # a control step, instead of being raised in the middle of the user's handler.
        _STATE.holding += 1
        try:
            if callable(previous):
                previous(received, frame)
        except SystemExit as exc:
            _STATE.holding -= 1
            if isinstance(exc, Terminated):
                raise
            _STATE.pending = None  # the handler's own exit is the stop it chose
            stop = Terminated(exc.code, f"{_describe(exc)} in the {name} handler")
            stop.__cause__ = exc
            _stop(stop)
            return
        except BaseException:
            _STATE.holding -= 1
            raise
        _STATE.holding -= 1
        if received == signal.SIGTERM:
            _stop(Terminated(128 + received))
        elif not _STATE.holding and not _STATE.waiting:
            _raise_held()  # a stop that came while the handler ran

    handler.neps_bcast_chained = previous  # type: ignore[attr-defined]  # for tests and debugging
    return handler


def preemption(exc: BaseException) -> Terminated | None:
    """``exc`` as a stop by the scheduler, or None when it is something else.

    ``Terminated`` itself; a ``SystemExit`` raised after a stop signal arrived in this
    process, or inside the current handler of a stop signal (the user's "requeue and
    exit", whether it was installed before ``run`` or inside the trial).
    """
    if isinstance(exc, Terminated):
        return exc
    if not isinstance(exc, SystemExit):
        return None
    received = [signal.Signals(s).name for s in dict.fromkeys(_STATE.received)]
    in_handler = _stop_handler_raising(exc)
    if in_handler is not None:
        how = f"{_describe(exc)} in the {in_handler} handler"
    elif received:
        how = f"{_describe(exc)} after {', '.join(received)}"
    else:
        return None
    _STATE.stopping = True
    stop = Terminated(exc.code, how)
    stop.__cause__ = exc
    return stop


def _describe(exc: SystemExit) -> str:
    return f"SystemExit({exc.code!r})"


def _stop_handler_raising(exc: BaseException) -> str | None:
    """The stop signal whose current handler's code is on ``exc``'s traceback, if any."""
    codes: dict[types.CodeType, str] = {}
    for signum in STOP_SIGNALS:
        for code in _codes_of(signal.getsignal(signum)):
            codes.setdefault(code, signal.Signals(signum).name)
    if not codes:
        return None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in codes:
                return codes[tb.tb_frame.f_code]
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return None


def _codes_of(handler: Any, depth: int = 0) -> list[types.CodeType]:
    """The code objects a handler runs first: a function, a bound method, a partial, a
    callable object, or one of ours chaining another (followed, a few levels deep)."""
    if depth > 4 or not callable(handler):
        return []
    found: list[types.CodeType] = []
    target = handler.func if isinstance(handler, functools.partial) else handler
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if isinstance(code, types.CodeType):
        found.append(code)
    elif not isinstance(target, types.BuiltinFunctionType):
        call = inspect.getattr_static(type(target), "__call__", None)
        code = getattr(call, "__code__", None)
        if isinstance(code, types.CodeType):
            found.append(code)
    chained = getattr(handler, "neps_bcast_chained", None)
    if chained is not None:
        found += _codes_of(chained, depth + 1)
    return found
