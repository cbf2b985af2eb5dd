"""neps_bcast vs NePS 0.17's built-in DDP mode, side by side, interleaved, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --quick   # make bench (~7 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --full    # make bench-full (~26 min)
    .venv/bin/python benchmarks/run.py --readme-table benchmarks/results/summary_full.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --only groups   # one section (~2 min)

Writes ``summary_<mode>.json``, ``REPORT.md`` and the PNG plots to ``benchmarks/results/``
(raw per-launch JSON to ``results/raw/``, git-ignored). ``--only groups`` measures that one
section with the mode's settings and prints its summary, writing nothing to ``results/``.
Measures only: nothing here asserts a time. The parts: ``configuration`` (what a mode measures), ``measurement``
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

from analysis import summarize, summarize_groups
from configuration import CONFIGS, RAW, RESULTS, Mode
from measurement import measure_all, measure_group_layouts, progress
from plots import save_plots
from readme_table import readme_section
from report import (
    GROUPS,
    MAIN_HEADER,
    goal_lines,
    groups_table,
    label_fields,
    markdown_table,
    metric_row,
    render_report,
)


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


def only_groups(mode: Mode, *, keep_tmp: bool) -> None:
    """The groups section alone: its launches' records stay in the temporary folder
    (kept with ``--keep-tmp``), the section's summary and table rows go to stdout."""
    config = CONFIGS[mode]
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="neps_bcast_bench_groups_"))
    started = time.monotonic()
    try:
        progress(f"[{mode}, groups only] tmp root {tmp}")
        launches = measure_group_layouts(config, tmp, raw_dir=tmp / "raw")
    finally:
        if not keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = {"groups": summarize_groups({"groups": launches})}
    print(json.dumps(summary, indent=1))
    print(markdown_table(MAIN_HEADER, [metric_row(GROUPS, summary, label_fields(summary, config))]))
    print()
    print(groups_table(summary))
    progress(f"done in {(time.monotonic() - started) / 60:.1f} min")


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
    parser.add_argument(
        "--only",
        choices=("groups",),
        help="measure only this section (quick or full settings), print its summary and rows,"
        " write nothing to results/",
    )
    args = parser.parse_args()
    if args.readme_table:
        print(readme_section(json.loads(args.readme_table.read_text())), end="")
        return
    mode: Mode = "full" if args.full else "quick"
    if args.only == "groups":
        only_groups(mode, keep_tmp=args.keep_tmp)
        return
    benchmark(mode, keep_tmp=args.keep_tmp)


if __name__ == "__main__":
    main()
