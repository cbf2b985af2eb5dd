"""Fails loudly when NePS changes what ``neps_bcast.compat.neps`` relies on.

Each test names the NePS behaviour it pins; when one fails after a NePS upgrade, fix
``src/neps_bcast/neps_compat.py`` (the only module that may touch NePS internals).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import neps
import neps.runtime
import pytest
from neps.space.neps_spaces.neps_space import adjust_evaluation_pipeline_for_neps_space
from neps.state.neps_state import NePSState

from neps_bcast.compat import neps as neps_compat
from neps_bcast.compat import neps_run
from neps_bcast.compat.neps import INJECTED_ARGUMENTS, NEPS_DDP_ENV_VARS, current_trial


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)


class FidelitySpace(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    epochs = neps.IntegerFidelity(1, 3)


def recorded(root: Path) -> dict[str, Any]:
    return NePSState.create_or_load(path=root, load_only=True).lock_and_read_trials()


def test_get_in_progress_trial_exists_and_refuses_outside_an_evaluation() -> None:
    assert callable(getattr(neps.runtime, "get_in_progress_trial", None)), (
        "neps.runtime.get_in_progress_trial is gone: neps_compat.current_trial needs a"
        " new way to learn the trial NePS is evaluating"
    )
    with pytest.raises(RuntimeError):
        current_trial()


def test_neps_ddp_variable_name_is_still_the_one_we_know() -> None:
    assert (neps.runtime._DDP_ENV_VAR_NAME,) == NEPS_DDP_ENV_VARS


def test_neps_injects_exactly_the_arguments_the_signature_names(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []
    during: list[neps_compat.NepsTrialInfo] = []

    def wants_all(
        lr: float,
        hidden: int,
        pipeline_directory: Path,
        previous_pipeline_directory: Path | None,
        pipeline_id: str,
    ) -> float:
        seen.append(
            dict(
                lr=lr,
                hidden=hidden,
                pipeline_directory=pipeline_directory,
                previous_pipeline_directory=previous_pipeline_directory,
                pipeline_id=pipeline_id,
            )
        )
        during.append(current_trial())
        return lr

    root = tmp_path / "all"
    neps.run(
        wants_all,
        Space(),
        root_directory=root,
        total_evaluations_to_spend=2,
        optimizer="random_search",
    )
    trials = recorded(root)
    assert len(seen) == 2
    assert sorted(trials) == sorted(kw["pipeline_id"] for kw in seen)
    for kwargs, info in zip(seen, during, strict=True):
        trial = trials[kwargs["pipeline_id"]]
        assert set(kwargs) - {"lr", "hidden"} == set(INJECTED_ARGUMENTS)
        assert Path(kwargs["pipeline_directory"]) == Path(trial.metadata.location)
        assert kwargs["previous_pipeline_directory"] is None
        # What current_trial() reports inside the evaluation is what NePS records.
        assert info.trial_id == trial.id == kwargs["pipeline_id"]
        assert info.pipeline_directory == Path(trial.metadata.location)
        assert info.previous_pipeline_directory is None
        assert trial.config == {"lr": kwargs["lr"], "hidden": kwargs["hidden"]}


def test_neps_injects_nothing_the_signature_does_not_name(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def wants_one(lr: float, hidden: int, pipeline_id: str) -> float:
        seen.append(dict(lr=lr, hidden=hidden, pipeline_id=pipeline_id))
        return lr

    def wants_none(**config: Any) -> float:
        seen.append(dict(config))
        return float(config["lr"])

    neps.run(
        wants_one,
        Space(),
        root_directory=tmp_path / "one",
        total_evaluations_to_spend=1,
        optimizer="random_search",
    )
    neps.run(
        wants_none,
        Space(),
        root_directory=tmp_path / "none",
        total_evaluations_to_spend=1,
        optimizer="random_search",
    )
    assert [set(kw) for kw in seen] == [{"lr", "hidden", "pipeline_id"}, {"lr", "hidden"}]
    for root in (tmp_path / "one", tmp_path / "none"):
        assert all(
            t.report is not None and t.report.reported_as == "success"
            for t in recorded(root).values()
        )


def test_previous_pipeline_directory_is_the_previous_rung_location(tmp_path: Path) -> None:
    seen: list[tuple[dict[str, Any], neps_compat.NepsTrialInfo]] = []

    def evaluate(
        lr: float,
        epochs: int,
        pipeline_directory: Path,
        previous_pipeline_directory: Path | None,
        pipeline_id: str,
    ) -> float:
        seen.append(
            (
                dict(
                    epochs=epochs,
                    pipeline_directory=pipeline_directory,
                    previous_pipeline_directory=previous_pipeline_directory,
                    pipeline_id=pipeline_id,
                ),
                current_trial(),
            )
        )
        return lr

    root = tmp_path / "sh"
    # eta=3 on [1, 3]: three trials at rung 0, then the best one continues at rung 1.
    neps.run(
        evaluate,
        FidelitySpace(),
        root_directory=root,
        total_evaluations_to_spend=4,
        optimizer="successive_halving",
    )
    trials = recorded(root)
    continued = [(kw, info) for kw, info in seen if kw["previous_pipeline_directory"]]
    assert continued, f"no trial continued from an earlier rung: {seen}"
    for kwargs, info in continued:
        trial = trials[kwargs["pipeline_id"]]
        assert trial.metadata.previous_trial_location is not None
        previous = Path(trial.metadata.previous_trial_location)
        assert Path(kwargs["previous_pipeline_directory"]) == previous
        assert info.previous_pipeline_directory == previous
        assert info.pipeline_directory == Path(trial.metadata.location)
        assert info.trial_id == kwargs["pipeline_id"]


def test_pipeline_space_wrapper_keeps_the_signature_visible() -> None:
    def evaluate(lr: float, hidden: int, pipeline_directory: Path) -> float:
        return lr

    wrapped = adjust_evaluation_pipeline_for_neps_space(evaluate, Space())
    assert wrapped is not evaluate
    # NePS reads the signature of this wrapper to decide what to inject: functools.wraps
    # must make it the user's, so neps_bcast's wrapper (also functools.wraps) is seen.
    assert getattr(wrapped, "__wrapped__", None) is evaluate
    assert inspect.signature(wrapped) == inspect.signature(evaluate)
    assert "pipeline_directory" in inspect.signature(wrapped).parameters


def small_search(tmp_path: Path, trials: int) -> Path:
    """A finished random search of ``trials`` trials under ``tmp_path/root``; the root."""
    root = tmp_path / "root"
    neps.run(
        lambda lr, hidden: lr,
        Space(),
        root_directory=root,
        total_evaluations_to_spend=trials,
        optimizer="random_search",
    )
    return root


def test_trial_lock_reset_and_crash_record_as_leases_use_them(tmp_path: Path) -> None:
    """``neps_compat.locked_trials``: NePS's trial lock and ``latest()`` trials; a trial
    set back to pending with ``Trial.reset`` keeps its id, config, location, previous
    location and sampling time (NePS hands out the oldest pending trial first); a trial
    set crashed is reported as NePS reports a raising evaluation; NePS's own locking
    function is the one neps.run installs (lockf unless NEPS_LINUX_FILELOCK_FUNCTION)."""
    import fcntl

    import portalocker.portalocker as portalocker_lock_module
    from neps.env import LINUX_FILELOCK_FUNCTION
    from neps.state.trial import State

    root = small_search(tmp_path, trials=2)
    state = NePSState.create_or_load(path=root, load_only=True)
    for trial in state._trial_repo.latest().values():  # as a dead worker leaves them
        trial.set_evaluating(time_started=123.0, worker_id="gone")
        state._trial_repo.update_trial(trial, hints="metadata")
    before = recorded(root)

    with neps_compat.locked_trials(root) as book:
        assert book is not None
        assert LINUX_FILELOCK_FUNCTION == "lockf"
        assert portalocker_lock_module.LOCKER is fcntl.lockf
        evaluating = sorted(book.evaluating(), key=lambda t: t.trial_id)
        assert [t.trial_id for t in evaluating] == ["1", "2"]
        assert evaluating[0].location == Path(before["1"].metadata.location)
        assert evaluating[0].time_started == 123.0
        assert evaluating[0].worker_id == "gone"
        book.set_pending("1")
        book.set_crashed("2", RuntimeError("interrupted 4 times"))
        assert book.state_of("1") == "pending"
    with neps_compat.locked_trials(tmp_path / "nothing") as none:
        assert none is None

    after = recorded(root)
    pending, crashed = after["1"], after["2"]
    assert pending.metadata.state == State.PENDING
    assert pending.report is None
    for name in ("id", "location", "previous_trial_location", "time_sampled"):
        assert getattr(pending.metadata, name) == getattr(before["1"].metadata, name)
    assert pending.config == before["1"].config
    assert crashed.metadata.state == State.CRASHED
    assert crashed.report is not None
    assert crashed.report.reported_as == "crashed"
    assert str(crashed.report.err) == "interrupted 4 times"
    assert (
        NePSState.create_or_load(path=root, load_only=True).lock_and_get_next_pending_trial().id
        == "1"
    )


def test_optimizer_lock_is_the_one_neps_takes_on_its_optimizer_state(tmp_path: Path) -> None:
    """``neps_compat._optimizer_lock``: the file, poll interval and timeout of NePS's own
    optimizer lock (the lock NePS holds while it rewrites ``optimizer_state.pkl`` in
    place), and the state file it guards. If NePS moves either, our loads of its state
    would again race its writes (tests/e2e/test_e2e_shared_root.py)."""
    from neps.env import STATE_FILELOCK_POLL, STATE_FILELOCK_TIMEOUT

    root = small_search(tmp_path, trials=1)
    state = NePSState.create_or_load(path=root, load_only=True)
    assert state._optimizer_state_path == root.resolve() / neps_compat.OPTIMIZER_STATE_FILE
    lock = state._optimizer_lock
    assert lock.lock_path == root.resolve() / neps_compat.OPTIMIZER_LOCK_FILE
    assert (lock.poll, lock.timeout) == (STATE_FILELOCK_POLL, STATE_FILELOCK_TIMEOUT)
    with neps_compat._optimizer_lock(root):  # takes and releases it, as NePS builds it
        pass
    assert neps_compat._loaded_state(root).path == state.path


def test_lock_kind_is_what_neps_run_locks_with() -> None:
    """neps.run replaces portalocker's flock with NEPS_LINUX_FILELOCK_FUNCTION (lockf by
    default); the root lock must be that kind, or it would not exclude NePS-style locks."""
    import fcntl

    import portalocker.portalocker as portalocker_lock_module
    from neps.env import LINUX_FILELOCK_FUNCTION

    assert LINUX_FILELOCK_FUNCTION == "lockf"
    assert neps_compat.lock_kind() == "lockf"
    saved = portalocker_lock_module.LOCKER
    try:
        neps_compat.use_neps_locking()
        assert portalocker_lock_module.LOCKER is fcntl.lockf
    finally:
        portalocker_lock_module.LOCKER = saved


def test_a_base_exception_out_of_an_evaluation_leaves_the_trial_set_until_forgotten(
    tmp_path: Path,
) -> None:
    """A pool's agent leaves ``neps.run`` with a ``BaseException`` after putting a trial
    back, and enters it again: NePS keeps the trial as "running in this process" (its
    ``_set_global_trial`` resets it only on a normal exit), and refuses the next one
    until ``forget_current_trial``."""

    class Leave(BaseException):
        pass

    def leaves(lr: float, hidden: int) -> float:
        raise Leave

    def returns(lr: float, hidden: int) -> float:
        return lr

    options: dict[str, Any] = {"root_directory": tmp_path / "root", "optimizer": "random_search"}
    with pytest.raises(Leave):
        neps.run(leaves, Space(), total_evaluations_to_spend=3, **options)
    with pytest.raises(neps.exceptions.NePSError, match="already set to run in this process"):
        neps.run(returns, Space(), total_evaluations_to_spend=3, **options)
    neps_run.forget_current_trial()
    neps.run(returns, Space(), total_evaluations_to_spend=3, **options)
    assert "success" in {t.metadata.state.value for t in recorded(tmp_path / "root").values()}


def test_sampling_and_recording_hooks_see_each_sample_and_each_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault points ``sample`` and ``record`` lie inside NePS (``_sample_trial``,
    ``_report_trial_evaluation``): each trial is sampled once and recorded once, by id."""
    monkeypatch.setattr(NePSState, "_sample_trial", NePSState._sample_trial)
    monkeypatch.setattr(NePSState, "_report_trial_evaluation", NePSState._report_trial_evaluation)
    seen: list[str] = []
    neps_run.call_before_sampling_and_recording(
        lambda: seen.append("sample"), lambda trial_id: seen.append(f"record {trial_id}")
    )
    neps_run.call_before_sampling_and_recording(  # installing twice keeps one wrapper
        lambda: seen.append("sample"), lambda trial_id: seen.append(f"record {trial_id}")
    )
    neps.run(
        lambda lr, hidden: lr,
        Space(),
        root_directory=tmp_path / "root",
        total_evaluations_to_spend=2,
        optimizer="random_search",
    )
    assert seen == ["sample", "record 1", "sample", "record 2"]


