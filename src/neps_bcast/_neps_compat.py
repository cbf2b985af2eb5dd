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
    location = trial.metadata.location
    previous = trial.metadata.previous_trial_location
    return NepsTrialInfo(
        trial_id=str(trial.id),
        pipeline_directory=Path(location) if location else None,
        previous_pipeline_directory=Path(previous) if previous else None,
    )
