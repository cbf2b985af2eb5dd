"""Per-trial start cost of a trial's DDP group: fresh processes against warm ranks regrouped.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/studies/pool_start_cost.py \
        [--sizes 1 2 4 8] [--reps 5] [--modes fresh warm] [--raw FILE]
    .venv/bin/python benchmarks/studies/pool_start_cost.py --table-from FILE   # the table of a raw file

Why: `neps-bcast launch --pool D` (issue 22) runs trials of different sizes side by side,
each its own DDP group. A trial's group either comes from k fresh processes (each imports
torch, Lightning and NePS, as a user's script does) or from k warm processes that already
did, waiting blocked on a pipe and told to form a new gloo group. This measures both, from
the decision to every rank having formed its gloo group and finished one allreduce on it:

- fresh: Popen of k interpreters; rank 0 creates the TCPStore on a port the OS picks and
  prints it, the parent hands it to the others on their stdin.
- warm: max(sizes) processes started once; per trial the parent creates a TCPStore on a
  port the OS picks and writes "form <world> <rank> <host> <port>" to each member; after
  the allreduce each member destroys the group and blocks again. Members rotate, so one
  process is in groups of different sizes one after another (its history is printed).

Every time is CLOCK_MONOTONIC (one clock for every process on Linux). Each measurement
records the 1-minute load average, since this machine is shared. Prints a markdown table;
--raw writes one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

HOST = "127.0.0.1"
TIMEOUT_S = 120.0  # a group's store and gloo waits
EXIT_TIMEOUT_S = 900.0  # a rank's exit: 10-60 s at load 20 and nice 19, once over 120 s


def load1() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


# ----------------------------------------------------------------------------------------
# Child side: one rank. Imports happen here, after the parent's clock started.


def _import_user_stack() -> None:
    import lightning  # noqa: F401
    import neps  # noqa: F401
    import torch
    import torch.distributed  # noqa: F401


def _form(world: int, rank: int, store: object) -> tuple[float, float]:
    """Init the default gloo group on `store`, one allreduce; (init returned, allreduce done)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S)
    )
    t_init = time.monotonic()
    dist.all_reduce(torch.ones(1))
    return t_init, time.monotonic()


def _report(**values: object) -> None:
    sys.stdout.write(json.dumps(values) + "\n")
    sys.stdout.flush()


def child_fresh(rank: int, world: int) -> None:
    _import_user_stack()
    t_imported = time.monotonic()
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=TIMEOUT_S)
    if rank == 0:
        store = dist.TCPStore(
            HOST, 0, world, is_master=True, timeout=timeout, wait_for_workers=False
        )
        _report(port=store.port)
    else:
        host, port = sys.stdin.readline().split()  # blocked until the parent hands it over
        store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timeout)
    t_init, t_ready = _form(world, rank, store)
    cpu = time.process_time()  # this rank's CPU seconds from its start: the load-free cost
    dist.destroy_process_group()
    _report(imported=t_imported, init=t_init, ready=t_ready, cpu=cpu)


def child_warm(index: int) -> None:
    _import_user_stack()
    from datetime import timedelta

    import torch.distributed as dist

    history: list[tuple[int, int]] = []
    _report(warm=index, pid=os.getpid())
    for line in sys.stdin:  # blocked in read(2) between trials: no polling
        words = line.split()
        if words[0] == "quit":
            break
        world, rank, host, port = int(words[1]), int(words[2]), words[3], int(words[4])
        cpu_before = time.process_time()
        store = dist.TCPStore(
            host, port, world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S)
        )
        t_init, t_ready = _form(world, rank, store)
        cpu = time.process_time() - cpu_before
        history.append((world, rank))
        dist.destroy_process_group()
        del store
        _report(init=t_init, ready=t_ready, left=time.monotonic(), cpu=cpu)
    _report(history=history)


# ----------------------------------------------------------------------------------------
# Parent side.


@dataclass
class Sample:
    mode: str
    world: int
    rep: int
    start_s: float  # decision -> every rank formed the group and finished one allreduce
    init_s: float  # decision -> last rank's init_process_group returned
    imports_s: float | None  # fresh: decision -> last rank finished its imports
    end_s: float  # fresh: last rank formed -> every process exited; warm: -> every rank left
    cpu_s: float  # CPU seconds of the busiest rank up to its group formed (fresh: from exec)
    load1: float
    members: list[int] = field(default_factory=list)