def test_a_trial_put_back_is_handed_out_first_on_entering_neps_run_again_under_a_new_worker_id(
    tmp_path: Path,
) -> None:
    """What ``run_entering_again`` relies on beyond ``forget_current_trial``: a trial set
    back to pending (a pool's agent puts back a trial whose ranks were lost) is the one
    NePS hands out on the next entry, before it samples a new one; NePS refuses a worker
    id it has seen, and a fresh one (``next_worker_id``) is taken; the root is not wiped
    again (``overwrite_root_directory`` only on the first entry)."""
    from neps_bcast.recovery.lease_file import next_worker_id

    class PutBack(BaseException):
        pass

    root = tmp_path / "root"
    seen: list[tuple[float, int]] = []

    def evaluate(lr: float, hidden: int) -> float:
        seen.append((lr, hidden))
        if len(seen) == 1:
            with neps_compat.locked_trials(root) as book:
                assert book is not None
                book.set_pending(neps_compat.current_trial().trial_id)
            raise PutBack
        return lr

    options: dict[str, Any] = {
        "root_directory": root,
        "optimizer": "random_search",
        "total_evaluations_to_spend": 2,
        "overwrite_root_directory": True,
        "worker_id": "first",
    }
    entries: list[dict[str, Any]] = []

    def run(given: dict[str, Any]) -> None:
        entries.append(given)
        neps.run(evaluate, Space(), **given)

    neps_run.run_entering_again(run, options, PutBack, next_worker_id)
    assert [e["worker_id"] for e in entries] == ["first", "first-2"]
    assert [e["overwrite_root_directory"] for e in entries] == [True, False]
    assert seen[1] == seen[0], "the trial put back was not the next one handed out"
    states = {tid: t.metadata.state.value for tid, t in recorded(root).items()}
    assert states == {"1": "success", "2": "success"}, states
    with pytest.raises(neps.exceptions.NePSError, match="Worker id 'first' already exists"):
        neps.run(
            evaluate,
            Space(),
            **{**options, "overwrite_root_directory": False, "total_evaluations_to_spend": 3},
        )


