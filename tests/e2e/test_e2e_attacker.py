"""Another user of this host attacks a real search from before its first rank starts to
after its last one exits, and drives nothing.

The outsider (``nobody``, tests/scripts/attacker_outsider.py, see tests/outsider.py)
plants a secret file and its path, forges the ``leader`` record, writes pickles that
would create a file under every key neps_bcast uses in every store it reaches (the
launcher's rendezvous store and the leader's), and replays every value it recorded from
an earlier search run with the same ``NEPS_BCAST_SECRET``. The search is a user's
Lightning DDP script (tests/scripts/attacker_search.py, trial 2 fails on rank 1),
launched as ``python script.py`` (Lightning starts rank 1) and with
``torchrun --standalone``; srun is in tests/slurm/test_e2e_slurm_attacker.py.

Each time: no pickle of the outsider runs; the search completes with every trial's real
result (or, where the outsider took the private folder first, every rank stops before
trial 1 naming it); nothing is left running, the kernel heard every rank end with the
code it recorded, none left its trial's objects to the interpreter's finalization, and
the leader's store listened on loopback only while Lightning's or torchrun's own listened
on every interface. Each class is one attacked launch (two for the replay) and its checks.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import outsider as o
from exits import ExitWatch
from harness import PYTHON, TORCHRUN, listening_ports, marked_pids, neps_trials

LAUNCHERS: dict[str, list[str]] = {
    "lightning": [PYTHON, str(o.SEARCH_SCRIPT)],
    "torchrun": [TORCHRUN, "--standalone", "--nproc-per-node=2", str(o.SEARCH_SCRIPT)],
}


LISTENERS: dict[str, dict[int, set[str]]] = {}
"""An attack's marker -> every port its launch's processes listened on -> the addresses."""


def launch(name: str) -> Callable[[o.Attack], Callable[[], int]]:
    """The launch as users start it, with the kernel's exit watch listening from before
    its first process, and what its processes listen on read while it runs."""
    started = o.popen(LAUNCHERS[name])

    def start(attack: o.Attack) -> Callable[[], int]:
        ExitWatch.get()
        seen = LISTENERS.setdefault(attack.marker, {})
        done = threading.Event()

        def look() -> None:
            while not done.wait(0.05):  # a bounded poll of /proc while the launch runs
                for pid in marked_pids(attack.marker):
                    for port, ip in listening_ports(pid).items():
                        seen.setdefault(port, set()).add(ip)

        looker = threading.Thread(target=look, daemon=True, name="listeners")
        looker.start()
        wait = started(attack)

        def finish() -> int:
            try:
                return wait()
            finally:
                done.set()
                looker.join(timeout=10)

        return finish

    return start


@pytest.fixture(scope="class")
def arena() -> Iterator[o.Arena]:
    with o.Arena.made() as made:
        yield made


class AttackedSearchThatCompletes:
    """The checks of a search the outsider attacked and that must complete."""

    def test_the_outsider_was_another_user_attacking_from_before_the_start(
        self, attacked: o.Attack
    ) -> None:
        o.assert_the_outsider_attacked_from_before_the_start(attacked)

    def test_it_reached_the_launchers_store_and_the_leaders_store(self, attacked: o.Attack) -> None:
        o.assert_it_reached_both_stores(attacked)

    def test_a_rank_refused_what_it_wrote_naming_the_key(self, attacked: o.Attack) -> None:
        o.assert_a_rank_refused_a_forged_value(attacked)

    def test_no_pickle_of_the_outsider_ran(self, attacked: o.Attack) -> None:
        o.assert_no_pickle_of_the_outsider_ran(attacked)

    def test_its_pickle_does_create_the_file_when_unpickled(self, attacked: o.Attack) -> None:
        """The positive control of the test above."""
        assert o.the_bomb_creates_the_marker(attacked.arena)

    def test_the_search_completed_with_every_trials_real_result(self, attacked: o.Attack) -> None:
        o.assert_completed_with_every_real_result(attacked)

    def test_nothing_is_left_running(self, attacked: o.Attack) -> None:
        o.assert_nothing_left_running(attacked)

    def test_neps_recorded_the_injected_failure_with_the_ranks_real_text(
        self, attacked: o.Attack
    ) -> None:
        """The leader read rank 1's own error record, not one the outsider forged."""
        err = str(neps_trials(attacked.result.root)[o.FAILING_TRIAL].report.err)
        want = f"trial {o.FAILING_TRIAL} failed on rank 1: rank 1: ValueError: injected failure"
        assert want in err, err

    def test_every_exit_the_kernel_heard_is_the_one_recorded(self, attacked: o.Attack) -> None:
        watch = ExitWatch.get()
        starts = {e["pid"]: e["t"] for e in attacked.result.of("start")}
        recorded = {e["pid"]: e["code"] for e in attacked.result.of("exit")}
        assert starts and sorted(recorded) == sorted(starts), (starts, recorded)
        heard = {}
        for pid, t in starts.items():
            exit_ = watch.wait(pid, since=t, timeout=5.0)
            heard[pid] = None if exit_ is None else exit_.status
        assert heard == recorded, (heard, recorded, watch.lost, attacked.result.tail())

    def test_no_trial_object_is_left_to_the_interpreters_finalization(
        self, attacked: o.Attack
    ) -> None:
        at_exit = {e["pid"]: e for e in attacked.result.of("at_exit")}
        assert len(at_exit) == 2, (at_exit, attacked.result.tail())
        for e in at_exit.values():
            assert e["trial_objects_seen"] > 0 and e["trial_objects_alive"] == [], e

    def test_the_leaders_store_listens_on_loopback_only(self, attacked: o.Attack) -> None:
        seen = LISTENERS[attacked.marker]
        stores = attacked.result.stores
        leaders = [port for port, what in stores.items() if what == "leader's store"]
        assert leaders, stores
        for port in leaders:
            assert seen.get(port) == {"127.0.0.1"}, (port, seen)

    def test_the_same_reading_sees_the_launchers_store_on_every_interface(
        self, attacked: o.Attack
    ) -> None:
        """The positive control of the test above: Lightning's or torchrun's own
        rendezvous store does listen on every interface."""
        seen = LISTENERS[attacked.marker]
        stores = attacked.result.stores
        theirs = [port for port, what in stores.items() if what == "launcher's rendezvous store"]
        assert theirs, stores
        for port in theirs:
            assert seen.get(port, set()) & {"0.0.0.0", "::"}, (port, seen)


