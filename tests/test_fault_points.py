"""The fault points the sweep lands faults at (tests/sweep/table.py) are part of the
library (``neps_bcast.faults``), and one short launch reaches every one of them.

The sweep takes most of an hour; a refactor that drops or renames a point must fail
here, in seconds, instead of turning every cell of that step into "the fault never
fired" at the end of the sweep.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import PYTHON, Result, assert_nothing_left, run
from neps_bcast import faults

SRC = Path(__file__).resolve().parents[1] / "src" / "neps_bcast"
SWEEP = Path(__file__).resolve().parent / "sweep"
sys.path.insert(0, str(SWEEP))

import table  # noqa: E402 - tests/sweep is not a package

SCRIPT_POINTS = {"before", "session", "fit", "after"}
"""Points the user-shaped test scripts call themselves (``faults.at``), in the user's code."""
TORCH_POINTS = {"reform"}
"""Points inside torch (``dist.init_process_group``), hooked by tests/scripts/faults.py."""


def points_in_code() -> dict[str, list[str]]:
    """Every ``faults.point("name", ...)`` call in the library: name -> where."""
    found: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "point"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "faults"
            ):
                assert node.args and isinstance(node.args[0], ast.Constant), (
                    f"{path}:{node.lineno}: a fault point's name must be a literal"
                )
                found.setdefault(str(node.args[0].value), []).append(
                    f"{path.relative_to(SRC)}:{node.lineno}"
                )
    return found


def sweep_points() -> set[str]:
    return {p.name for p in table.POINTS} | {p.name for p in table.POOL_POINTS}


def test_every_point_the_sweep_names_is_a_library_point_or_the_users_code() -> None:
    unknown = sweep_points() - set(faults.POINTS) - SCRIPT_POINTS - TORCH_POINTS
    assert not unknown, f"the sweep names points the library does not have: {sorted(unknown)}"


def test_every_listed_point_is_in_the_code_and_every_point_in_the_code_is_listed() -> None:
    in_code = points_in_code()
    assert set(in_code) == set(faults.POINTS), (
        f"listed but not in the code: {sorted(set(faults.POINTS) - set(in_code))};"
        f" in the code but not listed: {sorted(set(in_code) - set(faults.POINTS))}"
    )


def test_a_cell_left_to_its_twin_is_expected_the_same_and_its_twin_is_swept() -> None:
    """The sweep leaves a cell to a twin only where the table expects the same of both,
    and the twin is a cell the sweep runs: on 3 ranks (``on_3_ranks_instead``), or at
    another step (``TWINS``)."""
    cells = set(table.CELLS)
    point = {p.name: p for p in table.POINTS}
    fault = {f.name: f for f in table.FAULTS}
    left = 0

    def same(a: table.Expect | table.Unreachable, b: table.Expect | table.Unreachable) -> bool:
        assert isinstance(a, table.Expect) and isinstance(b, table.Expect)
        return (a.row, a.trials, a.leader, a.follower, a.rerun) == (
            b.row,
            b.trials,
            b.leader,
            b.follower,
            b.rerun,
        )

    for p in table.POINTS:
        for f in table.FAULTS:
            if table.on_3_ranks_instead("torchrun", p, f):
                left += 1
                assert ("torchrun3", p, f) in cells
                assert same(table.expect("torchrun", p, f), table.expect("torchrun3", p, f))
            if table.twin_swept(p, f):
                left += 1
                twin = point[table.TWINS[(p.name, f.name)]]
                assert ("torchrun", twin, fault[f.name]) in cells
                assert same(table.expect("torchrun", p, f), table.expect("torchrun", twin, f))
    assert left == 19 + len(table.TWINS)  # 3-rank twins: 22 before term_twice joined term_all


ROOT = Path(__file__).resolve().parents[1]

