"""``neps-bcast launch --pool 4`` end to end: right-sized trials on a pool of 4 CPU ranks.

Real launcher, real NePS (4 agents on one root), real gloo groups formed per trial by
PyTorch's tutorial code (``tests/scripts/pool_search.py``: each trial's size is its
config's ``ranks``, 1, 2 or 4; every rank records what it trained, when, on which
device). Each class runs one launch (or two) and its tests read what it left. Every
process of a launch inherits the harness's marker: that is how a test finds what is
left.
"""

from __future__ import annotations

import itertools
import json
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from harness import SCRIPTS, Result, Running, pool_launch, start, states
from neps_bcast.compat import procfs
from neps_bcast.recovery.lease_file import read_lease

SCRIPT = SCRIPTS / "pool_search.py"
POOL = 4


def pool_command(
    tmp_path: Path, name: str, trials: int, pool: int = POOL, extra: tuple[str, ...] = ()
) -> list[str]:
    """The launch (its logs under ``tmp_path/name``); the NePS root is ``tmp_path/root``,
    the same for every launch of a test; ``extra``: more of the launcher's options."""
    options = (*extra, "--status-interval", "2")
    return pool_launch(tmp_path, SCRIPT, trials, pool=pool, name=name, options=options)


def start_pool(
    tmp_path: Path,
    name: str,
    trials: int,
    pool: int = POOL,
    extra: tuple[str, ...] = (),
    **env: str,
) -> Running:
    return start(
        pool_command(tmp_path, name, trials, pool, extra),
        tmp_path,
        name=name,
        env={"POOL_RECORD": str(tmp_path / name / "rec"), **env},
        timeout=420.0,
    )


def pool_logs(folder: Path) -> str:
    return "\n".join(
        f"--- {path.name} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-30:])
        for path in sorted(folder.glob("**/pool/*.log"))
    )


