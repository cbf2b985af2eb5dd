"""A pool's devices end to end: a rank proves its device before it counts as free, and a
device whose rank keeps failing there is retired instead of failing every trial placed
on it (``neps-bcast launch --pool 2``, ``tests/scripts/weights_search.py``, whose
``NB_BROKEN_DEVICES`` makes a device fail at the library's ``device`` fault point each
time a rank starts on it). Before this, such a rank was restarted for ever and the launch
never ended. Two launches: one broken device of two (the search finishes on the other),
and every device broken (the launch ends with a clear error, nothing left).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import SCRIPTS, Result, assert_nothing_left, pool_launch, start, states

SCRIPT = SCRIPTS / "weights_search.py"
TRIALS = 4


def launch_pool(tmp: Path, broken: str) -> Result:
    command = pool_launch(tmp, SCRIPT, TRIALS, "--pool-ranks", "1", "--size", "64")
    env = {"NB_BROKEN_DEVICES": broken}
    if broken != "all":  # the trials wait for the retirement: the search outlasts it
        env["NB_WAIT_FOR"] = f"{tmp / 'run' / 'launcher.log'}::is retired"
    return start(command, tmp, env=env, timeout=420.0).finish()


def broken_starts(result: Result, device: int) -> int:
    return sum(
        1 for e in result.of("fault") if e["kind"] == "broken_device" and e["device"] == device
    )


class TestABrokenDeviceIsRetiredAndTheSearchFinishesOnTheOthers:
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        return launch_pool(tmp_path_factory.mktemp("pool_broken_one"), "1")

    def test_the_launch_exits_0_and_nothing_is_left(self, launch: Result) -> None:
        assert launch.returncode == 0, launch.tail()
        assert_nothing_left(launch)

    def test_device_1_failed_three_starts_and_was_retired_with_the_reason(
        self, launch: Result
    ) -> None:
        assert broken_starts(launch, 1) == 3, launch.tail()  # no fourth rank for it
        assert (
            "[neps_bcast launch] device 1 is retired: its rank failed to start 3 times in a"
            " row (exit codes 1, 1, 1; expected it to prove its device and say hello); 1 of"
            " 2 device(s) left." in launch.log
        ), launch.tail()

    def test_the_working_device_proved_itself_and_ran_every_trial(self, launch: Result) -> None:
        assert broken_starts(launch, 0) == 0  # the positive control: device 0 never failed
        assert states(launch.root) == {str(i): "success" for i in range(1, TRIALS + 1)}
        trained = {e["pid"] for e in launch.of("trained")}
        assert len(trained) == 1, trained  # one warm rank, device 0's

    def test_the_agents_had_no_gpu_and_never_initialised_cuda(self, launch: Result) -> None:
        agents = [e for e in launch.of("exit") if e["pool_role"] == "agent"]
        assert len(agents) == 2, launch.of("exit")
        assert all(e["cuda_visible"] == "" and not e["cuda_initialized"] for e in agents), agents


class TestWithEveryDeviceBrokenTheLaunchEndsWithAClearError:
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        return launch_pool(tmp_path_factory.mktemp("pool_broken_all"), "all")

    def test_the_launch_exits_1_naming_every_device_and_the_fix(self, launch: Result) -> None:
        assert launch.returncode == 1, launch.tail()
        assert (
            "[neps_bcast launch] no device of the pool is left (device 0: its rank failed to"
            " start 3 times in a row, exit codes 1, 1, 1; device 1: its rank failed to start"
            " 3 times in a row, exit codes 1, 1, 1): no trial can run, so the launch ends."
            " HINT: see the ranks' logs in" in launch.rank_logs["launcher"]
        ), launch.rank_logs["launcher"][-3000:]

    def test_nothing_is_left_and_no_trial_is_left_evaluating(self, launch: Result) -> None:
        assert_nothing_left(launch)
        assert broken_starts(launch, 0) == broken_starts(launch, 1) == 3
        if launch.root.exists():  # an agent may have sampled a trial before the end
            assert "evaluating" not in states(launch.root).values(), states(launch.root)
