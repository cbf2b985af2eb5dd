"""``neps.run`` as a leader runs it: under a worker id, entered again after a put-back trial.

Every NePS name the leader's loop around ``neps.run`` relies on beyond its public
arguments: whether it takes a worker id, how a pool's agent enters it again after a
trial was put back (and what NePS keeps set until then), and the two fault points that
lie inside NePS. ``tests/test_neps_compat.py`` pins each one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def forget_current_trial() -> None:
    """Clear NePS's record of the trial this process evaluates, left set when a
    ``BaseException`` leaves the evaluation (``neps.runtime._set_global_trial`` resets it
    only on a normal exit): a pool's agent enters ``neps.run`` again after putting a
    trial back, and NePS would refuse to set the next one ("A trial was already set to
    run in this process")."""
    import neps.runtime

    neps.runtime._CURRENTLY_RUNNING_TRIAL_IN_PROCESS = None


def run_entering_again(
    run: Callable[[dict[str, Any]], object],
    options: dict[str, Any],
    again: type[BaseException],
    next_worker_id: Callable[[str, int], str],
    before_the_end: Callable[[], int] = lambda: 0,
) -> None:
    """``run(options)`` (``neps.run``), entered again each time it is left with
    ``again``: a pool's agent leaves NePS's loop with a ``BaseException`` after putting
    its trial back to pending, and enters it again for the next. And entered again when
    it returns while ``before_the_end()`` says it put trials back for this worker to run
    (a trial in doubt it took over, ``recovery.in_doubt``): for that many trials only
    (``worker_evaluations_to_spend``), which NePS hands out before it samples a new one.

    What it relies on in NePS, each pinned by tests/test_neps_compat.py: a
    ``BaseException`` out of an evaluation leaves the trial set as running in this
    process until ``forget_current_trial``; NePS refuses a worker id it has seen, so each
    entry gets a fresh one (``next_worker_id(worker_id, entry)``, entries from 2); a
    trial put back to pending is handed out before a new one is sampled; and
    ``overwrite_root_directory`` would wipe the root at each entry, so only the first
    may ask for it."""
    entry = 1
    while True:
        try:
            run(options)
        except again:
            forget_current_trial()
        else:
            put_back = before_the_end()
            if put_back <= 0:
                return
            # A worker id of its own counts this entry's evaluations from 0.
            options = {**options, "worker_evaluations_to_spend": put_back}
        entry += 1
        options = {**options, "overwrite_root_directory": False}  # never wipe it again
        if options.get("worker_id") is not None:
            options["worker_id"] = next_worker_id(str(options["worker_id"]), entry)


def takes_worker_id() -> bool:
    """NePS's ``run`` takes ``worker_id`` (NePS 0.17 does; it stores it in each trial's
    ``evaluating_worker_id``). Asked of ``neps.api.run``: ``neps.run`` may be wrapped
    (a profiler, a test's observer) by a function taking ``**kwargs``."""
    import inspect

    from neps.api import run

    return "worker_id" in inspect.signature(run).parameters


_HOOKS: dict[str, Any] = {
    "before_sample": lambda: None,
    "before_record": lambda trial_id: None,
    "refuse": lambda trial_id: None,
}
"""What the wrappers of NePS's sampling and recording call (``_install``)."""


def call_before_sampling_and_recording(
    before_sample: Callable[[], None], before_record: Callable[[str], None]
) -> None:
    """Call ``before_sample()`` as NePS starts sampling a trial and ``before_record(id)``
    as it starts recording one's result (``NePSState._sample_trial`` and
    ``_report_trial_evaluation``, private to NePS). Only for fault points that a test
    armed (``neps_bcast.faults``). Installing twice keeps one wrapper."""
    _HOOKS["before_sample"] = before_sample
    _HOOKS["before_record"] = before_record
    _install()


def fence_recording(refuse: Callable[[str], str | None]) -> None:
    """Fencing: NePS records a trial's result only if ``refuse(trial_id)`` returns None;
    otherwise the result is dropped (and the reason returned by ``refuse`` is logged by
    it). NePS calls ``_report_trial_evaluation`` holding its trial lock, so the check and
    the write are one critical section: no other worker can take the trial over between
    them."""
    _HOOKS["refuse"] = refuse
    _install()


def _install() -> None:
    from neps.state.neps_state import NePSState

    sample = getattr(NePSState._sample_trial, "__wrapped__", NePSState._sample_trial)
    report = getattr(
        NePSState._report_trial_evaluation, "__wrapped__", NePSState._report_trial_evaluation
    )

    def sampling(self: Any, *args: Any, **kwargs: Any) -> Any:
        _HOOKS["before_sample"]()
        return sample(self, *args, **kwargs)

    def reporting(self: Any, *args: Any, **kwargs: Any) -> Any:
        trial = kwargs.get("trial", args[0] if args else None)
        trial_id = str(getattr(trial, "id", "?"))
        _HOOKS["before_record"](trial_id)
        if _HOOKS["refuse"](trial_id) is not None:
            return None  # the trial on disk is the current attempt's: left as it is
        return report(self, *args, **kwargs)

    sampling.__wrapped__ = sample  # type: ignore[attr-defined]
    reporting.__wrapped__ = report  # type: ignore[attr-defined]
    NePSState._sample_trial = sampling  # type: ignore[method-assign]
    NePSState._report_trial_evaluation = reporting  # type: ignore[method-assign]