def trained(events: list[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(trial, attempt) -> the "trained" record of each rank."""
    found: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["event"] == "trained":
            found[(e["trial"], e["attempt"])].append(e)
    return dict(found)


def overlapping(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return bool(a["start"] < b["end"] and b["start"] < a["end"])


def assert_nothing_left(result: Result, folder: Path) -> None:
    assert result.left_alive == [], f"left alive: {result.left_alive}\n{pool_logs(folder)}"


# -- trials of sizes 1, 2 and 4, side by side where they fit --------------------------------
class TestAPoolRunsTrialsOfTheirOwnSize:
    """With more agents than devices (``--agents``): trials are sampled ahead of free devices."""

    TRIALS = 12
    AGENTS = 6

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
        tmp = tmp_path_factory.mktemp("pool")
        agents = ("--agents", str(self.AGENTS))
        result = start_pool(tmp, "run", self.TRIALS, extra=agents, POOL_SLOW="1").finish()
        return result, tmp

    def test_the_pool_started_as_many_agents_as_asked(self, launch: tuple[Result, Path]) -> None:
        result, tmp = launch
        assert f"pool of {POOL} ranks on CPU and {self.AGENTS} agents;" in result.log
        agents = sorted(path.name for path in (tmp / "run" / "logs" / "pool").glob("agent*.log"))
        assert agents == [f"agent{i}.log" for i in range(self.AGENTS)]

    def test_the_launcher_exits_0_and_nothing_is_left(self, launch: tuple[Result, Path]) -> None:
        result, tmp = launch
        assert result.returncode == 0, pool_logs(tmp)
        assert_nothing_left(result, tmp)

    def test_neps_records_every_trial_once_as_a_success(self, launch: tuple[Result, Path]) -> None:
        result, tmp = launch
        assert states(result.root) == {str(i): "success" for i in range(1, self.TRIALS + 1)}
        assert sorted(t for t, _ in trained(result.events)) == sorted(
            str(i) for i in range(1, self.TRIALS + 1)
        ), pool_logs(tmp)

    def test_each_trial_ran_on_as_many_ranks_as_its_config_says(
        self, launch: tuple[Result, Path]
    ) -> None:
        for (trial, _), ranks in trained(launch[0].events).items():
            size = ranks[0]["config_ranks"]
            assert size in (1, 2, 4)
            assert sorted(e["rank"] for e in ranks) == list(range(size)), (trial, ranks)
            assert {e["world"] for e in ranks} == {size}, (trial, ranks)
            assert len({e["pid"] for e in ranks}) == size, (trial, ranks)

    def test_every_trials_ranks_agree(self, launch: tuple[Result, Path]) -> None:
        """The same trial, trained in step: the same weights on every rank at its end."""
        for trial, ranks in trained(launch[0].events).items():
            assert len({round(e["weight"], 6) for e in ranks}) == 1, (trial, ranks)

    def test_each_rank_has_a_device_of_its_own_and_no_two_running_trials_share_one(
        self, launch: tuple[Result, Path]
    ) -> None:
        records = [e for ranks in trained(launch[0].events).values() for e in ranks]
        for e in records:
            assert e["devices"] == e["world"]  # on CPU: Trainer(devices=trial.devices) = ranks
        by_trial: dict[str, set[int]] = defaultdict(set)
        for e in records:
            by_trial[e["trial"]].add(e["device"])
        for trial, devices in by_trial.items():
            assert len(devices) == len([e for e in records if e["trial"] == trial]), trial
            assert devices <= set(range(POOL)), trial
        for a, b in itertools.combinations(records, 2):
            if a["trial"] != b["trial"] and a["device"] == b["device"]:
                assert not overlapping(a, b), (a, b)
            if a["trial"] != b["trial"] and a["pid"] == b["pid"]:
                assert not overlapping(a, b), (a, b)

    def test_trials_ran_side_by_side(self, launch: tuple[Result, Path]) -> None:
        """The positive control of the test above: some trials did overlap in time."""
        records = [e for ranks in trained(launch[0].events).values() for e in ranks]
        assert any(
            a["trial"] != b["trial"] and overlapping(a, b)
            for a, b in itertools.combinations(records, 2)
        )

    def test_warm_ranks_took_several_trials_each(self, launch: tuple[Result, Path]) -> None:
        """Ranks are regrouped per trial, not started per trial: 4 processes did it all."""
        records = [e for ranks in trained(launch[0].events).values() for e in ranks]
        assert len({e["pid"] for e in records}) == POOL, {e["pid"] for e in records}


# -- a rule that asks for more ranks than the pool has: refused before the search ----------
class TestARuleTooWideForThePoolStopsTheLaunchBeforeTheSearch:
    """The script's trials take up to 4 ranks (its config's ``ranks``), the pool has 2:
    every agent refuses the rule on the space's corners before ``neps.run``, while the
    ranks may still be importing. The launch ends saying why; no trial was sampled,
    nothing is left."""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
        tmp = tmp_path_factory.mktemp("pool_too_wide")
        return start_pool(tmp, "run", 4, pool=2).finish(), tmp

    def test_the_launcher_exits_1_naming_the_rule_and_the_fix(
        self, launch: tuple[Result, Path]
    ) -> None:
        result, tmp = launch
        assert result.returncode == 1, pool_logs(tmp)
        assert "before the search starts: ranks_per_trial returned 4" in result.log, result.log[
            -3000:
        ]
        assert "neps-bcast launch --pool D" in result.log

    def test_no_trial_was_sampled_and_nothing_is_left(self, launch: tuple[Result, Path]) -> None:
        result, tmp = launch
        assert not result.root.exists()  # no agent reached neps.run
        assert_nothing_left(result, tmp)


# -- Lightning Fabric in the pool, as its docs write it ---------------------------------
class TestFabricTrialsInAPool:
    """``tests/scripts/fabric_search.py --pool-sized``: ``L.Fabric(devices=trial.devices,
    strategy="ddp")`` and ``fabric.launch()`` inside the session, each trial on 1 or 2
    of a pool of 2 ranks by its config's ``hidden``."""

    TRIALS = 6

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path]:
        tmp = tmp_path_factory.mktemp("pool_fabric")
        command = pool_launch(tmp, SCRIPTS / "fabric_search.py", self.TRIALS, "--pool-sized")
        return start(command, tmp, name="run", timeout=420.0).finish(), tmp

    def test_every_trial_is_a_success_and_nothing_is_left(
        self, launch: tuple[Result, Path]
    ) -> None:
        result, tmp = launch
        assert result.returncode == 0, pool_logs(tmp)
        assert states(result.root) == {str(i): "success" for i in range(1, self.TRIALS + 1)}
        assert_nothing_left(result, tmp)

    def test_each_trial_ran_on_its_size_with_one_config_on_every_rank(
        self, launch: tuple[Result, Path]
    ) -> None:
        by_trial: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for e in launch[0].events:
            if e["event"] == "trial":
                by_trial[e["trial_id"]].append(e)
        assert sorted(by_trial) == sorted(str(i) for i in range(1, self.TRIALS + 1))
        for trial, ranks in by_trial.items():
            size = 1 if ranks[0]["config"]["hidden"] <= 8 else 2
            assert sorted(e["rank"] for e in ranks) == list(range(size)), (trial, ranks)
            # world_size is None until a process group exists (Fabric forms none for 1)
            assert {e["world_size"] for e in ranks} == {size if size > 1 else None}, ranks
            assert len({json.dumps(e["config"], sort_keys=True) for e in ranks}) == 1, ranks


