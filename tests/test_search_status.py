"""``neps-bcast status ROOT`` on roots built from a real ``neps.run``'s files: what each
line says, stale and fresh leases, a pool's devices, 1000 trials, errors, no torch.

The end-to-end checks (a status of live Lightning, torchrun and pool searches) are in
tests/e2e/test_e2e_status.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import neps
import pytest

from neps_bcast import cli
from neps_bcast.compat import procfs
from neps_bcast.config import Settings
from neps_bcast.launcher import search_status, search_text, trial_placement
from neps_bcast.launcher.lease_record import Attempt, Lease, Owner
from neps_bcast.recovery.lease_file import write_lease


class Space(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)


CALLS = [0]


def evaluate(lr: float) -> float:
    """The 3rd evaluation raises: 5 successes and 1 crash, whatever NePS samples."""
    CALLS[0] += 1
    if CALLS[0] == 3:
        raise ValueError("the third evaluation fails")
    return lr


@pytest.fixture(scope="module")
def real_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("status") / "root"
    neps.run(
        evaluate,
        pipeline_space=Space(),
        root_directory=path,
        total_evaluations_to_spend=6,
        optimizer="random_search",
        ignore_errors=True,
    )
    return path


def trial_dir(root: Path, trial_id: str) -> Path:
    return root / "configs" / f"config_{trial_id}"


def make_root(real_root: Path, where: Path, n: int) -> Path:
    """A root of ``n`` trials: the real root's first trial copied, ids 1..n."""
    root = where / "root"
    root.mkdir()
    for name in ("optimizer_info.yaml", "pipeline_space.pkl", "optimizer_state.pkl"):
        shutil.copy(real_root / name, root / name)
    template = trial_dir(real_root, "1")  # a success: only the 3rd evaluation raises
    metadata = json.loads((template / "metadata.json").read_text())
    for i in range(1, n + 1):
        directory = trial_dir(root, str(i))
        shutil.copytree(template, directory)
        (directory / "metadata.json").write_text(
            json.dumps({**metadata, "id": str(i), "location": str(directory)})
        )
    return root


def set_evaluating(root: Path, trial_id: str, started: float, worker: str = "w") -> None:
    path = trial_dir(root, trial_id) / "metadata.json"
    metadata = json.loads(path.read_text())
    metadata.update(
        state="evaluating", time_started=started, time_end=None, evaluating_worker_id=worker
    )
    path.write_text(json.dumps(metadata))
    (trial_dir(root, trial_id) / "report.yaml").unlink(missing_ok=True)


def dead_owner() -> Owner:
    """This machine's identity with the pid of a process that has exited."""
    proc = subprocess.Popen(["sleep", "30"])
    ticks = procfs.start_ticks(proc.pid) or 0
    proc.kill()
    proc.wait()
    me = Owner.me()
    return Owner(me.host, me.boot_id, me.pid_namespace, proc.pid, ticks)


def status_of(root: Path, **settings: float) -> search_status.SearchStatus:
    return search_status.read_status(root, Settings(**settings))  # type: ignore[arg-type]


def test_a_finished_search_shows_each_trial_final_state_and_the_best(real_root: Path) -> None:
    status = status_of(real_root)
    states = {t.trial_id: t.state for t in status.trials}
    assert len(states) == 6
    assert sorted(states.values()) == ["crashed", *["success"] * 5]
    best = min((t for t in status.trials if t.state == "success"), key=lambda t: t.objective or 0)
    assert status.best == best
    assert status.best_config == {"lr": best.objective}
    assert status.budget.evaluations == 6
    assert status.budget.evaluations_limit == 6
    text = search_text.render(status)
    assert f"best: trial {best.trial_id}" in text
    assert "budget: 6 of 6 evaluations used" in text


def test_a_running_trial_shows_host_pid_ranks_attempt_and_a_fresh_heartbeat(
    real_root: Path, tmp_path: Path
) -> None:
    root = make_root(real_root, tmp_path, 3)
    now = time.time()
    set_evaluating(root, "2", now - 5)
    me = Owner.me()
    earlier = Attempt(dead_owner(), now - 100, now - 90, "its leader is gone")
    write_lease(trial_dir(root, "2"), Lease("2", me, now - 4, now - 1, (earlier,), ranks=2))
    trial = next(t for t in status_of(root).trials if t.trial_id == "2")
    assert (trial.state, trial.host, trial.pid, trial.ranks, trial.attempt) == (
        "evaluating",
        me.host,
        me.pid,
        2,
        2,
    )
    assert trial.stale is None
    assert trial.heartbeat_age_s is not None and trial.heartbeat_age_s < 60
    assert trial.elapsed_s is not None and trial.elapsed_s >= 5
    text = search_text.render(status_of(root))
    line = next(row for row in text.splitlines() if row.startswith("2 "))
    assert f"{me.host} pid {me.pid}, 2 ranks" in line


