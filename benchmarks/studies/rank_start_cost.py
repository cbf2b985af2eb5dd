"""What a rank pays before its first trial: CPU-seconds from process start to "ready for
trial 1" (the first call of the trial function), per rank, for a torchrun plain-DDP
search and a pool's ranks, and whether the rank had imported Lightning by then.

    python benchmarks/studies/rank_start_cost.py [--runs 3]

A user's plain-DDP script imports torch and NePS (its search space) and never Lightning:
every second a rank spends importing what the user did not ask for is paid by every rank
of every launch (and by every launch of the test suite). Prints one line per shape and
rank: median CPU-s and wall-s over the runs, and the fraction of runs where Lightning
was in ``sys.modules`` at the first trial.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import json, os, resource, sys, time
    import neps
    import neps_bcast

    OUT = os.environ["RANK_COST_OUT"]

    def _since_start():
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")

    FIRST = []

    class Space(neps.PipelineSpace):
        lr = neps.Float(1e-3, 1e-1, log=True)

    def evaluate_pipeline(lr):
        with neps_bcast.session() as trial:
            if not FIRST:
                FIRST.append(1)
                r = resource.getrusage(resource.RUSAGE_SELF)
                name = f"{os.environ.get('NEPS_BCAST_POOL_ROLE', 'rank')}-{os.getpid()}.json"
                with open(os.path.join(OUT, name), "w") as f:
                    json.dump({"rank": trial.rank, "cpu_s": r.ru_utime + r.ru_stime,
                               "wall_s": _since_start(),
                               "lightning": "lightning" in sys.modules}, f)
        return lr

    if __name__ == "__main__":
        kwargs = {}
        if os.environ.get("NEPS_BCAST_POOL_ROLE"):
            kwargs["ranks_per_trial"] = lambda config: 2
        neps_bcast.run(evaluate_pipeline, pipeline_space=Space(), root_directory=sys.argv[1],
                       total_evaluations_to_spend=1, optimizer="random_search", **kwargs)
    """
)


def one_run(shape: str, work: Path) -> list[dict[str, object]]:
    out = work / "out"
    out.mkdir()
    script = work / "search.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "RANK_COST_OUT": str(out), "OMP_NUM_THREADS": "1"}
    bin_dir = Path(sys.executable).parent
    if shape == "torchrun":
        command = [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", "2"]
    else:
        command = [str(bin_dir / "neps-bcast"), "launch", "--pool", "2"]
    subprocess.run(
        [*command, str(script), str(work / "root")],
        cwd=work,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        timeout=300,
    )
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.1f}")
    for shape in ("torchrun", "pool"):
        by_rank: dict[int, list[dict[str, object]]] = {}
        for _ in range(args.runs):
            with tempfile.TemporaryDirectory() as tmp:
                for record in one_run(shape, Path(tmp)):
                    by_rank.setdefault(int(str(record["rank"])), []).append(record)
        for rank, records in sorted(by_rank.items()):
            cpu = statistics.median(float(str(r["cpu_s"])) for r in records)
            wall = statistics.median(float(str(r["wall_s"])) for r in records)
            lightning = sum(bool(r["lightning"]) for r in records) / len(records)
            print(
                f"{shape:8s} rank {rank}: CPU {cpu:5.2f} s, wall {wall:5.2f} s to trial 1"
                f" (median of {len(records)}); Lightning imported in {lightning:.0%} of runs"
            )
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
