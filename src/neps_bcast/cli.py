"""``neps-bcast``: the command line (also ``python -m neps_bcast``).

``neps-bcast launch``: parses the options, checks them into a plan (``plan.py``: every
refusal happens here, before any process starts), then hands the plan to ``groups.run``
(K groups of N ranks) or, with ``--pool D``, to ``pool.run`` (right-sized trials on D
devices). ``neps-bcast status ROOT``: what the search on a NePS root is doing
(``search_status.py``; reads files only, imports neither NePS nor torch), with
``--plot FILE`` also as a picture (``search_plot.py``). Errors print
as ``[neps_bcast launch] what happened. HINT: what to do.`` (``[neps_bcast status]``) and
exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from neps_bcast.errors import LaunchError, SettingsError, format_message
from neps_bcast.launcher import groups, plan, search_plot, search_status, search_text
from neps_bcast.pool import launcher as pool

USAGE_EXAMPLE = "neps-bcast launch --groups 4 --nproc-per-group 2 train.py --trials 40"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="neps-bcast",
        description="Tools for NePS searches whose trials are DDP jobs (neps_bcast).",
    )
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    launch = commands.add_parser(
        "launch",
        help="start K DDP groups of N ranks on this node, each one NePS worker",
        description=(
            "Start K DDP groups of N ranks on this node with torch's own launcher"
            " (torchrun --standalone, one per group). Each group runs SCRIPT as torchrun"
            " would and is one NePS worker; all share the root directory SCRIPT passes to"
            f" neps_bcast.run. Example: {USAGE_EXAMPLE}"
        ),
    )
    launch.add_argument(
        "--groups", type=int, default=None, help="K, DDP groups (default: devices // N; 1 on CPU)"
    )
    launch.add_argument(
        "--nproc-per-group",
        type=int,
        default=None,
        help="N, ranks per group (default: devices // K; required on CPU)",
    )
    launch.add_argument(
        "--devices",
        default=None,
        help="GPUs to split among the groups, e.g. 0,1,2,3 or 0-3 (default: every visible GPU)",
    )
    launch.add_argument(
        "--pool",
        type=int,
        default=None,
        metavar="D",
        help="right-sized trials: D devices (GPUs, or D CPU ranks), each trial on as many"
        " as neps_bcast.run's ranks_per_trial(config) says, trials side by side where"
        " they fit (instead of --groups/--nproc-per-group)",
    )
    launch.add_argument(
        "--trial-time-limit",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --pool: a trial still running this long after its ranks were given"
        " is stopped (its ranks SIGKILLed and replaced) and goes back to pending, as for"
        " a lost rank, up to NEPS_BCAST_MAX_RETRIES times, then crashed (default: none)",
    )
    launch.add_argument(
        "--agents",
        type=int,
        default=None,
        metavar="N",
        help="with --pool: N NePS workers that sample the trials (default D). More than D"
        " samples ahead: a trial is sampled while the devices are busy and starts as soon"
        " as they are free, so no device waits on a slow sampler (Bayesian optimization)",
    )
    launch.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restarts of a group whose rank fails, torchrun's --max-restarts (default 0)",
    )
    launch.add_argument(
        "--log-dir",
        type=Path,
        default=Path("logs"),
        help="one file per rank: LOG_DIR/group<k>/rank<r>.log, and torchrun's own output in"
        " LOG_DIR/group<k>/torchrun.log (default: ./logs); as task i of several SLURM"
        " tasks (srun --ntasks-per-node=1), LOG_DIR/task<i>/group<k>/...",
    )
    launch.add_argument(
        "--status-interval",
        type=float,
        default=5.0,
        help="seconds between status lines (default 5)",
    )
    launch.add_argument(
        "--stop-timeout",
        type=float,
        default=45.0,
        help="after Ctrl-C or SIGTERM, seconds groups get to record their trials before"
        " everything left is SIGKILLed (default 45; torchrun's own bound is 30)",
    )
    launch.add_argument("script", type=Path, help="the Python script every rank runs")
    launch.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    status = commands.add_parser(
        "status",
        help="what the search on a NePS root is doing (trials, ranks, leases, best, budget)",
        description=(
            "One line per trial of the search on ROOT (state, attempt, host, pid, ranks,"
            " devices in a pool, heartbeat and whether the lease is stale, elapsed time,"
            " objective), then counts by state, the best trial and the budget used. Reads"
            " the root's files only, without locks: safe while the search runs, from any"
            " node that sees the root. Example: neps-bcast status results"
        ),
    )
    status.add_argument("root", type=Path, help="the NePS root_directory of the search")
    status.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="show it again every SECONDS until Ctrl-C",
    )
    status.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    status.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="FILE",
        help="also draw the search into FILE (.png or .svg): a bar per attempt on its"
        " group's or pool device's row, coloured by how it ended, and the best objective"
        " so far over wall time; with --watch, redrawn each time",
    )
    return top


def request_from(args: argparse.Namespace) -> plan.LaunchRequest:
    return plan.LaunchRequest(
        script=args.script,
        script_args=tuple(args.script_args),
        groups=args.groups,
        nproc_per_group=args.nproc_per_group,
        devices=plan.parse_devices(args.devices) if args.devices is not None else None,
        max_restarts=args.max_restarts,
        log_dir=plan.task_log_dir(args.log_dir, os.environ),
    )


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""The device nodes a GPU driver makes (NVIDIA's, ROCm's, WSL's): a machine without any
has no GPU torch could count, so the launcher does not import torch to ask."""


