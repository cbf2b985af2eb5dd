"""Unit tests of the pool's parts that need no process: the wire's opening and sealing
(hostile input refused before anything of it is used), ``ranks_per_trial``'s checks, and
the variables a warm rank gets for a trial."""

from __future__ import annotations

import os
import pickle
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import neps
import pytest

from neps_bcast.api import _check_ranks_per_trial
from neps_bcast.errors import NepsBcastError
from neps_bcast.pool import opening, wire
from neps_bcast.pool.agent import check_up_front, trial_size
from neps_bcast.pool.rank import trial_environment


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "pool.sock")
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(path)
    listening.listen(1)
    try:
        yield path, listening
    finally:
        listening.close()


def accept_in_thread(
    listening: socket.socket, key: str, admit: Any = lambda hello: None
) -> dict[str, Any]:
    """The launcher's side in a thread: its hello, or the error it raised."""
    seen: dict[str, Any] = {}

    def serve() -> None:
        sock, _ = listening.accept()
        conn = wire.Conn(sock)
        try:
            seen["hello"] = opening.accept(conn, key, admit)
            seen["next"] = conn.receive(10)
        except (wire.WireError, TimeoutError) as exc:
            seen["error"] = exc
        finally:
            conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    seen["thread"] = thread
    return seen


def test_a_member_with_the_key_is_welcomed_and_heard(server: tuple[str, socket.socket]) -> None:
    path, listening = server
    key = wire.new_key()
    seen = accept_in_thread(listening, key)
    conn = opening.connect(path, key, "rank", 3)
    conn.send({"op": "free", "order": "x", "clean": True})
    seen["thread"].join(10)
    conn.close()
    assert seen["hello"]["role"] == "rank" and seen["hello"]["index"] == 3
    assert seen["next"] == {"op": "free", "order": "x", "clean": True}


def test_the_hellos_pid_is_the_kernels_and_a_process_not_admitted_hears_why(
    server: tuple[str, socket.socket],
) -> None:
    """The launcher takes the pid from ``SO_PEERCRED``, not from what the process wrote,
    and a proven process it will not take (not the one it started, or connected already)
    learns the reason at ``connect`` instead of a welcome and then a closed socket."""
    path, listening = server
    key = wire.new_key()
    heard: list[dict[str, Any]] = []

    def admit(hello: dict[str, Any]) -> str | None:
        heard.append(hello)
        return "rank 3 is pid 1 here, not pid 2"

    seen = accept_in_thread(listening, key, admit)
    with pytest.raises(wire.WireError, match=r"refused this process: rank 3 is pid 1 here"):
        opening.connect(path, key, "rank", 3)
    seen["thread"].join(10)
    assert heard[0]["pid"] == os.getpid()
    assert "refused: rank 3 is pid 1 here" in str(seen["error"])


def test_a_process_without_the_key_is_refused_before_anything_it_sends_is_read(
    server: tuple[str, socket.socket],
) -> None:
    path, listening = server
    seen = accept_in_thread(listening, wire.new_key())
    with pytest.raises(wire.WireError):
        opening.connect(path, wire.new_key(), "agent", 0)  # its own key: the launcher's proof fails
    seen["thread"].join(10)
    assert "hello" not in seen and "next" not in seen
    assert isinstance(seen["error"], wire.WireError)


def test_a_socket_that_cannot_prove_the_key_is_not_trusted(
    server: tuple[str, socket.socket],
) -> None:
    """An impostor serving the path: the member refuses it and sends nothing more."""
    path, listening = server
    received: list[dict[str, Any]] = []

    def impostor() -> None:
        sock, _ = listening.accept()
        conn = wire.Conn(sock)
        received.append(conn.receive(10))
        conn.send({"op": "challenge", "nonce": "00", "proof": "not a proof"})
        try:
            received.append(conn.receive(10))
        except wire.WireError:
            pass
        conn.close()

    thread = threading.Thread(target=impostor)
    thread.start()
    with pytest.raises(wire.WireError, match="did not prove the pool's key"):
        opening.connect(path, wire.new_key(), "rank", 0)
    thread.join(10)
    assert [r["op"] for r in received] == ["hello"]  # no proof, nothing else, was sent


@pytest.mark.parametrize(
    "line",
    [b"not json\n", b"[1, 2]\n", b'{"no": "op"}\n', b'{"op": 3}\n', b"\xff\xfe\n"],
    ids=["text", "a list", "no op", "op not text", "not utf-8"],
)
def test_a_line_that_is_not_a_record_is_refused(line: bytes) -> None:
    left, right = socket.socketpair()
    try:
        left.sendall(line)
        with pytest.raises(wire.WireError):
            wire.Conn(right).receive(5)
    finally:
        left.close()
        right.close()


