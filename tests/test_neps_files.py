"""Pins ``neps_bcast.compat.neps_files`` (NePS's files, read without NePS) against what a
real ``neps.run`` writes and what NePS's own reader makes of it.

When one fails after a NePS upgrade, fix ``src/neps_bcast/compat/neps_files.py``: it is
the only module that knows NePS's on-disk format, and ``neps-bcast status`` reads
through it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import neps
import pytest
from neps.state.filebased import ReaderWriterTrial
from neps.state.neps_state import NePSState
from neps.state.trial import State

from neps_bcast.compat import neps_files


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    epochs = neps.IntegerFidelity(1, 3)


CALLS = [0]


def evaluate(lr: float, epochs: int) -> dict[str, Any]:
    """The 2nd evaluation raises (so the root holds a crash whatever NePS samples)."""
    CALLS[0] += 1
    if CALLS[0] == 2:
        raise ValueError(f"evaluation {CALLS[0]} fails")
    return {"objective_to_minimize": lr * epochs, "cost": float(epochs)}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A root a real ``neps.run`` wrote: hyperband, successes and crashes."""
    path = tmp_path_factory.mktemp("neps") / "root"
    neps.run(
        evaluate,
        pipeline_space=Space(),
        root_directory=path,
        total_evaluations_to_spend=8,
        optimizer="hyperband",
        ignore_errors=True,
    )
    return path


def neps_read(root: Path) -> dict[str, Any]:
    return NePSState.create_or_load(path=root, load_only=True).lock_and_read_trials()


def test_the_file_names_are_neps_own() -> None:
    fmt = neps_files.serialize_format()
    assert ReaderWriterTrial.METADATA_FILENAME == neps_files.METADATA_FILE
    assert neps_files.report_file(fmt) == ReaderWriterTrial.REPORT_FILENAME
    assert neps_files.config_file(fmt) == ReaderWriterTrial.CONFIG_FILENAME
    assert {s.value for s in State} == {*neps_files.STATES, "external"}


def test_the_root_holds_the_files_a_root_is_recognized_by(root: Path) -> None:
    assert neps_files.looks_like_root(root)
    for name in (*neps_files.STATE_FILES, neps_files.OPTIMIZER_STATE_FILE):
        assert (root / name).is_file(), name


def test_every_trial_reads_as_neps_reads_it(root: Path) -> None:
    theirs = neps_read(root)
    ours = {t.trial_id: t for t in (neps_files.read_trial(d) for d in neps_files.trial_dirs(root))}
    assert set(ours) == set(theirs)
    states = set()
    for trial_id, trial in theirs.items():
        mine = ours[trial_id]
        states.add(mine.state)
        assert mine.state == trial.metadata.state.value
        assert mine.time_started == trial.metadata.time_started
        assert mine.time_end == trial.metadata.time_end
        assert mine.evaluating_worker_id == trial.metadata.evaluating_worker_id
        assert mine.previous_trial_id == trial.metadata.previous_trial_id
        assert mine.objective == trial.report.objective_to_minimize
        assert mine.cost == trial.report.cost
        assert mine.reported_as == trial.report.reported_as
        assert (mine.error is None) == (trial.report.err is None)
    assert {"success", "crashed"} <= states, f"the search gave only {states}"


def test_a_trial_config_reads_as_neps_reads_it(root: Path) -> None:
    for trial_id, trial in neps_read(root).items():
        directory = root / neps_files.CONFIGS_DIR / f"{neps_files.TRIAL_DIR_PREFIX}{trial_id}"
        assert neps_files.read_config(directory) == trial.config


def test_the_budget_limit_is_the_one_neps_run_was_given(root: Path) -> None:
    budget = (
        NePSState.create_or_load(path=root, load_only=True).lock_and_get_optimizer_state().budget
    )
    limits = neps_files.budget_limits(root)
    assert limits is not None
    assert limits["total_evaluations_to_spend"] == 8 == budget.total_evaluations_to_spend
    assert limits["total_cost_to_spend"] is None


def test_a_pending_and_an_evaluating_trial_read_as_neps_wrote_them(
    root: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "root"
    shutil.copytree(root, copy)
    state = NePSState.create_or_load(path=copy, load_only=True)
    trials = state.lock_and_read_trials()
    first, second = sorted(trials)[:2]
    pending = trials[first]
    pending.reset()
    pending.report = None
    state._trial_repo.update_trial(pending, hints="metadata")
    running = trials[second]
    running.set_evaluating(time_started=123.0, worker_id="w")
    state._trial_repo.update_trial(running, hints="metadata")
    directory = copy / neps_files.CONFIGS_DIR
    assert neps_files.read_trial(directory / f"config_{first}").state == "pending"
    evaluating = neps_files.read_trial(directory / f"config_{second}")
    assert (evaluating.state, evaluating.time_started, evaluating.evaluating_worker_id) == (
        "evaluating",
        123.0,
        "w",
    )


def test_a_torn_metadata_file_is_unreadable_not_guessed(root: Path, tmp_path: Path) -> None:
    trial = tmp_path / "config_1"
    shutil.copytree(neps_files.trial_dirs(root)[0], trial)
    text = (trial / neps_files.METADATA_FILE).read_text()
    (trial / neps_files.METADATA_FILE).write_text(text[: len(text) // 2])
    torn = neps_files.read_trial(trial)
    assert (torn.state, torn.files_read) == ("unreadable", neps_files.TORN_RETRIES)


def test_the_optimizer_state_is_read_without_running_code_of_its_choice(tmp_path: Path) -> None:
    import pickle

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (shutil.rmtree, (str(tmp_path / "victim"),))

    (tmp_path / "victim").mkdir()
    (tmp_path / neps_files.OPTIMIZER_STATE_FILE).write_bytes(pickle.dumps({"budget": Boom()}))
    neps_files.budget_limits(tmp_path)
    assert (tmp_path / "victim").is_dir()
    # Positive control: a plain unpickle of the same bytes does remove it.
    pickle.loads((tmp_path / neps_files.OPTIMIZER_STATE_FILE).read_bytes())
    assert not (tmp_path / "victim").exists()