def test_a_dead_leader_on_this_machine_makes_its_lease_stale(
    real_root: Path, tmp_path: Path
) -> None:
    root = make_root(real_root, tmp_path, 2)
    now = time.time()
    set_evaluating(root, "1", now - 5)
    gone = dead_owner()
    write_lease(trial_dir(root, "1"), Lease("1", gone, now - 5, now - 1))
    trial = status_of(root).trials[0]
    assert trial.stale == f"its leader (pid {gone.pid} on {gone.host}) is gone"
    assert "STALE: its leader" in search_text.render(status_of(root))


def test_a_leader_elsewhere_is_stale_only_after_the_grace(real_root: Path, tmp_path: Path) -> None:
    root = make_root(real_root, tmp_path, 2)
    now = time.time()
    elsewhere = Owner("other-node", "boot", "ns", 4242, 1)
    for trial_id, heartbeat in (("1", now - 400), ("2", now - 10)):
        set_evaluating(root, trial_id, now - 500)
        write_lease(trial_dir(root, trial_id), Lease(trial_id, elsewhere, now - 500, heartbeat))
    silent, alive = status_of(root, lease_grace_s=300.0).trials
    assert silent.stale is not None and silent.stale.startswith("no heartbeat from its leader")
    assert alive.stale is None


def test_a_pool_shows_each_device_and_the_trial_on_it(real_root: Path, tmp_path: Path) -> None:
    root = make_root(real_root, tmp_path, 3)
    now = time.time()
    me = Owner.me()
    for trial_id, devices in (("1", (0, 1)), ("2", (3,))):
        set_evaluating(root, trial_id, now - 2)
        write_lease(trial_dir(root, trial_id), Lease(trial_id, me, now - 2, now))
        trial_placement.write(
            trial_dir(root, trial_id),
            trial_placement.placed_now(trial_id, devices, None, 4, (1, 2), "launch"),
        )
    status = status_of(root)
    on = {d.device: d.trial_id for d in status.devices}
    assert on == {0: "1", 1: "1", 2: None, 3: "2"}
    assert status.trials[0].devices == (0, 1)
    assert status.trials[0].ranks == 2
    assert status.trials[0].rank_pids == (1, 2)
    text = search_text.render(status)
    assert f"pool {socket.gethostname()} device 2: free" in text
    assert "devices 0,1 (rank pids 1,2)" in text


def test_a_placement_from_an_earlier_attempt_is_not_shown(real_root: Path, tmp_path: Path) -> None:
    root = make_root(real_root, tmp_path, 1)
    trial_placement.write(
        trial_dir(root, "1"), trial_placement.placed_now("1", (0,), None, 2, (1,), "old")
    )
    now = time.time() + 1
    set_evaluating(root, "1", now)
    write_lease(trial_dir(root, "1"), Lease("1", Owner.me(), now, now))
    status = status_of(root)
    assert (status.trials[0].devices, status.devices) == (None, [])


def test_1000_trials_take_one_scan_and_a_few_files_each(real_root: Path, tmp_path: Path) -> None:
    root = make_root(real_root, tmp_path, 1000)
    now = time.time()
    for i in range(1, 11):  # ten running, with leases and placements
        set_evaluating(root, str(i), now - 3)
        write_lease(trial_dir(root, str(i)), Lease(str(i), Owner.me(), now - 3, now))
    started = time.perf_counter()
    status = status_of(root)
    seconds = time.perf_counter() - started
    print(f"status of 1000 trials: {seconds:.3f} s, {status.files_read} files read")
    assert len(status.trials) == 1000
    assert status.counts == {"evaluating": 10, "success": 990}
    # Per trial: metadata + lease, a finished one its report, a running one its
    # placement; then the best trial's config and the optimizer state.
    assert status.files_read == 1000 * 2 + 990 + 10 + 2
    assert seconds < 5.0, f"{seconds:.2f} s for 1000 trials (goal: under 1 s on an idle core)"


