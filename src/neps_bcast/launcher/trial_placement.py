"""Where a pool placed a trial: a small file the pool's launcher writes in the trial's
directory, read by ``neps-bcast status``.

Why a file, and why there: only the launcher knows which devices (and which rank
processes) a trial got, and only the trial's agent knows the NePS root; the agent names
the trial's directory when it asks for ranks, and the launcher writes
``<trial dir>/.neps_bcast_placement.json`` when it places the trial. The status, reading
the root from any node, finds it next to the trial's lease. Written atomically (created
under another name, then renamed over the old one): a reader sees the old placement or
the new one, never half of one. A placement older than the trial's lease is from an
earlier attempt and is ignored.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PLACEMENT_FILE = ".neps_bcast_placement.json"


@dataclass(frozen=True)
class TrialPlacement:
    trial_id: str
    devices: tuple[int, ...]
    """The pool's device indices the trial runs on (its group rank i on ``devices[i]``)."""
    gpus: tuple[str, ...] | None
    """Their ``CUDA_VISIBLE_DEVICES`` entries (None on CPU)."""
    pool_size: int
    rank_pids: tuple[int, ...]
    host: str
    launcher_pid: int
    launch_id: str
    placed: float
    """``time.time()`` when the launcher placed it."""

    @classmethod
    def from_json(cls, text: str) -> TrialPlacement:
        raw = json.loads(text)
        return cls(
            trial_id=str(raw["trial_id"]),
            devices=tuple(int(d) for d in raw["devices"]),
            gpus=tuple(str(g) for g in raw["gpus"]) if raw.get("gpus") is not None else None,
            pool_size=int(raw["pool_size"]),
            rank_pids=tuple(int(p) for p in raw["rank_pids"]),
            host=str(raw["host"]),
            launcher_pid=int(raw["launcher_pid"]),
            launch_id=str(raw["launch_id"]),
            placed=float(raw["placed"]),
        )


def write(directory: Path, placement: TrialPlacement) -> None:
    """Atomically; never through a link planted under the temporary name."""
    tmp = directory / f"{PLACEMENT_FILE}.{socket.gethostname()}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps(asdict(placement)))
    tmp.replace(directory / PLACEMENT_FILE)


def read(directory: Path) -> TrialPlacement | None:
    """The trial's placement; None if it has none or an unreadable one."""
    try:
        return TrialPlacement.from_json((directory / PLACEMENT_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def placed_now(
    trial_id: str,
    devices: tuple[int, ...],
    gpus: tuple[str, ...] | None,
    pool_size: int,
    rank_pids: tuple[int, ...],
    launch_id: str,
) -> TrialPlacement:
    return TrialPlacement(
        trial_id=trial_id,
        devices=devices,
        gpus=gpus,
        pool_size=pool_size,
        rank_pids=rank_pids,
        host=socket.gethostname(),
        launcher_pid=os.getpid(),
        launch_id=launch_id,
        placed=time.time(),
    )
