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


LIGHTNING_AGREES = {
    "torchrun": {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    },
    "srun, a node range": {
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NAME": "hpo",
        "SLURM_NODELIST": "gpu[05-09],cpu1",
    },
    "srun, one node, MASTER_ADDR given": {
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NAME": "hpo",
        "SLURM_NODELIST": "gpu[7]",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "4444",
    },
    "RANK/WORLD_SIZE by hand": {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "5555",
    },
}


@pytest.mark.parametrize("case", LIGHTNING_AGREES)
def test_detection_reads_each_launcher_as_lightnings_cluster_environment_does(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Detection reads the launchers' variables itself (no Lightning import on a rank);
    Lightning's cluster environments are the reference it must agree with."""
    from lightning.fabric.plugins.environments import (
        LightningEnvironment,
        SLURMEnvironment,
        TorchElasticEnvironment,
    )

    env = LIGHTNING_AGREES[case]
    for name in [n for n in __import__("os").environ if n.startswith(("SLURM_", "TORCHELASTIC"))]:
        monkeypatch.delenv(name)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = detect(dict(env))
    cluster = next(
        c
        for c in (TorchElasticEnvironment, SLURMEnvironment, LightningEnvironment)
        if c.detect() or c is LightningEnvironment
    )()
    assert (
        launch.global_rank,
        launch.world_size,
        launch.local_rank,
        launch.node_rank,
        launch.main_address,
        launch.main_port,
    ) == (
        # Lightning's own environment learns rank and world from its strategy, and
        # detection always read them from RANK and WORLD_SIZE there
        int(env["RANK"]) if isinstance(cluster, LightningEnvironment) else cluster.global_rank(),
        int(env["WORLD_SIZE"])
        if isinstance(cluster, LightningEnvironment)
        else cluster.world_size(),
        cluster.local_rank(),
        cluster.node_rank(),
        cluster.main_address,
        cluster.main_port,
    )


def test_detection_imports_no_lightning() -> None:
    """A plain-DDP or pool rank never imported Lightning for its launch detection."""
    import subprocess
    import sys

    code = (
        "import sys; from neps_bcast.startup.launch import detect;"
        "detect({'TORCHELASTIC_RUN_ID': 'x', 'RANK': '0', 'WORLD_SIZE': '2', 'LOCAL_RANK': '0',"
        " 'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': '1'});"
        "import neps_bcast.api;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
