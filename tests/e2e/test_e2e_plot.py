"""End to end: ``neps-bcast status ROOT --plot FILE`` draws real searches, checked by the
figure's content (not its pixels) against what NePS and the launches recorded.

Two launches here, and the pool's picture on another file's launch:

- Lightning ``strategy="ddp"``, 2 ranks: the leader's code raises in its 2nd trial
  (crashed) and the leader is SIGKILLed in its 3rd; the same command again takes that
  trial back (put back, its owner gone) and finishes the budget. Two leaders, so two
  rows; the killed attempt is a put-back bar on the first leader's row, with a marker
  and its cause, and the retry a success bar on the second's.
- ``neps-bcast launch --pool 2``, trials of 1 or 2 ranks on two devices
  (``PoolPictureChecks``, run on tests/e2e/test_e2e_pool_promotion.py's Lightning
  launch, ``examples/pool_promotion.py``): a row per device, each trial's bars on as
  many rows as its placement's devices, never two at once on one device.

Checks: one bar per attempt on its row, its start and end NePS's (``time_started``,
``time_end``, read with NePS's own reader) or the lease's history for an interrupted
attempt, its colour by outcome; the best-so-far steps equal NePS's incumbents
(``summary/best_config_trajectory.txt``) where one worker ran every trial, and the
running minimum of NePS's results in the order they ended in the pool.
"""

from __future__ import annotations

import itertools
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness import LIGHTNING, NEPS_BCAST, Result, base_env, neps_trials, python, run
from neps_bcast.config import Settings
from neps_bcast.launcher import search_plot, search_status, trial_placement
from neps_bcast.recovery.lease_file import read_lease
from test_search_plot import figure_bars

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TRIALS = 4


