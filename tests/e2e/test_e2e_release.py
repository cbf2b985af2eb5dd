"""End to end: a failure releases the DDP group, and only the group.

When rank 1 raises during training, its peers must be released within seconds (not
after the group timeout), and the user's own connections must survive on every rank.
Real processes: Lightning strategy="ddp" (`python lightning_search.py`) and torchrun; a
small echo server in this pytest process plays the user's own service (an experiment
tracker's keep-alive connection, a database; tests/scripts/tracker.py is its client).

Bounds: a subgroup's timeout (60 s) > RELEASE_S, so a peer that is not released shows
as a failed assertion, not a hang; the launch deadline (240 s) < pytest's (600 s); every
process is gone within 15 s of the launcher's exit (CleanLaunch).
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass

import pytest

from harness import (
    LIGHTNING,
    TORCH_DDP,
    CleanLaunch,
    Result,
    python,
    raised,
    run,
    states,
    torchrun,
)

RELEASE_S = 20.0
"""From rank 1's error to every rank's session raising: seconds, not the group timeout."""

FAIL_IN_FIT_2 = "raise:follower:trial=2:at=fit"


class EchoServer:
    """Echoes every line back; remembers which connection each line came over."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.lines: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
                index = len(self._conns) - 1
            threading.Thread(target=self._serve, args=(conn, index), daemon=True).start()

    def _serve(self, conn: socket.socket, index: int) -> None:
        buffer = b""
        with conn:
            while True:
                try:
                    chunk = conn.recv(4096)
                except OSError:
                    return
                if not chunk:
                    return
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    with self._lock:
                        self.lines.append((index, line.decode()))
                    conn.sendall(line + b"\n")

    def connections_by_rank(self) -> dict[int, set[int]]:
        found: dict[int, set[int]] = {}
        with self._lock:
            for index, line in self.lines:
                found.setdefault(int(line.split()[1]), set()).add(index)
        return found

    def trials_by_rank(self) -> dict[int, list[int]]:
        found: dict[int, list[int]] = {}
        with self._lock:
            for _, line in self.lines:
                _, rank, _, seq = line.split()
                found.setdefault(int(rank), []).append(int(seq))
        return found

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            for conn in self._conns:
                conn.close()


class FailsInTrial2AndRecovers(CleanLaunch):
    """Rank 1 raises in fit of trial 2: trial 2 crashed, every rank's session raised
    within RELEASE_S of the fault, naming rank 1's error, and trials 3 and 4 trained
    on the group of 2 again."""

    def test_only_trial_2_crashed(self, launch: Result) -> None:
        assert states(launch.root) == {
            "1": "success",
            "2": "crashed",
            "3": "success",
            "4": "success",
        }, launch.tail()

    def test_every_ranks_session_raised_in_trial_2(self, launch: Result) -> None:
        assert sorted(raised(launch, 2)) == [0, 1], launch.tail()

    def test_the_leaders_session_raised_naming_rank_1s_error(self, launch: Result) -> None:
        leader = raised(launch, 2)[0]
        assert leader["type"] == "TrialFailedError", leader
        assert (
            "trial 2 failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit"
            in leader["text"]
        )

    def test_every_rank_was_released_within_seconds_of_the_fault(self, launch: Result) -> None:
        fault = launch.of("fault")[0]
        for e in raised(launch, 2).values():
            assert e["t"] - fault["t"] < RELEASE_S, (e, fault)

    def test_both_ranks_trained_on_the_group_of_2_again(self, launch: Result) -> None:
        trained = {(e["rank"], e["world_size_after"]) for e in launch.of("trained")}
        assert trained == {(0, 2), (1, 2)}


@dataclass
class Tracked:
    """A launch whose ranks used the tracker, and what the tracker's server saw."""

    launch: Result
    connections_by_rank: dict[int, set[int]]
    trials_by_rank: dict[int, list[int]]
    first: int
    """The first trial in which the ranks had a connection."""


CONNECTIONS = {
    # opened before neps_bcast.run under torchrun (a plain DDP loop)
    "before_run": ("torchrun", 1),
    # in trial 1, or mid-trial 2, under Lightning ddp
    "trial_1": ("python", 1),
    "trial_2": ("python", 2),
}


class TestTheUsersOwnConnectionSurvivesAFailure(FailsInTrial2AndRecovers):
    """Each rank keeps one TCP connection of its own and uses it in every trial; rank 1
    raises in fit in trial 2: the connection works in trials 3 and 4."""

    @pytest.fixture(scope="class", params=list(CONNECTIONS))
    def tracked(
        self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Tracked:
        opened = str(request.param)
        launcher, first = CONNECTIONS[opened]
        server = EchoServer()
        try:
            script = TORCH_DDP if launcher == "torchrun" else LIGHTNING
            args = (
                "--trials",
                4,
                "--ignore-errors",
                "--tracker",
                server.port,
                "--tracker-from",
                opened,
            )
            command = (
                torchrun(2, script, *args) if launcher == "torchrun" else python(script, *args)
            )
            launch = run(command, tmp_path_factory.mktemp("tracker"), fault=FAIL_IN_FIT_2)
            return Tracked(launch, server.connections_by_rank(), server.trials_by_rank(), first)
        finally:
            server.close()

    @pytest.fixture(scope="class")
    def launch(self, tracked: Tracked) -> Result:
        return tracked.launch

    def test_the_users_connection_never_broke(self, tracked: Tracked) -> None:
        broken = {
            (e["rank"], e["seq"]): e["error"] for e in tracked.launch.of("tracker") if not e["ok"]
        }
        assert not broken, f"the user's connection broke: {broken}\n{tracked.launch.tail()}"

    def test_every_rank_used_it_in_every_trial_from_the_one_it_opened_it_in(
        self, tracked: Tracked
    ) -> None:
        uses = sorted((e["rank"], e["seq"]) for e in tracked.launch.of("tracker"))
        assert uses == [(r, s) for r in (0, 1) for s in range(tracked.first, 5)], (
            tracked.launch.tail()
        )

    def test_each_rank_used_one_connection_only(self, tracked: Tracked) -> None:
        assert {r: len(c) for r, c in tracked.connections_by_rank.items()} == {0: 1, 1: 1}

    def test_the_server_got_every_ranks_line_of_each_trial(self, tracked: Tracked) -> None:
        assert {r: sorted(s) for r, s in tracked.trials_by_rank.items()} == {
            r: list(range(tracked.first, 5)) for r in (0, 1)
        }


class TestAFailureOnASubgroupMadeInTheTrialReleasesThePeer(FailsInTrial2AndRecovers):
    """torchrun; each trial trains plain DDP on a dist.new_group() it makes itself
    (timeout 60 s); rank 1 raises in trial 2 while rank 0 is in the subgroup's
    allreduce: rank 0 is released within RELEASE_S, trials 3 and 4 train again. Also
    with gloo's lazy connection mode (TORCH_GLOO_LAZY_INIT=1)."""

    @pytest.fixture(scope="class", params=[False, True], ids=["eager", "gloo_lazy_init"])
    def launch(
        self, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Result:
        env = {"TORCH_GLOO_LAZY_INIT": "1"} if request.param else {}
        command = torchrun(2, TORCH_DDP, "--trials", 4, "--ignore-errors", "--subgroup-timeout", 60)
        return run(command, tmp_path_factory.mktemp("subgroup"), fault=FAIL_IN_FIT_2, env=env)

    def test_rank_0s_own_error_in_the_allreduce_is_the_secondary_one(self, launch: Result) -> None:
        leader = raised(launch, 2)[0]
        assert "Caused by it: rank 0: " in leader["text"], leader
