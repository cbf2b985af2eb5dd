"""End to end: ranks started by an external launcher (torchrun, several nodes, SLURM),
Lightning Fabric, several NePS workers on one root, and bad input.

Real torchrun, real gloo, real NePS, real Lightning. Ports are chosen by torchrun
(``--standalone``) or by binding port 0 just before the launch.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from harness import (
    PYTHON,
    SCRIPTS,
    SEARCH,
    TORCHRUN,
    Launch,
    assert_clean_launch,
    base_env,
    launch,
    neps_trials,
    read_records,
    trials_by_rank,
)

FAKE_SRUN = SCRIPTS / "fake_srun.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun(nproc: int, *extra: str) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc-per-node={nproc}", *extra, str(SEARCH)]


def run_one(
    tmp_path: Path, cmd: list[str], name: str = "launch", *, cwd: Path | None = None, **env: str
) -> tuple[Launch, Path, list[dict[str, Any]]]:
    root, rec = tmp_path / f"{name}_root", tmp_path / f"{name}_rec"
    result = launch(
        cmd,
        log_path=tmp_path / f"{name}.log",
        env=base_env(NB_ROOT=str(root), NB_RECORD=str(rec), **env),
        cwd=cwd or tmp_path,
    )
    return result, root, read_records(rec)


def run_together(*jobs: dict[str, Any]) -> list[Launch]:
    """Start several launches at the same instant; each is bounded by ``launch``."""
    results: list[Any] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def go(i: int) -> None:
        start.wait()
        try:
            results[i] = launch(**jobs[i])
        except AssertionError as exc:  # overran: re-raised below with its log
            results[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, AssertionError):
            raise r
    return results


def assert_group_followed_its_leader(
    events: list[dict[str, Any]], world: int, log: str, trials: int | None = None
) -> list[str]:
    """Every rank evaluated exactly the leader's trials, with the same arguments, in order."""
    by_rank = trials_by_rank(events)
    assert sorted(by_rank) == list(range(world)), log[-3000:]
    leader = by_rank[0]
    if trials is not None:
        assert len(leader) == trials
    for rank in range(1, world):
        assert json.dumps(by_rank[rank], sort_keys=True) == json.dumps(leader, sort_keys=True)
    exits = [e for e in events if e["event"] == "exit"]
    assert len(exits) == world, exits
    assert all(e["ok"] for e in exits), exits
    for e in exits:
        if e["proc_rank"] != 0:  # followers never touch NePS
            assert e["calls"] == {"neps.run": 0, "NePSState.create_or_load": 0}
    return [tid for tid, _ in leader]


def assert_neps_recorded(root: Path, trial_ids: list[str]) -> None:
    recorded = neps_trials(root)
    assert sorted(recorded) == sorted(trial_ids)
    assert all(
        t.report is not None and t.report.reported_as == "success" for t in recorded.values()
    )


@pytest.mark.parametrize(("nproc", "trials"), [(2, 4), (4, 3)])
def test_torchrun_lightning_reuses_the_group(tmp_path: Path, nproc: int, trials: int) -> None:
    result, root, events = run_one(
        tmp_path, torchrun(nproc), NB_DEVICES=str(nproc), NB_TRIALS=str(trials), NB_EXTRA_ARGS="1"
    )
    assert_clean_launch(result)
    ids = assert_group_followed_its_leader(events, nproc, result.log, trials)
    assert_neps_recorded(root, ids)
    # torchrun started every rank; Lightning spawned nothing (every trial ran in the
    # processes that torchrun started) and the group existed before trial 1.
    started = {e["pid"] for e in events if e["event"] == "start"}
    assert len(started) == nproc
    assert {e["pid"] for e in events if e["event"] == "trial"} == started
    assert {e["world_size"] for e in events if e["event"] == "trial"} == {nproc}
    assert f"[neps_bcast rank {nproc - 1}/{nproc} follower] control channel up" in result.log


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_fabric_inside_the_function(tmp_path: Path, launcher: str) -> None:
    cmd = [PYTHON, str(SEARCH)] if launcher == "python" else torchrun(2)
    result, root, events = run_one(tmp_path, cmd, NB_STRATEGY="fabric", NB_TRIALS="3")
    assert_clean_launch(result)
    ids = assert_group_followed_its_leader(events, 2, result.log, 3)
    assert_neps_recorded(root, ids)
    if launcher == "python":  # Fabric's launcher re-ran the script once for rank 1
        assert "Lightning child of the leader" in result.log


def test_two_nodes_followers_need_no_neps_root(tmp_path: Path) -> None:
    """torchrun --nnodes 2 with a c10d rendezvous; each "node" has its own cwd."""
    port = free_port()
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    rec = tmp_path / "rec"
    jobs = []
    for i, node in enumerate(nodes):
        node.mkdir()
        cmd = [
            TORCHRUN,
            "--nnodes=2",
            "--nproc-per-node=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=nb{port}",
            str(SEARCH),
        ]
        env = base_env(
            NB_ROOT="results", NB_RECORD=str(rec), NB_STRATEGY="plain_ddp", NB_TRIALS="3"
        )
        jobs.append({"cmd": cmd, "log_path": tmp_path / f"node{i}.log", "env": env, "cwd": node})
    results = run_together(*jobs)
    for r in results:
        assert_clean_launch(r)
    events = read_records(rec)
    log = "\n".join(r.log for r in results)
    ids = assert_group_followed_its_leader(events, 4, log, 3)
    cwd_of = {e["proc_rank"]: Path(e["cwd"]) for e in events if e["event"] == "start"}
    leader_node = cwd_of[0]
    other = next(n for n in nodes if n != leader_node)
    assert sorted(cwd_of.values()).count(other) == 2  # two followers ran there
    assert list(other.iterdir()) == [], "a follower created files in its working directory"
    assert_neps_recorded(leader_node / "results", ids)


