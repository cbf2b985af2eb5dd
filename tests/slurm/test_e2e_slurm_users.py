"""End to end on the real one-node SLURM of ``make test-slurm``, with scripts written as
their users write them: PyTorch's DDP tutorial under srun, submitit, Lightning's SLURM
auto-requeue with ``--signal=USR1@N``, and a plain-DDP script whose own SIGUSR1 handler
checkpoints, requeues and exits.

SLURM's warning before a time limit (``--signal=USR1@90``, or USR2 for submitit) is
delivered with ``scancel --signal=...`` while trial 2 trains, as it would be 90 s before
the limit. In each case trial 2 goes back to ``pending`` (not ``crashed``), the requeued
job evaluates it first on both ranks and resumes it from its checkpoint (the step it
starts from is the saved one, not 0), the search completes with every trial
``success``, and no process of the job is left.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import torch
from test_e2e_slurm import (  # the one-node cluster's helpers and its fixture
    JOB_S,
    JOB_SBATCH,
    SLURM_CONF,
    Cluster,
    Job,
    cluster,
    poll,
    slurm,
    states,
)

from harness import MARKER, PYTHON, base_env
from neps_bcast.recovery.lease_file import read_lease

SCRIPTS = Path(__file__).parents[1] / "scripts"
USR1_SBATCH = Path(__file__).parent / "usr1.sbatch"
__all__ = ["cluster"]  # the fixture, imported for the tests below


def of(events: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == event]


def started_again(job: Job, first_pids: set[int]) -> list[dict[str, Any]]:
    return [e for e in job.events() if e["pid"] not in first_pids]


def interrupt_trial_2(job: Job, root: Path, signal_name: str) -> set[int]:
    """Wait until both ranks are 3 steps into trial 2 (slow on its first attempt), send
    the time-limit warning to every task, and wait for the requeue; the first run's pids."""

    def both_ranks_in_trial_2(events: list[dict[str, Any]]) -> set[int] | None:
        pids = {e["pid"] for e in of(events, "step") if e["step"] >= 3}
        return pids if len(pids) == 2 else None

    in_trial_2: set[int] = job.wait_events("both ranks at step 3 of trial 2", both_ranks_in_trial_2)
    assert states(root) == {"1": "success", "2": "evaluating"}, job.report()
    slurm("scancel", f"--signal={signal_name}", job.id)
    job.wait_state(
        "requeued", lambda i: i["Restarts"] == "1" and i["JobState"] != "RUNNING", timeout=120
    )
    poll(
        "the first run's processes gone",
        lambda: not any(Path(f"/proc/{pid}").exists() for pid in in_trial_2),
        60,
        job.report,
    )
    assert states(root) == {"1": "success", "2": "pending"}, job.report()
    return in_trial_2


# -- PyTorch's DDP tutorial under srun ----------------------------------------------------
def test_the_tutorial_pattern_under_srun(cluster: Cluster, tmp_path: Path) -> None:
    """init_process_group / destroy_process_group in every trial, each task with SLURM's
    rank; rank 1 fails mid-training in trial 2: released, recorded, trials 3 and 4 run."""
    root = tmp_path / "root"
    rec = tmp_path / "job" / "rec"
    rec.mkdir(parents=True)
    cmd = [PYTHON, str(SCRIPTS / "tutorial_ddp.py"), "--trials", "4", "--root", str(root)]
    env = {"TUTORIAL_RECORD": str(rec), "TUTORIAL_FAIL": "2:1"}
    job = cluster.submit(tmp_path / "job", JOB_SBATCH, cmd, env)
    info = job.wait_done()
    report = job.report()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), report
    assert states(root) == {"1": "success", "2": "crashed", "3": "success", "4": "success"}
    events = job.events()
    by_rank = {r: [(e["trial"], e["lr"]) for e in events if e["rank"] == r] for r in (0, 1)}
    assert [t for t, _ in by_rank[0]] == [f"config_{i}" for i in (1, 2, 3, 4)], report
    assert by_rank[1] == by_rank[0], report
    assert len({e["pid"] for e in events}) == 2, report  # srun's two tasks, nothing else
    job.assert_nothing_left()


