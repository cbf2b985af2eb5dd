"""neps_bcast vs NePS 0.17's built-in DDP mode, side by side, interleaved, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --quick   # make bench (~7 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --full    # make bench-full (~26 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --only groups   # one section (~2 min)

Writes ``summary_<mode>.json``, ``REPORT.md`` and the PNG plots to ``benchmarks/results/``
(raw per-launch JSON to ``results/raw/``, git-ignored). ``--only groups`` measures that one
section with the mode's settings and prints its summary, writing nothing to ``results/``.
Measures only: nothing here asserts a time. The parts: ``configuration`` (what a mode
measures), ``measurement`` (launching ``workloads/`` under ``_supervise.py``), ``analysis``
(statistics), ``report`` (REPORT.md, whose Headline table the README copies), ``plots``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from analysis import summarize, summarize_groups
from configuration import CONFIGS, RAW, RESULTS
from measurement import measure_all, measure_group_layouts, progress
from plots import save_plots
from report import (
    MAIN_HEADER,
    groups_row,
    groups_table,
    headline_rows,
    markdown_table,
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


@contextlib.contextmanager
def scratch(what: str, *, keep: bool) -> Iterator[Path]:
    """A temporary folder for the launches (removed afterwards unless ``keep``)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="neps_bcast_bench_"))
    progress(f"[{what}] tmp root {tmp}")
    try:
        yield tmp
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--quick", action="store_true", help="make bench (the default)")
    what.add_argument("--full", action="store_true", help="make bench-full")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the launches' folders")
    parser.add_argument(
        "--only",
        choices=("groups",),
        help="measure only this section (quick or full settings), print its summary and rows,"
        " write nothing to results/",
    )
    args = parser.parse_args()
    mode = "full" if args.full else "quick"
    config = CONFIGS[mode]
    started = time.monotonic()
    if args.only == "groups":  # the launches' records stay in the temporary folder
        with scratch(f"{mode}, groups only", keep=args.keep_tmp) as tmp:
            launches = measure_group_layouts(config, tmp, raw_dir=tmp / "raw")
        summary = {"groups": summarize_groups({"groups": launches})}
        print(json.dumps(summary, indent=1))
        print(markdown_table(MAIN_HEADER, [groups_row(summary, config)]) + "\n")
        print(groups_table(summary))
        progress(f"done in {(time.monotonic() - started) / 60:.1f} min")
        return
    shutil.rmtree(RAW, ignore_errors=True)
    RAW.mkdir(parents=True)
    with scratch(mode, keep=args.keep_tmp) as tmp:
        raw = measure_all(config, tmp)
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
    (RESULTS / f"summary_{mode}.json").write_text(json.dumps(document, indent=1))
    (RESULTS / "REPORT.md").write_text(render_report(summary, config, mode, machine, seconds))
    save_plots(summary, raw)
    progress(markdown_table(MAIN_HEADER.rpartition(" | ")[0], headline_rows(summary, config)))
    progress(f"done in {seconds / 60:.1f} min: {RESULTS / 'REPORT.md'}")


if __name__ == "__main__":
    main()
