"""End to end: ranks started by an external launcher (torchrun, several nodes, SLURM),
Lightning Fabric, several NePS workers on one root, and bad input.

Real torchrun, real gloo, real NePS, real Lightning. Ports are chosen by torchrun
(``--standalone``) or by the OS and held for the whole launch (tests/ports.py). Each class is one
launch (or the launches that make one search) and the tests that read what it left.
"""

from __future__ import annotations

import fcntl
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harness import (
    FABRIC,
    LIGHTNING,
    MISMATCHED,
    TORCH_DDP,
    CleanLaunch,
    LaunchChecks,
    Result,
    assert_every_process_exited_0,
    assert_followers_never_touch_neps,
    assert_nothing_left,
    assert_the_leader_touched_neps,
    assert_trials_freed_before_finalization,
    closed_by_torchrun,
    exits_by_rank,
    identical_on_every_rank,
    neps_trials,
    python,
    run,
    srun,
    start,
    torchrun,
)
from ports import HeldPort


@dataclass
class Group:
    """One DDP group's records (from one launch, or from every node's launch)."""

    events: list[dict[str, Any]]
    world: int
    root: Path

    @classmethod
    def of(cls, launch: Result, world: int) -> Group:
        return cls(launch.events, world, launch.root)


class FollowsItsLeader:
    """A group's tests: every rank evaluated exactly the leader's trials, with the same
    arguments, in order; every rank exited with 0; followers never touched NePS (the
    leader did); NePS recorded each trial as a success. A class provides ``group``."""

    def test_every_rank_evaluated_the_leaders_trials_with_the_same_arguments(
        self, group: Group
    ) -> None:
        identical_on_every_rank(group.events, group.world)

    def test_every_rank_recorded_exit_code_0(self, group: Group) -> None:
        exits = exits_by_rank(group.events)
        assert sorted(exits) == list(range(group.world)), exits
        assert all(e["ok"] and e["code"] == 0 for e in exits.values()), exits

    def test_followers_never_touched_neps_or_its_root(self, group: Group) -> None:
        assert_followers_never_touch_neps(exits_by_rank(group.events))

    def test_the_leader_touched_neps_and_its_root(self, group: Group) -> None:
        """The positive control: the counters that stay 0 on followers count here."""
        assert_the_leader_touched_neps(exits_by_rank(group.events))

    def test_neps_recorded_each_of_the_leaders_trials_as_a_success(self, group: Group) -> None:
        recorded = neps_trials(group.root)
        assert sorted(recorded) == sorted(identical_on_every_rank(group.events, group.world))
        assert all(
            t.report is not None and t.report.reported_as == "success" for t in recorded.values()
        )


class TestTorchrunLightningReusesTheGroup(CleanLaunch, FollowsItsLeader):
    """torchrun starts every rank (4 of them, 3 trials); Lightning ddp trains on the group
    neps_bcast formed.

    One launch of 4 ranks, not one of 2 as well: every check here is a function of the
    group's size (each follower evaluated the leader's trials, exited 0, never touched
    NePS; the last follower, rank 3, joined the control channel; every trial ran in the 4
    processes torchrun started), so 4 ranks check all that 2 did (rank 1 is a follower of
    both) and ranks 2 and 3 as well."""

    NPROC = 4
    TRIALS = 3

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = torchrun(
            self.NPROC, LIGHTNING, "--devices", self.NPROC, "--trials", self.TRIALS, "--with-dirs"
        )
        return run(command, tmp_path_factory.mktemp("torchrun_lightning"))

    @pytest.fixture(scope="class")
    def group(self, launch: Result) -> Group:
        return Group.of(launch, self.NPROC)

    def test_the_leader_evaluated_the_whole_budget(self, group: Group) -> None:
        assert len(identical_on_every_rank(group.events, group.world)) == self.TRIALS

    def test_every_trial_ran_in_the_processes_torchrun_started(self, launch: Result) -> None:
        """Lightning spawned nothing."""
        started = {e["pid"] for e in launch.of("start")}
        assert len(started) == self.NPROC
        assert {e["pid"] for e in launch.of("trial")} == started

    def test_the_group_existed_before_trial_1(self, launch: Result) -> None:
        assert {e["world_size"] for e in launch.of("trial")} == {self.NPROC}

    def test_the_last_follower_joined_the_control_channel(self, launch: Result) -> None:
        last = self.NPROC - 1
        assert f"[neps_bcast rank {last}/{self.NPROC} follower] control channel up" in launch.log