# -- a job stopped by USR1 in trial 2 and requeued ----------------------------------------
def submit_stopped_in_trial_2(
    cluster: Cluster, tmp_path: Path, script: str, record_variable: str, slow_variable: str
) -> tuple[Job, Path, set[int]]:
    """``script`` as a 3-trial search in usr1.sbatch, sent USR1 a few steps into trial 2:
    the job, its NePS root and the pids of its first start."""
    root = tmp_path / "root"
    rec = tmp_path / "job" / "rec"
    rec.mkdir(parents=True)
    cmd = [PYTHON, str(SCRIPTS / script), "--trials", "3", "--root", str(root)]
    env = {record_variable: str(rec), slow_variable: "2"}
    job = cluster.submit(tmp_path / "job", USR1_SBATCH, cmd, env)
    return job, root, interrupt_trial_2(job, root, "USR1")


def assert_requeued_once_and_completed(job: Job, root: Path) -> str:
    """The job ran twice and completed; every trial a success. Returns the job's report."""
    info = job.wait_done()
    report = job.report()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1")
    assert states(root) == dict.fromkeys("123", "success"), report
    return report


def assert_one_interruption(trial_dir: Path, how: str) -> None:
    lease = read_lease(trial_dir)
    assert lease is not None
    assert [a.how for a in lease.attempts] == [how], lease


# -- Lightning's SLURM auto-requeue -------------------------------------------------------
def test_lightning_auto_requeue_resumes_the_trial_from_its_hpc_checkpoint(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, root, first = submit_stopped_in_trial_2(
        cluster, tmp_path, "lightning_slurm.py", "LIGHTNING_RECORD", "LIGHTNING_SLOW"
    )
    trial_dir = root / "configs" / "config_2"
    saved = sorted(p.name for p in trial_dir.glob("hpc_ckpt_*.ckpt"))
    assert saved == ["hpc_ckpt_1.ckpt"], job.report()  # in default_root_dir = the trial's
    saved_step = torch.load(trial_dir / saved[0], weights_only=False)["global_step"]
    assert saved_step >= 3, job.report()

    report = assert_requeued_once_and_completed(job, root)
    again = started_again(job, first)
    for rank in (0, 1):
        starts = [e["global_step"] for e in of(again, "fit_start") if e["rank"] == rank]
        trained = [(e["trial"], e["attempt"]) for e in of(again, "trained") if e["rank"] == rank]
        # Trial 2 first, as attempt 2, resumed at the saved step (not restarted at 0).
        assert trained == [("2", 2), ("3", 1)], report
        assert starts[0] == saved_step, report
        assert starts[1] == 0, report
    assert_one_interruption(trial_dir, "preempted: SIGTERM on the leader (exit code 143)")
    job.assert_nothing_left()


# -- a plain-DDP script's own USR1 handler ------------------------------------------------
def test_a_users_own_usr1_handler_requeues_and_the_trial_resumes(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, root, first = submit_stopped_in_trial_2(
        cluster, tmp_path, "requeue_ddp.py", "REQUEUE_RECORD", "REQUEUE_SLOW"
    )
    events = job.ended()
    usr1 = [e["rank"] for e in of(events, "handler") if e["signal"] == "USR1"]
    assert sorted(usr1) == [0, 1], job.report()
    # SLURM's SIGTERM for the requeue can land while rank 0's handler waits for scontrol:
    # the user's SIGTERM handler then runs inside it (as it would without neps_bcast),
    # and the USR1 handler still runs to its exit (checked by the exit codes below).
    assert {e["rank"]: e["code"] for e in of(events, "exit")} == {0: 0, 1: 0}, job.report()
    saved_step = torch.load(root / "configs" / "config_2" / "checkpoint.pt")["step"]
    assert saved_step >= 3, job.report()

    report = assert_requeued_once_and_completed(job, root)
    again = started_again(job, first)
    for rank in (0, 1):
        trained = [
            (e["trial"], e["attempt"], e["start"], e["end"])
            for e in of(again, "trained")
            if e["rank"] == rank
        ]
        assert trained == [("2", 2, saved_step, 12), ("3", 1, 0, 12)], report
    assert_one_interruption(
        root / "configs" / "config_2",
        "preempted: SystemExit(0) in the SIGUSR1 handler on the leader (exit code 0)",
    )
    job.assert_nothing_left()


# -- submitit ------------------------------------------------------------------------------
class Submitter:
    """``python submitit_search.py`` (it submits the job and waits for its results), and
    the job it submitted, registered with the cluster fixture for its cleanup."""

    def __init__(self, cluster: Cluster, tmp_path: Path, trials: int, **env: str) -> None:
        self.folder = tmp_path / "job"
        (self.folder / "rec").mkdir(parents=True)
        self.root = tmp_path / "root"
        self.marker = uuid.uuid4().hex
        full = base_env(SUBMITIT_RECORD=str(self.folder / "rec"), **env)
        full.update({MARKER: self.marker, "SLURM_CONF": SLURM_CONF})
        full["MASTER_PORT"] = cluster.hold_port()  # read by TorchDistributedEnvironment
        self.out = self.folder / "submitter.out"
        cmd = [
            sys.executable,
            str(SCRIPTS / "submitit_search.py"),
            "--folder",
            str(self.folder / "submitit"),
            "--root",
            str(self.root),
            "--trials",
            str(trials),
        ]
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=self.folder, env=full, stdout=out, stderr=subprocess.STDOUT
            )
        # The submitter imports submitit, NePS and torch before it submits: 60 s was
        # overrun at load 20 on 2 cores (both submitit tests, in one suite beside two).
        job_id = poll(
            "submitit's job id",
            lambda: re.search(r"submitted job (\d+)", self.out.read_text()),
            240,
            self.out.read_text,
        ).group(1)
        self.job = Job.__new__(Job)  # the job submitit submitted, for Job's helpers
        self.job.folder, self.job.marker, self.job.id = self.folder, self.marker, job_id
        self.job.output = self.folder / "submitit" / f"{job_id}_0_log.out"
        cluster.jobs.append(self.job)

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=JOB_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the submitter overran\n{self.report()}") from None

    def report(self) -> str:
        logs = sorted((self.folder / "submitit").glob("*_log.*"))
        tails = "\n".join(
            f"--- {p.name} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-40:])
            for p in logs
        )
        return f"{self.job.report()}\n--- submitter ---\n{self.out.read_text()}\n{tails}"


def test_submitit_runs_the_search_as_srun_does(cluster: Cluster, tmp_path: Path) -> None:
    submitter = Submitter(cluster, tmp_path, trials=3)
    assert submitter.finish() == 0, submitter.report()
    info = submitter.job.wait_done()
    report = submitter.report()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), report
    assert "['rank 0 done', 'rank 1 done']" in submitter.out.read_text(), report
    assert states(submitter.root) == dict.fromkeys("123", "success"), report
    events = submitter.job.events()
    assert {(e["rank"], e["world_size"]) for e in of(events, "start")} == {(0, 2), (1, 2)}
    by_rank = {r: [e["trial"] for e in of(events, "trained") if e["rank"] == r] for r in (0, 1)}
    assert by_rank == {0: ["1", "2", "3"], 1: ["1", "2", "3"]}, report
    submitter.job.assert_nothing_left()