def test_a_sealed_payload_opens_only_with_its_key_kind_and_order() -> None:
    key = wire.new_key()
    payload = pickle.dumps({"lr": 0.1})
    sealed = wire.seal(key, "trial", "order-1", payload)
    assert wire.unseal(key, "trial", "order-1", sealed) == payload
    for other_key, what, order in [
        (wire.new_key(), "trial", "order-1"),
        (key, "result", "order-1"),
        (key, "trial", "order-2"),
    ]:
        with pytest.raises(wire.WireError):
            wire.unseal(other_key, what, order, sealed)


@pytest.mark.parametrize(
    "sealed", ["!!!not base64", 12, "", "QUFBQQ=="], ids=["garbage", "a number", "empty", "short"]
)
def test_a_forged_or_broken_payload_is_refused(sealed: object) -> None:
    with pytest.raises(wire.WireError):
        wire.unseal(wire.new_key(), "trial", "o", sealed)


def test_a_tampered_payload_is_refused() -> None:
    key = wire.new_key()
    sealed = wire.seal(key, "result", "o", pickle.dumps(1.0))
    raw = bytearray(__import__("base64").b64decode(sealed))
    raw[-1] ^= 1
    with pytest.raises(wire.WireError, match="failed its check"):
        wire.unseal(key, "result", "o", __import__("base64").b64encode(bytes(raw)).decode())


# -- ranks_per_trial ------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1, 2, 4])
def test_a_size_from_1_to_the_pool_is_taken(value: int) -> None:
    assert trial_size(lambda _c: value, {"epochs": 3}, 4, "tag") == value


def test_an_integer_like_size_is_taken() -> None:
    class Index:
        def __index__(self) -> int:
            return 2

    assert trial_size(lambda _c: Index(), {}, 4, "tag") == 2  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("value", [0, 5, -1, 1.5, True, "2", None])
def test_a_size_outside_1_to_the_pool_names_the_value_the_config_and_the_range(
    value: object,
) -> None:
    with pytest.raises(NepsBcastError) as info:
        trial_size(lambda _c: value, {"epochs": 9}, 4, "[agent]")  # type: ignore[arg-type,return-value]
    text = str(info.value)
    assert f"ranks_per_trial returned {value!r}" in text
    assert "{'epochs': 9}" in text
    assert "from 1 to 4" in text
    assert "HINT" in text


def test_a_ranks_per_trial_that_raises_names_its_error_and_the_config() -> None:
    def broken(config: dict[str, Any]) -> int:
        return int(config["missing"])

    with pytest.raises(NepsBcastError) as info:
        trial_size(broken, {"epochs": 1}, 4, "[agent]")
    assert "ranks_per_trial raised KeyError: 'missing' for the config {'epochs': 1}" in str(
        info.value
    )


class FidelitySpace(neps.PipelineSpace):
    lr = neps.Float(1e-3, 1e-1, log=True)
    optimizer = neps.Categorical(choices=("adam", "sgd"))
    epochs = neps.IntegerFidelity(1, 27)


def test_a_rule_too_wide_for_the_pool_at_the_top_fidelity_is_refused_before_the_search() -> None:
    def rule(config: dict[str, Any]) -> int:
        return 1 if config["epochs"] <= 3 else 8

    check_up_front(rule, FidelitySpace(), 8, "[agent]")
    with pytest.raises(NepsBcastError) as info:
        check_up_front(rule, FidelitySpace(), 4, "[agent]")
    text = str(info.value)
    assert "before the search starts: ranks_per_trial returned 8" in text
    assert "'epochs': 27" in text
    assert "from 1 to 4" in text


def test_a_rule_that_breaks_on_one_categorical_choice_is_refused_before_the_search() -> None:
    def rule(config: dict[str, Any]) -> int:
        return {"adam": 1}[config["optimizer"]]

    with pytest.raises(NepsBcastError, match="raised KeyError: 'sgd'"):
        check_up_front(rule, FidelitySpace(), 4, "[agent]")


def test_a_space_neps_cannot_convert_leaves_the_check_to_each_trial() -> None:
    check_up_front(lambda c: 99, object(), 4, "[agent]")


@pytest.mark.parametrize(
    ("value", "role", "expected"),
    [
        (3, "agent", "must be a function of the config"),
        (lambda c: 1, None, "not part of a pool"),
        (None, "agent", "was not given ranks_per_trial"),
    ],
    ids=["not callable", "outside a pool", "a pool without it"],
)
def test_ranks_per_trial_is_checked_up_front(
    value: object, role: str | None, expected: str
) -> None:
    with pytest.raises(NepsBcastError, match=expected):
        _check_ranks_per_trial(value, role)


@pytest.mark.parametrize(("value", "role"), [(None, None), (lambda c: 1, "agent"), (None, "rank")])
def test_ranks_per_trial_where_it_belongs_passes(value: object, role: str | None) -> None:
    _check_ranks_per_trial(value, role)


