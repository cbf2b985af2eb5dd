"""NePS 0.17's files in a root directory, read without importing NePS (nor torch).

Why: ``neps-bcast status`` runs on any node, often on a login node, and answers in a
fraction of a second; ``import neps`` imports torch (seconds, and gigabytes a login node
may not have). Every detail of NePS's on-disk format that the status reads is here, and
``tests/test_neps_files.py`` pins each against what a real ``neps.run`` wrote and what
NePS's own reader (``neps.state.filebased.ReaderWriterTrial``) makes of it.

What NePS writes (``neps/state/filebased.py``, ``neps/state/neps_state.py``):
``ROOT/configs/config_<id>/`` per trial, holding ``metadata.json`` (state, times,
worker ids), ``config.yaml`` and, once it ended, ``report.yaml`` (``.json`` instead
under ``NEPS_CONFIG_SERIALIZE_FORMAT=json``); ``ROOT/optimizer_state.pkl`` (the budget's
limits, among others); ``ROOT/summary/`` (written when a worker finishes).

Nothing here takes a lock. NePS rewrites ``metadata.json`` in place (truncate, then
write) under its trial lock, so a read may see a half-written file: such a file is read
again a few times, and reported unreadable (never guessed) if it stays torn. A reader
that took NePS's lock would hold up every worker's sampling while it reads a thousand
trials, and needs write access to the root, which a status from another account lacks.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIGS_DIR = "configs"
TRIAL_DIR_PREFIX = "config_"
METADATA_FILE = "metadata.json"
SERIALIZE_FORMAT_VARIABLE = "NEPS_CONFIG_SERIALIZE_FORMAT"
"""``yaml`` (NePS's default) or ``json``: the format of ``config.*`` and ``report.*``."""
OPTIMIZER_STATE_FILE = "optimizer_state.pkl"
SUMMARY_DIR = "summary"
STATE_FILES = ("optimizer_info.yaml", "pipeline_space.pkl")
"""Files ``NePSState.create_or_load`` writes into a fresh root."""

STATES = ("pending", "evaluating", "success", "failed", "crashed", "corrupted", "unknown")
"""``neps.state.trial.State`` values, in the order a status lists them (``external``
too, for trials a user imported)."""
FINAL_STATES = frozenset({"success", "failed", "crashed", "corrupted"})

TORN_RETRIES = 3
"""Reads of a file NePS may be rewriting in place before it is called unreadable."""


def serialize_format(environ: os._Environ[str] | dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    value = env.get(SERIALIZE_FORMAT_VARIABLE, "yaml").lower()
    return value if value in ("yaml", "json") else "yaml"


def report_file(fmt: str) -> str:
    return f"report.{fmt}"


def config_file(fmt: str) -> str:
    return f"config.{fmt}"


def looks_like_root(root: Path) -> bool:
    """``root`` holds NePS's state (a root a search created, even before its first trial)."""
    return (
        any((root / name).exists() for name in (*STATE_FILES, OPTIMIZER_STATE_FILE))
        or (root / CONFIGS_DIR).is_dir()
    )


def trial_dirs(root: Path) -> list[Path]:
    """Every trial's directory (one ``scandir`` of ``ROOT/configs``)."""
    try:
        with os.scandir(root / CONFIGS_DIR) as entries:
            return [
                Path(e.path)
                for e in entries
                if e.name.startswith(TRIAL_DIR_PREFIX) and e.is_dir(follow_symlinks=False)
            ]
    except FileNotFoundError:
        return []


@dataclass(frozen=True)
class TrialFiles:
    """One trial as NePS's files say it (None: not written, or not in NePS's record)."""

    trial_id: str
    directory: Path
    state: str
    """A ``STATES`` value; ``unreadable`` when its metadata stayed torn."""
    time_sampled: float | None = None
    time_started: float | None = None
    time_end: float | None = None
    evaluating_worker_id: str | None = None
    previous_trial_id: str | None = None
    objective: float | list[float] | None = None
    cost: float | None = None
    reported_as: str | None = None
    error: str | None = None
    files_read: int = 0


def _load(text: str, fmt: str) -> Any:
    if fmt == "json":
        return json.loads(text)
    import yaml  # type: ignore[import-untyped]  # a NePS dependency, without stubs

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load(text, Loader=loader)  # noqa: S506 - a safe loader


def _read_mapping(path: Path, fmt: str) -> tuple[dict[str, Any] | None, int]:
    """The mapping in ``path`` (None if absent or still torn) and how many reads it took."""
    reads = 0
    for _ in range(TORN_RETRIES):
        reads += 1
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None, reads
        try:
            data = _load(text, fmt)
        except ValueError:
            continue
        except Exception as exc:  # yaml's own errors
            if type(exc).__module__.startswith("yaml"):
                continue
            raise
        if isinstance(data, dict):
            return data, reads
    return None, reads


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_trial(directory: Path, fmt: str = "yaml") -> TrialFiles:
    """One trial from its directory, without any lock (see the module docstring)."""
    trial_id = directory.name[len(TRIAL_DIR_PREFIX) :]
    metadata, reads = _read_mapping(directory / METADATA_FILE, "json")
    if metadata is None:
        return TrialFiles(trial_id, directory, "unreadable", files_read=reads)
    state = str(metadata.get("state", "unknown"))
    report = None
    if state in FINAL_STATES:
        report, more = _read_mapping(directory / report_file(fmt), fmt)
        reads += more
    report = report or {}
    objective = report.get("objective_to_minimize")
    if isinstance(objective, list):
        objective = [float(v) for v in objective if _number(v) is not None]
    else:
        objective = _number(objective)
    error = report.get("err")
    return TrialFiles(
        trial_id=str(metadata.get("id", trial_id)),
        directory=directory,
        state=state,
        time_sampled=_number(metadata.get("time_sampled")),
        time_started=_number(metadata.get("time_started")),
        time_end=_number(metadata.get("time_end")),
        evaluating_worker_id=metadata.get("evaluating_worker_id"),
        previous_trial_id=metadata.get("previous_trial_id"),
        objective=objective,
        cost=_number(report.get("cost")),
        reported_as=report.get("reported_as"),
        error=str(error) if error is not None else None,
        files_read=reads,
    )


def read_config(directory: Path, fmt: str = "yaml") -> dict[str, Any] | None:
    """A trial's config (its hyperparameters), None if it cannot be read."""
    config, _ = _read_mapping(directory / config_file(fmt), fmt)
    return config


# -- the budget's limits, from optimizer_state.pkl ------------------------------------------
BUDGET_LIMITS = (
    "total_evaluations_to_spend",
    "total_cost_to_spend",
    "total_fidelities_to_spend",
)
"""``neps.state.optimizer.BudgetInfo`` fields holding the search's budget (the limits
``neps.run`` was given; NePS counts the usage from the trials themselves)."""


class _Opaque:
    """Stands for every class a NePS pickle names: records its state, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> _Opaque:
        self = super().__new__(cls)
        self.args = args
        self.fields = dict(kwargs)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args: tuple[Any, ...] = args
        self.fields: dict[str, Any] = dict(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}  # (dict, slots)
        if isinstance(state, dict):
            self.fields.update(state)

    # Containers a pickle may fill (an OrderedDict's items, a list subclass).
    def __setitem__(self, key: Any, value: Any) -> None:
        self.fields[str(key)] = value

    def append(self, value: Any) -> None:
        self.args = (*self.args, value)

    def extend(self, values: Any) -> None:
        self.args = (*self.args, *values)


class _NothingRuns(pickle.Unpickler):
    """An unpickler that resolves no class and calls no function of the pickle's choice:
    every global it names becomes a new subclass of ``_Opaque`` (so reading a root
    another user can write runs none of their code)."""

    def find_class(self, module: str, name: str) -> Any:
        return type(name, (_Opaque,), {"__module__": "neps_bcast.opaque"})


def budget_limits(root: Path) -> dict[str, float | None] | None:
    """The budget ``neps.run`` was given (``BUDGET_LIMITS``), None if unreadable (absent,
    or NePS is rewriting it in place this instant: it is not locked here either)."""
    for _ in range(TORN_RETRIES):
        try:
            data = (root / OPTIMIZER_STATE_FILE).read_bytes()
        except FileNotFoundError:
            return None
        try:
            state = _NothingRuns(io.BytesIO(data)).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError):
            continue
        budget = getattr(state, "fields", {}).get("budget")
        if budget is None:
            return dict.fromkeys(BUDGET_LIMITS)
        fields = getattr(budget, "fields", {})
        return {name: _number(fields.get(name)) for name in BUDGET_LIMITS}
    return None
