"""End to end: ranks started by an external launcher (torchrun, several nodes, SLURM),
Lightning Fabric, several NePS workers on one root, and bad input.

Real torchrun, real gloo, real NePS, real Lightning. Ports are chosen by torchrun
(``--standalone``) or by binding port 0 just before the launch.
"""

from __future__ import annotations

import fcntl
import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest

from harness import (
    assert_clean_launch,
    assert_followers_never_touch_neps,
    exits_by_rank,
    neps_trials,
    python_cmd,
    run,
    srun_cmd,
    start,
    torchrun_cmd,
    trials_by_rank,
)
from scenario import BadInput, Meet, Scenario


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_group_followed_its_leader(
    events: list[dict[str, Any]], world: int, log: str, trials: int | None = None
) -> list[str]:
    """Every rank evaluated exactly the leader's trials, with the same arguments, in
    order; every rank exited with 0; followers never touched NePS (the leader did)."""
    by_rank = trials_by_rank(events)
    assert sorted(by_rank) == list(range(world)), log[-3000:]
    leader = by_rank[0]
    if trials is not None:
        assert len(leader) == trials
    for rank in range(1, world):
        assert json.dumps(by_rank[rank], sort_keys=True) == json.dumps(leader, sort_keys=True)
    exits = exits_by_rank(events)
    assert sorted(exits) == list(range(world)), exits
    assert all(e["ok"] and e["code"] == 0 for e in exits.values()), exits
    assert_followers_never_touch_neps(exits)
    return [tid for tid, _ in leader]


def assert_neps_recorded(root: Path, trial_ids: list[str]) -> None:
    recorded = neps_trials(root)
    assert sorted(recorded) == sorted(trial_ids)
    assert all(
        t.report is not None and t.report.reported_as == "success" for t in recorded.values()
    )


@pytest.mark.parametrize(("nproc", "trials"), [(2, 4), (4, 3)])
def test_torchrun_lightning_reuses_the_group(tmp_path: Path, nproc: int, trials: int) -> None:
    result = run(
        Scenario(devices=nproc, trials=trials, extra_args=True), tmp_path, cmd=torchrun_cmd(nproc)
    )
    assert_clean_launch(result)
    events = result.events
    ids = assert_group_followed_its_leader(events, nproc, result.log, trials)
    assert_neps_recorded(result.root, ids)
    # torchrun started every rank; Lightning spawned nothing (every trial ran in the
    # processes that torchrun started) and the group existed before trial 1.
    started = {e["pid"] for e in result.of("start")}
    assert len(started) == nproc
    assert {e["pid"] for e in result.of("trial")} == started
    assert {e["world_size"] for e in result.of("trial")} == {nproc}
    assert f"[neps_bcast rank {nproc - 1}/{nproc} follower] control channel up" in result.log


@pytest.mark.parametrize("launcher", ["python", "torchrun"])
def test_fabric_inside_the_function(tmp_path: Path, launcher: str) -> None:
    cmd = python_cmd() if launcher == "python" else torchrun_cmd(2)
    result = run(Scenario(strategy="fabric", trials=3), tmp_path, cmd=cmd)
    assert_clean_launch(result)
    ids = assert_group_followed_its_leader(result.events, 2, result.log, 3)
    assert_neps_recorded(result.root, ids)
    if launcher == "python":  # Fabric's launcher re-ran the script once for rank 1
        assert "Lightning child of the leader" in result.log


def test_two_nodes_followers_need_no_neps_root(tmp_path: Path) -> None:
    """torchrun --nnodes 2 with a c10d rendezvous; each "node" has its own cwd."""
    port = free_port()
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    running = []
    for i, node in enumerate(nodes):
        node.mkdir()
        cmd = torchrun_cmd(
            2,
            "--nnodes=2",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=nb{port}",
            standalone=False,
        )
        scenario = Scenario(root="results", strategy="plain_ddp", trials=3)
        running.append(start(scenario, tmp_path, name=f"launch{i}", cmd=cmd, cwd=node))
    results = [r.finish() for r in running]
    for r in results:
        assert_clean_launch(r)
    events = sorted((e for r in results for e in r.events), key=lambda e: e["t"])
    log = "\n".join(r.log for r in results)
    ids = assert_group_followed_its_leader(events, 4, log, 3)
    cwd_of = {e["proc_rank"]: Path(e["cwd"]) for e in events if e["event"] == "start"}
    leader_node = cwd_of[0]
    other = next(n for n in nodes if n != leader_node)
    assert sorted(cwd_of.values()).count(other) == 2  # two followers ran there
    assert list(other.iterdir()) == [], "a follower created files in its working directory"
    assert_neps_recorded(leader_node / "results", ids)


def test_simulated_slurm_without_torchrun(tmp_path: Path) -> None:
    result = run(
        Scenario(trials=3),
        tmp_path,
        cmd=srun_cmd(2),
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
    )
    assert_clean_launch(result)
    ids = assert_group_followed_its_leader(result.events, 2, result.log, 3)
    assert_neps_recorded(result.root, ids)
    assert {e["world_size"] for e in result.of("trial")} == {2}
    assert len({e["pid"] for e in result.of("trial")}) == 2  # nothing spawned


