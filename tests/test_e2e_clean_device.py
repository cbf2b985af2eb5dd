"""Each trial starts on a clean device: no rank holds a weight-sized tensor of an earlier
trial when the next trial's function starts, and its memory stays flat.

Every rank runs trials back to back in one process; a finished trial's model, gradients
and Adam state are cyclic garbage (Trainer <-> LightningModule, DDP's reducer) that
Python frees only when its object counts trigger a collection, which a few huge tensors
never do. Measured before the clean start (``ddp.teardown.free_what_trials_left``): 0,
4, 8, 12 weight-sized tensors at the starts of trials 1 to 4 on every rank, RSS growing
by ~150 MB a trial. Two launches, one per shape: Lightning ``strategy="ddp"`` on 2 ranks
(``python script.py``: Lightning starts the follower) and ``neps-bcast launch --pool 2``
with trials of 2 ranks (``tests/scripts/weights_search.py``: a 3000 x 3000 Linear with
Adam, 36 MB a weight).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from harness import PYTHON, SCRIPTS, CleanLaunch, Result, python, run, states

SCRIPT = SCRIPTS / "weights_search.py"
NEPS_BCAST = str(Path(PYTHON).with_name("neps-bcast"))
SIZE = 3000
TRIALS = 4
WEIGHT_BYTES = SIZE * SIZE * 4
RSS_GROWTH_BOUND = 2 * WEIGHT_BYTES
"""From trial 2 on, a rank's RSS at a trial's start may exceed its RSS at trial 2's
start by less than two weights (allocator noise); one leaked trial is ~3 weights (the weight, Adam's
two moments), measured +110 MB."""


def heaps(result: Result, where: str) -> dict[int, list[dict[str, Any]]]:
    """pid -> its "heap" records at ``where`` ("start", "trained"), in trial order."""
    found: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in result.of("heap"):
        if e["where"] == where:
            found[e["pid"]].append(e)
    return {pid: sorted(es, key=lambda e: e["seq"]) for pid, es in found.items()}


class CleanStarts(CleanLaunch):
    """The checks of both shapes; a class provides ``launch`` and ``RANKS``."""

    RANKS = 2

    def test_every_trial_is_a_success_on_every_rank(self, launch: Result) -> None:
        assert states(launch.root) == {str(i): "success" for i in range(1, TRIALS + 1)}
        starts = heaps(launch, "start")
        assert len(starts) == self.RANKS, (starts, launch.tail())
        for pid, records in starts.items():
            assert [e["seq"] for e in records] == list(range(1, TRIALS + 1)), (pid, records)

    def test_no_rank_holds_a_weight_sized_tensor_of_an_earlier_trial_at_a_trials_start(
        self, launch: Result
    ) -> None:
        counts = {pid: [e["big_tensors"] for e in es] for pid, es in heaps(launch, "start").items()}
        assert counts, launch.tail()
        for pid, each in counts.items():
            assert each == [0] * TRIALS, f"pid {pid}: weight-sized tensors at each start {each}"

    def test_the_count_sees_the_trials_own_weights(self, launch: Result) -> None:
        """The positive control: after its fit a rank holds the weight and Adam's two
        moments (Lightning sets the gradients to None after the step), 3 weight-sized
        tensors at least."""
        trained = heaps(launch, "trained")
        assert len(trained) == self.RANKS, launch.tail()
        for pid, es in trained.items():
            assert [e["big_tensors"] >= 3 for e in es] == [True] * TRIALS, (pid, es)

    def test_rss_is_flat_from_the_second_trial_on(self, launch: Result) -> None:
        for pid, es in heaps(launch, "start").items():
            rss = [e["rss"] for e in es]
            growth = max(rss[1:]) - rss[1]
            assert growth < RSS_GROWTH_BOUND, (
                f"pid {pid}: RSS at each trial's start {[r // 2**20 for r in rss]} MB grew"
                f" {growth // 2**20} MB from trial 2 on (bound {RSS_GROWTH_BOUND // 2**20} MB)"
            )


class TestLightningDdpRanksStartEachTrialClean(CleanStarts):
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = python(SCRIPT, "--devices", 2, "--trials", TRIALS, "--size", SIZE)
        return run(command, tmp_path_factory.mktemp("clean_lightning"), timeout=360.0)


class TestPoolRanksStartEachTrialClean(CleanStarts):
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        tmp = tmp_path_factory.mktemp("clean_pool")
        command = [
            NEPS_BCAST,
            "launch",
            "--pool",
            "2",
            "--log-dir",
            str(tmp / "run" / "logs"),
            str(SCRIPT),
            "--pool-ranks",
            "2",
            "--trials",
            str(TRIALS),
            "--size",
            str(SIZE),
            "--root",
            str(tmp / "root"),
        ]
        return run(command, tmp, timeout=420.0)

    def test_the_agents_had_no_gpu_and_never_initialised_cuda(self, launch: Result) -> None:
        """Every agent ran with ``CUDA_VISIBLE_DEVICES=""``; the ranks did not (the
        positive control: the launcher sets it for agents only)."""
        exits = launch.of("exit")
        agents = [e for e in exits if e["pool_role"] == "agent"]
        ranks = [e for e in exits if e["pool_role"] == "rank"]
        assert len(agents) == 2, exits
        assert len(ranks) == 2, exits
        assert all(e["cuda_visible"] == "" and not e["cuda_initialized"] for e in agents), agents
        assert all(e["cuda_visible"] != "" for e in ranks), ranks
