"""NePS's trials as the leases read and change them, and the files NePS writes into one.

What a look for orphans sees of a root (the trials NePS holds ``evaluating``, who
evaluates each and since when) and the two ways it changes one (back to ``pending``,
or recorded ``crashed``), always under NePS's own trial lock: ``compat.neps`` takes
that lock and hands a ``TrialBook`` over (``locked_trials``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- trial leases (used by neps_bcast.recovery) ------------------------------------------------
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


def holder(trial_dir: Path) -> tuple[str, str | None] | None:
    """NePS's own record of the trial in ``trial_dir``: its state and the worker NePS
    holds it evaluating for; None where NePS has no record there. Read without NePS's
    lock (a thread of a leader cannot take it: ``compat.neps.locked_trials``), so a
    record NePS is rewriting in place raises ``ValueError`` (or ``OSError``): read again
    later."""
    import json

    from neps.state.filebased import ReaderWriterTrial

    try:
        text = (trial_dir / ReaderWriterTrial.METADATA_FILENAME).read_text()
    except FileNotFoundError:
        return None
    try:
        metadata = json.loads(text)
        state, worker_id = metadata["state"], metadata.get("evaluating_worker_id")
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"NePS's record of the trial cannot be read: {exc}") from exc
    return str(state), None if worker_id is None else str(worker_id)


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
