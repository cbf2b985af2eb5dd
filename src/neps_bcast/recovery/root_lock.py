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
``flock``), so it works wherever NePS's own locking works (NFS, Lustre); the lock file is
created owner-only (0600), opened for writing only because ``lockf`` needs it (read-only
with ``flock``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

from neps_bcast.compat import neps as neps_compat
from neps_bcast.errors import LaunchError, format_message
from neps_bcast.log import logger, rank_tag


class RootGuard:
    def __init__(self, root_directory: str | os.PathLike[str], timeout_s: float = 600.0) -> None:
        self.root = Path(root_directory)
        self.lock_path = self.root.parent / f".{self.root.name}.neps_bcast.lock"
        self.timeout_s = timeout_s
        self._file: IO[bytes] | None = None
        self._kind = "lockf"

    def acquire(self) -> None:
        timeout = self.timeout_s
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        # Owner-only; an exclusive lockf needs a descriptor open for writing, flock does not.
        self._kind = neps_compat.lock_kind()
        mode = os.O_RDWR if self._kind == "lockf" else os.O_RDONLY
        fd = os.open(self.lock_path, mode | os.O_CREAT | os.O_CLOEXEC, 0o600)
        handle = os.fdopen(fd, "r+b" if self._kind == "lockf" else "rb")
        deadline = time.monotonic() + timeout
        waited = False
        while True:
            try:
                self._lock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except (BlockingIOError, PermissionError):  # lockf: EAGAIN or EACCES
                if time.monotonic() > deadline:
                    handle.close()
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

    def _lock(self, handle: IO[bytes], flags: int) -> None:
        if self._kind == "lockf":
            fcntl.lockf(handle.fileno(), flags)
        else:
            fcntl.flock(handle.fileno(), flags)

    def release(self) -> None:
        if self._file is not None:
            try:
                self._lock(self._file, fcntl.LOCK_UN)
            finally:
                self._file.close()
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
