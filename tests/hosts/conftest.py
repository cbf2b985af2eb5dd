"""The multi-host tier (``make test-hosts``): its figures at the end of the run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import timings


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if timings.LINES:
        terminalreporter.write_sep("-", "hosts: each rank's end after the cut")
        for line in timings.LINES:
            terminalreporter.write_line(line)
