"""End to end (issue 9): a failure releases the DDP group, and only the group.

When rank 1 raises during training, its peers must be released within seconds (not
after the group timeout), and the user's own connections must survive on every rank.
Real processes: Lightning strategy="ddp" (`python search.py`) and torchrun; a small echo
server in this pytest process plays the user's own service (an experiment tracker's
keep-alive connection, a database).

Bounds: a subgroup's timeout (60 s) > RELEASE_S, so a peer that is not released shows
as a failed assertion, not a hang; the launch deadline (240 s) < pytest's (600 s); every
process is gone within 15 s of the launcher's exit (harness.assert_clean_launch).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import Result, assert_clean_launch, neps_trials, python_cmd, run, torchrun_cmd
from scenario import Echo, EchoOpened, Fault, Scenario

RELEASE_S = 20.0
"""From rank 1's error to every rank's session raising: seconds, not the group timeout."""

FAIL_IN_FIT_2 = Fault("raise", rank=1, seq=2, where="fit")


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


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    server = EchoServer()
    try:
        yield server
    finally:
        server.close()


def states(root: Path) -> dict[int, str]:
    return {
        int(tid): str(getattr(t.metadata.state, "value", t.metadata.state))
        for tid, t in neps_trials(root).items()
    }


def assert_failed_in_2_and_recovered(result: Result) -> None:
    assert_clean_launch(result)
    assert states(result.root) == {1: "success", 2: "crashed", 3: "success", 4: "success"}, (
        result.tail()
    )
    fault = next(e for e in result.events if e["event"] == "fault")
    raised = {e["rank"]: e for e in result.events if e["event"] == "raised" and e["seq"] == 2}
    assert sorted(raised) == [0, 1], result.tail()
    assert raised[0]["type"] == "TrialFailedError", raised[0]
    assert (
        "trial 2 failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit"
        in raised[0]["text"]
    )
    for e in raised.values():
        assert e["t"] - fault["t"] < RELEASE_S, (e, fault)
    trained = {(e["rank"], e["world_size_after"]) for e in result.events if e["event"] == "trained"}
    assert trained == {(0, 2), (1, 2)}


@pytest.mark.parametrize(
    ("opened", "launcher"),
    [("before_run", "torchrun"), ("trial_1", "python"), ("trial_2", "python")],
)
def test_the_users_own_connection_survives_a_failure(
    tmp_path: Path, echo: EchoServer, opened: EchoOpened, launcher: str
) -> None:
    """Each rank keeps one TCP connection of its own (opened before neps_bcast.run under
    torchrun; in trial 1, or mid-trial 2, under Lightning ddp) and uses it in every
    trial; rank 1 raises in fit in trial 2: the connection works in trials 3 and 4."""
    strategy = "plain_ddp" if launcher == "torchrun" else "ddp"
    result = run(
        Scenario(
            trials=4,
            strategy=strategy,
            ignore_errors=True,
            faults=(FAIL_IN_FIT_2,),
            echo=Echo(port=echo.port, opened=opened),
        ),
        tmp_path,
        cmd=torchrun_cmd(2) if launcher == "torchrun" else python_cmd(),
    )
    first = 2 if opened == "trial_2" else 1
    uses = {(e["rank"], e["seq"]): e for e in result.events if e["event"] == "echo"}
    broken = {key: e["error"] for key, e in uses.items() if not e["ok"]}
    assert not broken, f"the user's connection broke: {broken}\n{result.tail()}"
    assert sorted(uses) == [(r, s) for r in (0, 1) for s in range(first, 5)], result.tail()
    # Every use of a rank went over the one connection it opened, and the server saw it.
    assert {r: len(c) for r, c in echo.connections_by_rank().items()} == {0: 1, 1: 1}
    assert {r: sorted(s) for r, s in echo.trials_by_rank().items()} == {
        r: list(range(first, 5)) for r in (0, 1)
    }
    assert_failed_in_2_and_recovered(result)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "gloo_lazy_init"])
def test_a_failure_on_a_subgroup_made_in_the_trial_releases_the_peer(
    tmp_path: Path, lazy: bool
) -> None:
    """torchrun; each trial trains plain DDP on a dist.new_group() it makes itself
    (timeout 60 s); rank 1 raises in trial 2 while rank 0 is in the subgroup's
    allreduce: rank 0 is released within RELEASE_S, trials 3 and 4 train again. Also
    with gloo's lazy connection mode (TORCH_GLOO_LAZY_INIT=1)."""
    env: dict[str, Any] = {"TORCH_GLOO_LAZY_INIT": "1"} if lazy else {}
    result = run(
        Scenario(
            trials=4,
            strategy="plain_ddp",
            ignore_errors=True,
            subgroup_timeout_s=60,
            faults=(FAIL_IN_FIT_2,),
        ),
        tmp_path,
        cmd=torchrun_cmd(2),
        env=env,
    )
    assert_failed_in_2_and_recovered(result)
    # Rank 0 was inside the subgroup's allreduce when rank 1 raised: its own error there
    # is the secondary one.
    leader = next(e for e in result.events if e["event"] == "raised" and e["rank"] == 0)
    assert "Caused by it: rank 0: " in leader["text"], leader