def test_submitit_requeues_a_preempted_trial_and_the_requeued_job_finishes(
    cluster: Cluster, tmp_path: Path
) -> None:
    """submitit's own path: SIGUSR2 (its --signal=USR2@90, or preemption) runs its handler,
    which calls the Checkpointable's checkpoint (it saves the running trial), requeues the
    job and exits; the requeued job runs the search again from the root."""
    submitter = Submitter(cluster, tmp_path, trials=3, SUBMITIT_SLOW="2")
    job = submitter.job
    first = interrupt_trial_2(job, submitter.root, "USR2")
    saved_step = torch.load(submitter.root / "configs" / "config_2" / "checkpoint.pt")["step"]
    assert saved_step >= 3, submitter.report()

    assert submitter.finish() == 0, submitter.report()
    info = job.wait_done()
    report = submitter.report()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1")
    assert states(submitter.root) == dict.fromkeys("123", "success"), report
    again = started_again(job, first)
    for rank in (0, 1):
        trained = [
            (e["trial"], e["attempt"], e["start"], e["end"])
            for e in of(again, "trained")
            if e["rank"] == rank
        ]
        assert trained == [("2", 2, saved_step, 12), ("3", 1, 0, 12)], report
    lease = read_lease(submitter.root / "configs" / "config_2")
    assert lease is not None
    # submitit's handler requeues the job, then exits -1; the requeue makes SLURM send
    # SIGTERM to the job's tasks, which can reach the leader while the handler still
    # runs (seen once beside a second suite): either stop is this preemption.
    assert [a.how for a in lease.attempts] in (
        ["preempted: SystemExit(-1) in the SIGUSR2 handler on the leader (exit code -1)"],
        ["preempted: SIGTERM on the leader (exit code 143)"],
    ), lease
    job.assert_nothing_left()
