"""Several NePS workers on one root: the hash-seed dependent "pipeline space on disk does
not match" of plain NePS 0.17, and neps_bcast's safe start (real processes, real NePS)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import launches
from harness import PYTHON, assert_clean_launch, base_env, run
from scenario import Scenario

PLAIN_NEPS = """
import neps, sys
class Basic(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    hidden = neps.Integer(2, 16)
    activation = neps.Categorical(("relu", "tanh", "gelu"))
def evaluate(lr, hidden, activation):
    return lr
neps.run(evaluate, Basic(), root_directory=sys.argv[1], total_evaluations_to_spend=4,
         optimizer="random_search")
"""


def plain_neps(root: Path, tmp_path: Path, seed: str) -> subprocess.CompletedProcess[str]:
    launches.count("python")
    return subprocess.run(
        [PYTHON, "-c", PLAIN_NEPS, str(root)],
        cwd=tmp_path,
        env=base_env(PYTHONHASHSEED=seed),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_second_worker_with_another_hash_seed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    first = run(
        Scenario(trials=2, strategy="none", root=str(root)),
        tmp_path,
        name="first",
        env={"PYTHONHASHSEED": "1"},
    )
    assert_clean_launch(first)
    # Plain NePS refuses the very same space when the process's hash seed orders the
    # categorical choices differently (NePS builds them with list(set(choices))). If
    # this starts passing, NePS fixed it and neps_bcast.recovery.root_lock can be simplified.
    plain = plain_neps(root, tmp_path, "2")
    assert plain.returncode != 0
    assert "The pipeline space on disk does not match" in plain.stderr
    second = run(
        Scenario(trials=4, strategy="none", root=str(root)),
        tmp_path,
        name="second",
        env={"PYTHONHASHSEED": "2"},
    )
    assert_clean_launch(second)
    assert "continuing with the equivalent search space" in second.log
    lock = tmp_path / ".root.neps_bcast.lock"
    assert lock.exists()
    assert lock.stat().st_mode & 0o777 == 0o600  # owner-only
