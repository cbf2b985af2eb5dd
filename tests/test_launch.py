"""Role detection under a patched environment, and the startup fingerprint (no processes)."""

from __future__ import annotations

import neps
import pytest

from neps_bcast.errors import LaunchError
from neps_bcast.startup.launch import detect
from neps_bcast.startup.rendezvous import fingerprint


def test_torchrun_environment_is_external() -> None:
    env = {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "1234",
    }
    launch = detect(env)
    assert (
        launch.kind,
        launch.launcher,
        launch.global_rank,
        launch.world_size,
        launch.local_rank,
        launch.node_rank,
    ) == ("external", "torchelastic", 3, 4, 1, 1)
    assert (launch.main_address, launch.main_port) == ("node0", 1234)


def test_slurm_environment_is_external() -> None:
    env = {
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "2",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "hpo",
        "SLURM_NODELIST": "localhost",
        "MASTER_PORT": "4321",
    }
    launch = detect(env)
    assert (
        launch.kind,
        launch.launcher,
        launch.global_rank,
        launch.world_size,
        launch.node_rank,
    ) == ("external", "slurm", 2, 4, 1)
    assert launch.main_port == 4321


def test_torchrun_inside_slurm_is_torchrun() -> None:
    env = {
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_JOB_NAME": "hpo",
        "SLURM_NODELIST": "localhost",
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "a",
        "MASTER_PORT": "1",
    }
    assert detect(env).launcher == "torchelastic"


def test_interactive_slurm_shell_is_single() -> None:
    env = {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NAME": "bash"}
    assert detect(env).kind == "single"


def test_local_rank_without_launcher_fails_naming_variables() -> None:
    with pytest.raises(LaunchError, match=r"LOCAL_RANK=1 but neither a launcher \(torchrun"):
        detect({"LOCAL_RANK": "1"})


def test_fingerprint_ignores_object_identity_but_not_values() -> None:
    class Space(neps.PipelineSpace):
        lr = neps.Float(1e-3, 1e-1, log=True)
        act = neps.Categorical(("relu", "tanh"))

    class Other(neps.PipelineSpace):
        lr = neps.Float(1e-3, 1e-2, log=True)
        act = neps.Categorical(("relu", "tanh"))

    def fn(lr: float, act: str) -> float:
        return lr

    a = fingerprint(fn, Space(), {"root_directory": "r", "optimizer": "random_search"})
    assert a == fingerprint(fn, Space(), {"root_directory": "r", "optimizer": "random_search"})
    assert "0x" not in a["pipeline_space"]
    b = fingerprint(fn, Other(), {"root_directory": "r", "optimizer": "random_search"})
    assert a["pipeline_space"] != b["pipeline_space"]


def test_a_space_with_huge_choices_makes_a_short_fingerprint_that_still_tells_them_apart() -> None:
    """A 1 MB categorical value made a 1.1 MB start-up record, which every rank refused
    (the benchmark's sweep of trial sizes stopped before trial 1)."""

    def space(fill: str) -> neps.PipelineSpace:
        attrs = {"payload": neps.Categorical((fill * 1_000_000, "q"))}
        return type("Space", (neps.PipelineSpace,), attrs)()

    def fn(payload: str) -> float:
        return 0.0

    a = fingerprint(fn, space("p"), {"root_directory": "r"})
    assert len(a["pipeline_space"]) < 1000, len(a["pipeline_space"])
    assert a == fingerprint(fn, space("p"), {"root_directory": "r"})
    assert a != fingerprint(fn, space("x"), {"root_directory": "r"})
