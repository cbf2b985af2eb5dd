"""Nothing outside the job can drive a rank (issue 10), shown with a real attacker.

An attacker process on this host reaches the leader's store while a real search runs
(Lightning ``strategy="ddp"`` and torchrun) and, round after round, overwrites every
key neps_bcast uses with a pickle that creates a file when unpickled; it also bumps the
error counters so that the ranks read its forged error records when a trial fails. The
file must never exist, every trial must be recorded (the injected failure with its real
text), and nothing may be left running. Plus: a rank with another secret is refused
before trial 1 on every rank; the store listens on loopback only; a single-process
search serves no store at all.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from pathlib import Path
from typing import Any

from harness import (
    PYTHON,
    SCRIPTS,
    Running,
    assert_clean_launch,
    neps_trials,
    start,
    torchrun_cmd,
)
from neps_bcast.compat import procfs
from neps_bcast.transport import sockets
from scenario import Fault, Scenario

ATTACKER = SCRIPTS / "attacker.py"
FAILING_TRIAL = 3
SCENARIO = Scenario(
    trials=5,
    ignore_errors=True,
    faults=(
        # A window in trial 2 for the attack to be under way before trial 3 fails.
        Fault(kind="sleep", rank=0, seq=2, where="session", seconds=3.0),
        Fault(kind="raise", rank=1, seq=FAILING_TRIAL, where="fit"),
    ),
)


def follower_pid(running: Running) -> int:
    event = running.wait_for(
        "rank 1's first trial",
        lambda events: next((e for e in events if e["event"] == "trial" and e["rank"] == 1), None),
    )
    return int(event["pid"])


def leader_pid(running: Running) -> int:
    event = running.wait_for(
        "the leader's first trial",
        lambda events: next((e for e in events if e["event"] == "trial" and e["rank"] == 0), None),
    )
    return int(event["pid"])


def listening_ports(pid: int) -> dict[int, str]:
    """port -> address of every TCP socket the process listens on."""
    table = sockets.tcp_table()
    return {port: ip for ip, port in sockets.listening(table, sockets.socket_inodes(pid))}


def attacker(tmp_path: Path) -> subprocess.Popen[str]:
    """The attacker, started (imports done) before the search; it waits for targets."""
    cmd = [
        PYTHON,
        str(ATTACKER),
        "--marker",
        str(tmp_path / "PWNED"),
        "--stop",
        str(tmp_path / "stop"),
        "--targets",
        str(tmp_path / "targets.json"),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def aim(tmp_path: Path, addresses: list[str], prefixes: tuple[str, ...] = ()) -> None:
    partial = tmp_path / "targets.partial"
    partial.write_text(json.dumps({"addresses": addresses, "prefixes": list(prefixes)}))
    partial.rename(tmp_path / "targets.json")


def stop_attack(tmp_path: Path, attacker: subprocess.Popen[str]) -> dict[str, Any]:
    (tmp_path / "stop").touch()
    out, _ = attacker.communicate(timeout=60)
    return json.loads(out)


def assert_search_survived(result: Any, tmp_path: Path, report: dict[str, Any]) -> None:
    assert report["writes"] > 0, report  # the attack really happened
    # ... and reached the ranks: each refused a forged value, naming its key.
    assert "refused the value under 'neps_bcast/" in result.log, result.tail()
    assert not (tmp_path / "PWNED").exists(), "an outsider's pickle ran in a rank"
    assert_clean_launch(result)
    trials = neps_trials(result.root)
    assert len(trials) == SCENARIO.trials
    states = sorted(str(t.report.reported_as) for t in trials.values() if t.report)
    assert states == ["crashed"] + ["success"] * (SCENARIO.trials - 1), states
    crashed = next(t for t in trials.values() if t.report and t.report.reported_as == "crashed")
    text = str(crashed.report.err)
    assert "failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit" in text


def test_an_attacker_on_the_leaders_store_runs_nothing_lightning(tmp_path: Path) -> None:
    outsider = attacker(tmp_path)
    running = start(SCENARIO, tmp_path)
    child = follower_pid(running)
    address = procfs.environ(child)["NEPS_BCAST_LEADER"]
    aim(tmp_path, [address])
    leader = int(procfs.read_stat(child).ppid)  # type: ignore[union-attr]
    ports = listening_ports(leader)
    result = running.finish()
    report = stop_attack(tmp_path, outsider)
    assert_search_survived(result, tmp_path, report)
    # The socket table: the leader's store listens on loopback only ...
    assert ports[int(address.rpartition(":")[2])] == "127.0.0.1", ports
    # ... and the same reading does see a listener on every interface (Lightning's own).
    assert any(ip in ("0.0.0.0", "::") for ip in ports.values()), ports


def test_an_attacker_on_both_stores_runs_nothing_torchrun(tmp_path: Path) -> None:
    outsider = attacker(tmp_path)
    running = start(SCENARIO, tmp_path, cmd=torchrun_cmd(2))
    leader = leader_pid(running)
    env = procfs.environ(leader)
    rendezvous = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    meet = (
        f"neps_bcast/meet/{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    # The leader's own store: its port is no secret (the leader logs it; anyone can
    # find it in /proc/net/tcp).
    log = running.rank_logs()[running.wait_for_log("serving the control store on port")]
    port = re.search(r"serving the control store on port (\d+)", log).group(1)  # type: ignore[union-attr]
    aim(tmp_path, [rendezvous, f"127.0.0.1:{port}"], prefixes=(meet,))
    result = running.finish()
    report = stop_attack(tmp_path, outsider)
    assert_search_survived(result, tmp_path, report)


def test_a_single_process_search_serves_no_store(tmp_path: Path) -> None:
    running = start(
        Scenario(
            trials=3,
            strategy="none",
            faults=(Fault("sleep", rank=0, seq=2, where="session", seconds=1),),
        ),
        tmp_path,
    )
    running.wait_for(
        "trial 2's pause", lambda ev: any(e["event"] == "fault" and e["seq"] == 2 for e in ev)
    )
    pid = leader_pid(running)
    ports = listening_ports(pid)
    result = running.finish()
    assert_clean_launch(result)
    assert ports == {}, f"a single-process search listens on {ports}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_rank_with_another_secret_is_refused_before_trial_1_on_every_rank(
    tmp_path: Path,
) -> None:
    port = free_port()
    launches = []
    secrets = ("a1b2c3d4e5f60718" * 4, "f0e1d2c3b4a59687" * 4)  # 32 bytes each, as hex
    for rank, secret in enumerate(secrets):
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "NEPS_BCAST_SECRET": secret,
        }
        scenario = Scenario(trials=3, strategy="plain_ddp", root=str(tmp_path / "root"))
        launches.append(start(scenario, tmp_path, name=f"rank{rank}", env=env))
    results = [launch.finish() for launch in launches]
    for result in results:
        assert result.returncode == 1, result.tail()
        assert not result.left_alive
        assert "rank 1: refused the value under 'neps_bcast/leader'" in result.log, result.tail()
        assert not result.of("trial"), "a trial ran with a mismatched secret"
    assert not (tmp_path / "root" / "configs").exists() or not neps_trials(tmp_path / "root")