def test_a_trial_gets_torchruns_variables_for_its_rank_and_store() -> None:
    env = trial_environment({"order": "abc", "rank": 2, "world": 4, "port": 4242})
    assert env["RANK"] == env["LOCAL_RANK"] == "2"
    assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "4242")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # the agent's store: no rank binds
    assert env["TORCHELASTIC_RUN_ID"].endswith("abc")


def test_a_trials_rendezvous_store_listens_on_loopback_only() -> None:
    """Every rank of a pool runs on the launcher's host: the agent's per-trial store,
    where the trial's rank 0 publishes its control store and torch forms the trial's
    group, must not be reachable (and writable) from another host."""
    from neps_bcast.pool.agent import trial_store
    from neps_bcast.transport.sockets import own_listening

    store = trial_store()
    listening = {host for host, port in own_listening() if port == store.port}
    assert listening == {"127.0.0.1"}, listening
    store.set("neps_bcast/probe", "1")
    assert store.get("neps_bcast/probe") == b"1"


def test_reading_a_member_with_nothing_to_say_returns_at_once() -> None:
    """The launcher reads a trial's rank 0 for its last words without select's word: a
    member that has nothing to say gives no records and stays connected, whatever
    timeout its socket kept from the opening (the pool sweep once had a fresh rank's
    connection closed so, after the launcher's loop stalled for that timeout)."""
    launcher_side, member_side = socket.socketpair()
    launcher_side.settimeout(2.0)  # as ``opening.accept``'s bounded receive leaves it
    conn = wire.Conn(launcher_side)
    try:
        assert conn.feed() == []
        member_side.sendall(b'{"op": "free", "order": "x", "clean": true}\n')
        assert conn.receive(5) == {"op": "free", "order": "x", "clean": True}
    finally:
        conn.close()
        member_side.close()


def test_a_record_longer_than_the_sockets_buffer_goes_whole_after_a_read() -> None:
    """The launcher reads members without blocking (``feed``) and relays a trial's
    result to its agent: a result of megabytes must not fail on a full buffer."""
    launcher_side, agent_side = socket.socketpair()
    launcher, agent = wire.Conn(launcher_side), wire.Conn(agent_side)
    try:
        assert launcher.feed() == []  # what the launcher's loop does to every member
        got: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: got.update(agent.receive(30)))
        reader.start()
        launcher.send({"op": "outcome", "result": "x" * 5_000_000})
        reader.join(30)
        assert got.get("op") == "outcome" and len(got["result"]) == 5_000_000
    finally:
        launcher.close()
        agent.close()


def test_a_result_too_large_for_the_wire_is_an_error_naming_the_sizes_and_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0 checks its result before it sends it: the trial is then recorded crashed
    with this message instead of its agent hearing of a lost rank."""
    from neps_bcast.pool import rank as pool_rank

    key = wire.new_key()
    fits = pool_rank.sealed_result(key, "o1", {"loss": 0.5}, "7", "[neps_bcast]")
    assert pickle.loads(wire.unseal(key, "result", "o1", fits)) == {"loss": 0.5}
    monkeypatch.setattr(wire, "MAX_PAYLOAD", 2**20)
    with pytest.raises(NepsBcastError) as raised:
        pool_rank.sealed_result(key, "o1", b"x" * 3 * 2**20, "7", "[neps_bcast]")
    text = str(raised.value)
    assert "trial 7's result is 3 MiB pickled; a pool relays at most 1 MiB to the agent." in text
    assert "save tensors or models under pipeline_directory" in text


def test_a_result_that_does_not_pickle_is_an_error_naming_why() -> None:
    from neps_bcast.pool import rank as pool_rank

    with pytest.raises(NepsBcastError, match=r"trial 7's result cannot be sent to its agent:"):
        pool_rank.sealed_result(wire.new_key(), "o1", lambda: 1, "7", "[neps_bcast]")


@pytest.mark.parametrize(("rank", "world"), [(0, 1), (0, 2), (1, 2), (3, 4)])
def test_a_trials_launch_comes_from_its_order_not_the_process_environment(
    rank: int, world: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm rank's start reads its trial's rendezvous from the order (the same
    variables the user's code finds in the environment), never from whatever the
    process's environment holds."""
    from neps_bcast.startup.launch import detect

    order = {"rank": rank, "world": world, "port": 29511, "order": "o7"}
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("WORLD_SIZE", "99")
    launch = detect(trial_environment(order))
    assert launch.kind == ("external" if world > 1 else "single")
    if world > 1:
        assert (launch.global_rank, launch.world_size) == (rank, world)
        assert (launch.main_address, launch.main_port) == ("127.0.0.1", 29511)
        assert launch.is_single_node is True
