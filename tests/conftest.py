from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# The launch counter's hooks (tests/launches.py): every tier prints its count of real
# launches and fails past its budget (NEPS_BCAST_LAUNCH_BUDGET, set by the Makefile).
from launches import (
    pytest_configure,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

__all__ = ["pytest_configure", "pytest_sessionfinish", "pytest_terminal_summary"]


def pytest_collection_finish(session):  # type: ignore[no-untyped-def]
    # A selection that runs zero tests is a failure, not a green run. Under xdist the
    # workers collect and the controller turns pytest's exit 5 into 1 (launches.py).
    if hasattr(session.config, "workerinput"):
        return
    if not session.items and not session.config.option.collectonly:
        raise SystemExit("no tests were selected")
