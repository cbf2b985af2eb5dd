"""Every NePS name neps_bcast depends on beyond ``neps.run``, in one place.

``tests/test_neps_compat.py`` fails loudly when a NePS release changes any of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neps_bcast.compat import neps_files

INJECTED_ARGUMENTS = ("pipeline_directory", "previous_pipeline_directory", "pipeline_id")
"""Arguments NePS passes only when the function's signature names them
(``neps/state/pipeline_eval.py``, ``evaluate_trial``)."""

NEPS_DDP_ENV_VARS = ("NEPS_DDP_TRIAL_ID",)
"""Set by NePS's own DDP mode in the leader's environment; meaningless to us."""


@dataclass(frozen=True)
class NepsTrialInfo:
    trial_id: str
    pipeline_directory: Path | None
    previous_pipeline_directory: Path | None


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
) -> None:
    """``run(options)`` (``neps.run``), entered again each time it is left with
    ``again``: a pool's agent leaves NePS's loop with a ``BaseException`` after putting
    its trial back to pending, and enters it again for the next.

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
            entry += 1
            options = {**options, "overwrite_root_directory": False}  # never wipe it again
            if options.get("worker_id") is not None:
                options["worker_id"] = next_worker_id(str(options["worker_id"]), entry)
            continue
        return


def current_trial() -> NepsTrialInfo:
    """The trial NePS is evaluating in this process (call only inside its evaluation)."""
    from neps.runtime import get_in_progress_trial  # private to NePS's runtime module

    trial = get_in_progress_trial()
    location = trial.metadata.location  # type: ignore[attr-defined]
    previous = trial.metadata.previous_trial_location  # type: ignore[attr-defined]
    return NepsTrialInfo(
        trial_id=str(trial.id),
        pipeline_directory=Path(location) if location else None,
        previous_pipeline_directory=Path(previous) if previous else None,
    )


def trial_files() -> frozenset[str]:
    """The files NePS itself writes into a trial's directory (config, report, metadata,
    previous trial id): anything else there was written by the user's code."""
    from neps.state.filebased import ReaderWriterTrial

    return frozenset(
        {
            ReaderWriterTrial.CONFIG_FILENAME,
            ReaderWriterTrial.REPORT_FILENAME,
            ReaderWriterTrial.METADATA_FILENAME,
            ReaderWriterTrial.PREVIOUS_TRIAL_ID_FILENAME,
        }
    )


# -- the NePS root directory (used by neps_bcast.recovery.root_lock) ---------------------------
ROOT_DIRECTORY_DEFAULT = "neps_results"
"""``neps.run``'s default ``root_directory``."""

STATE_FILES = neps_files.STATE_FILES
"""Files ``NePSState.create_or_load`` writes into a fresh root (``neps/state/neps_state.py``):
a root holding none of them but existing makes NePS fail ("Failed to create or load")."""


def space_on_disk(root: Path) -> object | None:
    """The search space a NePS root holds (public ``neps.load_pipeline_space``), or None."""
    import neps

    if not (root / "pipeline_space.pkl").exists():
        return None
    try:
        return neps.load_pipeline_space(root)
    except (FileNotFoundError, ValueError, EOFError, OSError):
        return None


def classic_form(space: object) -> object | None:
    """The classic ``SearchSpace`` NePS converts a ``PipelineSpace`` into for classic
    optimizers (``convert_neps_to_classic_search_space``), or None if it does not."""
    from neps.space.neps_spaces.neps_space import (
        convert_neps_to_classic_search_space,
    )
    from neps.space.neps_spaces.parameters import PipelineSpace

    if not isinstance(space, PipelineSpace):
        return None
    return convert_neps_to_classic_search_space(space)


