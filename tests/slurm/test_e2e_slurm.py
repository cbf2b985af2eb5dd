"""End to end on a real SLURM: one node, slurmctld + slurmd + munge on this machine
(tests/slurm/cluster.sh, started and stopped by ``make test-slurm``).

Real sbatch, real srun (2 tasks), real gloo, real NePS, real Lightning. Each job gets a
port (MASTER_PORT) that the test holds until its jobs ended (tests/ports.py), its own
NePS root under ``tmp_path``, and carries a unique marker in its environment (as
tests/harness.py's launches do) so that the test can prove no process of it is left.
Every wait polls SLURM or the run's files against a deadline.

There is no accounting daemon (no ``sacct``): the final state comes from ``scontrol show
job``, which keeps finished jobs for MinJobAge (an hour, cluster.sh's slurm.conf).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exits import ExitWatch
from harness import (
    LIGHTNING,
    MARKER,
    PYTHON,
    base_env,
    marked_pids,
    neps_trials,
    read_records,
    with_kernel_exits,
)
from neps_bcast.compat import procfs
from neps_bcast.recovery.lease_file import read_lease
from ports import HeldPort

HERE = Path(__file__).parent
REPO = HERE.parents[1]
EXAMPLE = REPO / "examples" / "torchrun_ddp.py"
JOB_SBATCH = HERE / "job.sbatch"
REQUEUE_SBATCH = HERE / "requeue.sbatch"
SLURM_DIR = Path(os.environ.get("NEPS_BCAST_SLURM_DIR", "/tmp/neps_bcast_slurm"))
SLURM_CONF = os.environ.get("SLURM_CONF", str(SLURM_DIR / "slurm.conf"))
DONE = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}
"""Job states that are final (a requeued job goes through COMPLETING to PENDING instead)."""
JOB_S = 300.0
"""A job's bound, from submission to a final state (a job takes 20-60 s here)."""


