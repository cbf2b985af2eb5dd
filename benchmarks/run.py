"""neps_bcast vs NePS 0.17's built-in DDP mode, side by side, interleaved, in one run.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --quick   # make bench (~7 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --full    # make bench-full (~26 min + the pool)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --only groups   # one section (~2 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --full --only pool --save   # (45-65 min)
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --full --only pool --curves B --save

Writes ``summary_<mode>.json``, ``REPORT.md`` and the PNG plots to ``benchmarks/results/``
(raw per-launch JSON to ``results/raw/``, git-ignored). ``--only groups`` measures that one
section with the mode's settings and prints its summary, writing nothing to ``results/``.
The right-sized pool section (``pool_bench``, ``pool_report``: ``--pool D`` against the fixed
layouts on D simulated devices) is part of ``--full`` only; ``--only pool`` runs it alone
(quick: a small pool of 4 to develop with), and with ``--save`` also writes
``pool_<mode>.json``, its figures, and its section of REPORT.md (replaced in place);
``--curves B`` measures only that curve and rebuilds the section from the raw JSON of every
curve in ``results/raw/pool_<mode>/`` (the others' from their last run; a curve with no raw
JSON left keeps its summary from the last ``pool_<mode>.json``).
Measures only: nothing here asserts a time. The parts: ``configuration`` (what a mode
measures), ``measurement`` (launching ``workloads/`` under ``_supervise.py``), ``analysis``
(statistics), ``report`` (REPORT.md, whose Headline table the README copies), ``plots``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
from configuration import CONFIGS, POOL_CONFIGS, RAW, RESULTS, Mode
from measurement import measure_all, measure_group_layouts, progress
from plots import save_plots
from pool_bench import measure_pool_section, read_raw_launches, summarize_pool
from pool_report import pool_headline_row, pool_section, save_pool_plots, splice_section
from report import MAIN_HEADER, groups_row, groups_table, headline_rows, render_report
from tables import markdown_table


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
        choices=("groups", "pool"),
        help="measure only this section (quick or full settings), print its summary and rows,"
        " write nothing to results/ (but see --save)",
    )
    parser.add_argument(
        "--save",
        action="store_true",
        help="with --only pool: also write results/pool_<mode>.json, its figure and its"
        " section of REPORT.md (raw JSON to results/raw/pool_<mode>/)",
    )
    parser.add_argument(
        "--curves",
        help="with --only pool: the pool section's curves to measure, comma-separated (A,B,C);"
        " with --save the others' figures come from their raw JSON of an earlier run",
    )
    args = parser.parse_args()
    mode: Mode = "full" if args.full else "quick"
    config = CONFIGS[mode]
    started = time.monotonic()
    if args.only == "pool":
        curves = tuple(args.curves.split(",")) if args.curves else None
        only_pool(mode, keep=args.keep_tmp, save=args.save, curves=curves)
        return
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
        if mode == "full":  # make bench-full's last section
            raw["pool"] = measure_pool_section(POOL_CONFIGS[mode], tmp)
    seconds = time.monotonic() - started
    summary = summarize(raw, config)
    if "pool" in raw:
        summary["pool"] = summarize_pool(raw["pool"], POOL_CONFIGS[mode])
    machine = machine_description()
    document = {
        "mode": mode,
        "config": asdict(config),
        **({"pool_config": asdict(POOL_CONFIGS[mode])} if "pool" in raw else {}),
        "machine": machine,
        "seconds": seconds,
        "summary": summary,
    }
    (RESULTS / f"summary_{mode}.json").write_text(json.dumps(document, indent=1))
    (RESULTS / "REPORT.md").write_text(render_report(summary, config, mode, machine, seconds))
    save_plots(summary, raw)
    if "pool" in raw:
        save_pool_plots(summary, raw["pool"])
    progress(markdown_table(MAIN_HEADER.rpartition(" | ")[0], headline_rows(summary, config)))
    progress(f"done in {seconds / 60:.1f} min: {RESULTS / 'REPORT.md'}")


def only_pool(mode: Mode, *, keep: bool, save: bool, curves: tuple[str, ...] | None = None) -> None:
    """``--only pool``: the right-sized pool section alone; ``save``: into results/ too;
    ``curves``: only these of the mode's curves (with ``save``, the others come from their
    raw JSON in ``results/raw/pool_<mode>/``)."""
    started = time.monotonic()
    pool_config = POOL_CONFIGS[mode]
    names = [curve.name for curve in pool_config.curves]
    chosen = curves or tuple(names)
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        raise SystemExit(f"--curves {','.join(unknown)}: the {mode} curves are {names}")
    measured = dataclasses.replace(
        pool_config, curves=tuple(c for c in pool_config.curves if c.name in chosen)
    )
    raw_dir = RAW / f"pool_{mode}"
    if save:
        raw_dir.mkdir(parents=True, exist_ok=True)
        for name in chosen:  # this run replaces these curves' launches, keeps the others'
            for path in raw_dir.glob(f"pool{name}*_*.json"):
                path.unlink()
    with scratch(f"{mode}, pool only", keep=keep) as tmp:
        launches = measure_pool_section(measured, tmp, raw_dir if save else tmp / "raw")
    seconds = time.monotonic() - started
    if save:  # every curve's launches: this run's and, for the others, their last run's
        launches = read_raw_launches(raw_dir)
    summary = {"pool": summarize_pool(launches, pool_config if save else measured)}
    kept = keep_earlier_curves(summary["pool"], RESULTS / f"pool_{mode}.json") if save else []
    print(json.dumps(summary, indent=1))
    print(markdown_table(MAIN_HEADER.rpartition(" | ")[0], [pool_headline_row(summary)]) + "\n")
    if save:
        machine = machine_description()
        document = {
            "mode": mode,
            "pool_config": asdict(pool_config),
            "machine": machine,
            "seconds": seconds,
            "summary": summary,
        }
        (RESULTS / f"pool_{mode}.json").write_text(json.dumps(document, indent=1))
        save_pool_plots(summary, launches)
        when = "; ".join(
            f"curve {name} "
            + (
                "kept from the earlier pool_full.json (no raw JSON left)"
                if name in kept
                else measured_when(launches, name)
            )
            for name in names
        )
        note = (
            f"Measured by itself (not inside make bench-full; other jobs ran on the machine, see the load below): `OMP_NUM_THREADS=1 .venv/bin/python benchmarks/run.py --{mode}"
            f" --only pool{' --curves ' + ','.join(chosen) if curves else ''} --save`"
            f" ({when}); this run took {seconds / 60:.1f} min; machine: "
            + ", ".join(f"{key} {value}" for key, value in machine.items())
            + ". The rest of this report comes from its own run."
        )
        report = RESULTS / "REPORT.md"
        text = report.read_text() if report.exists() else ""
        report.write_text(splice_section(text, pool_section(summary, note=note)))
    else:
        print(pool_section(summary))
    progress(f"done in {seconds / 60:.1f} min")


def keep_earlier_curves(pool: dict, earlier: Path) -> list[str]:
    """The curves of ``pool`` with no launch at all (their raw JSON gone: it is git-ignored)
    take their summary from ``earlier`` (the last ``pool_<mode>.json``), if it has them;
    their names."""
    if not earlier.exists():
        return []
    before = {
        curve["curve"]: curve
        for curve in json.loads(earlier.read_text())["summary"]["pool"]["curves"]
    }
    kept = []
    for index, curve in enumerate(pool["curves"]):
        empty = all(entry["runs_total"] == 0 for entry in curve["layouts"].values())
        if empty and curve["curve"] in before:
            pool["curves"][index] = before[curve["curve"]]
            kept.append(curve["curve"])
    return kept


def measured_when(launches: list[dict[str, object]], curve: str) -> str:
    """``2026-12-03 15:59-16:19``: from the first launch's start to the last one's exit."""
    starts = [
        float(run["t_start"])
        for run in launches
        if run.get("curve") == curve and run.get("t_start")
    ]
    exits = [
        float(run["t_exit"]) for run in launches if run.get("curve") == curve and run.get("t_exit")
    ]
    if not starts or not exits:
        return "n/a"
    return (
        f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(min(starts)))}"
        f"-{time.strftime('%H:%M', time.localtime(max(exits)))}"
    )


if __name__ == "__main__":
    main()
