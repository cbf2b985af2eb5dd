"""Two NePS workers on one root: our reads of NePS's state never see a half-written file.

Every NePS 0.17 worker rewrites ``<root>/optimizer_state.pkl`` in place (``open("wb")``:
truncated, then pickled) under NePS's optimizer lock each time it samples a trial, and
``NePSState.create_or_load`` reads it without any lock. Our orphan check (and the crash
record) load that state while the other groups' workers sample: unlocked, they read an
empty pickle ("EOFError: Ran out of input"), which killed a starting leader in
``tests/e2e/test_e2e_launch.py``. Here a real ``neps.run`` is frozen in the middle of that write,
deterministically (a profile hook stops it when NePS's ``_sample_trial`` calls
``pickle.dump`` on the file it has just truncated), and the checks run against it.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

import launches
from harness import PYTHON, base_env

NEPS_WORKER = textwrap.dedent(
    """
    import json
    import pickle
    import sys
    from pathlib import Path

    import neps

    root = Path(sys.argv[1])


    class Space(neps.PipelineSpace):
        x = neps.Float(0.0, 1.0)


    def freeze_mid_write(frame, event, arg):
        # NePS's _sample_trial has opened optimizer_state.pkl with "wb" (truncated it)
        # and pickles the new state into it now: stop right here, holding NePS's lock.
        if event == "c_call" and arg is pickle.dump and frame.f_code.co_name == "_sample_trial":
            sys.setprofile(None)
            size = (root / "optimizer_state.pkl").stat().st_size
            print(json.dumps({"frozen": size}), flush=True)
            sys.stdin.readline()


    armed = []


    def evaluate(x):
        if not armed:  # after the first trial: freeze in the second sample, once
            armed.append(True)
            sys.setprofile(freeze_mid_write)
        return x


    neps.run(
        evaluate,
        Space(),
        root_directory=root,
        total_evaluations_to_spend=3,
        optimizer="random_search",
    )
    print(json.dumps({"done": True}), flush=True)
    """
)

CHECK = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    from neps_bcast.compat import neps as neps_compat
    from neps_bcast.config import Settings
    from neps_bcast.recovery.lease import Leases

    root, what = Path(sys.argv[1]), sys.argv[2]
    try:
        if what == "orphans":
            done = Leases(root, Settings.from_env()).recover_orphans()
        else:
            neps_compat.record_crashed("1", root, RuntimeError("interrupted"))
            done = []
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)[:300]}))
    else:
        print(json.dumps({"done": done}))
    """
)


def check(tmp_path: Path, root: Path, what: str, **env: str) -> dict[str, object]:
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    out = subprocess.run(
        [PYTHON, str(script), str(root), what],
        env=base_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def line(stream: IO[str] | None, log: Path) -> dict[str, object]:
    assert stream is not None
    text = stream.readline()
    assert text, f"the NePS worker ended early:\n{log.read_text()[-3000:]}"
    result: dict[str, object] = json.loads(text)
    return result


@dataclass
class Frozen:
    """What the checks returned while a real neps.run was frozen inside its write, and
    after it finished."""

    frozen: dict[str, object]
    busy: dict[str, dict[str, object]]
    """what -> the check's result while NePS held its lock (here given up on after 0.5 s)."""
    done: dict[str, object]
    returncode: int
    after: dict[str, object]
    root: Path


# The fixture starts a NePS worker and runs three checks, each a fresh interpreter that
# imports NePS and bounded at 120 s: the pytest bound is above their sum (under load on
# 2 cores the class took 152 s against the earlier 180 s bound, and once ran past it).
@pytest.mark.timeout(540)
class TestOurReadsNeverSeeNepsStateMidWrite:
    """A real neps.run frozen (deterministically) in the middle of rewriting
    optimizer_state.pkl, holding NePS's lock; then the orphan check and the crash record
    run against it, and again once NePS finished."""

    @pytest.fixture(scope="class")
    def checked(self, tmp_path_factory: pytest.TempPathFactory) -> Frozen:
        tmp_path = tmp_path_factory.mktemp("mid_write")
        root = tmp_path / "root"
        worker_script = tmp_path / "neps_worker.py"
        worker_script.write_text(NEPS_WORKER)
        log = tmp_path / "neps_worker.log"
        launches.count("python")
        with log.open("w") as err:
            worker = subprocess.Popen(
                [PYTHON, str(worker_script), str(root)],
                env=base_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        try:
            frozen = line(worker.stdout, log)
            busy = {
                what: check(tmp_path, root, what, NEPS_STATE_FILELOCK_TIMEOUT="0.5")
                for what in ("orphans", "crash_record")
            }
            assert worker.stdin is not None
            worker.stdin.write("\n")
            worker.stdin.flush()
            done = line(worker.stdout, log)
            returncode = worker.wait(timeout=120)
        finally:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        return Frozen(frozen, busy, done, returncode, check(tmp_path, root, "orphans"), root)

    def test_neps_was_frozen_inside_its_write_with_the_file_empty(self, checked: Frozen) -> None:
        """The file on disk is empty, NePS holds its lock."""
        assert checked.frozen == {"frozen": 0}

    @pytest.mark.parametrize("what", ["orphans", "crash_record"])
    def test_the_check_waits_for_neps_lock_instead_of_reading_the_empty_pickle(
        self, checked: Frozen, what: str
    ) -> None:
        """Before the fix, both raised EOFError here."""
        result = checked.busy[what]
        assert result.get("error") == "LockException", result
        assert "optimizer.lock" in str(result["message"]), result

    def test_neps_finished_its_run(self, checked: Frozen) -> None:
        assert checked.done == {"done": True}
        assert checked.returncode == 0

    def test_afterwards_the_orphan_check_loads_the_state_and_finds_nothing(
        self, checked: Frozen
    ) -> None:
        assert checked.after == {"done": []}

    def test_neps_recorded_its_trials_untouched_by_the_failed_attempt(
        self, checked: Frozen
    ) -> None:
        from neps.state.neps_state import NePSState

        state = NePSState.create_or_load(path=checked.root, load_only=True)
        trials = state.lock_and_read_trials()
        assert {t.metadata.state.value for t in trials.values()} == {"success"}
        assert len(trials) == 3