def corner_configs(space: object, most: int = 32) -> list[dict[str, Any]]:
    """A few configs of ``space`` at its corners, to check a function of the config
    before the search starts: every fidelity at its lowest and at its highest value,
    with the numerical parameters all at their lower bound, centre or upper bound, and
    each categorical choice in turn (the other categoricals at their centre). At most
    ``most``; none if NePS gives the space no classic form (the check is then left to
    each trial)."""
    try:
        classic = space if hasattr(space, "elements") else classic_form(space)
    except Exception:  # noqa: BLE001 - NePS reports a bad space itself, in neps.run
        return []
    elements = getattr(classic, "elements", None)
    if not isinstance(elements, dict):
        return []

    def at(param: Any, where: str) -> Any:
        if hasattr(param, "choices"):
            return param.center
        if hasattr(param, "lower"):
            return {"lower": param.lower, "center": param.center, "upper": param.upper}[where]
        return getattr(param, "value", None)

    fidelities = [n for n, p in elements.items() if getattr(p, "is_fidelity", False)]
    found: list[dict[str, Any]] = []
    for end in ("lower", "upper"):
        base = {n: at(p, "center") for n, p in elements.items()}
        base.update({n: at(elements[n], end) for n in fidelities})
        for where in ("lower", "center", "upper"):
            found.append(
                {**base, **{n: at(p, where) for n, p in elements.items() if n not in fidelities}}
            )
        for name, param in elements.items():
            for choice in getattr(param, "choices", ()):
                found.append({**base, name: choice})
    unique: list[dict[str, Any]] = []
    for config in found:
        if config not in unique:
            unique.append(config)
    return unique[:most]


def classic_parameters(space: object) -> dict[str, tuple[str, tuple[tuple[str, str], ...]]] | None:
    """A classic ``SearchSpace``'s parameters, independent of the order NePS happened to
    give categorical choices: it builds them with ``list(set(choices))``, so the order (and
    the derived ``center``) depend on the process's string-hash seed."""
    elements = getattr(space, "elements", None)
    if not isinstance(elements, dict):
        return None
    found = {}
    for name, param in elements.items():
        fields = {k: v for k, v in vars(param).items() if k not in ("center", "domain")}
        if "choices" in fields:
            fields["choices"] = sorted(repr(c) for c in fields["choices"])
        found[name] = (
            type(param).__qualname__,
            tuple(sorted((k, repr(v)) for k, v in fields.items())),
        )
    return found


def record_crashed(trial_id: str, root_directory: Path, error: BaseException) -> None:
    """Record a trial as crashed with ``error`` (used when the evaluation cannot return).

    NePS's public path for results that arrive outside the evaluate function.
    """
    from neps.api import save_pipeline_results

    exc = error if isinstance(error, Exception) else RuntimeError(str(error))
    root = Path(root_directory)
    # It loads NePS's state twice (``NePSState.create_or_load``): see ``_loaded_state``.
    with _optimizer_lock(root):
        save_pipeline_results({"exception": exc}, trial_id, root)


# -- trial leases (used by neps_bcast.recovery.lease) -------------------------------------------
# NePS 0.17 only hands out `pending` trials and has no heartbeat: a trial whose worker
# died stays `evaluating` for ever. neps_bcast puts such a trial back to `pending`, under
# NePS's own trial lock, with NePS's own ``Trial.reset`` (which keeps the id, config,
# location, previous location and time sampled, so NePS picks it up first).


@dataclass(frozen=True)
class EvaluatingTrial:
    trial_id: str
    location: Path
    time_started: float | None
    worker_id: str | None


