"""Looks for orphans (``Leases.recover_orphans``: a trial whose leader died is handed back
to pending) on real NePS roots, with real workers and recoverers racing for one orphan.
Apart from ``test_lease_unit.py`` so that the two halves run on two test workers: each
test here waits for processes of its own (imports, locks), seconds each on busy cores.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from harness import base_env
from lease_worker import PYTHON, states, worker
from neps_bcast.compat import procfs
from neps_bcast.compat.neps import use_neps_locking
from neps_bcast.config import Settings
from neps_bcast.recovery.lease import Leases
from neps_bcast.recovery.lease_file import lease_lock, read_lease

RECOVER = """
import json, sys
from pathlib import Path
import neps.state.neps_state  # the slow imports before "ready" (seconds on 2 busy cores)
from neps_bcast.compat import neps as neps_compat
from neps_bcast.config import Settings
from neps_bcast.recovery import hand_back
from neps_bcast.recovery.lease import Leases
neps_compat.lock_kind()
if len(sys.argv) > 2:  # the look's bound for a lease lock held by a frozen renewal
    hand_back.LOOK_LOCK_WAIT_S = float(sys.argv[2])
leases = Leases(Path(sys.argv[1]), Settings())
print("ready", flush=True)
print(json.dumps(leases.recover_orphans()))
"""


def blocked_on_a_lock(pid: int) -> bool:
    """``pid`` waits for a lock (a ``->`` line of /proc/locks names its waiters)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return any("->" in line and line.split()[-4] == str(pid) for line in lines)


def holds_open(pid: int, path: Path) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(fd.readlink() == path for fd in fds.iterdir())
    except OSError:
        return False


