"""Every NePS name neps_bcast depends on beyond ``neps.run``, in one place.

``tests/test_neps_compat.py`` fails loudly when a NePS release changes any of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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


# -- the NePS root directory (used by neps_bcast.root_guard) ---------------------------
ROOT_DIRECTORY_DEFAULT = "neps_results"
"""``neps.run``'s default ``root_directory``."""

STATE_FILES = ("optimizer_info.yaml", "pipeline_space.pkl")
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
    save_pipeline_results({"exception": exc}, trial_id, Path(root_directory))
