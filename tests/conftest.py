from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# A suite started in the background by a script (``make test &``, ``nohup .ci/run &``)
# inherits SIGINT ignored, and Python then never installs KeyboardInterrupt: the Ctrl-C
# tests in this process (tests/test_signals_unit.py) saw their signal do nothing, and every
# process the suite starts inherited the ignored signal (a fresh clone's run in the
# background failed 4 tests so). Users press Ctrl-C in a terminal, where it is not ignored:
# the suite runs as it would there. A handler (unlike SIG_IGN) is not inherited across exec.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
