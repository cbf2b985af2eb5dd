"""Run one rank's script with its output in a log file of its own, then get out of the way.

torchrun starts this module in place of the user's script, as
``python -u -m neps_bcast.launcher.rank_log GROUP LOG_DIR SCRIPT ARGS...`` (importing
``neps_bcast`` does not import torch, so this costs no more than running a file).
It points its standard output and error at ``LOG_DIR/rank<RANK>.log`` (appended, with
a header per attempt, so a restarted group keeps the previous attempt's output) and
``exec``s ``python -u SCRIPT ARGS...``: the script then runs in this very process (same
pid torchrun watches and signals, same environment), exactly as torchrun runs it.

torchrun's own ``--redirects`` writes stdout and stderr to two files per rank under a
fresh folder per attempt; one file per rank is easier to read and to follow.
"""

from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        sys.stderr.write(
            "usage: python -m neps_bcast.launcher.rank_log GROUP LOG_DIR SCRIPT [ARGS...]\n"
        )
        raise SystemExit(2)
    group, log_dir, script, *args = argv
    rank = os.environ.get("RANK", "0")
    fd = os.open(
        os.path.join(log_dir, f"rank{rank}.log"),  # noqa: PTH118 - no pathlib import here
        os.O_WRONLY | os.O_CREAT | os.O_APPEND,
        0o644,
    )
    header = (
        f"===== neps-bcast launch: group {group}"
        f" rank {rank} attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        f" pid {os.getpid()} at {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
    )
    os.write(fd, header.encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.execv(sys.executable, [sys.executable, "-u", script, *args])  # noqa: S606


if __name__ == "__main__":
    main(sys.argv[1:])