def test_a_trials_metadata_json_names_its_state_and_evaluating_worker(tmp_path: Path) -> None:
    """``neps_trials.holder``, read without NePS's lock by a leader's thread: the
    ``state`` and ``evaluating_worker_id`` keys of a trial's ``metadata.json``, as NePS
    writes them while the trial is evaluated (the worker id given to ``neps.run``) and
    once it is recorded. If NePS renames either or the file, the fence and the wait for
    a trial in doubt read nothing (or a ``ValueError``) where NePS holds the trial."""
    import json

    from neps.state.filebased import ReaderWriterTrial

    from neps_bcast.compat.neps_trials import holder

    during: list[tuple[dict[str, Any], tuple[str, str | None] | None]] = []
    directories: list[Path] = []

    def evaluate(lr: float, hidden: int, pipeline_directory: Path) -> float:
        directories.append(Path(pipeline_directory))
        metadata = Path(pipeline_directory) / ReaderWriterTrial.METADATA_FILENAME
        during.append((json.loads(metadata.read_text()), holder(Path(pipeline_directory))))
        return lr

    neps.run(
        evaluate,
        Space(),
        root_directory=tmp_path / "root",
        total_evaluations_to_spend=1,
        optimizer="random_search",
        worker_id="the-worker",
    )
    assert ReaderWriterTrial.METADATA_FILENAME == "metadata.json"
    [(metadata, held)] = during
    assert metadata.get("state") == "evaluating", (
        "NePS's metadata.json no longer names an evaluating trial's state under 'state':"
        f" fix compat/neps_trials.py holder ({sorted(metadata)})"
    )
    assert metadata.get("evaluating_worker_id") == "the-worker", (
        "NePS's metadata.json no longer names the worker evaluating the trial under"
        f" 'evaluating_worker_id': fix compat/neps_trials.py holder ({sorted(metadata)})"
    )
    assert held == ("evaluating", "the-worker")
    assert holder(directories[0]) == ("success", "the-worker")
    assert holder(tmp_path / "no trial here") is None