def slurm(*args: str) -> str:
    """A SLURM client command on the test cluster; its stdout."""
    done = subprocess.run(
        list(args),
        env={**os.environ, "SLURM_CONF": SLURM_CONF},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, f"{' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done.stdout


def poll(what: str, probe: Callable[[], Any], timeout: float, why: Callable[[], str]) -> Any:
    """``probe()`` until it is truthy (bounded); its value, or a failure saying ``why()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)  # a bounded poll of SLURM or of the run's files
    value = probe()
    if value:
        return value
    raise AssertionError(f"never saw {what} within {timeout} s\n{why()}")


def states(root: Path) -> dict[str, str]:
    return {tid: str(t.metadata.state.value) for tid, t in neps_trials(root).items()}


class Job:
    """One submitted batch job, its folder (cwd, output, records, rank logs) and marker."""

    def __init__(self, cluster: Cluster, folder: Path, script: Path, cmd: list[str], env: Any):
        self.folder = folder
        self.marker = uuid.uuid4().hex
        full_env = base_env(**env)
        full_env.update(
            {MARKER: self.marker, "SLURM_CONF": SLURM_CONF, "MASTER_PORT": cluster.hold_port()}
        )
        self.output = folder / "job.out"
        self.watch = ExitWatch.get()  # listening before the job's first process starts
        done = subprocess.run(
            [
                "sbatch",
                "--parsable",
                f"--chdir={folder}",
                f"--output={self.output}",
                str(script),
                *cmd,
            ],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, f"sbatch failed ({done.returncode}): {done.stderr}"
        self.id = done.stdout.strip().split(";")[0]
        cluster.jobs.append(self)

    def info(self) -> dict[str, str]:
        """``scontrol show job``'s fields (the ones without spaces in their values)."""
        text = slurm("scontrol", "show", "job", "--oneliner", self.id)
        return dict(re.findall(r"(?:^|\s)(\w+)=(\S*)", text))

    def events(self) -> list[dict[str, Any]]:
        return read_records(self.folder / "rec")

    def ended(self) -> list[dict[str, Any]]:
        """``events()`` once the processes they name are gone: each "exit" record's
        ``code`` is then the status the kernel reported (``harness.with_kernel_exits``)."""
        events = self.events()
        with_kernel_exits(events, self.watch)
        return events

    def report(self) -> str:
        """Everything a failure needs: SLURM's view, the job's output, every rank's log."""
        parts = [f"--- scontrol show job {self.id} ---\n{self.info()}"]
        texts = [self.output, *sorted((self.folder / "logs").glob("*.log"))]
        for path in texts:
            if path.exists():
                tail = "\n".join(path.read_text(errors="replace").splitlines()[-60:])
                parts.append(f"--- {path.name} (last 60 lines) ---\n{tail}")
        return "\n".join(parts)

    def wait_state(self, what: str, ok: Callable[[dict[str, str]], bool], timeout: float) -> Any:
        def probe() -> dict[str, str] | None:
            info = self.info()
            return info if ok(info) else None

        return poll(f"job {self.id} {what}", probe, timeout, self.report)

    def wait_done(self, timeout: float = JOB_S) -> dict[str, str]:
        info: dict[str, str] = self.wait_state(
            "in a final state", lambda i: i["JobState"] in DONE, timeout
        )
        return info

    def wait_events(self, what: str, found: Callable[[list[dict[str, Any]]], Any]) -> Any:
        return poll(what, lambda: found(self.events()), JOB_S, self.report)

    def assert_nothing_left(self, timeout: float = 60.0) -> None:
        """No process that carries this job's marker is alive (bounded wait)."""
        poll(
            f"every process of job {self.id} gone",
            lambda: not marked_pids(self.marker),
            timeout,
            lambda: f"still alive: {marked_pids(self.marker)}\n{self.report()}",
        )


class Cluster:
    def __init__(self) -> None:
        self.jobs: list[Job] = []
        self.ports: list[HeldPort] = []

    def hold_port(self) -> str:
        """A job's MASTER_PORT, held until every job ended (a requeued job binds it again)."""
        port = HeldPort()
        self.ports.append(port)
        return str(port.number)

    def submit(self, folder: Path, script: Path, cmd: list[str], env: Any = None) -> Job:
        folder.mkdir(parents=True, exist_ok=True)
        return Job(self, folder, script, cmd, env or {})

    def cleanup(self) -> None:
        """scancel whatever is not finished, wait (bounded) until SLURM says it ended and
        its processes are gone; kill (and fail on) anything SLURM left behind."""
        left: list[int] = []
        try:
            for job in self.jobs:
                if job.info()["JobState"] not in DONE:
                    slurm("scancel", job.id)
                    job.wait_done(timeout=120)
                try:
                    job.assert_nothing_left()
                except AssertionError:
                    left += marked_pids(job.marker)
                    for pid in marked_pids(job.marker):
                        procfs.kill(pid)
        finally:
            for port in self.ports:
                port.release()
        assert not left, f"processes left after the jobs ended (killed now): {left}"


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    assert Path(SLURM_CONF).exists(), (
        f"no test cluster ({SLURM_CONF} missing): run `make test-slurm`, which starts it"
    )
    c = Cluster()
    try:
        yield c
    finally:
        c.cleanup()


def test_sbatch_runs_the_example_search(cluster: Cluster, tmp_path: Path) -> None:
    """examples/slurm.sbatch's flow at 1 node x 2 tasks: srun starts both ranks of
    examples/torchrun_ddp.py; the job ends COMPLETED with exactly the budget in NePS."""
    root = tmp_path / "root"
    cmd = [PYTHON, str(EXAMPLE), "--devices", "2", "--trials", "3", "--root", str(root)]
    job = cluster.submit(tmp_path / "job", JOB_SBATCH, cmd)
    info = job.wait_done()
    report = job.report()
    assert info["JobState"] == "COMPLETED", report
    assert info["ExitCode"] == "0:0", report
    assert states(root) == dict.fromkeys("123", "success"), report
    out = job.output.read_text()
    # Both ranks are srun's tasks (neps_bcast detected SLURM), in one group of 2.
    assert "[neps_bcast rank 0/2 leader]" in out, report
    assert "[neps_bcast rank 1/2 follower]" in out, report
    job.assert_nothing_left()


@pytest.mark.parametrize("how", ["scontrol_requeue", "sigterm_to_the_tasks"])
def test_a_requeued_job_evaluates_the_interrupted_trial_again(
    cluster: Cluster, tmp_path: Path, how: str
) -> None:
    """examples/slurm_requeue.sbatch's flow. During trial 2 the job is either requeued by
    SLURM (``scontrol requeue``, as preemption does: SIGTERM to every task and the batch
    script) or its tasks get SIGTERM (``scancel --signal=TERM``, as ``--signal=TERM@120``
    does before a time limit: the script sees 143 and requeues the job itself). Trial 2 is
    back to pending, every rank exited 143; the requeued job evaluates trial 2 first, on
    both ranks, with the same arguments, finishes the budget and ends COMPLETED."""
    root = tmp_path / "root"
    folder = tmp_path / "job"
    env = {
        "NB_RECORD_DIR": str(folder / "rec"),
        "NB_LOG_DIR": str(folder / "logs"),
        # The first run's trial 2 trains for a long while on every rank, so that the
        # requeue arrives in its middle whatever the machine's load.
        "NB_FAULT_FIRST_RUN": "sleep:all:trial=2:s=240",
    }
    search = [PYTHON, str(LIGHTNING), "--trials", "3", "--root", str(root), "--with-dirs"]
    job = cluster.submit(folder, REQUEUE_SBATCH, search, env)

    job.wait_events(
        "both ranks inside trial 2's training",
        lambda ev: {e["rank"] for e in ev if e["event"] == "fault" and e["seq"] == 2} == {0, 1},
    )
    assert states(root) == {"1": "success", "2": "evaluating"}, job.report()
    first_pids = {e["pid"] for e in job.events() if e["event"] == "start"}
    before = [e for e in job.events() if e["event"] == "trial" and e["trial_id"] == "2"]
    if how == "scontrol_requeue":
        slurm("scontrol", "requeue", job.id)
    else:
        slurm("scancel", "--signal=TERM", job.id)

    job.wait_state(
        "requeued and pending",
        lambda i: i["Restarts"] == "1" and i["JobState"] == "PENDING",
        timeout=120,
    )
    # Every process of the first run is gone: each rank recorded 143 ("requeue me"), and
    # NePS holds trial 2 as pending (not crashed, not evaluating).
    exits = {e["proc_rank"]: e["code"] for e in job.ended() if e["event"] == "exit"}
    assert exits == {0: 143, 1: 143}, job.report()
    assert states(root) == {"1": "success", "2": "pending"}, job.report()
    assert not marked_pids(job.marker), job.report()
    # slurmctld holds a requeued batch job back until its old credential expired
    # (cred_expire + 1 s: 11 s with tests/slurm/cluster.sh's AuthInfo=cred_expire=10). Not
    # overridden with StartTime=now: started earlier, slurmd refused the revoked credential
    # and the job FAILED at once (ExitCode 1:0), 2 times in 2 runs after the script itself
    # had requeued the job.

    info = job.wait_done()
    report = job.report()
    assert info["JobState"] == "COMPLETED", report
    assert info["ExitCode"] == "0:0", report
    assert info["Restarts"] == "1", report
    assert states(root) == dict.fromkeys("123", "success"), report

    events = job.ended()
    again = [e for e in events if e["pid"] not in first_pids]
    exits_again = {e["proc_rank"]: e["code"] for e in again if e["event"] == "exit"}
    assert exits_again == {0: 0, 1: 0}, report
    trials_again = sorted((e for e in again if e["event"] == "trial"), key=lambda e: e["t"])
    redone = [e for e in trials_again if e["trial_id"] == "2"]
    assert sorted(e["rank"] for e in redone) == [0, 1], report
    for e in redone:  # the same configuration, the same pipeline directory
        assert e["kwargs"] == before[0]["kwargs"], report
    assert trials_again[0]["trial_id"] == "2", report  # before anything new was sampled
    lease = read_lease(Path(before[0]["kwargs"]["pipeline_directory"]))
    assert lease is not None
    assert len(lease.attempts) == 1, lease
    assert "preempted" in lease.attempts[0].how, lease

    out = job.output.read_text()
    assert f"job {job.id}, restart 0" in out, report
    assert f"job {job.id}, restart 1" in out, report
    requeued_by_script = "the running trial is pending again; requeueing" in out
    assert requeued_by_script == (how == "sigterm_to_the_tasks"), report
    job.assert_nothing_left()