def test_two_groups_start_together_on_one_root(tmp_path: Path) -> None:
    """Two DDP groups (two torchrun launches) start together on one root, which exists
    but is empty, with hash seeds that order NePS's categorical choices differently:
    plain NePS fails in each of these ways. The test holds the root lock while both
    start, so that both leaders are seen waiting for it, then lets them contend."""
    root = tmp_path / "shared_root"
    root.mkdir()
    lock_path = tmp_path / ".shared_root.neps_bcast.lock"
    waiting = "waiting for another worker to finish starting on"
    meet = tmp_path / "meet"
    meet.mkdir()
    with lock_path.open("ab") as held:
        fcntl.lockf(held.fileno(), fcntl.LOCK_EX)  # the kind NePS (and the guard) use
        running = []
        for name, other, seed in (("a", "b", "1"), ("b", "a", "2")):
            scenario = Scenario(
                root=str(root),
                strategy="plain_ddp",
                trials=6,
                # Each group's first trial waits for the other's, so they overlap.
                meet=Meet(folder=str(meet), me=name, other=other),
            )
            running.append(
                start(
                    scenario, tmp_path, name=name, cmd=torchrun_cmd(2), env={"PYTHONHASHSEED": seed}
                )
            )
        for r in running:
            r.wait_for_log(f"[neps_bcast rank 0/2 leader] {waiting} {root}")
        fcntl.lockf(held.fileno(), fcntl.LOCK_UN)
    results = [r.finish() for r in running]
    ids: list[str] = []
    for r in results:
        assert_clean_launch(r)
        group_ids = assert_group_followed_its_leader(r.events, 2, r.log)
        assert group_ids, f"group {r.name} evaluated nothing"
        ids += group_ids
        # Each leader waited once, for the test's hold; nothing waited in a follower.
        assert r.log.count(waiting) == 1, r.tail()
    assert len(ids) == len(set(ids)), "a trial was evaluated by both groups"
    assert_neps_recorded(root, ids)
    assert len(ids) >= 6
    # Serialized by the lock: one leader created the root, the other then found it.
    made = ["removing the empty root" in r.log for r in results]
    found = ["continuing with the equivalent search space" in r.log for r in results]
    assert sorted(made) == [False, True], [r.tail() for r in results]
    assert found == [not m for m in made], [r.tail() for r in results]


JOIN = {"NEPS_BCAST_JOIN_TIMEOUT_S": "15"}


def test_a_rank_that_never_calls_run_is_named(tmp_path: Path) -> None:
    result = run(
        Scenario(bad=BadInput(rank=1, skip_run=True)), tmp_path, cmd=torchrun_cmd(2), env=JOIN
    )
    assert_clean_launch(result, expect_rc=1)
    assert (
        "[neps_bcast rank 0/2 leader] rank 1 of 2 did not call neps_bcast.run within"
        " 15 s; expected ranks 0..1, observed only 0. HINT:"
    ) in result.log
    assert not result.root.exists()
    exits = result.exits
    assert exits[1]["code"] == 0 and result.of("skipped_run"), exits  # it returned early
    assert exits[0]["code"] == 1 and "did not call neps_bcast.run" in exits[0]["error"], exits


def test_ranks_with_different_arguments_fail_on_every_rank(tmp_path: Path) -> None:
    result = run(
        Scenario(bad=BadInput(rank=1, other_root=True, other_space=True)),
        tmp_path,
        cmd=torchrun_cmd(2),
        env=JOIN,
    )
    assert_clean_launch(result, expect_rc=1)
    root = result.root
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
    exits = result.exits
    assert sorted(exits) == [0, 1]
    for e in exits.values():
        assert e["code"] == 1 and "called neps_bcast.run with different" in e["error"], e


def test_trainer_devices_inconsistent_with_the_world_size(tmp_path: Path) -> None:
    """Lightning itself refuses devices * num_nodes != torchrun's world size, on every
    rank; the trial fails on every rank and the search ends, bounded, nothing left."""
    result = run(Scenario(devices=4, trials=3), tmp_path, cmd=torchrun_cmd(2))
    assert_clean_launch(result, expect_rc=1)
    assert (
        "You set `devices=4` and `num_nodes=1` in Lightning, but the product (4 * 1)"
        " does not match the world size (2)"
    ) in result.log
    assert re.search(r"trial 1 failed on ranks (0, 1|1, 0): rank", result.log)
    exits = result.exits
    assert not exits[0]["ok"] and exits[0]["code"] == 1
    assert "WorkerRaiseError" in exits[0]["error"]  # NePS re-raises the trial's error
    assert exits[1]["ok"] and exits[1]["code"] == 0  # stopped when its leader's run ended
    recorded = neps_trials(result.root)
    assert [t.report.reported_as for t in recorded.values()] == ["crashed"]