def plot_command(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [NEPS_BCAST, "status", str(root), "--plot", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=base_env(),
        check=False,
    )


def neps_record(root: Path) -> dict[str, Any]:
    """trial id -> NePS's metadata and report, read with NePS's reader."""
    return {tid: t for tid, t in neps_trials(root).items()}


def state(trial: Any) -> str:
    return str(getattr(trial.metadata.state, "value", trial.metadata.state))


def incumbents(root: Path) -> list[str]:
    """The trial ids of NePS's incumbent trajectory, in its order."""
    text = (root / "summary" / "best_config_trajectory.txt").read_text()
    return re.findall(r"Config ID: (\S+)", text)


def drawn(root: Path) -> tuple[search_plot.Picture, Any]:
    status = search_status.read_status(root, Settings(), history=True)
    pic = search_plot.picture(status)
    return pic, search_plot.draw(pic)


def assert_colours_follow_the_bars(pic: search_plot.Picture, fig: Any) -> None:
    """Each outcome's collection holds exactly that outcome's bars, in its colour
    (``figure_bars`` checks the colour)."""
    expected: dict[str, list[tuple[float, float, float]]] = {}
    for b in pic.bars:
        expected.setdefault(b.outcome, []).append((b.start, b.end, float(b.row)))
    got = figure_bars(fig)
    assert set(got) == set(expected)
    for outcome, bars in expected.items():
        assert len(got[outcome]) == len(bars), outcome
        for drawn_bar, bar in zip(got[outcome], sorted(bars), strict=True):
            assert drawn_bar == pytest.approx(bar, abs=1e-6), outcome


# -- Lightning ddp x2: a crash, a killed leader, the rerun -------------------------------------
class TestLightningCrashKilledLeaderAndRerun:
    @pytest.fixture(scope="class")
    def search(self, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
        tmp = tmp_path_factory.mktemp("plot_lightning")
        command = python(LIGHTNING, "--trials", TRIALS, "--ignore-errors")
        first = run(
            command, tmp, name="first", fault="raise:leader:trial=2, sigkill:leader:trial=3"
        )
        again = run(command, tmp, name="again")
        out = tmp / "search.png"
        return {
            "first": first,
            "again": again,
            "root": first.root,
            "cli": plot_command(first.root, out),
            "out": out,
        }

    @staticmethod
    def leader(result: Result) -> int:
        starts = [e for e in result.events if e["event"] == "start" and e.get("proc_rank") == 0]
        return int(starts[0]["pid"])

    def test_the_searches_ended_as_the_faults_say(self, search: dict[str, Any]) -> None:
        record = neps_record(search["root"])
        assert sorted(state(t) for t in record.values()) == ["crashed", *["success"] * 3]
        assert search["again"].returncode == 0, search["again"].tail()

    def test_the_command_writes_the_picture(self, search: dict[str, Any]) -> None:
        done = search["cli"]
        assert done.returncode == 0, done.stderr
        assert done.stdout.rstrip().endswith(f"picture: {search['out']}")
        assert search["out"].read_bytes()[:4] == b"\x89PNG"

    def test_one_row_per_leader_and_one_bar_per_attempt_at_neps_times(
        self, search: dict[str, Any]
    ) -> None:
        pic, _ = drawn(search["root"])
        first, again = self.leader(search["first"]), self.leader(search["again"])
        assert [r.label.split(" pid ")[1] for r in pic.rows] == [
            f"{first}, 2 ranks",
            f"{again}, 2 ranks",
        ]
        record = neps_record(search["root"])
        killed = next(
            tid for tid, t in record.items() if read_lease(Path(t.metadata.location)).attempts
        )  # type: ignore[union-attr]
        history = read_lease(Path(record[killed].metadata.location)).attempts  # type: ignore[union-attr]
        assert len(history) == 1 and "is gone" in history[0].how
        expected = set()
        for tid, t in record.items():
            row = 0 if t.metadata.evaluating_worker_id.startswith(f"neps_bcast-{first}-") else 1
            expected.add(
                (tid, len(history) + 1 if tid == killed else 1, row,
                 t.metadata.time_started - pic.t0, t.metadata.time_end - pic.t0, state(t))
            )  # fmt: skip
        expected.add((killed, 1, 0, history[0].started - pic.t0, history[0].ended - pic.t0, "put back"))  # fmt: skip
        got = {(b.trial_id, b.attempt, b.row, b.start, b.end, b.outcome) for b in pic.bars}
        assert len(pic.bars) == len(got) == TRIALS + 1
        assert {g[:3] + g[5:] for g in got} == {e[:3] + e[5:] for e in expected}
        for g in got:
            e = next(e for e in expected if e[:3] == g[:3])
            assert g[3:5] == pytest.approx(e[3:5], abs=1e-6), g

    def test_the_killed_attempt_is_marked_with_its_cause(self, search: dict[str, Any]) -> None:
        pic, fig = drawn(search["root"])
        cut = [b for b in pic.bars if b.interrupted]
        assert [(b.outcome, b.row) for b in cut] == [("put back", 0)]
        assert cut[0].cause is not None and "is gone" in cut[0].cause
        assert any("is gone" in t.get_text() for t in fig.axes[0].texts)

    def test_each_bar_is_drawn_in_its_outcome_colour(self, search: dict[str, Any]) -> None:
        pic, fig = drawn(search["root"])
        assert_colours_follow_the_bars(pic, fig)

    def test_the_best_so_far_steps_are_neps_incumbents(self, search: dict[str, Any]) -> None:
        pic, fig = drawn(search["root"])
        assert [s.trial_id for s in pic.best] == incumbents(search["root"])
        record = neps_record(search["root"])
        for s in pic.best:
            assert s.objective == record[s.trial_id].report.objective_to_minimize
            assert s.t == pytest.approx(record[s.trial_id].metadata.time_end - pic.t0)
        line = next(ln for ln in fig.axes[1].lines if ln.get_gid() == "best so far")
        assert list(line.get_ydata())[:-1] == [s.objective for s in pic.best]


# -- a pool of 2, trials of 1 or 2 ranks ---------------------------------------------------------
class PoolPictureChecks:
    """The picture of a pool of 2 whose trials take 1 or 2 ranks, each trial's size its
    placement's (``trial_placement``: the devices the launcher gave it). A class provides
    ``launch``: a ``neps-bcast launch --pool 2`` whose every trial is a success (that it
    is, with its exit code and nothing left, the class checks itself). Run on
    tests/e2e/test_e2e_pool_promotion.py's Lightning launch (its first rung's trials on
    1 rank, its promoted ones on 2): a launch of its own drew the same picture."""

    def test_one_row_per_device_and_a_bar_per_device_of_each_trial(self, launch: Result) -> None:
        pic, fig = drawn(launch.root)
        assert [r.label.split(" ", 1)[1] for r in pic.rows] == ["device 0", "device 1"]
        for tid, t in neps_record(launch.root).items():
            placed = trial_placement.read(Path(t.metadata.location))
            assert placed is not None and placed.devices, (tid, placed)
            size = len(placed.devices)
            mine = [b for b in pic.bars if b.trial_id == tid]
            assert len(mine) == size and len({b.row for b in mine}) == size, (tid, mine)
            for b in mine:
                # On its devices from its placement (its agent held it evaluating while it
                # waited for them, since NePS's time_started) to NePS's time_end.
                assert t.metadata.time_started <= placed.placed
                assert (b.start, b.end) == pytest.approx(
                    (placed.placed - pic.t0, t.metadata.time_end - pic.t0), abs=1e-6
                )
                assert pic.rows[b.row].label.endswith(tuple(f"device {d}" for d in placed.devices))
                assert b.outcome == "success"
        assert_colours_follow_the_bars(pic, fig)

    def test_trials_of_one_and_of_two_devices_were_drawn(self, launch: Result) -> None:
        """The positive control of the test above: it saw bars of both sizes."""
        sizes = set()
        for t in neps_record(launch.root).values():
            placed = trial_placement.read(Path(t.metadata.location))
            sizes.add(len(placed.devices) if placed is not None else 0)
        assert sizes == {1, 2}, sizes

    def test_no_device_runs_two_trials_at_once(self, launch: Result) -> None:
        pic, _ = drawn(launch.root)
        for row in range(len(pic.rows)):
            spans = sorted((b.start, b.end) for b in pic.bars if b.row == row)
            for (_, end), (start, _) in itertools.pairwise(spans):
                # NePS's end is when the agent recorded the result, a moment after the
                # ranks freed the devices and the launcher placed the next trial there.
                assert start >= end - 1.0, spans

    def test_the_best_so_far_is_the_running_minimum_in_the_order_trials_ended(
        self, launch: Result
    ) -> None:
        pic, _ = drawn(launch.root)
        done = sorted(
            (t.metadata.time_end, tid, t.report.objective_to_minimize)
            for tid, t in neps_record(launch.root).items()
        )
        steps: list[tuple[str, float]] = []
        for _, tid, objective in done:
            if not steps or objective < steps[-1][1]:
                steps.append((tid, objective))
        assert [(s.trial_id, s.objective) for s in pic.best] == steps
        assert 0 < pic.busy_s <= pic.available_s