def test_two_leaders_never_both_take_one_orphan(tmp_path: Path) -> None:
    """Three recoverers race for one orphan, forced, not by timing: the test holds the
    orphan's lease lock until one recoverer waits for it (under NePS's trial lock, so it
    has read the orphan as evaluating) and the other two wait at NePS's trial lock."""
    first = worker(tmp_path, trials=3, fault="kill", at="2")
    assert first.returncode == -signal.SIGKILL
    root = tmp_path / "root"
    trial_lock = (root / ".configs.lock").resolve()
    env = base_env()
    with lease_lock(root / "configs" / "config_2"):
        procs = [
            subprocess.Popen(
                # The race takes seconds to set on a busy machine, past the look's bound
                # (5 s, tested below): every recoverer would pass the orphan over first.
                [PYTHON, "-c", RECOVER, str(root), "600"],
                env=env,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(3)
        ]
        try:
            for p in procs:
                assert p.stdout is not None and p.stdout.readline() == "ready\n"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                inside = [p.pid for p in procs if blocked_on_a_lock(p.pid)]
                at_the_door = [p.pid for p in procs if holds_open(p.pid, trial_lock)]
                if len(inside) == 1 and len(at_the_door) == 3:
                    break
                time.sleep(0.01)  # a bounded poll of /proc: the race is set when both hold
            else:
                ended = {p.pid: p.poll() for p in procs}
                raise AssertionError(
                    f"the race never set in 120 s: {inside=} {at_the_door=}; exit codes of"
                    f" the recoverers (None: alive): {ended}"
                )
        except BaseException:
            for p in procs:
                p.kill()
            raise
    outputs = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    taken = [o for o in outputs if o]
    assert len(taken) == 1, outputs
    assert taken[0] == ["2: back to pending (interruption 1 of at most 3 retried)"]
    lease = read_lease(tmp_path / "root" / "configs" / "config_2")
    assert lease is not None
    assert len(lease.attempts) == 1
    assert states(tmp_path)["2"] == "pending"
    assert not [p for p in procs if procfs.is_alive(p.pid)]


def test_between_trials_a_leader_looks_for_orphans_once_per_heartbeat_period(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    assert worker(tmp_path, trials=3, fault="kill", at="2").returncode == -signal.SIGKILL
    hourly = Leases(root, Settings(heartbeat_s=3600.0, lease_grace_s=4 * 3600.0))
    # Its first look is due: it hands the orphan back.
    assert hourly.recover_orphans_if_due() == [
        "2: back to pending (interruption 1 of at most 3 retried)"
    ]
    # The next worker evaluates the pending trial first and is killed in it again.
    assert worker(tmp_path, trials=3, fault="kill", at="2").returncode == -signal.SIGKILL
    assert states(tmp_path)["2"] == "evaluating"
    assert hourly.recover_orphans_if_due() == []  # looked less than an hour ago
    assert states(tmp_path)["2"] == "evaluating"
    at_once = Leases(root, Settings(heartbeat_s=0.0, lease_grace_s=4 * 3600.0))
    at_once.recover_orphans()  # a look now: the next one is due a period (0 s) later
    assert states(tmp_path)["2"] == "pending"
    assert worker(tmp_path, trials=3, fault="kill", at="2").returncode == -signal.SIGKILL
    assert at_once.recover_orphans_if_due() == [
        "2: back to pending (interruption 3 of at most 3 retried)"
    ]


LOOK_AGAIN = """
import json, sys
from pathlib import Path
import neps.state.neps_state  # the slow imports before "ready" (seconds on 2 busy cores)
from neps_bcast.compat import neps as neps_compat
from neps_bcast.config import Settings
from neps_bcast.recovery.lease import Leases
neps_compat.lock_kind()
leases = Leases(Path(sys.argv[1]), Settings())
print(json.dumps(leases.recover_orphans()), flush=True)  # a leader's look at its start
sys.stdin.readline()
print(json.dumps(leases.recover_orphans()), flush=True)  # and before a later trial
"""


def test_a_leaders_look_for_orphans_does_not_wait_while_another_worker_samples(
    tmp_path: Path,
) -> None:
    """NePS holds its optimizer lock for the whole of a sample (a Bayesian optimizer's fit:
    seconds), while the look for orphans needs only NePS's trial lock: a leader that
    waited for the optimizer lock before each trial left its devices idle for other
    workers' samples (a pool of 4 agents under BO: ~19 s before one trial asked for its
    device). The test holds the optimizer lock, as a sampling worker does, while a leader
    that looked once already looks again and finds a new orphan."""
    import portalocker.portalocker as portalocker_lock_module
    from neps.state.neps_state import NePSState

    assert worker(tmp_path, trials=1).returncode == 0
    root = tmp_path / "root"
    saved = portalocker_lock_module.LOCKER
    leader = subprocess.Popen(
        [PYTHON, "-c", LOOK_AGAIN, str(root)],
        env=base_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert leader.stdout is not None and leader.stdin is not None
        assert json.loads(leader.stdout.readline()) == []
        assert worker(tmp_path, trials=3, fault="kill", at="2").returncode == -signal.SIGKILL
        use_neps_locking()  # the kind of lock a NePS worker takes (lockf)
        with NePSState.create_or_load(path=root, load_only=True)._optimizer_lock.lock():
            leader.stdin.write("look\n")
            leader.stdin.flush()
            found, _ = leader.communicate(timeout=120)
    finally:
        portalocker_lock_module.LOCKER = saved
        leader.kill()
        leader.wait()
    assert json.loads(found) == ["2: back to pending (interruption 1 of at most 3 retried)"]
    assert states(tmp_path)["2"] == "pending"


def recover(root: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """One look for orphans of ``root`` in a process of its own (``RECOVER``), bounded."""
    return subprocess.run(
        [PYTHON, "-c", RECOVER, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_look_passes_over_a_trial_whose_lease_lock_stays_held_and_takes_it_once_free(
    tmp_path: Path,
) -> None:
    """A renewal frozen mid-write (a frozen process, a hung mount) keeps its trial's lease
    lock: a look for orphans, which runs under NePS's trial lock (every worker of the root
    waits meanwhile), waits ``LOOK_LOCK_WAIT_S`` for it, passes that trial over and
    returns; the next look, once the lock is free, takes the orphan."""
    first = worker(tmp_path, trials=3, fault="kill", at="2")
    assert first.returncode == -signal.SIGKILL
    root = tmp_path / "root"
    env = base_env()
    with lease_lock(root / "configs" / "config_2"):  # held by this process for the look
        look = recover(root, env)
        assert look.returncode == 0, look.stderr
        assert json.loads(look.stdout.splitlines()[-1]) == [], look.stdout
        assert "trial 2 not looked at" in look.stderr, look.stderr
        assert states(tmp_path)["2"] == "evaluating"
    again = recover(root, env)
    assert json.loads(again.stdout.splitlines()[-1]) == [
        "2: back to pending (interruption 1 of at most 3 retried)"
    ], again.stderr
    assert states(tmp_path)["2"] == "pending"
