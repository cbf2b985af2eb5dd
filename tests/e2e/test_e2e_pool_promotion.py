"""Promotions that grow: under ``neps-bcast launch --pool 2`` successive halving promotes a
trial from 1 epoch on one rank to 3 epochs on two, and the promoted trial goes on from
its lower rung's checkpoint: the global step counter continues where the lower rung's
ended, on every rank of the bigger group.

Two launches, one per way users checkpoint: ``examples/pool_promotion.py`` (Lightning:
``trainer.save_checkpoint`` into ``pipeline_directory``, ``fit(ckpt_path=...)`` from
``previous_pipeline_directory``) and ``tests/scripts/pool_promotion_ddp.py`` (plain DDP:
``torch.save`` on rank 0, ``torch.load`` on every rank). Each rank of each trial writes
what it saw to ``rank<r>.json`` in its trial's directory; which trial a promotion
continued from is read from NePS's own records, not from the script's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_e2e_plot import PoolPictureChecks

from harness import SCRIPTS, Result, neps_trials, pool_launch, start, states
from neps_bcast.launcher import trial_placement

REPO = Path(__file__).resolve().parents[2]
TRIALS = 8
"""Successive halving (eta 3) on epochs 1 and 3 promotes one of every 3 first-rung
trials: with 2 agents the first promotion is sampled by the 5th trial at the latest."""


def launch_pool(tmp: Path, script: Path) -> Result:
    return start(pool_launch(tmp, script, TRIALS), tmp, timeout=420.0).finish()


def pool_logs(result: Result) -> str:
    folder = result.root.parent / result.name / "logs" / "pool"
    return result.tail() + "".join(
        f"\n--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
        for path in sorted(folder.glob("*.log"))
    )


def seen_by_rank(root: Path, trial_id: str) -> list[dict[str, Any]]:
    """What each rank of a trial wrote (its ``rank<r>.json``), in rank order."""
    folder = root / "configs" / f"config_{trial_id}"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def promotions(result: Result) -> list[tuple[str, str, Path]]:
    """(promoted trial, the trial it continued from, that trial's directory), as NePS
    recorded them."""
    return [
        (tid, t.metadata.previous_trial_id, Path(t.metadata.previous_trial_location))
        for tid, t in neps_trials(result.root).items()
        if t.metadata.previous_trial_id is not None
    ]


class PromotionChecks:
    """Every check of one launch; a class per variant provides ``launch`` and the name
    of the checkpoint file its script writes and its records call the loaded one."""

    CHECKPOINT: str
    LOADED: str

    def test_the_launcher_exits_0_every_trial_a_success_and_nothing_is_left(
        self, launch: Result
    ) -> None:
        assert launch.returncode == 0, pool_logs(launch)
        assert set(states(launch.root).values()) == {"success"}, states(launch.root)
        assert len(states(launch.root)) == TRIALS
        assert launch.left_alive == [], f"left alive: {launch.left_alive}\n{pool_logs(launch)}"

    def test_some_trial_was_promoted(self, launch: Result) -> None:
        assert promotions(launch), (states(launch.root), pool_logs(launch))

    def test_a_promoted_trial_ran_on_more_ranks_than_its_lower_rung(self, launch: Result) -> None:
        for promoted, lower, _ in promotions(launch):
            low, high = seen_by_rank(launch.root, lower), seen_by_rank(launch.root, promoted)
            assert [s["world_size"] for s in low] == [1], (lower, low)
            assert [(s["rank"], s["world_size"]) for s in high] == [(0, 2), (1, 2)], high

    def test_every_rank_of_a_promoted_trial_loaded_its_lower_rungs_checkpoint(
        self, launch: Result
    ) -> None:
        for promoted, _, lower_dir in promotions(launch):
            checkpoint = lower_dir / self.CHECKPOINT
            assert checkpoint.is_file(), checkpoint
            for seen in seen_by_rank(launch.root, promoted):
                assert seen[self.LOADED] == str(checkpoint), (promoted, seen)

    def test_the_step_counter_goes_on_where_the_lower_rung_ended_on_every_rank(
        self, launch: Result
    ) -> None:
        for promoted, lower, _ in promotions(launch):
            (low,) = seen_by_rank(launch.root, lower)
            high = seen_by_rank(launch.root, promoted)
            assert low["end_step"] > 0, low
            assert [s["start_step"] for s in high] == [low["end_step"]] * 2, (low, high)
            assert len({s["end_step"] for s in high}) == 1, high
            assert high[0]["end_step"] > low["end_step"], (low, high)

    def test_every_trial_ran_on_as_many_ranks_as_its_placement_has_devices(
        self, launch: Result
    ) -> None:
        """The placement the pool's picture draws each trial's bars from is the group that
        trained it."""
        for trial in states(launch.root):
            placed = trial_placement.read(launch.root / "configs" / f"config_{trial}")
            assert placed is not None, trial
            seen = seen_by_rank(launch.root, trial)
            assert len(seen) == len(placed.devices), (trial, placed, seen)

    def test_a_trial_that_continues_nothing_starts_at_step_0(self, launch: Result) -> None:
        """The positive control of the test above: the counter is the trial's own."""
        promoted = {p for p, _, _ in promotions(launch)}
        fresh = [t for t in states(launch.root) if t not in promoted]
        assert fresh
        for trial in fresh:
            (seen,) = seen_by_rank(launch.root, trial)
            assert (seen["start_step"], seen[self.LOADED]) == (0, None), (trial, seen)


class TestLightningPromotionResumesItsCheckpointOnTwoRanks(PromotionChecks, PoolPictureChecks):
    """``examples/pool_promotion.py``, as its docstring says; and ``neps-bcast status
    --plot``'s picture of this pool (``PoolPictureChecks``, tests/e2e/test_e2e_plot.py:
    its trials take 1 rank or 2, as a pool's picture needs)."""

    CHECKPOINT = "last.ckpt"
    LOADED = "resumed_from"

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        tmp = tmp_path_factory.mktemp("promotion_lightning")
        return launch_pool(tmp, REPO / "examples" / "pool_promotion.py")


class TestPlainDdpPromotionLoadsItsCheckpointOnEveryRank(PromotionChecks):
    """``tests/scripts/pool_promotion_ddp.py``: rank 0 saved, every rank loads."""

    CHECKPOINT = "checkpoint.pt"
    LOADED = "loaded"

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        tmp = tmp_path_factory.mktemp("promotion_ddp")
        return launch_pool(tmp, SCRIPTS / "pool_promotion_ddp.py")

    def test_every_rank_started_from_the_lower_rungs_weights(self, launch: Result) -> None:
        """Loaded by each rank itself (recorded before DDP's broadcast from rank 0)."""
        for promoted, lower, _ in promotions(launch):
            (low,) = seen_by_rank(launch.root, lower)
            high = seen_by_rank(launch.root, promoted)
            assert [s["start_weights"] for s in high] == [low["end_weights"]] * 2, (low, high)
