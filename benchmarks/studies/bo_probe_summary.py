"""Summarize bo_probe runs (benchmarks/studies/bo_gap.md): python benchmarks/studies/bo_probe_summary.py RUN_DIR...
(or ``--pairs OURS_DIR BUILTIN_DIR ...``: per-sample ratios of two runs of one BO problem)

Each RUN_DIR holds the ``timings`` folder of one ``plain_launch.py --script ../studies/bo_probe.py``
run. Prints, per run: the sampled configs' digest (same digest = same BO problem), the
medians over the samples after the first (which is the random initial design) of wall
and CPU time, the follower ranks' CPU while the leader sampled, the GP fit and
acquisition phases, and the leader's gap from one trial's function returning to the
next one's being entered, split into its steps.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(run: Path) -> dict:
    t = run / "timings"
    samples = rows(t / "sample.jsonl")
    later = samples[1:]
    configs = [s["configs"] for s in samples]
    digest = hashlib.sha256(json.dumps(configs).encode()).hexdigest()[:10]
    rank0 = rows(t / "rank0.jsonl")
    enters = [r for r in rank0 if "t_enter" in r]
    exits = [r for r in rank0 if "t_exit" in r]
    reports = rows(t / "report.jsonl")
    recovers = [r for r in rows(t / "recover.jsonl")]
    steps: dict[str, list[float]] = {}
    for i in range(len(exits) - 1):
        t_exit, t_next = exits[i]["t_exit"], enters[i + 1]["t_enter"]
        sample = next(s for s in samples if s["t_start"] > t_exit)
        report = next(r for r in reports if r["t_start"] > t_exit)
        recover = [r for r in recovers if t_exit < r["t_start"] < report["t_start"]]
        s_end = sample["t_start"] + sample["wall_s"]
        parts = {
            "gap": t_next - t_exit,
            "exit_to_report": report["t_start"] - t_exit,
            "recover_orphans": sum(r["t_end"] - r["t_start"] for r in recover),
            "report": report["t_end"] - report["t_start"],
            "report_to_sample": sample["t_start"] - report["t_end"],
            "sample": sample["wall_s"],
            "sample_to_enter": t_next - s_end,
        }
        for key, value in parts.items():
            steps.setdefault(key, []).append(value)
    phase = lambda name, k: [s.get("phases", {}).get(name, [0, 0, 0, 0])[k] for s in later]  # noqa: E731
    return {
        "run": run.name,
        "configs": digest,
        "n_samples": len(samples),
        "sample_wall": med([s["wall_s"] for s in later]),
        "sample_thread_cpu": med([s["thread_cpu_s"] for s in later]),
        "sample_process_cpu": med([s["process_cpu_s"] for s in later]),
        "sum_thread_cpu": sum(s["thread_cpu_s"] for s in later),
        "sum_wall": sum(s["wall_s"] for s in later),
        "followers_cpu_per_sample_s": med([sum(s["peers_cpu_s"].values()) for s in later]),
        "followers_cpu_per_wall": sum(sum(s["peers_cpu_s"].values()) for s in later)
        / max(sum(s["wall_s"] for s in later), 1e-9),
        "fit_wall": med(phase("fit_gpytorch_mll", 1)),
        "acqf_wall": med(phase("optimize_acqf", 1)),
        "acqf_thread_cpu": med(phase("optimize_acqf", 2)),
        "scipy_nfev_total": sum(phase("scipy", 3)),
        "torch_threads": sorted({s["torch_threads"] for s in samples}),
        "env": samples[0]["env"] if samples else None,
        "threads": samples[-1]["n_threads"] if samples else None,
        "steps_median_ms": {k: round(1000 * med(v), 1) for k, v in steps.items()},
        "recover_ms_all": [round(1000 * (r["t_end"] - r["t_start"]), 2) for r in recovers],
    }


def paired(ours: Path, builtin: Path) -> dict:
    """Same BO problem in both runs: per sample (after the first), ours / builtin."""
    a, b = rows(ours / "timings" / "sample.jsonl"), rows(builtin / "timings" / "sample.jsonl")
    same = [s["configs"] for s in a[: len(b)]] == [s["configs"] for s in b[: len(a)]]
    ratios: dict[str, list[float]] = {}
    for x, y in list(zip(a, b, strict=False))[1:]:
        for key in ("wall_s", "thread_cpu_s", "process_cpu_s"):
            ratios.setdefault(key, []).append(x[key] / y[key])
        nfev = lambda s: s.get("phases", {}).get("scipy", [0, 0, 0, 0])[3]  # noqa: E731
        ratios.setdefault("nfev", []).append(nfev(x) / max(nfev(y), 1))
    return {
        "pair": f"{ours.name} / {builtin.name}",
        "same_configs": same,
        "samples": len(ratios.get("wall_s", [])),
        **{
            f"{k}_ratio": {
                "median": round(med(v), 3),
                "min": round(min(v), 3),
                "max": round(max(v), 3),
            }
            for k, v in ratios.items()
        },
    }


def main() -> None:
    if sys.argv[1] == "--pairs":
        dirs = [Path(arg) for arg in sys.argv[2:]]
        for ours, builtin in zip(dirs[::2], dirs[1::2], strict=True):
            print(json.dumps(paired(ours, builtin)))
        return
    for arg in sys.argv[1:]:
        print(json.dumps(summarize(Path(arg))))


if __name__ == "__main__":
    main()