class FabricChecks(CleanLaunch, FollowsItsLeader):
    @pytest.fixture(scope="class")
    def group(self, launch: Result) -> Group:
        return Group.of(launch, 2)

    def test_the_leader_evaluated_the_whole_budget(self, group: Group) -> None:
        assert len(identical_on_every_rank(group.events, 2)) == 3


class TestFabricInsideTheFunctionUnderPython(FabricChecks):
    """``python fabric_search.py``: Fabric's launcher starts rank 1 in trial 1."""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        return run(python(FABRIC, "--trials", 3), tmp_path_factory.mktemp("fabric"))

    def test_fabrics_launcher_ran_the_script_again_for_rank_1(self, launch: Result) -> None:
        assert "Lightning child of the leader" in launch.log


class TestFabricInsideTheFunctionUnderTorchrun(FabricChecks):
    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        return run(torchrun(2, FABRIC, "--trials", 3), tmp_path_factory.mktemp("fabric"))


@dataclass
class Nodes:
    launches: list[Result]
    folders: list[Path]


class TestTwoNodesFollowersNeedNoNepsRoot(FollowsItsLeader):
    """torchrun --nnodes 2 with a c10d rendezvous, each "node" a launch with its own cwd
    and a relative root."""

    @pytest.fixture(scope="class")
    def nodes(self, tmp_path_factory: pytest.TempPathFactory) -> Nodes:
        tmp = tmp_path_factory.mktemp("two_nodes")
        folders = [tmp / "node0", tmp / "node1"]
        with HeldPort() as port:
            rendezvous = (
                "--nnodes=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=nb{port}",
            )
            running = []
            for i, folder in enumerate(folders):
                folder.mkdir()
                command = torchrun(
                    2, TORCH_DDP, "--trials", 3, "--root", "results", rendezvous=rendezvous
                )
                running.append(start(command, tmp, name=f"launch{i}", cwd=folder))
            return Nodes([r.finish() for r in running], folders)

    @pytest.fixture(scope="class")
    def group(self, nodes: Nodes) -> Group:
        events = sorted((e for r in nodes.launches for e in r.events), key=lambda e: e["t"])
        return Group(events, 4, self.leader_node(nodes) / "results")

    @staticmethod
    def leader_node(nodes: Nodes) -> Path:
        events = [e for r in nodes.launches for e in r.of("start")]
        return Path(next(e["cwd"] for e in events if e["proc_rank"] == 0))

    @pytest.mark.parametrize("node", [0, 1])
    def test_the_nodes_launch_exits_with_0(self, nodes: Nodes, node: int) -> None:
        launch = nodes.launches[node]
        assert launch.returncode == 0, launch.tail()

    @pytest.mark.parametrize("node", [0, 1])
    def test_no_process_of_the_nodes_launch_is_left(self, nodes: Nodes, node: int) -> None:
        assert_nothing_left(nodes.launches[node])

    @pytest.mark.parametrize("node", [0, 1])
    def test_every_process_of_the_node_exited_with_0(self, nodes: Nodes, node: int) -> None:
        assert_every_process_exited_0(nodes.launches[node])

    @pytest.mark.parametrize("node", [0, 1])
    def test_no_trial_object_is_left_to_the_interpreters_finalization(
        self, nodes: Nodes, node: int
    ) -> None:
        assert_trials_freed_before_finalization(nodes.launches[node])

    def test_the_leader_evaluated_the_whole_budget(self, group: Group) -> None:
        assert len(identical_on_every_rank(group.events, 4)) == 3

    def test_two_followers_ran_on_the_other_node(self, nodes: Nodes) -> None:
        other = next(n for n in nodes.folders if n != self.leader_node(nodes))
        cwds = [Path(e["cwd"]) for r in nodes.launches for e in r.of("start")]
        assert cwds.count(other) == 2

    def test_no_follower_created_a_file_in_its_working_directory(self, nodes: Nodes) -> None:
        other = next(n for n in nodes.folders if n != self.leader_node(nodes))
        assert list(other.iterdir()) == []


