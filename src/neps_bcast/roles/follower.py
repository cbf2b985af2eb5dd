"""A follower: evaluates what its leader hands it until the leader says stop.

All of the follower's life is here: the trial loop (``follow``), how it leaves on an
interrupt (its control channel closed at once), and how its process ends quickly
however it stops (without the interpreter's final garbage collection,
``_freeze_at_exit``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import io
import itertools
import logging
from collections.abc import Callable
from typing import Any, cast

from neps_bcast.ddp.teardown import free_trials_at_exit, free_what_trials_left
from neps_bcast.errors import SearchStopped
from neps_bcast.recovery.signals import indivisible, stop_signals
from neps_bcast.runtime import Runtime
from neps_bcast.transport.messages import StopMessage, TrialMessage
from neps_bcast.trial.run import evaluate_once, log_freed


def follow(rt: Runtime, fn: Callable[..., Any], first: TrialMessage | None) -> None:
    """Evaluate trials until STOP. A trial's error is reported, never raised here:

    Lightning's process observer kills the whole launch when a child exits non-zero,
    so a follower leaves with code 0 unless its leader is lost.
    """
    message, held = (first, contextlib.ExitStack()) if first is not None else _receive(rt)
    while isinstance(message, TrialMessage):
        rt.log(logging.INFO, "trial %s (#%d) received", message.trial_id, message.seq)
        try:
            outcome = evaluate_once(rt, fn, message, held=held)
        except SearchStopped as stopped:
            # The leader left this trial and stopped (an interrupt between two of its
            # steps): it is at STOP or goodbye already, so this rank goes there too.
            message = StopMessage(stopped.reason)
            break
        finally:
            held.close()  # let go by evaluate_once already, unless it raised before
        if outcome.failures:
            rt.log(
                logging.INFO,
                "trial %s failed: %s",
                message.trial_id,
                "; ".join(f.headline() for f in outcome.failures),
            )
        # While the leader records the trial in NePS and samples the next: the next
        # trial's clean start, off its critical path. The outcome's error holds the
        # trial's frames (its Trainer, model): dropped first.
        del outcome
        log_freed(rt, free_what_trials_left())
        message, held = _receive(rt)
    # The leader leaving is normal from now on (its watch ends quietly), but not its
    # silence before the goodbye: a leader frozen there is still named within the peer
    # bound and ends this rank (``runtime.say_goodbye``), never NEPS_BCAST_WAIT_TIMEOUT_S.
    rt.link.stopping = True
    rt.log(logging.INFO, "stopping: %s", message.reason)
    rt.say_goodbye()
    rt.close()


def _receive(rt: Runtime) -> tuple[TrialMessage | StopMessage, contextlib.ExitStack]:
    """The leader's next message, and a stop held from its receipt on
    (``signals.indivisible``): ``evaluate_once`` lets go of it once the trial's first
    step, the forming of its group, is done; after a STOP it is let go at once.

    Why: a follower that holds a trial takes part in its first step. A SIGTERM to every
    rank (preemption) as the leader re-formed the group after a failed trial (the fault
    sweep, Lightning) was raised on the follower right after its receive: it exited and
    left its leader in torch's rendezvous for the new group, until Lightning's observer
    SIGKILLed it (-9 instead of 143).
    """
    held = contextlib.ExitStack()
    held.enter_context(indivisible())
    try:
        message = rt.receive()
    except BaseException:
        held.close()
        raise
    if not isinstance(message, TrialMessage):
        held.close()
    return message, held


def run_follower(rt: Runtime, fn: Callable[..., Any], *, first_contact: bool) -> None:
    """A follower's whole life in ``neps_bcast.run``: trials until STOP, then goodbye.

    ``first_contact``: a Lightning child, whose first trial waits in the leader's store.
    """
    _exit_without_collecting()
    try:
        with stop_signals():
            follow(rt, fn, rt.first_contact() if first_contact else None)
    except BaseException:
        # SIGTERM, Ctrl-C, sys.exit, an error of ours: close neps_bcast's own gloo group
        # (the channel) now. Left to the interpreter's finalization, its worker threads
        # can abort the process (see ``ddp.teardown.free_trials_at_exit``); measured: every
        # interrupted follower of the suite's signal tests still held it at exit.
        rt.close()
        raise
    finally:
        rt.link.release_watch()


def _exit_without_collecting() -> None:
    """A follower's interpreter exit skips the cyclic garbage collection of everything
    it imported (``_freeze_at_exit``), however the follower stops.

    Why: whoever waits for this process (torchrun, srun, a scheduler, the launch's
    last process) waits for it to be gone, and that collection frees every object
    torch, Lightning and NePS made (about 470,000, in 4,700 modules): measured on 2
    busy cores (load 10), 2.5 to 7 s between the follower's last line of Python and
    the end of its process; 0.5 to 0.7 s with it skipped. And when the leader's
    ``neps.run`` raises, the leader exits non-zero right after their goodbye and
    torchrun SIGTERMs every worker still alive: a follower still in that collection
    ended with -15 instead of 0 (CI: 1.8 s after its last atexit handler). Registered
    when the follower starts; it acts only at exit. ``_freeze_at_exit`` does
    ``free_trials_at_exit``'s work first, so that handler is not run a second time.
    """
    atexit.unregister(free_trials_at_exit)
    atexit.unregister(_freeze_at_exit)  # once, however often run is called
    atexit.register(_freeze_at_exit)


def _freeze_at_exit() -> None:
    """Flush every open file, free what the trials left (``free_trials_at_exit``: the
    group destroyed, one collection, so no gloo group is left to finalization), then
    freeze every object out of the garbage collector. Flushed first: a collected cycle
    closes its files in no set order, and a text file closed after its buffer loses
    what it held (measured: the unit test's file came out empty).

    Runs as the first atexit handler (the last registered): every other handler runs
    after it as usual (logging's shutdown flushes and closes its handlers), so do the
    flush of stdout and stderr and the exit code. What changes: objects left in
    reference cycles at exit are not finalized (Python never promises that), and those
    include the globals of any module defining a function, ``__main__`` among them. So
    the one thing that finalization would have saved, the buffered data of a file the
    user's code never closed, is flushed here. Nothing is read from an object but its
    type before it is known to be a file (some module proxies warn on any access).

    The files are found without a Python-level step per object: after a Lightning trial
    a follower holds about 480,000 objects. A loop testing each one's type cost 0.37 s of
    CPU (idle core), 1.1 to 3.1 s of wall time on 2 cores at load 7, where the suite's
    5 s bound from a lost-leader follower's exit record to its process gone failed once.
    Here ``map`` and ``compress`` walk the list in C and only the ~1,400 distinct types
    are tested in Python: 0.15 to 0.22 s of CPU. Testing by type id, with a type whose
    test raises counted as no file: a class with an unhashable metaclass makes io's
    ABCs raise ``TypeError`` (it stopped the old loop, and so the freeze).
    """
    gc.unfreeze()  # the heap frozen before the first trial (``free_what_trials_left``)
    objects = gc.get_objects()
    types = list(map(type, objects))
    type_ids = list(map(id, types))  # by id: a metaclass may be unhashable
    distinct = dict(zip(type_ids, types, strict=True))
    files = {i for i, t in distinct.items() if _is_file_type(t)}
    for obj in itertools.compress(objects, map(files.__contains__, type_ids)):
        stream = cast(io.IOBase, obj)
        with contextlib.suppress(Exception):  # closed, detached, a reader gone
            if not stream.closed and stream.writable():
                stream.flush()
    del objects, types, type_ids, distinct
    free_trials_at_exit()
    gc.freeze()


def _is_file_type(cls: type) -> bool:
    try:
        return issubclass(cls, _FILES)
    except TypeError:  # io's ABCs cache classes in sets: an unhashable class raises
        return False


_FILES = (io.BufferedIOBase, io.TextIOBase, io.RawIOBase)
