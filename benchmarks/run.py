"""neps_bcast vs NePS 0.17's built-in DDP mode, side by side, interleaved, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --quick   # make bench (~5 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --full    # make bench-full (~26 min)
    .venv/bin/python benchmarks/run.py --readme-table benchmarks/results/summary_full.json

Writes ``summary_<mode>.json``, ``REPORT.md`` and the PNG plots to ``benchmarks/results/``
(raw per-launch JSON to ``results/raw/``, git-ignored). Measures only: nothing here
asserts a time. The parts: ``configuration`` (what a mode measures), ``measurement``
(launching and supervising), ``analysis`` (statistics), ``report`` (REPORT.md and the
README table), ``plots``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from analysis import summarize
from configuration import CONFIGS, RAW, RESULTS, Mode
from measurement import measure_all, progress
from plots import save_plots
from readme_table import readme_section
from report import goal_lines, render_report


def machine_description() -> dict[str, str]:
    cpu_model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "",
    )
    return {
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model or platform.processor(),
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "lightning": importlib.metadata.version("lightning"),
        "neps": importlib.metadata.version("neural-pipeline-search"),
        "kernel": platform.release(),
        "load average (1/5/15 min) at the end": " ".join(
            Path("/proc/loadavg").read_text().split()[:3]
        ),
    }


def benchmark(mode: Mode, *, keep_tmp: bool) -> None:
    config = CONFIGS[mode]
    os.environ["OMP_NUM_THREADS"] = "1"
    if RAW.exists():
        shutil.rmtree(RAW)
    RAW.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="neps_bcast_bench_"))
    started = time.monotonic()
    try:
        progress(f"[{mode}] tmp root {tmp}")
        raw = measure_all(config, tmp)
    finally:
        if not keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    seconds = time.monotonic() - started
    summary = summarize(raw, config)
    machine = machine_description()
    document = {
        "mode": mode,
        "config": asdict(config),
        "machine": machine,
        "seconds": seconds,
        "summary": summary,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"summary_{mode}.json").write_text(json.dumps(document, indent=1))
    (RESULTS / "REPORT.md").write_text(render_report(summary, config, mode, machine, seconds))
    save_plots(summary, raw)
    for line in goal_lines(summary):
        progress(line)
    progress(f"done in {seconds / 60:.1f} min: {RESULTS / 'REPORT.md'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--quick", action="store_true", help="make bench (the default)")
    what.add_argument("--full", action="store_true", help="make bench-full")
    what.add_argument(
        "--readme-table",
        metavar="SUMMARY_JSON",
        type=Path,
        help="print the README's benchmark table from a summary_<mode>.json, measure nothing",
    )
    parser.add_argument("--keep-tmp", action="store_true", help="keep the launches' folders")
    args = parser.parse_args()
    if args.readme_table:
        print(readme_section(json.loads(args.readme_table.read_text())), end="")
        return
    benchmark("full" if args.full else "quick", keep_tmp=args.keep_tmp)


if __name__ == "__main__":
    main()
