"""Nothing outside the job can drive a rank, shown with a real attacker.

An attacker process on this host reaches the leader's store while a real search runs
(Lightning ``strategy="ddp"`` and torchrun) and, round after round, overwrites every
key neps_bcast uses with a pickle that creates a file when unpickled; it also bumps the
error counters so that the ranks read its forged error records when a trial fails. The
file must never exist, every trial must be recorded (the injected failure with its real
text), and nothing may be left running. Plus: the store listens on loopback only. (A
single-process search serves no store at all, and a rank with another secret is refused
before trial 1 on every rank: tests/test_e2e_guarantees.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness import (
    LIGHTNING,
    PYTHON,
    SCRIPTS,
    CleanLaunch,
    Result,
    Running,
    listening_ports,
    neps_trials,
    python,
    start,
    torchrun,
)
from neps_bcast.compat import procfs

ATTACKER = SCRIPTS / "attacker.py"
TRIALS = 5
# A window in trial 2 for the attack to be under way before trial 3 fails.
FAULT = "sleep:leader:trial=2:at=session:s=3, raise:follower:trial=3:at=fit"


def first_trial_pid(running: Running, rank: int) -> int:
    event = running.wait_for(
        f"rank {rank}'s first trial",
        lambda events: next(
            (e for e in events if e["event"] == "trial" and e["rank"] == rank), None
        ),
    )
    return int(event["pid"])


class Attacker:
    """The attacker process, started (imports done) before the search; it waits for its
    targets."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.proc = subprocess.Popen(
            [
                PYTHON,
                str(ATTACKER),
                "--marker",
                str(tmp / "PWNED"),
                "--stop",
                str(tmp / "stop"),
                "--targets",
                str(tmp / "targets.json"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

    def aim(self, addresses: list[str], prefixes: tuple[str, ...] = ()) -> None:
        partial = self.tmp / "targets.partial"
        partial.write_text(json.dumps({"addresses": addresses, "prefixes": list(prefixes)}))
        partial.rename(self.tmp / "targets.json")

    def stop(self) -> dict[str, Any]:
        (self.tmp / "stop").touch()
        out, _ = self.proc.communicate(timeout=60)
        report: dict[str, Any] = json.loads(out)
        return report

    def __enter__(self) -> Attacker:
        return self

    def __exit__(self, *exc: object) -> None:
        """Whatever happened, the attacker is gone (stopped, or killed)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


@dataclass
class Attacked:
    launch: Result
    report: dict[str, Any]
    tmp: Path
    ports: dict[int, str] = field(default_factory=dict)
    """What the leader listened on while the search ran."""
    store_port: int = 0
    """The leader's store, as the attacker found it."""


class SurvivesTheAttack(CleanLaunch):
    """The search with the attacker: the attack happened and reached the ranks, no
    outsider's pickle ran, and the search recorded every trial as if alone."""

    @pytest.fixture(scope="class")
    def launch(self, attacked: Attacked) -> Result:
        return attacked.launch

    def test_the_attacker_wrote_to_the_stores(self, attacked: Attacked) -> None:
        assert attacked.report["writes"] > 0, attacked.report

    def test_a_rank_refused_a_forged_value_naming_its_key(self, attacked: Attacked) -> None:
        """The positive control of the next test: the attack reached the ranks."""
        assert "refused the value under 'neps_bcast/" in attacked.launch.log, attacked.launch.tail()

    def test_no_outsiders_pickle_ran_in_a_rank(self, attacked: Attacked) -> None:
        assert not (attacked.tmp / "PWNED").exists()

    def test_neps_recorded_every_trial_one_crashed_the_others_successes(
        self, attacked: Attacked
    ) -> None:
        trials = neps_trials(attacked.launch.root)
        assert len(trials) == TRIALS
        recorded = sorted(str(t.report.reported_as) for t in trials.values() if t.report)
        assert recorded == ["crashed"] + ["success"] * (TRIALS - 1), recorded

    def test_the_injected_failure_is_recorded_with_its_real_text(self, attacked: Attacked) -> None:
        trials = neps_trials(attacked.launch.root).values()
        crashed = next(t for t in trials if t.report and t.report.reported_as == "crashed")
        assert "failed on rank 1: rank 1: ValueError: injected failure on rank 1 at fit" in str(
            crashed.report.err
        )


class TestAnAttackerOnTheLeadersStoreRunsNothingLightning(SurvivesTheAttack):
    @pytest.fixture(scope="class")
    def attacked(self, tmp_path_factory: pytest.TempPathFactory) -> Attacked:
        tmp = tmp_path_factory.mktemp("attack_lightning")
        outsider = Attacker(tmp)
        with outsider:
            running = start(
                python(LIGHTNING, "--trials", TRIALS, "--ignore-errors"), tmp, fault=FAULT
            )
            child = first_trial_pid(running, 1)
            address = procfs.environ(child)["NEPS_BCAST_LEADER"]
            outsider.aim([address])
            leader = int(procfs.read_stat(child).ppid)  # type: ignore[union-attr]
            ports = listening_ports(leader)
            launch = running.finish()
            report = outsider.stop()
        return Attacked(launch, report, tmp, ports, int(address.rpartition(":")[2]))

    def test_the_leaders_store_listens_on_loopback_only(self, attacked: Attacked) -> None:
        assert attacked.ports[attacked.store_port] == "127.0.0.1", attacked.ports

    def test_the_same_reading_sees_a_listener_on_every_interface(self, attacked: Attacked) -> None:
        """The positive control: Lightning's own store does listen on every interface."""
        assert any(ip in ("0.0.0.0", "::") for ip in attacked.ports.values()), attacked.ports


class TestAnAttackerOnBothStoresRunsNothingTorchrun(SurvivesTheAttack):
    @pytest.fixture(scope="class")
    def attacked(self, tmp_path_factory: pytest.TempPathFactory) -> Attacked:
        tmp = tmp_path_factory.mktemp("attack_torchrun")
        outsider = Attacker(tmp)
        with outsider:
            command = torchrun(2, LIGHTNING, "--trials", TRIALS, "--ignore-errors")
            running = start(command, tmp, fault=FAULT)
            env = procfs.environ(first_trial_pid(running, 0))
            rendezvous = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            run_id = env["TORCHELASTIC_RUN_ID"]
            meet = f"neps_bcast/meet/{run_id}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            # The leader's own store: its port is no secret (the leader logs it; anyone
            # can find it in /proc/net/tcp).
            log = running.rank_logs()[running.wait_for_log("serving the control store on port")]
            found = re.search(r"serving the control store on port (\d+)", log)
            assert found is not None, log
            ours = [f"127.0.0.1:{found.group(1)}"]
            outsider.aim([rendezvous, *ours], prefixes=(meet,))
            launch = running.finish()
            report = outsider.stop()
        return Attacked(launch, report, tmp)
