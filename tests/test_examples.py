"""Every script in examples/ runs, launched as README says, at small settings.

So that none can rot: `python examples/lightning_ddp.py`, `torchrun --standalone ...
examples/torchrun_ddp.py`, `neps-bcast launch ... examples/groups.py` (and `--pool` with
examples/pool.py), each from the
repository root with its NePS root under ``tmp_path``. Each must exit 0, NePS must hold
every trial it was asked for (all successful), and no process of the launch may be left.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest

import launches
from harness import LINGER_S, MARKER, PYTHON, TORCHRUN, base_env, marked_pids, neps_trials
from neps_bcast.compat import procfs

REPO = Path(__file__).parent.parent
NEPS_BCAST = str(Path(PYTHON).with_name("neps-bcast"))


def run_example(cmd: list[str], tmp_path: Path, timeout: float = 240) -> str:
    marker = uuid.uuid4().hex
    env = base_env()
    env[MARKER] = marker
    launches.count("example")
    try:
        done = subprocess.run(
            cmd,
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
    finally:
        until = time.monotonic() + LINGER_S  # returns once they are gone
        while marked_pids(marker) and time.monotonic() < until:
            time.sleep(0.05)  # bounded wait for the launch's processes to exit
        left = marked_pids(marker)
        for pid in left:
            procfs.kill(pid)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert not left, f"processes {left} left running:\n{output[-3000:]}"
    return output


def assert_trials(root: Path, at_least: int) -> None:
    states = {tid: t.metadata.state.value for tid, t in neps_trials(root).items()}
    assert len(states) >= at_least, states
    assert set(states.values()) == {"success"}, states


@pytest.mark.timeout(300)
def test_lightning_ddp_example_as_readme_says(tmp_path: Path) -> None:
    # README: python examples/lightning_ddp.py --devices 2 --trials 10
    root = tmp_path / "root"
    out = run_example(
        [
            PYTHON,
            "examples/lightning_ddp.py",
            "--devices",
            "2",
            "--trials",
            "3",
            "--root",
            str(root),
        ],
        tmp_path,
    )
    assert_trials(root, 3)
    assert "NePS results (" in out


@pytest.mark.timeout(300)
def test_torchrun_ddp_example_as_readme_says(tmp_path: Path) -> None:
    # README: torchrun --standalone --nproc-per-node 4 examples/torchrun_ddp.py --devices 4 --trials 20
    root = tmp_path / "root"
    run_example(
        [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/torchrun_ddp.py",
            "--devices",
            "2",
            "--trials",
            "2",
            "--root",
            str(root),
        ],
        tmp_path,
    )
    assert_trials(root, 2)


@pytest.mark.timeout(300)
def test_groups_example_under_neps_bcast_launch_as_readme_says(tmp_path: Path) -> None:
    # README: neps-bcast launch --groups 2 --nproc-per-group 2 examples/groups.py --trials 8
    root = tmp_path / "root"
    out = run_example(
        [
            NEPS_BCAST,
            "launch",
            "--groups",
            "2",
            "--nproc-per-group",
            "2",
            "--log-dir",
            str(tmp_path / "logs"),
            "examples/groups.py",
            "--trials",
            "4",
            "--epochs",
            "1",
            "--root",
            str(root),
        ],
        tmp_path,
    )
    assert_trials(root, 4)
    assert "group 0: finished" in out and "group 1: finished" in out, out
    assert sorted(p.name for p in (tmp_path / "logs" / "group1").iterdir()) == [
        "rank0.log",
        "rank1.log",
        "torchrun.log",
    ]


@pytest.mark.timeout(420)
def test_pool_example_under_neps_bcast_launch_as_readme_says(tmp_path: Path) -> None:
    # README: neps-bcast launch --pool 4 examples/pool.py --trials 12 (Lightning, sized by
    # epochs: 1 rank for up to 2 epochs, else 2)
    root = tmp_path / "root"
    out = run_example(
        [
            NEPS_BCAST,
            "launch",
            "--pool",
            "4",
            "--log-dir",
            str(tmp_path / "logs"),
            "examples/pool.py",
            "--trials",
            "6",
            "--root",
            str(root),
        ],
        tmp_path,
        timeout=360,
    )
    assert_trials(root, 6)
    assert "pool of 4 ranks on CPU and 4 agents" in out, out
    assert sorted(p.name for p in (tmp_path / "logs" / "pool").iterdir()) == [
        *(f"agent{i}.log" for i in range(4)),
        *(f"rank{i}.log" for i in range(4)),
    ]


@pytest.mark.timeout(300)
def test_tutorial_ddp_example_as_readme_says(tmp_path: Path) -> None:
    # README: torchrun --standalone --nproc-per-node 2 examples/tutorial_ddp.py
    root = tmp_path / "root"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node", "2", "examples/tutorial_ddp.py"]
    run_example([*cmd, "--trials", "3", "--steps", "20", "--root", str(root)], tmp_path)
    assert_trials(root, 3)
    for trial in (1, 2, 3):  # rank 0 checkpointed every 10 steps into the trial's own directory
        assert (root / "configs" / f"config_{trial}" / "checkpoint.pt").exists()


@pytest.mark.timeout(300)
def test_submitit_example_on_this_machine_as_docs_say(tmp_path: Path) -> None:
    # docs/launching.md: python examples/submitit_search.py --cluster local --trials 4 --tasks 2
    root = tmp_path / "root"
    out = run_example(
        [
            PYTHON,
            "examples/submitit_search.py",
            "--cluster",
            "local",
            "--trials",
            "2",
            "--tasks",
            "2",
            "--root",
            str(root),
            "--folder",
            str(tmp_path / "jobs"),
        ],
        tmp_path,
    )
    assert_trials(root, 2)
    assert "['done', 'done']" in out, out  # both tasks' results
