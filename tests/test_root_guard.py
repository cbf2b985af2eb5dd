"""Several NePS workers on one root: the hash-seed dependent "pipeline space on disk does
not match" of plain NePS 0.17, and neps_bcast's safe start (real processes, real NePS)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness import PYTHON, SEARCH, base_env

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


def run(cmd: list[str], tmp_path: Path, seed: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd,
        cwd=tmp_path,
        env=base_env(PYTHONHASHSEED=seed, **env),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_second_worker_with_another_hash_seed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    search = {"NB_ROOT": str(root), "NB_STRATEGY": "none"}
    first = run([PYTHON, str(SEARCH)], tmp_path, "1", NB_TRIALS="2", **search)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    # Plain NePS refuses the very same space when the process's hash seed orders the
    # categorical choices differently (NePS builds them with list(set(choices))). If
    # this starts passing, NePS fixed it and neps_bcast.root_guard can be simplified.
    plain = run([PYTHON, "-c", PLAIN_NEPS, str(root)], tmp_path, "2")
    assert plain.returncode != 0
    assert "The pipeline space on disk does not match" in plain.stderr
    second = run([PYTHON, str(SEARCH)], tmp_path, "2", NB_TRIALS="4", **search)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "continuing with the equivalent search space" in second.stdout + second.stderr
    assert (tmp_path / ".root.neps_bcast.lock").exists()
