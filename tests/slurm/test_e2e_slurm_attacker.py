"""Another user of the node attacks a search that a real srun starts (the one-node SLURM
of ``make test-slurm``), from before its first rank starts to after its last one exits.

The same attack as tests/e2e/test_e2e_attacker.py (see tests/outsider.py): the outsider,
as ``nobody``, plants a secret file and its path, forges the ``leader`` record, writes
pickles that would create a file under every key neps_bcast uses in the rendezvous
store rank 0 serves on ``MASTER_PORT`` and in the leader's store, and replays what it
recorded from an earlier search with the same ``NEPS_BCAST_SECRET``. The job is
tests/slurm/attacker.sbatch: ``srun`` starts both ranks of
tests/scripts/attacker_search.py (trial 2 fails on rank 1).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import outsider as o
from harness import PYTHON
from ports import HeldPort

HERE = Path(__file__).parent
SBATCH = HERE / "attacker.sbatch"
SLURM_DIR = Path(os.environ.get("NEPS_BCAST_SLURM_DIR", "/tmp/neps_bcast_slurm"))
SLURM_CONF = os.environ.get("SLURM_CONF", str(SLURM_DIR / "slurm.conf"))
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
JOB_S = 300.0


def scontrol_job(job_id: str) -> dict[str, str]:
    done = subprocess.run(
        ["scontrol", "show", "job", "--oneliner", job_id],
        env={**os.environ, "SLURM_CONF": SLURM_CONF},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", done.stdout))


def srun_job(attack: o.Attack) -> Callable[[], int]:
    """Submit the job (its environment is the launch's), return how to wait for it. Its
    MASTER_PORT is held until the wait is over."""
    port = HeldPort()
    try:
        env = attack.env()
        env.update(SLURM_CONF=SLURM_CONF, MASTER_PORT=str(port.number))
        output = attack.log_dir / "job.out"
        submitted = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--chdir={attack.folder}",
                f"--output={output}",
                str(SBATCH),
                PYTHON,
                str(o.SEARCH_SCRIPT),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert submitted.returncode == 0, f"sbatch failed: {submitted.stderr}"
    except BaseException:
        port.release()
        raise
    job_id = submitted.stdout.strip().split(";")[0]

    def wait() -> int:
        with port:
            deadline = time.monotonic() + JOB_S
            while time.monotonic() < deadline:
                info = scontrol_job(job_id)
                if info.get("JobState") in DONE:
                    completed = info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0"
                    return 0 if completed else 1
                time.sleep(0.5)  # a bounded poll of SLURM
            subprocess.run(
                ["scancel", job_id], env={**os.environ, "SLURM_CONF": SLURM_CONF}, check=False
            )
            raise AssertionError(f"job {job_id} not done within {JOB_S} s: {scontrol_job(job_id)}")

    return wait


@pytest.fixture(scope="module", autouse=True)
def test_cluster() -> None:
    assert Path(SLURM_CONF).exists(), (
        f"no test cluster ({SLURM_CONF} missing): run `make test-slurm`, which starts it"
    )


@pytest.fixture(scope="class")
def arena() -> Iterator[o.Arena]:
    with o.Arena.made() as made:
        yield made


class AttackedJobThatCompletes:
    def test_the_outsider_was_another_user_attacking_from_before_the_start(
        self, attacked: o.Attack
    ) -> None:
        o.assert_the_outsider_attacked_from_before_the_start(attacked)

    def test_it_reached_the_rendezvous_store_and_the_leaders_store(
        self, attacked: o.Attack
    ) -> None:
        o.assert_it_reached_both_stores(attacked)

    def test_a_rank_refused_what_it_wrote_naming_the_key(self, attacked: o.Attack) -> None:
        o.assert_a_rank_refused_a_forged_value(attacked)

    def test_no_pickle_of_the_outsider_ran(self, attacked: o.Attack) -> None:
        o.assert_no_pickle_of_the_outsider_ran(attacked)

    def test_its_pickle_does_create_the_file_when_unpickled(self, attacked: o.Attack) -> None:
        """The positive control of the test above."""
        assert o.the_bomb_creates_the_marker(attacked.arena)

    def test_the_search_completed_with_every_trials_real_result(self, attacked: o.Attack) -> None:
        o.assert_completed_with_every_real_result(attacked)

    def test_both_ranks_were_srun_tasks(self, attacked: o.Attack) -> None:
        starts = attacked.result.of("start")
        assert sorted((e["rank"], e["rank_from"]) for e in starts) == [
            (0, "SLURM_PROCID"),
            (1, "SLURM_PROCID"),
        ], starts
        assert "[neps_bcast rank 1/2 follower]" in attacked.result.logs, attacked.result.tail()

    def test_nothing_is_left_running(self, attacked: o.Attack) -> None:
        o.assert_nothing_left_running(attacked)


class TestSrunWithTheSameSecret(AttackedJobThatCompletes):
    """The full attack on a first job (recording everything), then a replay of that
    recording only on a second job with the same NEPS_BCAST_SECRET."""

    @pytest.fixture(scope="class")
    def searches(
        self, arena: o.Arena, tmp_path_factory: pytest.TempPathFactory
    ) -> tuple[o.Attack, o.Attack]:
        tmp = tmp_path_factory.mktemp("srun_secret")
        first = o.Attack(arena, tmp / "first", o.SECRET).run(srun_job)
        recorded = arena.work / "first.recorded.json"
        replay = o.Attack(arena, tmp / "replayed", o.SECRET, ("--replay", str(recorded)))
        return first, replay.run(srun_job)

    @pytest.fixture(scope="class", params=["full attack", "replay of the first job"])
    def attacked(
        self, request: pytest.FixtureRequest, searches: tuple[o.Attack, o.Attack]
    ) -> o.Attack:
        return searches[0] if request.param == "full attack" else searches[1]

    def test_the_replay_had_genuine_values_to_replay(
        self, searches: tuple[o.Attack, o.Attack]
    ) -> None:
        recorded = json.loads((searches[0].arena.work / "first.recorded.json").read_text())
        # Every genuine value of the first search was recorded (the outsider reads each
        # key before it overwrites it, atomically): the peers' records and the error board.
        for key in ("neps_bcast/rank/0", "neps_bcast/rank/1", "neps_bcast/err/2/1"):
            assert key in recorded, sorted(recorded)
        assert any(k.startswith("neps_bcast/meet/") for k in recorded), sorted(recorded)
        assert searches[1].report["replays"] > 0, searches[1].report


class TestSrunWithoutASecret(AttackedJobThatCompletes):
    @pytest.fixture(scope="class")
    def attacked(self, arena: o.Arena, tmp_path_factory: pytest.TempPathFactory) -> o.Attack:
        folder = tmp_path_factory.mktemp("srun_no_secret") / "run"
        return o.Attack(arena, folder, None).run(srun_job)


class TestSrunWithoutASecretWhenTheOutsiderTookThePrivateFolder:
    @pytest.fixture(scope="class")
    def attacked(self, arena: o.Arena, tmp_path_factory: pytest.TempPathFactory) -> o.Attack:
        folder = tmp_path_factory.mktemp("srun_taken") / "run"
        plant = ("--plant-private-dir", str(arena.private_dir))
        return o.Attack(arena, folder, None, plant).run(srun_job)

    def test_every_rank_stops_before_trial_1_naming_the_folder(self, attacked: o.Attack) -> None:
        o.assert_stopped_before_trial_1(
            attacked, f"rank 0: refused the private directory {attacked.arena.private_dir}:"
        )

    def test_no_pickle_of_the_outsider_ran(self, attacked: o.Attack) -> None:
        o.assert_no_pickle_of_the_outsider_ran(attacked)

    def test_nothing_is_left_running(self, attacked: o.Attack) -> None:
        o.assert_nothing_left_running(attacked)
