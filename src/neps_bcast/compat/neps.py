"""Every NePS name neps_bcast depends on beyond ``neps.run``, in one place.

``tests/test_neps_compat.py`` fails loudly when a NePS release changes any of them.
Beside this module: ``neps_run`` (the leader's loop around ``neps.run``) and
``neps_trials`` (the trials a look for orphans reads and changes under the lock taken
here).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from neps_bcast.compat import neps_files
from neps_bcast.compat.neps_trials import TrialBook

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


# -- NePS's locks (used by neps_bcast.recovery) -------------------------------------------------


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
