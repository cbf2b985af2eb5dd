"""Several NePS workers (leaders) starting on one root directory at the same time.

Plain NePS 0.17 fails here in three ways (measured):

- two workers creating a fresh root at the same instant: one reads the other's
  half-written state (``EOFError`` in ``NePSState.create_or_load``);
- a root that exists but is empty (made by a job script, or by a worker that is still
  creating it): "Failed to create or load the NePS state";
- a second worker given the very same ``PipelineSpace``: "The pipeline space on disk
  does not match the one provided". NePS converts a simple space into a classic one
  with ``list(set(choices))``, so the order of categorical choices depends on each
  process's string-hash seed (``PYTHONHASHSEED``): any two processes may disagree.

The leader therefore starts ``neps.run`` holding an exclusive ``flock`` on a lock file
next to the root (``.<root name>.neps_bcast.lock``), and keeps it until NePS hands it
its first trial (by then the state on disk is complete) or ``neps.run`` returns. Under
the lock it removes an empty root, and when the root already holds an equivalent
classic space (same parameters, categorical choices in any order) it lets NePS load
that space from disk (``pipeline_space=None``, NePS's documented way to continue a run)
instead of comparing pickles. A space that really differs is passed on unchanged, and
NePS's own error explains it. Only neps_bcast leaders take this lock: start every worker
with ``neps_bcast.run``. The lock is the kind NePS itself locks its state with
(``neps_compat.lock_kind``: ``lockf`` unless ``NEPS_LINUX_FILELOCK_FUNCTION`` says
``flock``), so it works wherever NePS's own locking works (NFS, Lustre).

The lock file sits in a directory other users may be able to write (the root's parent),
so it is opened no wider than the lock needs and never through a link:
``O_WRONLY | O_CREAT | O_NOFOLLOW`` for ``lockf`` (which needs a descriptor open for
writing), ``O_RDONLY | O_CREAT | O_NOFOLLOW`` for ``flock``, both ``O_NONBLOCK`` (a
planted FIFO cannot hold the open), mode 0600 when created; then ``fstat`` on the
descriptor must show a regular file of this user's. A symbolic link, a FIFO or a file
of another user (who could hold the lock to keep this search from starting) is refused
with an error naming its owner and what to do. Nothing is read from or written to the
file.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Any

from neps_bcast.compat import neps as neps_compat
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.log import logger, rank_tag
from neps_bcast.transport import private

LOCK_HINT = (
    "if you did not make it, another user did (a lock file of theirs can keep this search"
    " from starting): remove it (rm {path}) and keep the NePS root in a directory only you"
    " can write."
)


class RootGuard:
    def __init__(self, root_directory: str | os.PathLike[str], timeout_s: float = 600.0) -> None:
        self.root = Path(root_directory)
        self.lock_path = self.root.parent / f".{self.root.name}.neps_bcast.lock"
        self.timeout_s = timeout_s
        self._file: int | None = None
        self._kind = "lockf"

    def open_lock_file(self) -> int:
        """The lock file's descriptor, opened as the module docstring says (checked)."""
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        # An exclusive lockf needs a descriptor open for writing, flock does not.
        self._kind = neps_compat.lock_kind()
        access = os.O_WRONLY if self._kind == "lockf" else os.O_RDONLY
        hint = LOCK_HINT.format(path=self.lock_path)
        expected = "a regular file of this user's"
        label = "the root's lock file"
        fd = private.open_nofollow(
            self.lock_path, access | os.O_CREAT, 0o600, hint=hint, kind=expected, label=label
        )
        try:
            private.check_mine(
                fd, self.lock_path, directory=False, hint=hint, private=False, label=label
            )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def acquire(self) -> None:
        timeout = self.timeout_s
        handle = self.open_lock_file()
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                self._lock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except (BlockingIOError, PermissionError):  # lockf: EAGAIN or EACCES
                if time.monotonic() > deadline:
                    os.close(handle)
                    raise LaunchError(
                        format_message(
                            rank_tag(),
                            f"another NePS worker has held {self.lock_path} for more than"
                            f" {timeout:.0f} s while starting on {self.root}; expected it to"
                            " release the lock once NePS gave it its first trial.",
                            "see that worker's log (it may be stuck); raise NEPS_BCAST_ROOT_LOCK_TIMEOUT_S"
                            " if creating the root is legitimately slow.",
                        )
                    ) from None
                if not waited:
                    logger.log(
                        logging.INFO,
                        "waiting for another worker to finish starting on %s",
                        self.root,
                    )
                    waited = True
                time.sleep(0.05)  # startup only: bounded wait for another worker's lock
        self._file = handle

    def _lock(self, fd: int, flags: int) -> None:
        if self._kind == "lockf":
            fcntl.lockf(fd, flags)
        else:
            fcntl.flock(fd, flags)

    def release(self) -> None:
        if self._file is not None:
            try:
                self._lock(self._file, fcntl.LOCK_UN)
            finally:
                os.close(self._file)
                self._file = None

    def prepare(self, pipeline_space: Any, overwrite: bool) -> Any:
        """Under the lock: make the root loadable; the space to hand to ``neps.run``."""
        if overwrite:
            return pipeline_space
        if self.root.is_dir() and not any(self.root.iterdir()):
            logger.log(
                logging.INFO,
                "removing the empty root %s so that NePS creates it afresh",
                self.root,
            )
            self.root.rmdir()
            return pipeline_space
        if pipeline_space is None:
            return None
        on_disk = neps_compat.space_on_disk(self.root)
        if on_disk is None:
            return pipeline_space
        mine = neps_compat.classic_parameters(neps_compat.classic_form(pipeline_space))
        theirs = neps_compat.classic_parameters(on_disk)
        if mine is not None and mine == theirs:
            logger.log(
                logging.INFO,
                "continuing with the equivalent search space saved in %s",
                self.root,
            )
            return None
        return pipeline_space