def test_simulated_slurm_without_torchrun(tmp_path: Path) -> None:
    cmd = [PYTHON, str(FAKE_SRUN), "--ntasks", "2", "--", PYTHON, str(SEARCH)]
    result, root, events = run_one(
        tmp_path, cmd, NB_TRIALS="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    )
    assert_clean_launch(result)
    ids = assert_group_followed_its_leader(events, 2, result.log, 3)
    assert_neps_recorded(root, ids)
    assert {e["world_size"] for e in events if e["event"] == "trial"} == {2}
    assert len({e["pid"] for e in events if e["event"] == "trial"}) == 2  # nothing spawned


def test_two_groups_start_together_on_one_root(tmp_path: Path) -> None:
    """Two DDP groups (two torchrun launches) start at the same instant on one root,
    which exists but is empty, with hash seeds that order NePS's categorical choices
    differently: plain NePS fails in each of these ways."""
    root = tmp_path / "shared_root"
    root.mkdir()
    jobs = []
    for name, other, seed in (("a", "b", "1"), ("b", "a", "2")):
        # NB_MEET: each group's first trial waits for the other's, so they overlap.
        env = base_env(
            NB_ROOT=str(root),
            NB_RECORD=str(tmp_path / f"rec_{name}"),
            NB_STRATEGY="plain_ddp",
            NB_TRIALS="6",
            PYTHONHASHSEED=seed,
            NB_MEET=f"{tmp_path}:{name}:{other}",
        )
        jobs.append(
            {"cmd": torchrun(2), "log_path": tmp_path / f"{name}.log", "env": env, "cwd": tmp_path}
        )
    results = run_together(*jobs)
    ids: list[str] = []
    for r, name in zip(results, "ab", strict=True):
        assert_clean_launch(r)
        group_ids = assert_group_followed_its_leader(
            read_records(tmp_path / f"rec_{name}"), 2, r.log
        )
        assert group_ids, f"group {name} evaluated nothing"
        ids += group_ids
    assert len(ids) == len(set(ids)), "a trial was evaluated by both groups"
    assert_neps_recorded(root, ids)
    assert len(ids) >= 6
    assert "continuing with the equivalent search space" in "\n".join(r.log for r in results)


JOIN = {"NEPS_BCAST_JOIN_TIMEOUT_S": "15"}


def test_a_rank_that_never_calls_run_is_named(tmp_path: Path) -> None:
    result, root, _ = run_one(tmp_path, torchrun(2), NB_BAD="skip_run:rank=1", **JOIN)
    assert_clean_launch(result, expect_rc=1)
    assert (
        "[neps_bcast rank 0/2 leader] rank 1 of 2 did not call neps_bcast.run within"
        " 15 s; expected ranks 0..1, observed only 0. HINT:"
    ) in result.log
    assert not root.exists()


def test_ranks_with_different_arguments_fail_on_every_rank(tmp_path: Path) -> None:
    result, root, _ = run_one(tmp_path, torchrun(2), NB_BAD="root+space:rank=1", **JOIN)
    assert_clean_launch(result, expect_rc=1)
    for tag in ("rank 0/2 leader", "rank 1/2 follower"):
        line = next(
            line
            for line in result.log.splitlines()
            if f"[neps_bcast {tag}] the ranks called neps_bcast.run with different" in line
        )
        assert "expected the same pipeline_space, root_directory on all 2 ranks" in line
        assert f"root_directory: rank 0: '{root}', rank 1: '{root}_elsewhere'" in line
        assert "pipeline_space: rank 0: Basic(" in line
        assert "rank 1: WithFidelity(" in line
        assert "HINT: every rank must run the same script" in line
    assert not root.exists()


def test_trainer_devices_inconsistent_with_the_world_size(tmp_path: Path) -> None:
    """Lightning itself refuses devices * num_nodes != torchrun's world size, on every
    rank; the trial fails on every rank and the search ends, bounded, nothing left."""
    result, root, events = run_one(tmp_path, torchrun(2), NB_DEVICES="4", NB_TRIALS="3")
    assert_clean_launch(result, expect_rc=1)
    assert (
        "You set `devices=4` and `num_nodes=1` in Lightning, but the product (4 * 1)"
        " does not match the world size (2)"
    ) in result.log
    assert re.search(r"trial 1 failed on ranks (0, 1|1, 0): rank", result.log)
    exits = {e["proc_rank"]: e for e in events if e["event"] == "exit"}
    assert not exits[0]["ok"]
    assert "WorkerRaiseError" in exits[0]["error"]  # NePS re-raises the trial's error
    assert exits[1]["ok"]  # the follower stopped when its leader's neps.run ended
    recorded = neps_trials(root)
    assert [t.report.reported_as for t in recorded.values()] == ["crashed"]
