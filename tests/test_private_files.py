"""Files a rank trusts only when this user made them: the root's lock file and the
private directory the secret and a Lightning child's first trial travel through.

"Another user" is played by making the file's owner differ from the process's user:
``os.geteuid`` is patched to a uid that owns nothing here, so the checks see every file
of this test as foreign (the end-to-end attacker in tests/e2e/test_e2e_attacker.py is a real
other user).
"""

from __future__ import annotations

import fcntl
import os
import re
from pathlib import Path

import pytest

from neps_bcast.compat import neps as neps_compat
from neps_bcast.errors import AuthError
from neps_bcast.recovery.root_lock import RootGuard
from neps_bcast.transport import private

STRANGER = 54321
"""A uid that owns none of this test's files."""


def open_flags(fd: int) -> int:
    """The flags the kernel holds for ``fd`` (``/proc/self/fdinfo``)."""
    text = Path(f"/proc/self/fdinfo/{fd}").read_text()
    match = re.search(r"^flags:\s+([0-7]+)$", text, re.MULTILINE)
    assert match, text
    return int(match.group(1), 8)


@pytest.fixture(params=["lockf", "flock"])
def lock_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(neps_compat, "lock_kind", lambda: request.param)
    return str(request.param)


def test_the_lock_file_is_opened_no_wider_than_the_lock_needs(
    tmp_path: Path, lock_kind: str
) -> None:
    guard = RootGuard(tmp_path / "root", timeout_s=5)
    guard.acquire()
    try:
        assert guard._file is not None
        flags = open_flags(guard._file)
        access = os.O_WRONLY if lock_kind == "lockf" else os.O_RDONLY
        assert flags & os.O_ACCMODE == access, oct(flags)
        assert flags & os.O_CLOEXEC
    finally:
        guard.release()
    lock = tmp_path / ".root.neps_bcast.lock"
    assert lock.stat().st_mode & 0o777 == 0o600
    # The positive control of the refusals below: our own existing lock file is taken.
    again = RootGuard(tmp_path / "root", timeout_s=5)
    again.acquire()
    again.release()


def test_a_lock_file_that_is_a_symlink_is_refused(tmp_path: Path, lock_kind: str) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("a file of the user's, somewhere else")
    lock = tmp_path / ".root.neps_bcast.lock"
    lock.symlink_to(target)
    guard = RootGuard(tmp_path / "root", timeout_s=5)
    with pytest.raises(AuthError) as refused:
        guard.acquire()
    text = str(refused.value)
    assert (
        f"refused the root's lock file {lock}: it is a symbolic link (to {target}); expected a"
        " regular file of this user's (nothing in it was used). HINT: if you did not make it,"
        f" another user did (a lock file of theirs can keep this search from starting):"
        f" remove it (rm {lock})"
    ) in text, text
    assert target.read_text() == "a file of the user's, somewhere else"
    assert guard._file is None