LEFT_TO_THE_FULL_SWEEP = {
    # (step, fault) of a Lightning cell -> the launcher whose cell runs on every commit
    ("handed", "term_leader"): "torchrun",
    ("handed", "term_all"): "torchrun",
    ("handed", "int_leader"): "torchrun",
    ("handed", "kill_leader"): "torchrun",
    ("handed", "freeze_leader"): "torchrun",
    ("handed", "raise"): "torchrun",
    ("exchange", "term_leader"): "torchrun3",
    ("exchange", "term_all"): "torchrun3",
    ("exchange", "int_leader"): "torchrun3",
    ("exchange", "kill_leader"): "torchrun3",
    ("exchange", "freeze_leader"): "torchrun",
    ("sample", "term_leader"): "torchrun",
    ("sample", "term_all"): "torchrun",
    ("sample", "int_leader"): "torchrun",
    ("sample", "freeze_leader"): "torchrun",
    ("sample", "raise"): "torchrun",
    ("stop", "term_leader"): "torchrun3",
    ("stop", "term_all"): "torchrun3",
    ("stop", "int_leader"): "torchrun3",
    ("stop", "kill_leader"): "torchrun3",
    ("stop", "freeze_leader"): "torchrun",
}
"""Every Lightning cell that only ``make test-faults-full`` runs, by name, with its twin:
a fault to the leader (or an exception) before or after Lightning's fit, where the
leader's code and the follower's wait are those torchrun runs."""


def test_every_step_and_fault_of_the_table_runs_on_every_commit() -> None:
    """``make test-faults`` (table.CI_CELLS) runs each (step, fault) pair the full sweep
    runs, under one launcher at least; the positive control: the full sweep's own list
    has Lightning cells that the commit's sweep leaves out."""
    pairs = {(p.name, f.name) for _, p, f in table.CELLS}
    on_every_commit = {(p.name, f.name) for _, p, f in table.CI_CELLS}
    assert pairs - on_every_commit == set()
    assert len(table.CELLS) - len(table.CI_CELLS) == len(LEFT_TO_THE_FULL_SWEEP)


def test_each_lightning_cell_left_to_the_full_sweep_has_a_twin_expected_the_same() -> None:
    """The cells named above, and no other, are left out of ``make test-faults``; each
    one's twin runs there and is expected by the same rule to leave the same trial
    states and the same rerun; none reaches code only Lightning runs."""
    left = {(p.name, f.name): twin for (_, p, f), twin in table.FULL_ONLY.items()}
    assert left == LEFT_TO_THE_FULL_SWEEP
    ci = set(table.CI_CELLS)
    for (launcher, p, f), twin in table.FULL_ONLY.items():
        assert launcher == "lightning"
        assert (twin, p, f) in ci
        want, theirs = table.expect("lightning", p, f), table.expect(twin, p, f)
        assert isinstance(want, table.Expect) and isinstance(theirs, table.Expect)
        assert (want.row, want.trials, want.rerun, want.goes_on) == (
            theirs.row,
            theirs.trials,
            theirs.rerun,
            theirs.goes_on,
        ), (p.name, f.name, twin)
        assert p.name not in ("form", "fit") and p.kind != "settle" and f.to != "follower"


def test_the_cells_that_check_more_are_the_sweeps_extra_and_run_on_every_commit() -> None:
    import test_sweep  # the sweep's module imports its harness: only here

    names = {(launcher, p.name, f.name) for launcher, p, f in table.CI_CELLS}
    assert set(test_sweep.EXTRA) - names == set()
    assert table.CHECKED_MORE - set(test_sweep.EXTRA) == set()


def test_each_lightning_only_path_exists() -> None:
    """.ci/run runs the full sweep when one of these changed: a path that moved would
    silently stop triggering it."""
    paths = table.lightning_only_paths()
    assert "src/neps_bcast/compat/lightning.py" in paths
    missing = [path for path in paths if not (ROOT / path).is_file()]
    assert missing == []