def _readline(stream: IO[str]) -> dict[str, object]:
    line = stream.readline()
    if not line:
        raise RuntimeError("a rank exited before reporting (see its stderr above)")
    result: dict[str, object] = json.loads(line)
    return result


def _child_cmd(*args: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--child", *args]


def measure_fresh(world: int, rep: int) -> Sample:
    t0 = time.monotonic()
    procs = [
        subprocess.Popen(
            _child_cmd("fresh", str(rank), str(world)),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        assert procs[0].stdout is not None
        port = _readline(procs[0].stdout)["port"]
        for proc in procs[1:]:
            assert proc.stdin is not None
            proc.stdin.write(f"{HOST} {port}\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            assert proc.stdout is not None
            reports.append(_readline(proc.stdout))
        for proc in procs:
            proc.wait(timeout=EXIT_TIMEOUT_S)
        t_exit = time.monotonic()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ready = max(float(r["ready"]) for r in reports)  # type: ignore[arg-type]
    return Sample(
        mode="fresh",
        world=world,
        rep=rep,
        start_s=ready - t0,
        init_s=max(float(r["init"]) for r in reports) - t0,  # type: ignore[arg-type]
        imports_s=max(float(r["imported"]) for r in reports) - t0,  # type: ignore[arg-type]
        end_s=t_exit - ready,
        cpu_s=max(float(r["cpu"]) for r in reports),  # type: ignore[arg-type]
        load1=load1(),
    )


class WarmPool:
    def __init__(self, size: int) -> None:
        self.procs = [
            subprocess.Popen(
                _child_cmd("warm", str(index)),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for index in range(size)
        ]
        self.pids = []
        for proc in self.procs:
            assert proc.stdout is not None
            self.pids.append(int(_readline(proc.stdout)["pid"]))  # type: ignore[call-overload]
        self.next_member = 0

    def _send(self, index: int, text: str) -> None:
        stdin = self.procs[index].stdin
        assert stdin is not None
        stdin.write(text)
        stdin.flush()

    def measure(self, world: int, rep: int) -> Sample:
        import torch.distributed as dist

        members = [(self.next_member + i) % len(self.procs) for i in range(world)]
        self.next_member = (self.next_member + 3) % len(self.procs)  # rotate the subsets
        t0 = time.monotonic()
        store = dist.TCPStore(HOST, 0, None, is_master=True, wait_for_workers=False)
        for group_rank, index in enumerate(members):
            self._send(index, f"form {world} {group_rank} {HOST} {store.port}\n")
        reports = []
        for index in members:
            stdout = self.procs[index].stdout
            assert stdout is not None
            reports.append(_readline(stdout))
        del store
        ready = max(float(r["ready"]) for r in reports)  # type: ignore[arg-type]
        return Sample(
            mode="warm",
            world=world,
            rep=rep,
            start_s=ready - t0,
            init_s=max(float(r["init"]) for r in reports) - t0,  # type: ignore[arg-type]
            imports_s=None,
            end_s=max(float(r["left"]) for r in reports) - ready,  # type: ignore[arg-type]
            cpu_s=max(float(r["cpu"]) for r in reports),  # type: ignore[arg-type]
            load1=load1(),
            members=members,
        )

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used so far by every warm process."""
        tick = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in self.pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        return total / tick

    def rss_mb(self) -> list[float]:
        result = []
        for pid in self.pids:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    result.append(int(line.split()[1]) / 1024)
        return result

    def close(self) -> list[object]:
        histories = []
        for index in range(len(self.procs)):  # all at once: an exit takes seconds under load
            self._send(index, "quit\n")
        for proc in self.procs:
            assert proc.stdout is not None
            histories.append(_readline(proc.stdout)["history"])
            proc.wait(timeout=EXIT_TIMEOUT_S)
        return histories

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _cell(values: list[float], scale: float, digits: int) -> str:
    if not values:
        return "n/a"
    median = statistics.median(values) * scale
    return (
        f"{median:.{digits}f} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"
    )


def table(samples: list[Sample], sizes: list[int]) -> str:
    lines = [
        "| k | fresh: start, s | fresh: imports done, s | fresh: CPU per rank, s "
        "| fresh: exit after, s | warm: start, ms | warm: init returned, ms "
        "| warm: CPU per rank, ms | warm: destroy, ms | load1 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for world in sizes:
        fresh = [s for s in samples if s.mode == "fresh" and s.world == world]
        warm = [s for s in samples if s.mode == "warm" and s.world == world]
        loads = [s.load1 for s in fresh + warm] or [float("nan")]
        lines.append(
            f"| {world} | {_cell([s.start_s for s in fresh], 1, 2)} "
            f"| {_cell([s.imports_s or 0.0 for s in fresh], 1, 2)} "
            f"| {_cell([s.cpu_s for s in fresh], 1, 2)} "
            f"| {_cell([s.end_s for s in fresh], 1, 2)} "
            f"| {_cell([s.start_s for s in warm], 1000, 1)} "
            f"| {_cell([s.init_s for s in warm], 1000, 1)} "
            f"| {_cell([s.cpu_s for s in warm], 1000, 1)} "
            f"| {_cell([s.end_s for s in warm], 1000, 1)} "
            f"| {min(loads):.2f}-{max(loads):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--modes", nargs="+", choices=["fresh", "warm"], default=["fresh", "warm"])
    parser.add_argument("--raw", type=Path, help="write one JSON line per measurement here")
    parser.add_argument("--table-from", type=Path, help="print the table of a --raw file")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.table_from:
        lines = args.table_from.read_text().splitlines()
        samples = [Sample(**json.loads(line)) for line in lines if line.strip()]
        for mode in ("fresh", "warm"):
            counts = {w: sum(s.mode == mode and s.world == w for s in samples) for w in args.sizes}
            print(f"{mode}: samples per k {counts}")
        print(table(samples, args.sizes))
        return
    if args.child:
        if args.child[0] == "fresh":
            child_fresh(int(args.child[1]), int(args.child[2]))
        else:
            child_warm(int(args.child[1]))
        return

    import torch

    print(f"# pool start cost, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, nice {os.nice(0)}")
    print(f"load at start: {Path('/proc/loadavg').read_text().strip()}")
    raw = args.raw.open("w") if args.raw else None
    pool = WarmPool(max(args.sizes)) if "warm" in args.modes else None
    samples: list[Sample] = []
    histories: list[object] = []
    try:
        if pool:
            cpu_before = pool.cpu_s()
            time.sleep(5.0)
            idle_cpu_ms = (pool.cpu_s() - cpu_before) * 1000
            print(
                f"{len(pool.procs)} warm ranks idle 5 s: {idle_cpu_ms:.0f} ms CPU in all; "
                f"RSS per warm rank {statistics.median(pool.rss_mb()):.0f} MB"
            )
        for rep in range(args.reps):  # interleaved, so both modes see the same load
            for world in args.sizes:
                for mode in args.modes:
                    if mode == "fresh":
                        sample = measure_fresh(world, rep)
                    else:
                        assert pool is not None
                        sample = pool.measure(world, rep)
                    samples.append(sample)
                    print(
                        f"rep {rep} k={world} {sample.mode}: start {sample.start_s * 1000:.1f} ms "
                        f"init {sample.init_s * 1000:.1f} ms end {sample.end_s * 1000:.1f} ms "
                        f"cpu {sample.cpu_s * 1000:.1f} ms load1 {sample.load1:.2f}",
                        flush=True,
                    )
                    if raw:
                        raw.write(json.dumps(asdict(sample)) + "\n")
                        raw.flush()
        if pool:
            histories = pool.close()
    finally:
        if pool:
            pool.kill()
        if raw:
            raw.close()
    for index, history in enumerate(histories):
        print(f"warm rank {index}: (world, rank) per trial {history}")
    print(f"load at end: {Path('/proc/loadavg').read_text().strip()}")
    print()
    print(table(samples, args.sizes))


if __name__ == "__main__":
    main()
