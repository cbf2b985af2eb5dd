"""neps_bcast's handoff alone: the control channel between real processes, no NePS.

    python benchmarks/channel_bench.py --world 4 --reps 50 --out x.json

The leader process serves the store (OS-picked port), starts ``world - 1`` follower
processes, and every rank joins the ``GlooChannel`` exactly as ``neps_bcast.run`` does.
Per repetition the leader idles ``--gap`` seconds (followers are blocked in the receive),
reads CLOCK_REALTIME and broadcasts the payload; each follower reads the clock when the
broadcast returns; an allgather brings the follower times back. Latency = the last
follower's time minus the leader's. Then the leader holds ``--hold`` seconds while the
followers wait in the receive, and each follower reports its process CPU time (all
threads) over that wait.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

from neps_bcast.channel import GlooChannel, connect_store, serve_store


def now() -> float:
    return time.clock_gettime(time.CLOCK_REALTIME)


def run_rank(channel: GlooChannel, args: argparse.Namespace) -> dict[str, object]:
    payloads = [int(v) for v in args.payloads.split(",") if v]
    leader = channel.group_rank == 0
    samples: dict[str, list[float]] = {}
    for size in payloads:
        blob = os.urandom(size)
        for rep in range(args.reps + 1):  # the first repetition is a warm-up
            if leader:
                time.sleep(args.gap)
                t0 = now()
                channel.broadcast(blob)
                t1 = t0
            else:
                channel.broadcast(None)
                t1 = now()
            times = channel.allgather(struct.pack("d", t1))
            if leader and rep > 0:
                latest = max(struct.unpack("d", t)[0] for t in times[1:])
                samples.setdefault(str(size), []).append(latest - t0)
    # Follower CPU while the leader holds the next trial.
    c0, w0 = time.process_time(), time.monotonic()
    if leader:
        time.sleep(args.hold)
        channel.broadcast(b"go")
    else:
        channel.broadcast(None)
    cpu = struct.pack("dd", time.process_time() - c0, time.monotonic() - w0)
    waits = [struct.unpack("dd", c) for c in channel.allgather(cpu)]
    channel.broadcast(b"stop" if leader else None)
    return {
        "latency_s": samples,
        "wait": [{"rank": r, "cpu_s": c, "wall_s": w} for r, (c, w) in enumerate(waits)][1:],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--payloads", default="1000,100000,1000000")
    p.add_argument("--gap", type=float, default=0.02)
    p.add_argument("--hold", type=float, default=3.0)
    p.add_argument("--out", default="")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--store", default="")
    args = p.parse_args()
    if args.rank == 0:
        store = serve_store()
        address = f"127.0.0.1:{store.port}"
        argv = [a for a in sys.argv[1:]]
        children = [
            subprocess.Popen(
                [sys.executable, __file__, *argv, "--rank", str(r), "--store", address],
                env=dict(os.environ, BENCH_ROLE=f"rank{r}"),
                stdin=subprocess.DEVNULL,
            )
            for r in range(1, args.world)
        ]
        channel = GlooChannel.join(store, 0, args.world, generation=0)
        result = run_rank(channel, args)
        channel.close()
        codes = [c.wait(timeout=60) for c in children]
        result.update(world=args.world, follower_exit_codes=codes)
        Path(args.out).write_text(json.dumps(result))
    else:
        store = connect_store(args.store)
        channel = GlooChannel.join(store, args.rank, args.world, generation=0)
        run_rank(channel, args)
        channel.close()


if __name__ == "__main__":
    main()