def test_ci_runs_the_full_sweep_when_a_lightning_only_path_changed(tmp_path: Path) -> None:
    """.ci/run's choice, on a repository of its own: the commit in .ci/full-sweep-at,
    then a change to another file (the commit's sweep), to a Lightning-only path (the
    full sweep), and a commit the clone does not have (the full sweep)."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    (repo / "tests" / "sweep").mkdir(parents=True)
    (repo / "src").mkdir()
    shutil.copy(ROOT / ".ci" / "sweep-target", repo / ".ci" / "sweep-target")
    (repo / "tests" / "sweep" / "lightning_only_paths.txt").write_text("# why\nsrc/l.py\n")
    (repo / "src" / "l.py").write_text("a\n")
    (repo / "src" / "other.py").write_text("a\n")

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=repo,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()

    def target() -> str:
        done = subprocess.run(
            ["bash", ".ci/sweep-target"], cwd=repo, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "start")
    (repo / ".ci" / "full-sweep-at").write_text(git("rev-parse", "HEAD") + "\n")
    git("add", "-A")
    git("commit", "-qm", "the full sweep passed at start")
    assert target() == "test-faults"
    (repo / "src" / "other.py").write_text("b\n")
    git("commit", "-qam", "another file")
    assert target() == "test-faults"
    (repo / "src" / "l.py").write_text("b\n")
    assert target() == "test-faults-full"  # uncommitted, as in a developer's tree
    git("commit", "-qam", "a Lightning-only path")
    assert target() == "test-faults-full"
    (repo / ".ci" / "full-sweep-at").write_text("0" * 40 + "\n")
    git("commit", "-qam", "a commit this clone does not have")
    assert target() == "test-faults-full"
    (repo / ".ci" / "full-sweep-at").unlink()
    git("commit", "-qam", "no record")
    assert target() == "test-faults-full"


def test_arming_an_unknown_point_names_the_points() -> None:
    with pytest.raises(ValueError, match=r"no fault point named handedd; the points are"):
        faults.arm(lambda name, context: None, ["handedd"])
    faults.disarm()


def test_a_point_is_a_no_op_unless_armed() -> None:
    reached: list[str] = []
    faults.point("handed", seq=1)
    faults.arm(lambda name, context: reached.append(name), ["lease"])
    try:
        faults.point("handed", seq=1)
        faults.point("lease")
    finally:
        faults.disarm()
    faults.point("lease")
    assert reached == ["lease"]


@pytest.fixture(scope="module")
def traced_pool(tmp_path_factory: pytest.TempPathFactory) -> Result:
    """One short pool launch (2 devices, trials of 2 ranks, 3 trials, the group formed
    by ``session()``) with every point armed and recorded; rank 1 of trial 2 is SIGKILLed in its training step, so the
    agent settles that trial (back to pending) and the pool evaluates it again."""
    tmp = tmp_path_factory.mktemp("points")
    command = [
        str(Path(PYTHON).with_name("neps-bcast")),
        *("launch", "--pool", "2", str(SWEEP / "pool_fault_search.py"), "--trials", "3"),
        "--session-forms-group",
    ]
    return run(
        command,
        tmp,
        name="traced",
        fault="sigkill:follower:at=fit:id=2",
        env={"NB_TRACE_POINTS": "1"},
        timeout=300,
    )


def test_one_short_launch_reaches_every_point_of_the_library(traced_pool: Result) -> None:
    reached = {e["name"] for e in traced_pool.of("point")}
    missing = set(faults.POINTS) - reached
    assert not missing, (
        f"points no process reached: {sorted(missing)}; reached: {sorted(reached)};"
        f" logs:\n{traced_pool.tail()}"
    )


def test_the_traced_launch_finished_its_budget_and_left_nothing(traced_pool: Result) -> None:
    assert traced_pool.returncode == 0, traced_pool.tail()
    assert_nothing_left(traced_pool)


def test_the_users_function_does_not_see_the_pools_key(traced_pool: Result) -> None:
    """The key proves membership of the pool and seals its payloads: read once by each
    agent and rank, it is out of the environment before the user's code runs."""
    seen = traced_pool.of("environment")
    assert seen, "no trial recorded its environment"
    assert not any(e["pool_key"] for e in seen), seen