class TrialBook:
    """NePS's trials while this process holds NePS's trial lock (see ``locked_trials``)."""

    def __init__(self, state: Any) -> None:
        self._state = state
        self._trials: dict[str, Any] = state._trial_repo.latest()

    def evaluating(self) -> list[EvaluatingTrial]:
        from neps.state.trial import State

        return [
            EvaluatingTrial(
                trial_id=str(t.id),
                location=Path(t.metadata.location),
                time_started=t.metadata.time_started,
                worker_id=t.metadata.evaluating_worker_id,
            )
            for t in self._trials.values()
            if t.metadata.state == State.EVALUATING
        ]

    def state_of(self, trial_id: str) -> str | None:
        trial = self._trials.get(trial_id)
        return None if trial is None else str(trial.metadata.state.value)

    def set_pending(self, trial_id: str) -> None:
        """Back to `pending`: NePS's next free worker evaluates it again (same config,
        same pipeline directory, same previous pipeline directory)."""
        trial = self._trials[trial_id]
        trial.reset()
        trial.report = None
        self._state._trial_repo.update_trial(trial, hints="metadata")

    def set_crashed(self, trial_id: str, error: Exception) -> None:
        """Recorded `crashed` with ``error``, as NePS records an evaluation that raised."""
        import time

        trial = self._trials[trial_id]
        report = trial.set_complete(
            report_as="crashed",
            time_end=time.time(),
            objective_to_minimize=None,
            cost=None,
            learning_curve=None,
            err=error,
            tb=str(error),
            extra=None,
            evaluation_duration=None,
        )
        worker_id = trial.metadata.evaluating_worker_id or "neps_bcast"
        self._state._report_trial_evaluation(trial, report, worker_id=worker_id)


def takes_worker_id() -> bool:
    """NePS's ``run`` takes ``worker_id`` (NePS 0.17 does; it stores it in each trial's
    ``evaluating_worker_id``). Asked of ``neps.api.run``: ``neps.run`` may be wrapped
    (a profiler, a test's observer) by a function taking ``**kwargs``."""
    import inspect

    from neps.api import run

    return "worker_id" in inspect.signature(run).parameters


def lock_kind() -> str:
    """``"lockf"`` or ``"flock"``: what NePS locks its files with once ``neps.run`` runs
    (``NEPS_LINUX_FILELOCK_FUNCTION``, default ``lockf``, the kind that works on NFS and
    Lustre; portalocker's own default, ``flock``, is replaced by neps.run)."""
    from neps.env import LINUX_FILELOCK_FUNCTION

    name = LINUX_FILELOCK_FUNCTION.lower()
    return name if name in ("flock", "lockf") else "lockf"


def use_neps_locking() -> None:
    """Lock NePS's files with the function NePS itself uses (``lockf`` by default,
    ``NEPS_LINUX_FILELOCK_FUNCTION``): ``neps.run`` sets it only when it starts, and a
    ``flock`` does not exclude a ``lockf`` on Linux."""
    import fcntl

    import portalocker.portalocker as portalocker_lock_module
    from neps.env import LINUX_FILELOCK_FUNCTION

    name = LINUX_FILELOCK_FUNCTION.lower()
    if name in ("flock", "lockf"):
        portalocker_lock_module.LOCKER = getattr(fcntl, name)


@contextmanager
def locked_trials(root_directory: Path) -> Iterator[TrialBook | None]:
    """Hold NePS's own trial lock on ``root_directory``; None if there is no NePS state.

    Never call it from a thread while NePS's worker holds the lock in this process:
    POSIX locks belong to the process, so a second one would not wait, and closing it
    would release NePS's.
    """
    root = Path(root_directory)
    if not (root / OPTIMIZER_STATE_FILE).exists():
        yield None
        return
    state = _trials_state(root)
    with state._trial_lock.lock():
        yield TrialBook(state)


_STATES: dict[Path, Any] = {}
"""NePS's state of each root, loaded once per process (``_trials_state``)."""


def _trials_state(root: Path) -> Any:
    """NePS's state of ``root`` for its trials, loaded the first time only.

    Loading it takes NePS's optimizer lock (``_loaded_state``), which a worker holds for
    the whole of a sample: under Bayesian optimization a GP fit of seconds, and several
    workers queue for it. Loaded before every look for orphans, it held a leader's next
    trial (and its devices) until the other workers had sampled: 19 s before one trial
    of a pool of 4 agents asked for its device. What a look uses of the state are its
    trial repository, trial lock and error file, which NePS reads anew from disk each
    time (``TrialRepo.latest``), never its optimizer state."""
    key = root.resolve()
    if key not in _STATES:
        _STATES[key] = _loaded_state(root)
    return _STATES[key]


