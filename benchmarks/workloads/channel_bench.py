"""neps_bcast's handoff alone: the control channel between real processes, no NePS.

    python benchmarks/workloads/channel_bench.py --world 4 --reps 50 --out x.json

The leader process serves the store (OS-picked port), starts ``world - 1`` follower
processes, and every rank joins the channel exactly as ``neps_bcast.run`` does.
Per repetition the leader idles ``--gap`` seconds (followers are blocked in the receive),
reads CLOCK_REALTIME and hands the payload over as neps_bcast does (one allgather, the
followers contributing a short "ready"); each follower reads the clock when that step
returns; another allgather brings the follower times back. Latency = the last
follower's time minus the leader's. Then the leader holds ``--hold`` seconds while the
followers wait in the receive, and each follower reports its process CPU time (all
threads) over that wait. Only ``open_store``, ``join_channel`` and the channel's ``allgather``
touch neps_bcast.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from neps_bcast.config import Settings
from neps_bcast.transport import store as control_store
from neps_bcast.transport.channel import GlooChannel

SETTINGS = Settings.from_env()
"""neps_bcast's own timeouts (NEPS_BCAST_* variables or their defaults), as run() uses them."""


def open_store(address: str) -> tuple[Any, str]:
    """The leader serves the store (empty ``address``); followers connect to ``address``."""
    wait_timeout = datetime.timedelta(seconds=SETTINGS.wait_timeout_s)
    if address:
        return control_store.connect(address, wait_timeout, SETTINGS.connect_timeout_s), address
    served = control_store.serve(wait_timeout, loopback=True)
    return served, f"127.0.0.1:{served.port}"


def join_channel(store: Any, group_rank: int, world: int) -> GlooChannel:
    join_timeout = datetime.timedelta(seconds=SETTINGS.join_timeout_s)
    wait_timeout = datetime.timedelta(seconds=SETTINGS.wait_timeout_s)
    return GlooChannel.join(store, group_rank, world, join_timeout, wait_timeout)


READY = b"ready"
"""A follower's part of a hand-over step (its size is what a real one costs)."""


def now() -> float:
    return time.clock_gettime(time.CLOCK_REALTIME)


def measure(link: GlooChannel, group_rank: int, args: argparse.Namespace) -> dict[str, object]:
    payload_sizes = [int(size) for size in args.payloads.split(",") if size]
    is_leader = group_rank == 0
    latencies: dict[str, list[float]] = {}
    for size in payload_sizes:
        payload = os.urandom(size)
        for repetition in range(args.reps + 1):  # the first repetition is a warm-up
            if is_leader:
                time.sleep(args.gap)
                sent_at = now()
                link.allgather(payload)
                received_at = sent_at
            else:
                link.allgather(READY)
                received_at = now()
            arrivals = link.allgather(struct.pack("d", received_at))
            if is_leader and repetition > 0:
                last_arrival = max(struct.unpack("d", arrival)[0] for arrival in arrivals[1:])
                latencies.setdefault(str(size), []).append(last_arrival - sent_at)
    # Follower CPU while the leader holds the next trial.
    cpu_before, wall_before = time.process_time(), time.monotonic()
    if is_leader:
        time.sleep(args.hold)
        link.allgather(b"go")
    else:
        link.allgather(READY)
    own_wait = struct.pack("dd", time.process_time() - cpu_before, time.monotonic() - wall_before)
    waits = [struct.unpack("dd", wait) for wait in link.allgather(own_wait)]
    link.allgather(b"stop" if is_leader else READY)
    return {
        "latency_s": latencies,
        "wait": [
            {"rank": rank, "cpu_s": cpu_s, "wall_s": wall_s}
            for rank, (cpu_s, wall_s) in enumerate(waits)
        ][1:],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--payloads", default="1000,100000,1000000")
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--hold", type=float, default=3.0)
    parser.add_argument("--out", default="")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--store", default="")
    args = parser.parse_args()
    store, address = open_store(args.store)
    if args.rank != 0:
        link = join_channel(store, args.rank, args.world)
        measure(link, args.rank, args)
        link.close()
        return
    followers = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--rank", str(rank), "--store", address],
            env=dict(os.environ, BENCH_ROLE=f"rank{rank}"),
            stdin=subprocess.DEVNULL,
        )
        for rank in range(1, args.world)
    ]
    link = join_channel(store, 0, args.world)
    result = measure(link, 0, args)
    link.close()
    exit_codes = [follower.wait(timeout=60) for follower in followers]
    result.update(world=args.world, follower_exit_codes=exit_codes)
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
