"""The launch counter: every real launch a test makes counts, and a tier fails past its budget.

A launch (a search's processes started the way users start them: ``python script.py``,
torchrun, ``neps-bcast launch``, an example's command, a NePS worker) costs seconds of
CPU per process before any trial trains (importing torch, Lightning and NePS), so the
launches are what makes a tier slow, not its number of tests. Each place in the tests
that starts one calls ``count(kind)`` (``harness.start``, ``user_launch.UserLaunch``,
``outsider.popen``, and the few tests that start one themselves); it writes one small
file into a folder that the pytest controller creates at ``pytest_configure`` and names
in ``NEPS_BCAST_TEST_LAUNCH_DIR`` (pytest-xdist's workers inherit it: they start after
it is set). At the end of the session the controller reads the folder, prints the
count, and fails the session when ``NEPS_BCAST_LAUNCH_BUDGET`` (the Makefile sets one
per tier) is exceeded, naming the count, the budget and the files that launch most.

A launch started outside a pytest session (a script run by hand) counts nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

DIR_ENV = "NEPS_BCAST_TEST_LAUNCH_DIR"
BUDGET_ENV = "NEPS_BCAST_LAUNCH_BUDGET"
TOP = 8
"""How many launching files a report names."""


def current_test() -> str:
    """The node id of the test (or fixture setup) running now, as pytest sets it."""
    return os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]


def count(kind: str, test: str | None = None) -> None:
    """One real launch, of ``kind`` ("lightning", "torchrun", "launch", "example", ...),
    by the test running now."""
    folder = os.environ.get(DIR_ENV)
    if not folder:
        return
    record = {"test": test or current_test(), "kind": kind}
    path = Path(folder) / f"{os.getpid()}-{uuid.uuid4().hex}.json"
    path.write_text(json.dumps(record))


@dataclass(frozen=True)
class Tally:
    launches: list[dict[str, str]]
    budget: int | None

    @property
    def total(self) -> int:
        return len(self.launches)

    @property
    def over(self) -> bool:
        return self.budget is not None and self.total > self.budget

    def by_file(self) -> list[tuple[str, int]]:
        return Counter(e["test"].split("::", 1)[0] for e in self.launches).most_common()

    def by_kind(self) -> list[tuple[str, int]]:
        return Counter(e["kind"] for e in self.launches).most_common()

    def summary(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {self.budget}"
        kinds = ", ".join(f"{k} {n}" for k, n in self.by_kind()) or "none"
        return f"{self.total} real launches ({budget}; {kinds})"

    def failure(self) -> str:
        top = "\n".join(f"  {n:4d}  {f}" for f, n in self.by_file()[:TOP])
        return (
            f"launch budget exceeded: this run made {self.total} real launches, its budget"
            f" ({BUDGET_ENV}) is {self.budget}. The files that launch most:\n{top}\n"
            "HINT: a new guarantee in this tier shares a launch with one already there, or"
            " goes to tests/e2e (make test-e2e); raise the budget in the Makefile only with"
            " the tier's measured time."
        )


def read(folder: Path) -> list[dict[str, str]]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def parse_budget(text: str | None) -> int | None:
    if text is None or text == "":
        return None
    try:
        budget = int(text)
    except ValueError:
        raise pytest.UsageError(f"{BUDGET_ENV}={text!r}: want a whole number") from None
    if budget < 0:
        raise pytest.UsageError(f"{BUDGET_ENV}={text!r}: want a number >= 0")
    return budget


def tally(launches: Iterable[dict[str, str]], budget: int | None) -> Tally:
    return Tally(list(launches), budget)


# ---------------------------------------------------------------- pytest hooks
# Registered by tests/conftest.py (which imports them), on the controller and on every
# xdist worker; only the controller (no ``workerinput``) owns the folder and the verdict.

_TALLY = pytest.StashKey[Tally]()
_DIR = pytest.StashKey[Path]()
_NOTHING = pytest.StashKey[bool]()


def is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not is_controller(config):
        return
    parse_budget(os.environ.get(BUDGET_ENV))  # a bad budget fails before any launch
    folder = Path(tempfile.mkdtemp(prefix="neps_bcast_launches_"))
    config.stash[_DIR] = folder
    os.environ[DIR_ENV] = str(folder)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    if not is_controller(config) or _DIR not in config.stash:
        return
    folder = config.stash[_DIR]
    result = tally(read(folder), parse_budget(os.environ.get(BUDGET_ENV)))
    shutil.rmtree(folder, ignore_errors=True)
    os.environ.pop(DIR_ENV, None)
    config.stash[_TALLY] = result
    if result.over:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        # A selection that ran zero tests tested nothing: a failure, not pytest's 5
        # (which a script may take for "nothing to do").
        config.stash[_NOTHING] = True
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    config = terminalreporter.config
    if _TALLY not in config.stash:
        return
    result = config.stash[_TALLY]
    if config.stash.get(_NOTHING, False):
        terminalreporter.write_sep("=", "no tests ran: a failure", red=True, bold=True)
    if result.over:
        terminalreporter.write_sep("=", "launch budget exceeded", red=True, bold=True)
        terminalreporter.write_line(result.failure())
    terminalreporter.write_sep("-", result.summary())
