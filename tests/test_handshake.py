"""The start-up handshake of an external launch, between two real processes on gloo.

The two processes form the group themselves (the user's-group path of
``startup/external.py``) and run the handshake once per case (tests/scripts/
handshake_ranks.py): the same secret twice (a restart), a leader's record replayed from
the earlier start, another secret, a weak secret, other arguments, and no secret at all
(the private file). Every failing case must fail on both ranks, with the same error.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

import launches
from harness import PYTHON, SCRIPTS, base_env

SCRIPT = SCRIPTS / "handshake_ranks.py"
CASES = 9


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp("handshake")
    private_tmp = tmp / "tmp"
    private_tmp.mkdir()
    env = base_env(TMPDIR=str(private_tmp))
    launches.count("python")  # two ranks of one handshake
    ranks = [
        subprocess.Popen(
            [PYTHON, str(SCRIPT), str(rank), str(tmp / "store")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    found: dict[str, dict[int, dict[str, Any]]] = {}
    try:
        for proc in ranks:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err[-4000:]
            for line in out.splitlines():
                outcome = json.loads(line)
                found.setdefault(outcome["case"], {})[outcome["rank"]] = outcome
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert len(found) == CASES, found
    left = list((private_tmp / f"neps_bcast-{os.geteuid()}").iterdir())
    assert left == [], f"the secret's file was left behind: {left}"
    return found


def both_failed(outcome: dict[int, dict[str, Any]]) -> tuple[str, str]:
    assert set(outcome) == {0, 1}
    assert "error" in outcome[0] and "error" in outcome[1], outcome
    return outcome[0]["error"], outcome[1]["error"]


def test_ranks_with_the_same_secret_agree_on_the_search(outcomes: dict[str, Any]) -> None:
    first = outcomes["first"]
    assert "error" not in first[0] and "error" not in first[1], first
    assert first[0]["search"] == first[1]["search"]
    assert first[0]["key"] == first[1]["key"]
    assert first[1]["connected"] and first[0]["loopback"] and first[1]["loopback"]


def test_a_restart_with_the_same_secret_is_another_search(outcomes: dict[str, Any]) -> None:
    first, restart = outcomes["first"], outcomes["restart"]
    assert restart[0]["search"] == restart[1]["search"]
    assert restart[0]["key"] == first[0]["key"]  # the same NEPS_BCAST_SECRET ...
    assert restart[0]["search"] != first[0]["search"]  # ... and yet a new search


def test_a_leaders_record_replayed_from_an_earlier_start_is_refused_on_every_rank(
    outcomes: dict[str, Any],
) -> None:
    leader, follower = both_failed(outcomes["replayed"])
    refusal = (
        "rank 1: refused the leader's record 'neps_bcast/leader': it does not hold this"
        " rank's challenge of this start (a record of another search or restart, or not a"
        " record at all; nothing in it was used) (fix: another process is tampering"
    )
    for error in (leader, follower):
        assert error.startswith("AuthError: [neps_bcast rank "), error
        assert (
            "stopping before trial 1 on every rank: 1 of 2 ranks refused a value this search"
            " would have trusted." in error
        ), error
        assert refusal in error, error
        assert "HINT: fix what each rank refused" in error


def test_a_rank_with_another_secret_is_refused_on_every_rank(outcomes: dict[str, Any]) -> None:
    for error in both_failed(outcomes["another secret"]):
        assert "rank 1: refused the value under 'neps_bcast/leader'" in error, error
        assert "different NEPS_BCAST_SECRET values" in error


def test_a_weak_secret_on_one_rank_stops_every_rank(outcomes: dict[str, Any]) -> None:
    for error in both_failed(outcomes["weak secret"]):
        assert "rank 1: refused NEPS_BCAST_SECRET: too weak to protect the search" in error, error
        assert "the search's secret" not in error  # never shown


def test_ranks_with_other_arguments_fail_on_every_rank(outcomes: dict[str, Any]) -> None:
    for error in both_failed(outcomes["different arguments"]):
        assert error.startswith("LaunchError: [neps_bcast rank "), error
        assert "root_directory: rank 0: 'root', rank 1: 'elsewhere'" in error


def test_without_a_secret_one_host_agrees_through_the_private_file(
    outcomes: dict[str, Any],
) -> None:
    plain = outcomes["no secret, one host"]
    assert "error" not in plain[0] and "error" not in plain[1], plain
    assert plain[0]["key"] == plain[1]["key"]
    assert plain[0]["key"] != outcomes["first"][0]["key"]  # the leader made a new one


def test_ranks_on_other_hosts_when_the_launch_says_one_node_fail_on_every_rank(
    outcomes: dict[str, Any],
) -> None:
    for error in both_failed(outcomes["one node, two hosts"]):
        assert error.startswith("LaunchError: [neps_bcast rank "), error
        assert (
            "the launcher's variables put every rank on this node, but the ranks report"
            " different hosts (rank 0: " in error
        ), error
        assert "rank 1: elsewhere). HINT: check the launch" in error


def test_several_hosts_without_a_secret_warn_on_every_rank(outcomes: dict[str, Any]) -> None:
    spread = outcomes["several hosts, no secret"]
    assert "error" not in spread[0] and "error" not in spread[1], spread
    assert spread[0]["key"] == spread[1]["key"]
    assert spread[0]["loopback"] is False  # the leader's store listens on every interface
    for rank in (0, 1):
        assert any(
            "this group spans 2 hosts and NEPS_BCAST_SECRET is not set" in w and "in the clear" in w
            for w in spread[rank]["warnings"]
        ), spread[rank]["warnings"]
    # The positive control: one host without a secret does not warn.
    assert outcomes["no secret, one host"][0]["warnings"] == []


def test_an_oversized_or_unreadable_record_from_the_group_is_an_error() -> None:
    from neps_bcast.errors import LaunchError
    from neps_bcast.startup import ranks

    with pytest.raises(LaunchError, match=r"a rank sent a startup record of 2000000 bytes"):
        ranks._checked_size(2_000_000, "neps_bcast rank 1/2 follower")
    with pytest.raises(LaunchError, match=r"cannot read the leader's record sent over the group"):
        ranks.record(b"\x80not json", "the leader's record", "neps_bcast rank 1/2 follower")