def test_a_lock_file_of_another_user_is_refused(
    tmp_path: Path, lock_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / ".root.neps_bcast.lock"
    lock.touch(mode=0o644)
    owner = private.user_name(os.geteuid())
    monkeypatch.setattr(os, "geteuid", lambda: STRANGER)
    guard = RootGuard(tmp_path / "root", timeout_s=5)
    with pytest.raises(AuthError) as refused:
        guard.acquire()
    text = str(refused.value)
    assert (
        f"refused the root's lock file {lock}: it is owned by {owner}; expected a regular file"
        f" of uid {STRANGER}"
    ) in text, text
    assert f"remove it (rm {lock})" in text
    # Nothing holds a lock on it: another worker could take it at once.
    with lock.open("ab") as f:
        fcntl.lockf(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_a_fifo_planted_as_the_lock_file_is_refused_at_once(tmp_path: Path, lock_kind: str) -> None:
    """A FIFO would block the open (waiting for its other end): O_NONBLOCK, then refused."""
    lock = tmp_path / ".root.neps_bcast.lock"
    os.mkfifo(lock, 0o666)
    with pytest.raises(AuthError) as refused:
        RootGuard(tmp_path / "root", timeout_s=5).acquire()
    observed = "it is a FIFO or a socket" if lock_kind == "lockf" else "it is not a regular file"
    assert f"refused the root's lock file {lock}: {observed}" in str(refused.value)


def test_a_lock_file_this_user_may_not_open_is_refused_naming_its_owner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock = tmp_path / ".root.neps_bcast.lock"
    lock.touch()
    real_open = os.open

    def denied(path: object, *args: object, **kwargs: object) -> int:
        if Path(str(path)) == lock:
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(AuthError) as refused:
        RootGuard(tmp_path / "root", timeout_s=5).acquire()
    owner = private.user_name(lock.stat().st_uid)
    assert (
        f"refused the root's lock file {lock}: this user may not open it (owned by {owner})"
        in str(refused.value)
    )


def test_the_private_directory_is_made_owner_only_and_its_files_too(tmp_path: Path) -> None:
    path = tmp_path / "neps_bcast-test"
    with private.opened(path, create=True) as folder:
        written = folder.write("secret-x", b"abc")
        assert folder.read("secret-x", hint="h") == b"abc"
        folder.remove("secret-x")
    assert path.stat().st_mode & 0o777 == 0o700
    assert not written.exists()
    assert [p.name for p in path.iterdir()] == []  # no temporary name left behind


@pytest.mark.parametrize("how", ["owner", "mode", "symlink"])
def test_a_planted_private_directory_is_refused(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "neps_bcast-0"
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / "secret-x").write_text("00" * 32)
    if how == "symlink":
        path.symlink_to(planted)
    else:
        path.mkdir(mode=0o700)
        if how == "mode":
            path.chmod(0o777)
        else:
            monkeypatch.setattr(os, "geteuid", lambda: STRANGER)
    with pytest.raises(AuthError) as refused:
        private.open_dir(path, create=True)
    text = str(refused.value)
    observed = {
        "owner": "it is owned by uid",
        "mode": "its mode is 0777",
        "symlink": f"it is a symbolic link (to {planted})",
    }[how]
    assert f"refused the private directory {path}: {observed}" in text, text
    assert "expected a directory of" in text and "with mode 0700" in text
    assert "HINT: if another user made it" in text and "NEPS_BCAST_SECRET" in text


@pytest.mark.parametrize("how", ["mode", "symlink", "missing", "owner"])
def test_a_planted_or_missing_secret_file_is_refused(
    tmp_path: Path, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "private"
    with private.opened(path, create=True) as folder:
        if how == "mode":
            folder.write("secret-x", b"00" * 32)
            (path / "secret-x").chmod(0o644)
        elif how == "symlink":
            (tmp_path / "mine").write_text("00" * 32)
            (path / "secret-x").symlink_to(tmp_path / "mine")
        elif how == "owner":
            folder.write("secret-x", b"00" * 32)
            real = os.geteuid()
            monkeypatch.setattr(os, "geteuid", lambda: STRANGER)
        with pytest.raises(AuthError) as refused:
            folder.read("secret-x", hint="the hint.", label="the secret's file")
        if how == "owner":
            monkeypatch.setattr(os, "geteuid", lambda: real)
    text = str(refused.value)
    observed = {
        "mode": "its mode is 0644",
        "symlink": "it is a symbolic link",
        "missing": "it does not exist",
        "owner": "it is owned by uid",
    }[how]
    assert f"refused the secret's file {path / 'secret-x'}: {observed}" in text, text
    assert text.endswith("(nothing in it was used). HINT: the hint.")


def test_the_private_directory_follows_the_users_runtime_directory_only_when_private(
    tmp_path: Path,
) -> None:
    runtime = tmp_path / "run-user"
    runtime.mkdir(mode=0o700)
    assert private.private_dir({"XDG_RUNTIME_DIR": str(runtime)}) == runtime / "neps_bcast"
    runtime.chmod(0o755)  # not private: the temporary directory instead
    fallback = private.private_dir({"XDG_RUNTIME_DIR": str(runtime)})
    assert fallback.name == f"neps_bcast-{os.geteuid()}"
    assert fallback.parent != runtime


def test_a_trial_left_by_a_leader_that_is_gone_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A Lightning leader SIGKILLed before its children read trial 1 cannot remove the
    # trial it left them; the next leader on the host removes it, and only it.
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = private.new_dir()
        assert alive.parent == tmp_path
        with private.opened(alive, create=False) as folder:
            folder.write("trial", b"signed trial")
        # Left by a leader that is gone (the child, killed below), by an earlier
        # process under a pid now reused (another start time), by a process of
        # another pid namespace (not this host's to judge), and one with a left-behind
        # name that is open to others (not this user's own private directory): kept.
        namespace = "".join(c for c in private.procfs.pid_namespace() if c.isdigit())
        start = private.procfs.start_ticks(child.pid)
        names = {
            "dead": f"neps_bcast-trial-{child.pid}.{start}.{namespace}-dead",
            "reused": f"neps_bcast-trial-{child.pid}.{(start or 0) + 1}.{namespace}-reuse",
            "other_namespace": f"neps_bcast-trial-{child.pid}.{(start or 0) + 1}.1-other",
            "open": f"neps_bcast-trial-{child.pid}.{(start or 0) + 1}.{namespace}-open",
        }
        for key, name in names.items():
            (tmp_path / name).mkdir(mode=0o755 if key == "open" else 0o700)
            (tmp_path / name).chmod(0o755 if key == "open" else 0o700)
            (tmp_path / name / "trial").write_bytes(b"left")
        (tmp_path / "unrelated").mkdir()
        child.kill()
        child.wait()
        second = private.new_dir()
        left = sorted(p.name for p in tmp_path.iterdir())
        kept = [alive.name, second.name, names["other_namespace"], names["open"], "unrelated"]
        assert left == sorted(kept)
        assert (alive / "trial").read_bytes() == b"signed trial"
    finally:
        child.kill()
        child.wait()