# -- one rank of one trial SIGKILLed while other trials run ------------------------------
class TestARankKilledInATrialPutsOnlyThatTrialBack:
    TRIALS = 8

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> tuple[Result, Path, str, int]:
        tmp = tmp_path_factory.mktemp("pool_kill")
        running = start_pool(tmp, "run", self.TRIALS, POOL_SLOW="3")

        def a_trial_of_two_or_more(events: list[dict[str, Any]]) -> dict[str, Any] | None:
            started = [e for e in events if e["event"] == "started"]
            done = {(e["trial"], e["rank"]) for e in events if e["event"] == "trained"}
            return next(
                (
                    e
                    for e in started
                    if e["world"] >= 2
                    and e["rank"] == 1
                    and (e["trial"], e["rank"]) not in done
                    and e["attempt"] == 1
                ),
                None,
            )

        # Bounded by the launch's deadline: 8 processes import torch and NePS first.
        victim = running.wait_for(
            "a rank 1 training a trial of 2 or 4", a_trial_of_two_or_more, timeout=360
        )
        procfs.kill(victim["pid"], signal.SIGKILL)
        return running.finish(), tmp, victim["trial"], victim["pid"]

    def test_the_search_completes_every_trial_a_success(
        self, launch: tuple[Result, Path, str, int]
    ) -> None:
        result, tmp, _, _ = launch
        assert result.returncode == 0, pool_logs(tmp)
        assert states(result.root) == {str(i): "success" for i in range(1, self.TRIALS + 1)}
        assert_nothing_left(result, tmp)

    def test_the_killed_trial_went_back_to_pending_and_ran_again(
        self, launch: tuple[Result, Path, str, int]
    ) -> None:
        result, _, victim, _ = launch
        runs = trained(result.events)
        assert (victim, 2) in runs, sorted(runs)
        lease = read_lease(result.root / "configs" / f"config_{victim}")
        assert lease is not None
        assert len(lease.attempts) == 1, lease

    def test_no_other_trial_was_affected(self, launch: tuple[Result, Path, str, int]) -> None:
        result, _, victim, _ = launch
        for (trial, attempt), ranks in trained(result.events).items():
            if trial != victim:
                assert attempt == 1, (trial, ranks)
                assert len(ranks) == ranks[0]["world"], (trial, ranks)

    def test_a_fresh_rank_took_the_killed_ones_device(
        self, launch: tuple[Result, Path, str, int]
    ) -> None:
        result, _, victim, pid = launch
        assert "a fresh one takes its device" in result.rank_logs["launcher"]
        # The killed process may have trained other trials before the victim's (a warm rank).
        killed_in = max(
            e["t"]
            for e in result.events
            if e["event"] == "started" and e["pid"] == pid and e["trial"] == victim
        )
        later = [
            e
            for e in result.events
            if e["event"] == "trained" and e["pid"] == pid and e["t"] > killed_in
        ]
        assert later == [], later


# -- SIGTERM to the launcher, then the same command again ------------------------------------
class TestSigtermToThePoolPutsRunningTrialsBackAndTheSameCommandFinishes:
    TRIALS = 8

    @pytest.fixture(scope="class")
    def launches(
        self, tmp_path_factory: pytest.TempPathFactory
    ) -> tuple[Result, dict[str, str], set[str], Result]:
        tmp = tmp_path_factory.mktemp("pool_term")
        first = start_pool(tmp, "first", self.TRIALS, POOL_SLOW="4")

        def training(events: list[dict[str, Any]]) -> set[str] | None:
            started = {e["trial"] for e in events if e["event"] == "started"}
            done = {e["trial"] for e in events if e["event"] == "trained"}
            return (started - done) or None

        running = first.wait_for("a trial training", training, timeout=360)
        procfs.kill(first.proc.pid, signal.SIGTERM)
        stopped = first.finish()
        after_stop = states(stopped.root)
        again = start_pool(tmp, "again", self.TRIALS).finish()
        return stopped, after_stop, running, again

    def test_the_launcher_exits_143_and_nothing_is_left(
        self, launches: tuple[Result, dict[str, str], set[str], Result]
    ) -> None:
        stopped = launches[0]
        assert stopped.returncode == 143, stopped.tail()
        assert stopped.left_alive == []

    def test_every_trial_that_was_running_is_back_to_pending(
        self, launches: tuple[Result, dict[str, str], set[str], Result]
    ) -> None:
        _, after_stop, running, _ = launches
        assert "evaluating" not in after_stop.values(), after_stop
        for trial in running:
            assert after_stop[trial] == "pending", after_stop

    def test_the_same_command_again_finishes_the_budget(
        self, launches: tuple[Result, dict[str, str], set[str], Result]
    ) -> None:
        again = launches[3]
        assert again.returncode == 0, again.tail()
        assert states(again.root) == {str(i): "success" for i in range(1, self.TRIALS + 1)}
        assert again.left_alive == []
