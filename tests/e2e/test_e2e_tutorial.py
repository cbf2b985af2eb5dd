"""End to end: PyTorch's DDP tutorial turned into a search (tests/scripts/tutorial_ddp.py),
unchanged in shape, under the launchers people use: torchrun, SLURM-style tasks that
each call ``init_process_group`` with their own rank (simulated here; the real SLURM is
in tests/slurm/test_e2e_slurm_users.py) and ``neps-bcast launch``.

The three ways the group is formed: in the function and destroyed at its end, every
trial (the tutorial); once before ``neps_bcast.run``; in the function when there is
none, never destroyed. In each launch rank 1 fails in the middle of trial 2's training:
both ranks are released, NePS records trial 2 crashed with rank 1's error, and trials
3 and 4 run in the same processes, on a group formed again. Checked: every rank
evaluated the leader's trials, in order, with the leader's arguments, in the processes
the launcher started; NePS's record; the exit code; no process left.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import FAKE_SRUN, PYTHON, TORCHRUN, neps_trials
from ports import HeldPort
from user_launch import SCRIPTS, UserLaunch, records, states

SCRIPT = SCRIPTS / "tutorial_ddp.py"
NEPS_BCAST = str(Path(PYTHON).with_name("neps-bcast"))
RANK_1_FAILS = "rank 1 failed in the middle of its training"


def launcher(how: str, tmp_path: Path, port: int) -> tuple[list[str], dict[str, str]]:
    """The launch's command and variables; ``port`` (held by the test) is srun's."""
    if how == "torchrun":
        return [TORCHRUN, "--standalone", "--nproc-per-node=2"], {}
    if how == "srun":  # every task calls init_process_group with SLURM's rank
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        return [PYTHON, str(FAKE_SRUN), "--ntasks", "2", "--", PYTHON], env
    logs = str(tmp_path / "logs")
    return [NEPS_BCAST, "launch", "--nproc-per-group", "2", "--log-dir", logs], {}


@pytest.mark.parametrize(
    ("group", "how"),
    [("per-trial", "torchrun"), ("once", "torchrun"), ("lazy", "srun"), ("per-trial", "launch")],
    ids=[
        "tutorial_torchrun",
        "formed_before_run_torchrun",
        "never_destroyed_srun",
        "tutorial_neps_bcast_launch",
    ],
)
def test_the_tutorial_pattern_keeps_every_guarantee(tmp_path: Path, group: str, how: str) -> None:
    rec = tmp_path / "rec"
    rec.mkdir()
    with HeldPort() as port:
        cmd, env = launcher(how, tmp_path, port)
        cmd += [str(SCRIPT), "--group", group, "--trials", "4", "--root", "root"]
        env.update(TUTORIAL_RECORD=str(rec), TUTORIAL_FAIL="2:1")
        run = UserLaunch(cmd, tmp_path, "launch", env)
        code = run.finish()
    events = records(rec)
    report = f"{run.log()}\n" + "".join(
        p.read_text()[-3000:] for p in sorted((tmp_path / "logs").glob("*/*.log"))
    )
    assert code == 0, report

    by_rank = {
        r: [(e["trial"], e["lr"], e["hidden"]) for e in events if e["rank"] == r] for r in (0, 1)
    }
    assert [t for t, _, _ in by_rank[0]] == [f"config_{i}" for i in (1, 2, 3, 4)], report
    assert by_rank[1] == by_rank[0], report  # the same trials, arguments and order
    assert len({e["pid"] for e in events}) == 2, report  # nothing restarted or spawned

    assert states(tmp_path / "root") == {
        "1": "success",
        "2": "crashed",
        "3": "success",
        "4": "success",
    }
    crashed = neps_trials(tmp_path / "root")["2"].report
    assert crashed is not None
    assert f"trial 2 failed on rank 1: rank 1: RuntimeError: {RANK_1_FAILS}" in str(crashed.err)