class TestSimulatedSlurmWithoutTorchrun(CleanLaunch, FollowsItsLeader):
    """srun-like variables (tests/scripts/fake_srun.py) start both ranks of a Lightning
    ddp search; MASTER_ADDR and MASTER_PORT as an sbatch script exports them."""

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        with HeldPort() as port:
            return run(
                srun(2, LIGHTNING, "--trials", 3),
                tmp_path_factory.mktemp("slurm"),
                env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
            )

    @pytest.fixture(scope="class")
    def group(self, launch: Result) -> Group:
        return Group.of(launch, 2)

    def test_the_leader_evaluated_the_whole_budget(self, group: Group) -> None:
        assert len(identical_on_every_rank(group.events, 2)) == 3

    def test_the_group_existed_before_trial_1(self, launch: Result) -> None:
        assert {e["world_size"] for e in launch.of("trial")} == {2}

    def test_every_trial_ran_in_the_two_tasks(self, launch: Result) -> None:
        """Nothing spawned."""
        assert len({e["pid"] for e in launch.of("trial")}) == 2


WAITING = "waiting for another worker to finish starting on"


@dataclass
class SharedRoot:
    root: Path
    launches: dict[str, Result]


class TestTwoGroupsStartTogetherOnOneRoot:
    """Two DDP groups (two torchrun launches) start together on one root, which exists
    but is empty, with hash seeds that order NePS's categorical choices differently:
    plain NePS fails in each of these ways. The test holds the root lock while both
    start, so that both leaders are seen waiting for it, then lets them contend."""

    @pytest.fixture(scope="class")
    def shared(self, tmp_path_factory: pytest.TempPathFactory) -> SharedRoot:
        tmp = tmp_path_factory.mktemp("shared_root")
        root = tmp / "shared_root"
        root.mkdir()
        meet = tmp / "meet"
        meet.mkdir()
        lock_path = tmp / ".shared_root.neps_bcast.lock"
        with lock_path.open("ab") as held:
            fcntl.lockf(held.fileno(), fcntl.LOCK_EX)  # the kind NePS (and the guard) use
            running = {}
            for name, other, seed in (("a", "b", "1"), ("b", "a", "2")):
                running[name] = start(
                    torchrun(2, TORCH_DDP, "--trials", 6, "--root", root),
                    tmp,
                    name=name,
                    # Each group's first trial waits for the other's, so they overlap.
                    env={"PYTHONHASHSEED": seed, "NB_MEET": f"{meet}:{name}:{other}"},
                )
            for r in running.values():
                r.wait_for_log(f"[neps_bcast rank 0/2 leader] {WAITING} {root}")
            fcntl.lockf(held.fileno(), fcntl.LOCK_UN)
        return SharedRoot(root, {name: r.finish() for name, r in running.items()})

    @staticmethod
    def ids(shared: SharedRoot) -> list[str]:
        return [tid for r in shared.launches.values() for tid in identical_on_every_rank(r, 2)]

    @pytest.mark.parametrize("group", ["a", "b"])
    def test_the_groups_launch_exits_with_0(self, shared: SharedRoot, group: str) -> None:
        assert shared.launches[group].returncode == 0, shared.launches[group].tail()

    @pytest.mark.parametrize("group", ["a", "b"])
    def test_no_process_of_the_groups_launch_is_left(self, shared: SharedRoot, group: str) -> None:
        assert_nothing_left(shared.launches[group])

    @pytest.mark.parametrize("group", ["a", "b"])
    def test_every_process_of_the_group_exited_with_0(self, shared: SharedRoot, group: str) -> None:
        assert_every_process_exited_0(shared.launches[group])

    @pytest.mark.parametrize("group", ["a", "b"])
    def test_no_trial_object_is_left_to_the_interpreters_finalization(
        self, shared: SharedRoot, group: str
    ) -> None:
        assert_trials_freed_before_finalization(shared.launches[group])

    @pytest.mark.parametrize("group", ["a", "b"])
    def test_the_groups_followers_evaluated_their_leaders_trials(
        self, shared: SharedRoot, group: str
    ) -> None:
        assert identical_on_every_rank(shared.launches[group], 2), (
            f"group {group} evaluated nothing"
        )

    @pytest.mark.parametrize("group", ["a", "b"])
    def test_the_groups_ranks_exited_0_and_its_followers_never_touched_neps(
        self, shared: SharedRoot, group: str
    ) -> None:
        exits = shared.launches[group].exits
        assert sorted(exits) == [0, 1], exits
        assert all(e["ok"] and e["code"] == 0 for e in exits.values()), exits
        assert_followers_never_touch_neps(exits)

    @pytest.mark.parametrize("group", ["a", "b"])
    def test_the_groups_leader_waited_once_for_the_tests_hold(
        self, shared: SharedRoot, group: str
    ) -> None:
        """Nothing waited in a follower."""
        launch = shared.launches[group]
        assert launch.log.count(WAITING) == 1, launch.tail()

    def test_no_trial_was_evaluated_by_both_groups(self, shared: SharedRoot) -> None:
        ids = self.ids(shared)
        assert len(ids) == len(set(ids))

    def test_neps_recorded_every_trial_of_both_groups_as_a_success(
        self, shared: SharedRoot
    ) -> None:
        recorded = neps_trials(shared.root)
        assert sorted(recorded) == sorted(self.ids(shared))
        assert all(
            t.report is not None and t.report.reported_as == "success" for t in recorded.values()
        )

    def test_the_groups_spent_the_budget(self, shared: SharedRoot) -> None:
        assert len(self.ids(shared)) >= 6

    def test_one_leader_created_the_root_and_the_other_found_it(self, shared: SharedRoot) -> None:
        """Serialized by the lock."""
        launches = list(shared.launches.values())
        made = ["removing the empty root" in r.log for r in launches]
        found = ["continuing with the equivalent search space" in r.log for r in launches]
        assert sorted(made) == [False, True], [r.tail() for r in launches]
        assert found == [not m for m in made], [r.tail() for r in launches]


