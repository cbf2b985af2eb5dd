"""Files only this user can have made: how a secret or a trial reaches a rank on this
host without passing through anything another user can write.

Why: a TCP store is open to every user who reaches its port, and a path read from one is
a path an outsider may have chosen. So a path here is never read from a store: it is
derived from the run (the secret of an external launch: ``run_file``) or handed over in
the environment a process inherits (a Lightning child's first trial). Every file and
directory is opened with ``O_NOFOLLOW`` and checked with ``fstat`` on the open
descriptor before use: a directory must be this user's and closed to everyone else
(mode 0700), a file must be a regular file of this user's that nobody else may read or
write. Anything else is refused with an error that names it and says what to do.

- ``private_dir``: ``$XDG_RUNTIME_DIR/neps_bcast`` when ``XDG_RUNTIME_DIR`` is a
  directory of this user's (mode 0700), else ``<tmp>/neps_bcast-<uid>``; made 0700.
- ``write``: a temporary name then ``rename`` (readers never see half a file), created
  with ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pwd
import secrets
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from neps_bcast.compat import procfs
from neps_bcast.errors import AuthError, format_message
from neps_bcast.log import rank_tag

MAX_BYTES = 64 * 1024 * 1024
"""Largest private file read (a trial's pickled arguments)."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def user_name(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def me() -> str:
    return user_name(os.geteuid())


def refuse(path: Path | str, what: str, expected: str, hint: str, label: str = "") -> AuthError:
    """The error for a file or directory that failed a check (``label``: what it is)."""
    name = f"{label} {path}" if label else str(path)
    return AuthError(
        format_message(
            rank_tag(),
            f"refused {name}: {what}; expected {expected} (nothing in it was used).",
            hint,
        )
    )


def check_mine(
    fd: int,
    path: Path | str,
    *,
    directory: bool,
    hint: str,
    private: bool = True,
    label: str = "",
) -> os.stat_result:
    """``fstat`` the open ``fd``: the right type, owned by this user, and (``private``)
    closed to group and others. ``AuthError`` naming ``path`` otherwise."""
    st = os.fstat(fd)
    kind = "a directory" if directory else "a regular file"
    is_kind = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    expected = f"{kind} of {me()}" + (" with mode 0700" if directory and private else "")
    if not directory and private:
        expected += " that only its owner can read or write (mode 0600)"
    if not is_kind:
        raise refuse(path, f"it is not {kind} (mode {st.st_mode:o})", expected, hint, label)
    if st.st_uid != os.geteuid():
        raise refuse(path, f"it is owned by {user_name(st.st_uid)}", expected, hint, label)
    if private and st.st_mode & 0o077:
        mode = f"its mode is {stat.S_IMODE(st.st_mode):04o}"
        raise refuse(path, mode, expected, hint, label)
    return st


def open_nofollow(
    path: Path | str, flags: int, mode: int, *, hint: str, kind: str, label: str = ""
) -> int:
    """``os.open`` with ``O_NOFOLLOW``; a link or a forbidden file is refused.

    ``O_NONBLOCK`` too: opening a FIFO someone planted there must not wait for a writer
    or a reader (``fstat`` then refuses it); it changes nothing for a regular file."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            what = f"it is a symbolic link{_link_target(path)}"
            raise refuse(path, what, kind, hint, label) from None
        if exc.errno == errno.ENXIO:
            raise refuse(path, "it is a FIFO or a socket", kind, hint, label) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            what = f"this user may not open it{_owner(path)}"
            raise refuse(path, what, kind, hint, label) from None
        raise


def _link_target(path: Path | str) -> str:
    try:
        return f" (to {Path(path).readlink()})"
    except OSError:
        return ""


def _owner(path: Path | str) -> str:
    try:
        return f" (owned by {user_name(os.lstat(path).st_uid)})"
    except OSError:
        return ""


def private_dir(environ: dict[str, str] | None = None) -> Path:
    """Where this user's private files of this host live (see the module docstring)."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        try:
            st = os.lstat(runtime)
        except OSError:
            st = None
        if (
            st is not None
            and stat.S_ISDIR(st.st_mode)
            and st.st_uid == os.geteuid()
            and not st.st_mode & 0o077
        ):
            return Path(runtime) / "neps_bcast"
    return Path(tempfile.gettempdir()) / f"neps_bcast-{os.geteuid()}"


DIR_HINT = (
    "if another user made it (to plant a secret, or to stop this search), remove it; or"
    " point XDG_RUNTIME_DIR or TMPDIR to a directory only you can write; or set"
    " NEPS_BCAST_SECRET on every rank (then no file is used)."
)


@dataclass
class PrivateDir:
    """An open private directory: every file of it is reached through ``fd``."""

    path: Path
    fd: int

    def file(self, name: str) -> Path:
        return self.path / name

    def write(self, name: str, data: bytes) -> Path:
        """Write ``name`` whole, mode 0600 (a temporary name, then ``rename``)."""
        temporary = f".{name}.{secrets.token_hex(8)}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temporary, flags, 0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.rename(temporary, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary, dir_fd=self.fd)
            raise
        return self.file(name)

    def read(self, name: str, *, hint: str, label: str = "") -> bytes:
        """The content of ``name`` after checking it (``AuthError`` naming the file)."""
        path = self.file(name)
        expected = f"a regular file of {me()} with mode 0600"
        try:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(name, flags, dir_fd=self.fd)
        except FileNotFoundError:
            raise refuse(path, "it does not exist", expected, hint, label) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refuse(path, "it is a symbolic link", expected, hint, label) from None
            raise
        with os.fdopen(fd, "rb") as f:
            st = check_mine(f.fileno(), path, directory=False, hint=hint, label=label)
            if st.st_size > MAX_BYTES:
                size = f"it holds {st.st_size} bytes"
                raise refuse(path, size, f"at most {MAX_BYTES}", hint, label)
            return f.read(MAX_BYTES + 1)

    def remove(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_dir(
    path: Path, *, create: bool, hint: str = DIR_HINT, label: str = "the private directory"
) -> PrivateDir:
    """Open (and, with ``create``, make) a directory only this user can use."""
    if create:
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
    expected = f"a directory of {me()} with mode 0700"
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            what = (
                f"it is a symbolic link{_link_target(path)}"
                if path.is_symlink()
                else "it is not a directory"
            )
            raise refuse(path, what, expected, hint, label) from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            what = f"this user may not open it{_owner(path)}"
            raise refuse(path, what, expected, hint, label) from None
        raise
    try:
        check_mine(fd, path, directory=True, hint=hint, label=label)
    except BaseException:
        os.close(fd)
        raise
    return PrivateDir(path, fd)


@contextlib.contextmanager
def opened(
    path: Path, *, create: bool, hint: str = DIR_HINT, label: str = "the private directory"
) -> Iterator[PrivateDir]:
    directory = open_dir(path, create=create, hint=hint, label=label)
    try:
        yield directory
    finally:
        directory.close()


TRIAL_DIR_PREFIX = "neps_bcast-trial-"


def new_dir() -> Path:
    """A fresh private directory with a name nobody can have taken (``mkdtemp``, 0700,
    in the temporary directory), named after the process that makes it.

    Why the name: a leader SIGKILLed before its Lightning children read trial 1 cannot
    remove the trial it left for them; the next leader on this host removes every such
    directory of this user's whose maker is gone (a test run left one per killed leader
    in ``/tmp``). Not in ``private_dir``: a directory planted there by another user
    must not stop a search that sets ``NEPS_BCAST_SECRET`` (then no file is used there).
    """
    remove_left_behind(Path(tempfile.gettempdir()))
    prefix = f"{TRIAL_DIR_PREFIX}{_process_tag(os.getpid())}-"
    return Path(tempfile.mkdtemp(prefix=prefix))


def _process_tag(pid: int) -> str:
    """``<pid>.<start ticks>.<pid namespace's number>``: one process of this machine's
    boot (a reused pid has another start time; another pid namespace another meaning)."""
    namespace = "".join(c for c in procfs.pid_namespace() if c.isdigit())
    return f"{pid}.{procfs.start_ticks(pid)}.{namespace}"


def remove_left_behind(parent: Path) -> None:
    """Remove the trial directories in ``parent`` whose maker, a process of this pid
    namespace, is gone; never raises (a leftover is only a leftover). Each is opened and
    emptied as a private directory (``opened``): one that is not this user's own, or is
    a link, is left alone."""
    namespace = _process_tag(os.getpid()).rpartition(".")[2]
    try:
        names = os.listdir(parent)  # noqa: PTH208 - names only; each is opened checked
    except OSError:
        return
    for name in names:
        if not name.startswith(TRIAL_DIR_PREFIX):
            continue
        tag = name[len(TRIAL_DIR_PREFIX) :].rpartition("-")[0]  # mkdtemp adds no "-"
        pid, _, rest = tag.partition(".")
        if not pid.isdigit() or rest.rpartition(".")[2] != namespace:
            continue
        if _process_tag(int(pid)) == tag:
            continue  # its maker lives
        with contextlib.suppress(OSError, AuthError):
            with opened(parent / name, create=False) as folder:
                for entry in os.listdir(folder.fd):  # noqa: PTH208 - through the descriptor
                    folder.remove(entry)
            (parent / name).rmdir()