OPTIMIZER_STATE_FILE = neps_files.OPTIMIZER_STATE_FILE
OPTIMIZER_LOCK_FILE = ".optimizer.lock"
"""NePS's optimizer state in a root, and the lock file NePS takes (``_optimizer_lock``)
whenever it reads or rewrites it (``neps/state/neps_state.py``)."""


@contextmanager
def _optimizer_lock(root: Path) -> Iterator[None]:
    """Hold NePS's own lock on ``optimizer_state.pkl``, as NePS builds it (same file,
    poll interval and timeout: ``NEPS_STATE_FILELOCK_POLL``, ``NEPS_STATE_FILELOCK_TIMEOUT``).

    Same caveat as ``locked_trials``: never from a thread while NePS's worker holds it in
    this process. NePS takes it before its trial lock, never after, so holding it and
    then the trial lock cannot deadlock against NePS.
    """
    from neps.env import STATE_FILELOCK_POLL, STATE_FILELOCK_TIMEOUT
    from neps.state.filebased import FileLocker

    use_neps_locking()
    locker = FileLocker(
        lock_path=root / OPTIMIZER_LOCK_FILE,
        poll=STATE_FILELOCK_POLL,
        timeout=STATE_FILELOCK_TIMEOUT,
    )
    with locker.lock():
        yield


def _loaded_state(root: Path) -> Any:
    """NePS's state of ``root``, loaded while no NePS worker rewrites it.

    ``NePSState.create_or_load`` reads ``optimizer_state.pkl`` without any lock, while
    every NePS worker rewrites that file in place (``open("wb")``: truncated, then
    pickled), under NePS's optimizer lock, each time it samples a trial
    (``_sample_trial``), registers itself (``lock_and_set_new_worker_id``) or sets the
    run's budgets (``lock_and_update_global_budgets``). A load that lands in between
    reads an empty or cut-off pickle: ``EOFError: Ran out of input`` (or
    ``UnpicklingError: pickle data was truncated``). ``neps.run`` survives it only
    because it retries its own load (automl/neps#161); we load under that same lock.
    """
    from neps.state.neps_state import NePSState

    with _optimizer_lock(root):
        return NePSState.create_or_load(path=root, load_only=True)


def call_before_sampling_and_recording(
    before_sample: Callable[[], None], before_record: Callable[[str], None]
) -> None:
    """Call ``before_sample()`` as NePS starts sampling a trial and ``before_record(id)``
    as it starts recording one's result (``NePSState._sample_trial`` and
    ``_report_trial_evaluation``, private to NePS). Only for fault points that a test
    armed (``neps_bcast.faults``): nothing installs it otherwise. Installing twice keeps
    one wrapper."""
    from neps.state.neps_state import NePSState

    sample = getattr(NePSState._sample_trial, "__wrapped__", NePSState._sample_trial)
    report = getattr(
        NePSState._report_trial_evaluation, "__wrapped__", NePSState._report_trial_evaluation
    )

    def sampling(self: Any, *args: Any, **kwargs: Any) -> Any:
        before_sample()
        return sample(self, *args, **kwargs)

    def reporting(self: Any, *args: Any, **kwargs: Any) -> Any:
        trial = kwargs.get("trial", args[0] if args else None)
        before_record(str(getattr(trial, "id", "?")))
        return report(self, *args, **kwargs)

    sampling.__wrapped__ = sample  # type: ignore[attr-defined]
    reporting.__wrapped__ = report  # type: ignore[attr-defined]
    NePSState._sample_trial = sampling  # type: ignore[method-assign]
    NePSState._report_trial_evaluation = reporting  # type: ignore[method-assign]