JOIN = {"NEPS_BCAST_JOIN_TIMEOUT_S": "15"}


class TestARankThatNeverCallsRunIsNamed(LaunchChecks):
    returncode = 1

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = torchrun(2, MISMATCHED, "--rank1", "skips-run")
        return run(command, tmp_path_factory.mktemp("skips_run"), env=JOIN)

    def test_the_leader_names_the_rank_that_did_not_call_run(self, launch: Result) -> None:
        assert (
            "[neps_bcast rank 0/2 leader] rank 1 of 2 did not call neps_bcast.run within"
            " 15 s; expected ranks 0..1, observed only 0. HINT:"
        ) in launch.log

    def test_the_root_was_never_created(self, launch: Result) -> None:
        assert not launch.root.exists()

    def test_rank_1_returned_early_with_0(self, launch: Result) -> None:
        assert launch.of("skipped_run"), launch.tail()
        assert launch.exits[1]["code"] == 0, launch.exits

    def test_the_leader_exited_with_1_naming_it(self, launch: Result) -> None:
        leader = launch.exits[0]
        assert leader["code"] == 1 and "did not call neps_bcast.run" in leader["error"], leader


class TestRanksWithDifferentArgumentsFailOnEveryRank(LaunchChecks):
    """Rank 1 passes another root directory and another search space."""

    returncode = 1

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        tmp = tmp_path_factory.mktemp("other_arguments")
        command = torchrun(2, MISMATCHED, "--rank1", "other-arguments", "--root", tmp / "root")
        return run(command, tmp, env=JOIN)

    @pytest.mark.parametrize("tag", ["rank 0/2 leader", "rank 1/2 follower"])
    def test_the_rank_names_every_difference(self, launch: Result, tag: str) -> None:
        line = next(
            (
                line
                for line in launch.log.splitlines()
                if f"[neps_bcast {tag}] the ranks called neps_bcast.run with different" in line
            ),
            None,
        )
        assert line is not None, launch.tail()
        root = launch.root
        assert "expected the same pipeline_space, root_directory on all 2 ranks" in line
        assert f"root_directory: rank 0: '{root}', rank 1: '{root}_elsewhere'" in line
        assert "pipeline_space: rank 0: Basic(" in line
        assert "rank 1: WithFidelity(" in line
        assert "HINT: every rank must run the same script" in line

    def test_the_root_was_never_created(self, launch: Result) -> None:
        assert not launch.root.exists()

    def test_every_rank_exited_with_1_naming_the_difference(self, launch: Result) -> None:
        exits = launch.exits
        assert sorted(exits) == [0, 1]
        for e in exits.values():  # the script's own code: torchrun may SIGTERM the later
            # one (test_every_exit_the_kernel_reported_is_the_one_recorded)
            assert e["predicted"] == 1 and "called neps_bcast.run with different" in e["error"], e


