"""/proc helpers shared by the supervisor and the runner (Linux only, no third-party imports)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")

SCRUB = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "PL_GLOBAL_SEED",
    "NEPS_DDP_TRIAL_ID",
)


def clean_env(**extra: str) -> dict[str, str]:
    """The runner's environment without any launcher or rank variables (no fixed ports)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in SCRUB and not k.startswith(("SLURM_", "NEPS_BCAST_", "BENCH_", "PYTEST_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    env.update(extra)
    return env


def read_stat(pid: int) -> tuple[str, int, float] | None:
    """(state, session id, CPU seconds utime+stime) of a process, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    # fields[0]=state, [3]=session, [11]=utime, [12]=stime (man proc, minus pid and comm)
    return fields[0], int(fields[3]), (int(fields[11]) + int(fields[12])) / CLK_TCK


def session_pids(sid: int, exclude: tuple[int, ...] = ()) -> list[int]:
    """Live (non-zombie) processes whose session id is ``sid``."""
    pids = []
    for entry in os.listdir("/proc"):  # noqa: PTH208
        if not entry.isdigit() or int(entry) in exclude:
            continue
        st = read_stat(int(entry))
        if st is not None and st[1] == sid and st[0] != "Z":
            pids.append(int(entry))
    return pids


def describe(pid: int) -> dict[str, str]:
    """Role of a benchmark process: its rank variables and a short command line."""
    out: dict[str, str] = {}
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        for item in environ:
            key, _, value = item.decode(errors="replace").partition("=")
            if key in ("RANK", "LOCAL_RANK", "BENCH_ROLE"):
                out[key] = value
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        out["cmd"] = cmd.strip()[-120:]
    except OSError:
        pass
    rank = out.get("LOCAL_RANK") or out.get("RANK")
    out["role"] = out.get("BENCH_ROLE") or (f"rank{rank}" if rank else "rank0")
    return out


def kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True
