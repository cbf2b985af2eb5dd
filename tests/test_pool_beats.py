"""The pool's beats (``neps_bcast.pool.beats``): a frozen agent, rank or launcher of a
pool is found silent within the bound, a live one never, and a member SIGKILLs only its
own launcher. Real processes beat here (no torch: the launcher's side imports none); the
pool's end-to-end cells are the fault sweep's ``freeze_agent`` and ``freeze_launcher``."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from neps_bcast.compat import procfs
from neps_bcast.pool import beats
from verdicts import WAIT, Verdicts, wait_until

BOUND = 1.0
PYTHON = sys.executable

BEATING = """
import sys, time
from pathlib import Path
from neps_bcast.pool import beats
b = beats.Beats(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), print)
print("beating", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def beating(tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen[str]]]:
    """Start a process that beats under a name (as an agent or a rank does)."""
    started: list[subprocess.Popen[str]] = []

    def start(name: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [PYTHON, "-c", BEATING, str(tmp_path), name, str(BOUND)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "beating"
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.kill()
            proc.wait(WAIT)


def test_a_frozen_member_is_found_silent_after_the_bound_and_a_live_one_never(
    tmp_path: Path, beating: Callable[[str], subprocess.Popen[str]]
) -> None:
    frozen, live = beating("agent0.1"), beating("rank0.2")
    verdicts = Verdicts[beats.Silent]()
    judge = beats.Beats(tmp_path, beats.LAUNCHER, BOUND, verdicts)
    judge.watch("agent0.1", "agent 0", procfs.Process.of(frozen.pid))
    judge.watch("rank0.2", "rank 0", procfs.Process.of(live.pid))
    try:
        # Positive control: both beat, and nobody is found silent meanwhile.
        start = {n: beats.read(tmp_path, n) or 0 for n in ("agent0.1", "rank0.2")}
        wait_until(
            lambda: all((beats.read(tmp_path, n) or 0) >= start[n] + 5 for n in start),
            "five beats of each",
        )
        assert verdicts.seen == []
        frozen.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert verdicts.event.wait(WAIT)
        took = time.monotonic() - frozen_at
        # The live one beats on for two bounds more and is still not found silent.
        seen = beats.read(tmp_path, "rank0.2") or 0
        wait_until(
            lambda: (beats.read(tmp_path, "rank0.2") or 0) >= seen + 2 * beats.BEATS_PER_BOUND,
            "two bounds more of the live one's beats",
        )
    finally:
        judge.stop()
        frozen.send_signal(signal.SIGCONT)
    (silent,) = verdicts.seen
    assert (silent.label, silent.pid) == ("agent 0", frozen.pid)
    assert silent.silent_s > BOUND
    assert took > BOUND - 2 * BOUND / beats.BEATS_PER_BOUND
    assert "agent 0 (pid" in silent.describe() and "silent for" in silent.describe()


def test_silence_counts_only_the_time_the_judge_ran_and_a_new_beat_clears_it(
    tmp_path: Path,
) -> None:
    """The judge's own clock, driven by hand: a wake-up late by more than two beats (the
    judge was frozen or starved) adds two beats, not its whole lateness."""
    verdicts = Verdicts[beats.Silent]()
    judge = beats.Beats(tmp_path, beats.LAUNCHER, 1000.0, verdicts)  # its thread stays asleep
    try:
        judge.watch("rank1.7", "rank 1", procfs.Process("h", "b", "pid:[1]", 7, 70))
        assert judge._judge(500.0) == []  # not beating yet: never silent
        (tmp_path / "rank1.7").write_text("1")
        assert judge._judge(100.0) == []  # its first beat
        for _ in range(5):
            assert judge._judge(100.0) == []  # 500 s of silence
        (tmp_path / "rank1.7").write_text("2")
        assert judge._judge(100.0) == []  # a new beat: silence starts again
        for _ in range(10):
            assert judge._judge(100.0) == []  # exactly the bound: not past it
        (found,) = judge._judge(100.0)
        assert (found.label, found.pid, found.silent_s) == ("rank 1", 7, 1100.0)
        assert judge._judge(100.0) == []  # found once, then no longer watched
    finally:
        judge.stop()


KILLS_ITS_PARENT = """
import os, sys
from dataclasses import replace
from neps_bcast.compat import procfs
from neps_bcast.pool import beats
verdict = beats.end_silent_launcher("[test member]")
def silent(process):
    return beats.Silent("launcher", "the pool's launcher", process.pid, 31.0, 30.0, process)
# A stranger's pid first: not this process's parent, never killed.
verdict(silent(procfs.Process.of(int(sys.argv[1]))))
# Its parent's pid, but another start time (the pid of a launcher that died, handed on).
parent = procfs.Process.of(os.getppid())
verdict(silent(replace(parent, start_ticks=parent.start_ticks - 1)))
print("spared", flush=True)
verdict(silent(parent))
"""

PARENT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
child.wait()
print("child ended", child.returncode, flush=True)
sys.stdin.read()
"""


def test_a_member_sigkills_its_own_silent_launcher_and_no_other_process() -> None:
    stranger = subprocess.Popen(
        [PYTHON, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    launcher = subprocess.Popen(
        [PYTHON, "-c", PARENT, KILLS_ITS_PARENT, str(stranger.pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        code = launcher.wait(WAIT)
        out, err = launcher.communicate()
        assert code == -signal.SIGKILL, (code, out, err)
        assert "spared" in out and "child ended" not in out  # killed before its child ended
        assert stranger.poll() is None  # the stranger lives
        assert "lost the pool's launcher" in err and "silent for 31 s" in err, err
    finally:
        for proc in (stranger, launcher):
            proc.kill()
            proc.wait(WAIT)


LEAVES = """
import sys
from pathlib import Path
from neps_bcast.pool import beats
b = beats.Beats(Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), print)
print("beating", flush=True)
sys.stdin.readline()
b.leave()  # what a member does as it exits: its exit may outlast the bound
print("left", flush=True)
sys.stdin.read()
"""


def test_a_member_that_leaves_is_judged_no_more(tmp_path: Path) -> None:
    """A process in its exit (atexit handlers, finalization: no daemon thread beats
    there) that takes longer than the bound is not taken for silent; the positive control
    is the first test's frozen member."""
    proc = subprocess.Popen(
        [PYTHON, "-c", LEAVES, str(tmp_path), "rank1.9", str(BOUND)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    verdicts = Verdicts[beats.Silent]()
    judge = beats.Beats(tmp_path, beats.LAUNCHER, BOUND, verdicts)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().strip() == "beating"
        judge.watch("rank1.9", "rank 1", procfs.Process.of(proc.pid))
        wait_until(lambda: (beats.read(tmp_path, "rank1.9") or 0) >= 5, "five beats")
        proc.stdin.write("leave\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "left"
        # Three bounds of the judge's own beats with the member beating no more.
        mine = beats.read(tmp_path, beats.LAUNCHER) or 0
        wait_until(
            lambda: (beats.read(tmp_path, beats.LAUNCHER) or 0) >= mine + 3 * beats.BEATS_PER_BOUND,
            "three bounds of the judge's beats",
        )
        assert verdicts.seen == []
        assert (tmp_path / "rank1.9").read_text() == beats.LEAVING
    finally:
        judge.stop()
        proc.kill()
        proc.wait(WAIT)