def full_attack(arena: o.Arena, folder: Path, launcher: str, secret: str | None) -> o.Attack:
    return o.Attack(arena, folder, secret).run(launch(launcher))


def replay_of(earlier: o.Attack, folder: Path, launcher: str) -> o.Attack:
    recorded = earlier.arena.work / f"{earlier.folder.name}.recorded.json"
    attack = o.Attack(earlier.arena, folder, earlier.secret, ("--replay", str(recorded)))
    return attack.run(launch(launcher))


class WithTheSameSecret(AttackedSearchThatCompletes):
    """Two searches with the same NEPS_BCAST_SECRET: the first under the full attack
    (which also records every value), the second under a replay of that recording
    only (no pickles: what a rank refused there, it refused because it was recorded from
    the first search with the same secret). Every check runs on each."""

    launcher = "lightning"

    @pytest.fixture(scope="class")
    def searches(
        self, arena: o.Arena, tmp_path_factory: pytest.TempPathFactory
    ) -> tuple[o.Attack, o.Attack]:
        tmp = tmp_path_factory.mktemp(f"{self.launcher}_secret")
        first = full_attack(arena, tmp / "first", self.launcher, o.SECRET)
        return first, replay_of(first, tmp / "replayed", self.launcher)

    @pytest.fixture(scope="class", params=["full attack", "replay of the first search"])
    def attacked(
        self, request: pytest.FixtureRequest, searches: tuple[o.Attack, o.Attack]
    ) -> o.Attack:
        return searches[0] if request.param == "full attack" else searches[1]

    def test_the_replay_had_genuine_values_to_replay(
        self, searches: tuple[o.Attack, o.Attack]
    ) -> None:
        recorded = json.loads((searches[0].arena.work / "first.recorded.json").read_text())
        # Every genuine value of the first search was recorded (the outsider reads each
        # key before it overwrites it, atomically): the peers' records and the error board.
        for key in ("neps_bcast/rank/0", "neps_bcast/rank/1", "neps_bcast/err/2/1"):
            assert key in recorded, sorted(recorded)
        assert searches[1].report["replays"] > 0, searches[1].report


class TestLightningWithTheSameSecret(WithTheSameSecret):
    launcher = "lightning"


class TestTorchrunWithTheSameSecret(WithTheSameSecret):
    launcher = "torchrun"


class TestLightningWithoutASecretAndAPlantedPrivateFolder(AttackedSearchThatCompletes):
    """Lightning's children get the secret and their first trial from their leader
    directly (inherited variables, a fresh private folder): a planted folder and a
    planted secret path do not matter."""

    @pytest.fixture(scope="class")
    def attacked(self, arena: o.Arena, tmp_path_factory: pytest.TempPathFactory) -> o.Attack:
        folder = tmp_path_factory.mktemp("lightning_no_secret") / "run"
        plant = ("--plant-private-dir", str(arena.private_dir))
        return o.Attack(arena, folder, None, plant).run(launch("lightning"))


class TestTorchrunWithoutASecret(AttackedSearchThatCompletes):
    """One host, no NEPS_BCAST_SECRET: the secret goes through this user's private
    folder; the secret file path, secret and leader record the outsider plants in the
    launcher's store are never read."""

    @pytest.fixture(scope="class")
    def attacked(self, arena: o.Arena, tmp_path_factory: pytest.TempPathFactory) -> o.Attack:
        folder = tmp_path_factory.mktemp("torchrun_no_secret") / "run"
        return o.Attack(arena, folder, None).run(launch("torchrun"))


class TestTorchrunWithoutASecretWhenTheOutsiderTookThePrivateFolder:
    """The outsider made the private folder first (its own, mode 0777, with a secret in
    it): every rank stops before trial 1, naming the folder."""

    @pytest.fixture(scope="class")
    def attacked(self, arena: o.Arena, tmp_path_factory: pytest.TempPathFactory) -> o.Attack:
        folder = tmp_path_factory.mktemp("torchrun_taken") / "run"
        plant = ("--plant-private-dir", str(arena.private_dir))
        return o.Attack(arena, folder, None, plant).run(launch("torchrun"))

    def test_every_rank_stops_before_trial_1_naming_the_folder(self, attacked: o.Attack) -> None:
        o.assert_stopped_before_trial_1(
            attacked, f"rank 0: refused the private directory {attacked.arena.private_dir}:"
        )

    def test_the_error_says_who_owns_it_and_what_to_do(self, attacked: o.Attack) -> None:
        error = str(attacked.result.of("exit")[0]["error"])
        assert "it is owned by uid 65534 (nobody)" in error, error
        assert "NEPS_BCAST_SECRET" in error
        assert "rank 1: the leader could not start the search (see rank 0's refusal)" in error

    def test_no_pickle_of_the_outsider_ran(self, attacked: o.Attack) -> None:
        o.assert_no_pickle_of_the_outsider_ran(attacked)

    def test_nothing_is_left_running(self, attacked: o.Attack) -> None:
        o.assert_nothing_left_running(attacked)