def test_re_entering_neps_run_for_n_evaluations_hands_out_a_pending_trial_first(
    tmp_path: Path,
) -> None:
    """``run_entering_again`` after a trial in doubt was taken over (``recovery.in_doubt``):
    ``neps.run`` returned with its budget reached while another worker's trial was
    evaluating; that trial, set back to pending, is the one NePS hands out when
    ``neps.run`` is entered again under a new worker id with
    ``worker_evaluations_to_spend=1``, and that entry evaluates it only (counted from 0
    for the new id), nothing new sampled, even with the total budget not reached."""

    class HostDied(BaseException):
        pass

    root = tmp_path / "root"
    evaluated: list[str] = []

    def dies(lr: float, hidden: int, pipeline_id: str) -> float:
        raise HostDied

    def trains(lr: float, hidden: int, pipeline_id: str) -> float:
        evaluated.append(str(pipeline_id))
        return lr

    options: dict[str, Any] = {"root_directory": root, "optimizer": "random_search"}
    with pytest.raises(HostDied):  # trial 1 left evaluating, as a dead host leaves it
        neps.run(dies, Space(), total_evaluations_to_spend=3, worker_id="a", **options)
    neps_run.forget_current_trial()
    neps.run(trains, Space(), total_evaluations_to_spend=3, worker_id="b", **options)
    assert evaluated == ["2", "3"], "NePS's budget no longer counts an evaluating trial"
    with neps_compat.locked_trials(root) as book:
        assert book is not None
        book.set_pending("1")
    neps.run(
        trains,
        Space(),
        total_evaluations_to_spend=5,
        worker_evaluations_to_spend=1,
        worker_id="b-2",
        **options,
    )
    assert evaluated == ["2", "3", "1"], (
        "entered again for one evaluation under a new worker id, NePS did not hand out"
        f" the pending trial (and only it): {evaluated}"
    )
    states = {tid: t.metadata.state.value for tid, t in recorded(root).items()}
    assert states == {"1": "success", "2": "success", "3": "success"}, states
