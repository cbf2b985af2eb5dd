"""A minimal torchrun stand-in for the plain-DDP workload: starts ``--world`` ranks.

Every rank gets RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (a port the OS
picked, never a fixed one, held by this process until it exits: see ``held_port``). For
``--system builtin`` the followers start once the leader's first trial exists, with
NEPS_DDP_TRIAL_ID set to it (what Lightning's launcher does for NePS; torchrun cannot, so
NePS's mode fails under torchrun). Exits with the leader's exit code as soon as the leader
exits: like Lightning's launcher, it does not wait for followers (the supervisor accounts
for them).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent


def held_port() -> socket.socket:
    """A socket bound to a port the OS picked, on every address, with SO_REUSEADDR, never
    listening: while it is open the kernel gives the port to no one else, and rank 0's
    TCPStore (SO_REUSEADDR too) serves on it all the same (tests/ports.py, shown by
    tests/test_ports.py). A probe socket closed at once would leave the port to anyone."""
    try:
        held = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # and every IPv4 address
        address = "::"
    except OSError:  # a host without IPv6
        held, address = socket.socket(socket.AF_INET, socket.SOCK_STREAM), "0.0.0.0"
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind((address, 0))
    return held


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--start-timeout", type=float, default=120.0)
    parser.add_argument(
        "--script", default="plain_search.py", help="the rank's script, relative to this folder"
    )
    args, rest = parser.parse_known_args()
    system = rest[rest.index("--system") + 1]
    timings = Path(rest[rest.index("--timings") + 1])
    timings.mkdir(parents=True, exist_ok=True)
    held = held_port()  # open until this launcher exits, which is when the leader exits
    port = held.getsockname()[1]

    def start(rank: int, **extra: str) -> subprocess.Popen[bytes]:
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            BENCH_ROLE=f"rank{rank}",
            **extra,
        )
        return subprocess.Popen(
            [sys.executable, str(HERE / args.script), *rest],
            env=env,
            stdin=subprocess.DEVNULL,
        )

    leader = start(0)
    followers: list[subprocess.Popen[bytes]] = []
    if system == "builtin":
        first = timings / "rank0.jsonl"
        deadline = time.monotonic() + args.start_timeout
        while not first.exists() or not first.read_text().strip():
            if leader.poll() is not None or time.monotonic() > deadline:
                leader.kill()
                sys.exit(f"leader exited or never started a trial (code {leader.poll()})")
            time.sleep(0.01)
        trial_id = json.loads(first.read_text().splitlines()[0])["trial"]
        for rank in range(1, args.world):
            followers.append(start(rank, NEPS_DDP_TRIAL_ID=str(trial_id)))
    else:
        followers = [start(rank) for rank in range(1, args.world)]
    # Like Lightning's process observer: a follower that dies with an error takes the
    # leader down (otherwise the leader would wait for it until its barrier timeout).
    while (exit_code := leader.poll()) is None:
        for rank, follower in enumerate(followers, start=1):
            if follower.poll() not in (None, 0):
                leader.kill()
                leader.wait()
                sys.exit(
                    f"follower rank {rank} exited with code {follower.returncode}: leader killed"
                )
        time.sleep(0.05)
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