def test_json_parses_and_holds_every_trial(
    real_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["status", str(real_root), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["trials"]) == 6
    assert data["budget"]["evaluations_limit"] == 6
    assert data["best"]["state"] == "success"


def expect_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["status", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.strip()


def test_a_missing_root_names_the_path_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expect_error([str(tmp_path / "nope")], capsys) == (
        f"[neps_bcast status] {tmp_path / 'nope'} does not exist; expected the root_directory"
        " your script passes to neps_bcast.run (NePS's default: neps_results). HINT: pass"
        " that directory (a relative path is taken from the current directory, on any node"
        " that sees the shared filesystem), e.g. neps-bcast status results."
    )


def test_a_file_is_not_a_root(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.py").write_text("")
    assert expect_error([str(tmp_path / "train.py")], capsys) == (
        f"[neps_bcast status] {tmp_path / 'train.py'} is a file; expected a NePS root"
        f" directory. HINT: pass the directory the search writes to, e.g. {tmp_path}."
    )


def test_a_directory_that_is_not_a_root_points_to_the_root_nearby(
    real_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    what = (
        "is not a NePS root: it holds none of optimizer_info.yaml, pipeline_space.pkl,"
        " optimizer_state.pkl or configs/."
    )
    for given in (real_root / "configs", real_root.parent):
        assert expect_error([str(given)], capsys) == (
            f"[neps_bcast status] {given} {what} HINT: did you mean {real_root}?"
            f" neps-bcast status {real_root}."
        )


def test_an_empty_directory_says_to_start_the_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expect_error([str(tmp_path)], capsys).endswith(
        "HINT: pass the root_directory your script passes to neps_bcast.run; a search that"
        " has not started yet has no root: start it first."
    )


def test_watch_needs_positive_seconds(real_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert expect_error([str(real_root), "--watch", "0"], capsys) == (
        "[neps_bcast status] --watch 0.0: expected a positive number of seconds."
        " HINT: pass e.g. --watch 5."
    )


NO_TORCH = """
import sys
{setup}
from neps_bcast.cli import main
assert main(["status", sys.argv[1]]) == 0
print("IMPORTED", sorted(m for m in ("torch", "neps", "lightning") if m in sys.modules))
"""


def imported_by_status(root: Path, setup: str = "") -> str:
    out = subprocess.run(
        [sys.executable, "-c", NO_TORCH.format(setup=setup), str(root)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
    ).stdout
    return out.splitlines()[-1]


def test_status_imports_neither_torch_nor_neps(real_root: Path) -> None:
    assert imported_by_status(real_root) == "IMPORTED []"


def test_the_import_check_sees_torch_when_it_is_imported(real_root: Path) -> None:
    assert imported_by_status(real_root, "import neps") == "IMPORTED ['neps', 'torch']"


HOLD_LOCKS = """
import fcntl, os, sys
fds = []
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    fds.append(fd)
print("held", flush=True)
sys.stdin.read()
"""


def test_status_answers_while_another_process_holds_every_lock_of_the_root(
    real_root: Path, tmp_path: Path
) -> None:
    """NePS's trial, optimizer and summary locks and every lease's lock, held
    exclusively by another process (as a NePS worker holds them while it samples or
    records): the status still answers, because it takes none of them."""
    root = make_root(real_root, tmp_path, 3)
    set_evaluating(root, "1", time.time())
    write_lease(trial_dir(root, "1"), Lease("1", Owner.me(), time.time(), time.time()))
    locks = [root / ".configs.lock", root / ".optimizer.lock"]
    locks += [trial_dir(root, str(i)) / ".neps_bcast_lease.lock" for i in (1, 2, 3)]
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCKS, *map(str, locks)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # Positive control: the locks are really held (a lock attempt here fails).
        fd = os.open(locks[0], os.O_RDWR)
        try:
            with pytest.raises(
                OSError, match=r"Resource temporarily unavailable|Permission denied"
            ):
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        done = subprocess.run(
            [sys.executable, "-m", "neps_bcast", "status", str(root), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["counts"] == {"evaluating": 1, "success": 2}
    finally:
        holder.communicate(input="", timeout=30)


def test_watch_shows_it_again_until_ctrl_c(real_root: Path) -> None:
    watcher = subprocess.Popen(
        [sys.executable, "-m", "neps_bcast", "status", str(real_root), "--watch", "0.1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watcher.stdout is not None
    shown = 0
    for line in watcher.stdout:  # bounded: each refresh prints; the second one ends the loop
        shown += line.startswith(str(real_root))
        if shown == 2:
            break
    watcher.send_signal(signal.SIGINT)
    assert (watcher.wait(timeout=30), shown) == (0, 2), watcher.stderr.read()  # type: ignore[union-attr]


def test_a_lease_written_before_ranks_were_recorded_still_reads() -> None:
    """A shared root may hold leases of an older neps_bcast (no ``ranks``)."""
    old = json.loads(Lease("7", Owner.me(), 1.0, 2.0).to_json())
    del old["ranks"]
    assert Lease.from_json(json.dumps(old)).ranks is None
    assert Lease.from_json(Lease("7", None, 1.0, 2.0, ranks=4).to_json()).ranks == 4


def test_a_root_that_cannot_be_read_names_the_error_and_the_fix(
    real_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(real_root / "optimizer_info.yaml", root / "optimizer_info.yaml")
    (root / "configs").write_text("not a directory")
    assert expect_error([str(root)], capsys) == (
        f"[neps_bcast status] could not read the search on {root}: NotADirectoryError:"
        f" [Errno 20] Not a directory: '{root / 'configs'}'. HINT: run it as a user who can"
        " read the root and every trial's directory in it; a root that another process is"
        " deleting cannot be shown."
    )
