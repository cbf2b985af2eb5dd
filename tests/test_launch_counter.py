"""The launch counter (tests/launches.py): what it counts, and that a tier past its
budget fails, across pytest-xdist's workers. The last two tests run a tiny pytest
session of their own (no torch, no launch: about a second each)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import launches
from harness import PYTHON, kind_of, python, srun, torchrun

TESTS = Path(__file__).parent


def test_a_launch_writes_one_record_naming_its_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(launches.DIR_ENV, str(tmp_path))
    launches.count("torchrun")
    launches.count("python", test="tests/test_x.py::TestY::test_z")
    found = launches.read(tmp_path)
    assert sorted(e["kind"] for e in found) == ["python", "torchrun"]
    assert {e["test"] for e in found} == {
        "tests/test_launch_counter.py::test_a_launch_writes_one_record_naming_its_test",
        "tests/test_x.py::TestY::test_z",
    }


def test_outside_a_session_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(launches.DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    launches.count("python")
    assert list(tmp_path.iterdir()) == []


def test_the_tally_is_over_only_past_the_budget() -> None:
    three = [{"test": f"tests/e2e/test_{i % 2}.py::t{i}", "kind": "python"} for i in range(3)]
    assert not launches.tally(three, 3).over
    assert launches.tally(three, 2).over
    assert not launches.tally(three, None).over
    assert launches.tally(three, 2).by_file() == [
        ("tests/e2e/test_0.py", 2),
        ("tests/e2e/test_1.py", 1),
    ]


def test_the_failure_names_count_budget_and_top_files() -> None:
    found = [{"test": "tests/test_a.py::t", "kind": "torchrun"}] * 5
    text = launches.tally(found, 4).failure()
    assert "made 5 real launches" in text
    assert "NEPS_BCAST_LAUNCH_BUDGET) is 4" in text
    assert "     5  tests/test_a.py" in text


@pytest.mark.parametrize("text", ["ten", "-1"])
def test_a_budget_that_is_not_a_count_is_refused(text: str) -> None:
    with pytest.raises(pytest.UsageError, match="NEPS_BCAST_LAUNCH_BUDGET"):
        launches.parse_budget(text)


def test_each_launcher_is_named_by_its_kind() -> None:
    script = Path("s.py")
    assert kind_of(python(script)) == "python"
    assert kind_of(torchrun(2, script)) == "torchrun"
    assert kind_of(srun(2, script)) == "srun"
    assert kind_of([str(Path(PYTHON).with_name("neps-bcast")), "launch"]) == "neps-bcast launch"


SESSION = """
import launches

def test_one():
    launches.count("python")

def test_two():
    launches.count("torchrun")
    launches.count("torchrun")
"""


def session(tmp_path: Path, budget: str, *args: str) -> subprocess.CompletedProcess[str]:
    """A pytest session of three launches over two xdist workers, with ``budget``."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_three.py").write_text(textwrap.dedent(SESSION))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(TESTS), launches.BUDGET_ENV: budget}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "launches",
            "-n",
            "2",
            "-p",
            "no:cacheprovider",
            *args,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_session_within_its_budget_passes_and_prints_its_count(tmp_path: Path) -> None:
    done = session(tmp_path, "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 real launches (budget 3; torchrun 2, python 1)" in done.stdout, done.stdout


def test_a_session_past_its_budget_fails_naming_count_budget_and_file(tmp_path: Path) -> None:
    done = session(tmp_path, "2")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "2 passed" in done.stdout, done.stdout  # every test passed: the budget failed it
    assert "made 3 real launches, its budget (NEPS_BCAST_LAUNCH_BUDGET) is 2" in done.stdout
    assert "     3  test_three.py" in done.stdout, done.stdout


def test_a_session_that_runs_no_test_fails(tmp_path: Path) -> None:
    """pytest's own exit for it is 5, which a script may take for "nothing to do"."""
    done = session(tmp_path, "3", "-k", "no_such_test")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no tests ran: a failure" in done.stdout, done.stdout