def cuda_device_count(device_nodes: Sequence[str] = GPU_DEVICE_NODES) -> int:
    """GPUs CUDA reports (0 without any, or without a CUDA build of torch).

    Importing torch costs the launcher ~2 CPU-seconds before any rank starts; where no GPU
    driver's device node exists, the answer is 0 without it."""
    if not any(Path(node).exists() for node in device_nodes):
        return 0
    import torch

    return int(torch.cuda.device_count())


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "status":
        return show_status(args)
    try:
        request = request_from(args)
        if args.status_interval <= 0 or args.stop_timeout <= 0:
            raise LaunchError(
                format_message(
                    plan.TAG,
                    f"--status-interval {args.status_interval} / --stop-timeout"
                    f" {args.stop_timeout}: both must be positive seconds.",
                    "pass e.g. --status-interval 5 --stop-timeout 45.",
                )
            )
        settings = groups.Settings(
            status_interval_s=args.status_interval, stop_timeout_s=args.stop_timeout
        )
        if args.pool is not None:
            return pool.run(pool_plan(args, request), settings, sys.stdout)
        if args.trial_time_limit is not None:
            raise LaunchError(
                format_message(
                    plan.TAG,
                    "--trial-time-limit is for a pool (--pool D): a group's trials run"
                    " inside its own ranks, which the launcher cannot stop one by one.",
                    "pass --pool D with it, or bound the trial in your own code (e.g."
                    " Lightning's Trainer(max_time=...)).",
                )
            )
        if args.agents is not None:
            raise LaunchError(
                format_message(
                    plan.TAG,
                    "--agents is for a pool (--pool D): each group is one NePS worker.",
                    "pass --pool D with it, or more groups (--groups) for more workers.",
                )
            )
        the_plan = plan.plan(request, plan.visible_devices(os.environ, cuda_device_count()))
    except LaunchError as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    return groups.run(the_plan, settings, sys.stdout)


def pool_plan(args: argparse.Namespace, request: plan.LaunchRequest) -> pool.PoolPlan:
    """``--pool D``: checked before anything starts (``LaunchError`` names the fix)."""
    if args.groups is not None or args.nproc_per_group is not None or args.max_restarts:
        raise LaunchError(
            format_message(
                plan.TAG,
                "--pool cannot be combined with --groups, --nproc-per-group or"
                " --max-restarts: a pool sizes each trial by itself.",
                "pass only --pool D (and ranks_per_trial to neps_bcast.run), or only"
                " --groups/--nproc-per-group.",
            )
        )
    pool.check(args.pool, args.trial_time_limit, args.agents)
    # The same checks as a group of D ranks: the script, --devices, one device each.
    one_group = plan.plan(
        plan.LaunchRequest(
            script=request.script,
            script_args=request.script_args,
            groups=1,
            nproc_per_group=args.pool,
            devices=request.devices,
            log_dir=request.log_dir,
        ),
        plan.visible_devices(os.environ, cuda_device_count()),
    )
    devices = one_group.groups[0].devices
    return pool.PoolPlan(
        size=args.pool,
        devices=devices,
        script=request.script,
        script_args=request.script_args,
        log_dir=request.log_dir / "pool",
        trial_time_limit_s=args.trial_time_limit,
        agents=args.agents if args.agents is not None else args.pool,
    )


def show_status(args: argparse.Namespace) -> int:
    """``neps-bcast status``: 0, or 2 with the error on stderr (a wrong root, a bad
    setting); with ``--watch``, until Ctrl-C (then 0)."""
    try:
        if args.watch is not None and not args.watch > 0:
            raise LaunchError(
                format_message(
                    search_status.TAG,
                    f"--watch {args.watch}: expected a positive number of seconds.",
                    "pass e.g. --watch 5.",
                )
            )
        if args.plot is not None:
            search_plot.check_path(args.plot)
        root = search_status.check_root(args.root)
        while True:
            status = search_status.read_status(root, history=args.plot is not None)
            text = status.to_json() if args.json else search_text.render(status)
            if args.plot is not None:
                search_plot.save(search_plot.picture(status), args.plot)
                if not args.json:
                    text += f"\npicture: {args.plot}"
            if args.watch is not None and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")  # redraw in place
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            if args.watch is None:
                return 0
            time.sleep(args.watch)  # the refresh period the user asked for
    except (LaunchError, SettingsError) as exc:
        sys.stderr.write(f"{exc}\n")
        return 2
    except KeyboardInterrupt:
        return 0


def console_main() -> None:
    raise SystemExit(main())
