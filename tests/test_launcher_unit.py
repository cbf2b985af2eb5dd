"""`neps-bcast launch` without processes: argument checks, device slicing, environments,
the torchrun command, the status read from a leader's log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from neps_bcast import cli
from neps_bcast.errors import LaunchError
from neps_bcast.launcher import groups, plan, status


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def make(script: Path, visible: tuple[str, ...] = (), **kwargs: object) -> plan.LaunchPlan:
    return plan.plan(plan.LaunchRequest(script=script, **kwargs), visible)  # type: ignore[arg-type]


def slices(p: plan.LaunchPlan) -> list[tuple[str, ...] | None]:
    return [g.devices for g in p.groups]


def test_gpus_are_split_into_disjoint_slices_in_order(script: Path) -> None:
    p = make(script, ("0", "1", "2", "3", "4", "5", "6", "7"), groups=4, nproc_per_group=2)
    assert slices(p) == [("0", "1"), ("2", "3"), ("4", "5"), ("6", "7")]
    assert [g.log_dir for g in p.groups] == [Path("logs") / f"group{k}" for k in range(4)]
    assert p.unused_devices == ()


def test_counts_default_from_the_devices(script: Path) -> None:
    visible = tuple(str(i) for i in range(8))
    assert slices(make(script, visible, nproc_per_group=2)) == [
        ("0", "1"),
        ("2", "3"),
        ("4", "5"),
        ("6", "7"),
    ]
    assert slices(make(script, visible, groups=2)) == [("0", "1", "2", "3"), ("4", "5", "6", "7")]


def test_devices_index_into_what_cuda_visible_devices_shows(script: Path) -> None:
    p = make(script, ("4", "5", "6", "7"), groups=2, nproc_per_group=1, devices=("1", "3"))
    assert slices(p) == [("5",), ("7",)]
    uuids = ("GPU-aaa", "GPU-bbb")
    assert slices(make(script, uuids, groups=1, nproc_per_group=1, devices=("GPU-bbb",))) == [
        ("GPU-bbb",)
    ]


def test_left_over_devices_are_reported(script: Path) -> None:
    p = make(script, ("0", "1", "2"), groups=1, nproc_per_group=2)
    assert p.unused_devices == ("2",)
    assert any("devices 2 stay unused" in n for n in p.notes)


def test_on_cpu_groups_get_no_device_and_k_defaults_to_one(script: Path) -> None:
    p = make(script, (), nproc_per_group=3)
    assert [(g.nproc, g.devices) for g in p.groups] == [(3, None)]


def test_on_cpu_devices_given_only_label_the_groups(script: Path) -> None:
    p = make(script, (), groups=2, nproc_per_group=2, devices=("0", "1", "2", "3"))
    assert slices(p) == [("0", "1"), ("2", "3")]
    assert any("no GPU is visible" in n for n in p.notes)


@pytest.mark.parametrize(
    ("kwargs", "visible", "message"),
    [
        (
            {"groups": 2, "nproc_per_group": 0},
            (),
            r"--nproc-per-group 0: a DDP group needs at least one rank\. HINT: pass --nproc-per-group 1 or more",
        ),
        (
            {"groups": 0, "nproc_per_group": 2},
            (),
            r"--groups 0: a launch needs at least one DDP group\. HINT: pass --groups 1 or more",
        ),
        (
            {"groups": -1, "nproc_per_group": 2},
            (),
            r"--groups -1: ",
        ),
        (
            {"groups": 3, "nproc_per_group": 2},
            ("0", "1", "2", "3"),
            r"--groups 3 x --nproc-per-group 2 = 6 ranks, but there are only 4 devices \(0,1,2,3\), one per rank\. HINT: lower --groups or --nproc-per-group so that groups x nproc-per-group <= 4",
        ),
        (
            {"groups": 2, "nproc_per_group": 2, "devices": ("0", "1", "2")},
            (),
            r"--groups 2 x --nproc-per-group 2 = 4 ranks, but there are only 3 devices \(0,1,2\)",
        ),
        (
            {"groups": 2, "nproc_per_group": 1, "devices": ("0", "1", "0")},
            ("0", "1"),
            r"--devices lists device 0 twice \(0,1,0\): two ranks \(or two groups\) would share one device\. HINT: list every device once",
        ),
        (
            {"groups": 2, "nproc_per_group": 1, "devices": ("1", "GPU-b")},
            ("GPU-a", "GPU-b"),
            r"--devices \(as CUDA_VISIBLE_DEVICES=GPU-a,GPU-b\) lists device GPU-b twice .*HINT: list every device once",
        ),
        (
            {"groups": 1, "nproc_per_group": 1, "devices": ("4",)},
            ("0", "1"),
            r"--devices names device 4, which this process cannot see \(visible: 0,1; 2 GPU\(s\)\)\. HINT: use indexes 0\.\.1",
        ),
        (
            {"groups": 2},
            (),
            r"--nproc-per-group is missing and there are no GPUs to count from\. HINT: pass --nproc-per-group N",
        ),
        (
            {},
            ("0", "1"),
            r"neither --groups nor --nproc-per-group is given \(2 devices: 0,1\)\. HINT: pass --nproc-per-group N",
        ),
        (
            {"groups": 3},
            ("0", "1"),
            r"--groups 3 is more than the 2 devices \(0,1\)\. HINT: pass --groups 2 or fewer",
        ),
        (
            {"nproc_per_group": 3},
            ("0", "1"),
            r"--nproc-per-group 3 is more than the 2 devices \(0,1\)\. HINT: pass --nproc-per-group 2 or fewer",
        ),
        (
            {"groups": 1, "nproc_per_group": 1, "max_restarts": -1},
            (),
            r"--max-restarts -1 is negative\. HINT: pass --max-restarts 0",
        ),
    ],
)
def test_bad_requests_are_refused_naming_the_fix(
    script: Path, kwargs: dict[str, object], visible: tuple[str, ...], message: str
) -> None:
    with pytest.raises(LaunchError, match=r"^\[neps_bcast launch\] " + message):
        make(script, visible, **kwargs)


def test_a_missing_script_or_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"the script '.*nothere\.py' does not exist\. HINT"):
        make(tmp_path / "nothere.py", (), nproc_per_group=1)
    with pytest.raises(LaunchError, match=r"the script '.*' is a directory, not a script\. HINT"):
        make(tmp_path, (), nproc_per_group=1)


def test_parse_devices() -> None:
    assert plan.parse_devices("0,1,2") == ("0", "1", "2")
    assert plan.parse_devices("0-3,6") == ("0", "1", "2", "3", "6")
    assert plan.parse_devices(" GPU-a-b , 2") == ("GPU-a-b", "2")
    with pytest.raises(LaunchError, match=r"has an empty entry\. HINT"):
        plan.parse_devices("0,,1")
    with pytest.raises(
        LaunchError, match=r"range '3-1' runs backwards\. HINT: write it low to high"
    ):
        plan.parse_devices("3-1")


def test_visible_devices() -> None:
    assert plan.visible_devices({}, 0) == ()
    assert plan.visible_devices({"CUDA_VISIBLE_DEVICES": "0,1"}, 0) == ()
    assert plan.visible_devices({}, 3) == ("0", "1", "2")
    assert plan.visible_devices({"CUDA_VISIBLE_DEVICES": "4,6"}, 2) == ("4", "6")


def test_without_a_gpu_device_node_the_launcher_counts_no_gpu_and_imports_no_torch(
    tmp_path: Path,
) -> None:
    """The launcher asks torch for CUDA devices only where a GPU driver's device node
    exists; the positive control: with a node that exists, torch is imported to count."""
    probe = (
        "import sys\n"
        "from neps_bcast import cli\n"
        "nodes = sys.argv[1:]\n"
        "print(cli.cuda_device_count(nodes), 'torch' in sys.modules)\n"
    )
    absent = str(tmp_path / "nvidiactl")
    present = tmp_path / "kfd"
    present.touch()
    outputs = [
        subprocess.run(
            [sys.executable, "-c", probe, *nodes],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()
        for nodes in ([absent], [absent, str(present)])
    ]
    assert outputs[0] == ["0", "False"]
    assert outputs[1][1] == "True"


def test_group_environment_marks_slices_and_drops_the_slurm_task_layout(script: Path) -> None:
    p = make(script, ("0", "1", "2", "3"), groups=2, nproc_per_group=2)
    base = {"PATH": "/bin", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}
    env = plan.group_environment(base, p.groups[1], "abc")
    assert env == {
        "PATH": "/bin",
        "SLURM_JOB_ID": "7",
        plan.ENV_LAUNCH_ID: "abc",
        plan.ENV_GROUP: "1",
        "CUDA_VISIBLE_DEVICES": "2,3",
    }
    cpu = make(script, (), groups=1, nproc_per_group=2)
    assert "CUDA_VISIBLE_DEVICES" not in plan.group_environment({}, cpu.groups[0], "abc")


def test_each_group_is_one_standalone_torchrun(script: Path) -> None:
    p = plan.plan(
        plan.LaunchRequest(
            script=script,
            script_args=("--trials", "4"),
            groups=2,
            nproc_per_group=2,
            max_restarts=1,
        ),
        (),
    )
    cmd = groups.torchrun_command(p.groups[1], p)
    assert cmd[:8] == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--module",
        "neps_bcast.launcher.rank_log",
    ]
    assert cmd[8:] == ["1", str((Path("logs") / "group1").resolve()), str(script), "--trials", "4"]
    assert not any("29500" in part or "master-port" in part for part in cmd)


def test_the_command_line_keeps_the_scripts_own_options(script: Path) -> None:
    args = cli.parser().parse_args(
        ["launch", "--groups", "2", "--nproc-per-group", "1", str(script), "--groups", "9", "-x"]
    )
    request = cli.request_from(args)
    assert (request.groups, request.nproc_per_group) == (2, 1)
    assert request.script_args == ("--groups", "9", "-x")


def test_cli_errors_exit_2_with_the_message(
    script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["launch", "--nproc-per-group", "0", str(script)]) == 2
    assert capsys.readouterr().err.startswith("[neps_bcast launch] --nproc-per-group 0:")
    assert cli.main(["launch", "--nproc-per-group", "1", "--stop-timeout", "0", str(script)]) == 2
    assert "must be positive seconds" in capsys.readouterr().err
    limit = ["--trial-time-limit", "60", str(script)]
    assert cli.main(["launch", "--nproc-per-group", "1", *limit]) == 2
    assert "--trial-time-limit is for a pool (--pool D)" in capsys.readouterr().err
    assert cli.main(["launch", "--pool", "1", "--trial-time-limit", "0", str(script)]) == 2
    assert "--trial-time-limit 0: a limit must be a positive" in capsys.readouterr().err
    assert cli.main(["launch", "--nproc-per-group", "1", "--agents", "2", str(script)]) == 2
    assert "--agents is for a pool (--pool D)" in capsys.readouterr().err
    assert cli.main(["launch", "--pool", "2", "--agents", "0", str(script)]) == 2
    assert "--agents 0: a pool needs at least one agent" in capsys.readouterr().err


LEADER_LOG = """\
===== neps-bcast launch: group 1 rank 0 attempt 0 pid 10 at 2026-01-01 00:00:00 =====
INFO neps_bcast: [neps_bcast rank 0/2 leader] trial 2 (#1) handed to the group
INFO neps.runtime: Worker 'w' evaluated trial: 2 as success.
INFO neps_bcast: [neps_bcast rank 0/2 leader] trial 4 (#2) handed to the group
INFO neps.runtime: Worker 'w' evaluated trial: 4 as State.CRASHED.
INFO neps_bcast: [neps_bcast rank 0/2 leader] trial 5 (#3) handed to the group
===== neps-bcast launch: group 1 rank 0 attempt 1 pid 11 at 2026-01-01 00:00:09 =====
INFO neps_bcast: [neps_bcast rank 0/2 leader] trial 7 (#1) handed to the gr"""


def test_leader_log_counts_trials_restarts_and_the_running_trial() -> None:
    log = status.LeaderLog()
    log.feed(LEADER_LOG, now=100.0)
    assert (log.attempt, log.finished, log.failed, log.trial) == (1, 1, 1, None)
    log.feed("oup\n", now=103.0)  # the rest of a line written in two pieces
    assert (log.trial, log.trial_since) == ("7", 103.0)
    line = status.status_line(1, "running", log, now=110.0, devices="2,3")
    assert line.startswith("group 1 [2,3]: running   restarts 1  trial 7 for 7s")
    assert line.endswith("finished 1  failed 1")


def test_log_follower_reads_only_what_was_appended(tmp_path: Path) -> None:
    path = tmp_path / "rank0.log"
    follower = status.LogFollower(path)
    assert follower.read_new() == ""
    path.write_text("a\n")
    assert follower.read_new() == "a\n"
    with path.open("a") as f:
        f.write("b\n")
    assert follower.read_new() == "b\n"


def test_each_slurm_task_keeps_its_logs_apart() -> None:
    logs = Path("logs")
    assert plan.task_log_dir(logs, {}) == logs
    assert plan.task_log_dir(logs, {"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}) == logs
    assert plan.task_log_dir(logs, {"SLURM_NTASKS": "4", "SLURM_PROCID": "3"}) == logs / "task3"
    assert plan.task_log_dir(logs, {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}) == (
        logs / "task1"
    )
    assert plan.task_log_dir(logs, {"SLURM_NTASKS": "2"}) == logs  # not a task of the step