class TestTrainerDevicesInconsistentWithTheWorldSize(LaunchChecks):
    """Lightning itself refuses devices * num_nodes != torchrun's world size, on every
    rank; the trial fails on every rank and the search ends, bounded, nothing left."""

    returncode = 1

    @pytest.fixture(scope="class")
    def launch(self, tmp_path_factory: pytest.TempPathFactory) -> Result:
        command = torchrun(2, LIGHTNING, "--devices", 4, "--trials", 3)
        return run(command, tmp_path_factory.mktemp("devices"))

    def test_lightning_refused_the_devices(self, launch: Result) -> None:
        assert (
            "You set `devices=4` and `num_nodes=1` in Lightning, but the product (4 * 1)"
            " does not match the world size (2)"
        ) in launch.log

    def test_trial_1_failed_on_both_ranks(self, launch: Result) -> None:
        """Both at Lightning's check, or one first while the other still formed the trial's
        group (either way round: gloo's full mesh can be complete on one side first): the
        other's closed connection is then named as caused by the first one's error."""
        assert re.search(
            r"trial 1 failed on (ranks (0, 1|1, 0): rank|rank (?P<first>[01]): rank (?P=first):"
            r" ValueError: You set `devices=4`[^\n]*Caused by it: rank [01]: RuntimeError:"
            r" Gloo connectFullMesh)",
            launch.log,
        ), launch.tail()

    def test_the_leader_exited_with_1_raising_neps_error(self, launch: Result) -> None:
        """NePS re-raises the trial's error."""
        leader = launch.exits[0]
        assert not leader["ok"] and leader["code"] == 1
        assert "WorkerRaiseError" in leader["error"]

    def test_the_follower_exited_with_0_when_its_leaders_run_ended(self, launch: Result) -> None:
        """Its run ended with 0 (its own record); the kernel heard 0, or torchrun's
        closing SIGTERM when the leader's exit 1 came first and the follower was still
        finalizing (torchrun's rule once a worker fails; a race of the two exits)."""
        follower = launch.exits[1]
        assert follower["ok"] and follower["predicted"] == 0, follower
        assert follower["code"] == 0 or (
            follower["code"] == -15 and closed_by_torchrun(launch, follower["pid"])
        ), follower

    def test_neps_recorded_the_one_trial_crashed(self, launch: Result) -> None:
        recorded = neps_trials(launch.root)
        assert [t.report.reported_as for t in recorded.values()] == ["crashed"]
