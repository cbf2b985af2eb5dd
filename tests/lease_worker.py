"""One NePS worker on a real root, for the lease tests (``test_lease_unit.py``,
``test_lease_orphans.py``): ``tests/scripts/recovery_single.py`` runs ``neps_bcast.run``
with no DDP (a trivial function, so each launch costs only its imports); a fault fires
in the trial the environment names."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from harness import PYTHON, base_env, neps_trials

SCRIPT = Path(__file__).parent / "scripts" / "recovery_single.py"


def worker(
    tmp_path: Path, *, trials: int, fault: str = "", at: str = "", **env: str
) -> subprocess.CompletedProcess[str]:
    """Run one worker to its end (bounded); its output is returned for the asserts."""
    full = base_env(
        NB_ROOT=str(tmp_path / "root"),
        NB_TRIALS=str(trials),
        NB_FAULT=fault,
        NB_FAULT_AT=at,
        NB_LOG=str(tmp_path / "evaluations.jsonl"),
        **env,
    )
    return subprocess.run(
        [PYTHON, str(SCRIPT)], env=full, capture_output=True, text=True, timeout=180, check=False
    )


def evaluations(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "evaluations.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def states(tmp_path: Path) -> dict[str, str]:
    return {tid: str(t.metadata.state.value) for tid, t in neps_trials(tmp_path / "root").items()}
