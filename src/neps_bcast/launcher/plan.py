"""What ``neps-bcast launch`` will start, decided and checked before any process starts.

Why a module of its own: every refusal (too many ranks for the devices, a device listed
twice, no rank per group, a script that is not there) must happen before the first
process exists, and must be testable without starting one. Nothing here starts a
process or imports torch; the caller passes in what devices are visible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from neps_bcast.errors import LaunchError, format_message

TAG = "neps_bcast launch"

ENV_LAUNCH_ID = "NEPS_BCAST_LAUNCH_ID"
"""Set for every process of one launch (a fresh id): how the launcher finds what is left."""
ENV_GROUP = "NEPS_BCAST_LAUNCH_GROUP"
"""Set for every process of group k to ``k``: which group a rank belongs to."""

SLURM_TASK_VARIABLES = (
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
)
"""The task layout of ``srun --ntasks-per-node=1 neps-bcast launch``: one task per node.
A group is a torchrun launch, not that task; Lightning checks SLURM before TorchElastic,
so groups must not inherit these (each would take the node's task rank as its own)."""


def task_log_dir(log_dir: Path, environ: Mapping[str, str]) -> Path:
    """``LOG_DIR/task<i>`` for task ``i`` of several SLURM tasks, else ``LOG_DIR``.

    Under ``srun --ntasks-per-node=1 neps-bcast launch --log-dir logs`` every node's
    launcher gets the same ``--log-dir`` on a shared filesystem: without a folder per
    task, each would write ``logs/group0/rank0.log`` over the others' (and clear them
    when a group starts)."""
    raw = environ.get("SLURM_NTASKS") or environ.get("SLURM_STEP_NUM_TASKS") or "1"
    procid = environ.get("SLURM_PROCID", "")
    if raw.isdigit() and int(raw) > 1 and procid.isdigit():
        return log_dir / f"task{procid}"
    return log_dir


def _fail(what: str, hint: str) -> LaunchError:
    return LaunchError(format_message(TAG, what, hint))


@dataclass(frozen=True)
class LaunchRequest:
    """The command line, as parsed (nothing checked yet)."""

    script: Path
    script_args: tuple[str, ...] = ()
    groups: int | None = None
    nproc_per_group: int | None = None
    devices: tuple[str, ...] | None = None
    """``--devices`` entries as written, or None when not given."""
    max_restarts: int = 0
    log_dir: Path = Path("logs")


@dataclass(frozen=True)
class GroupPlan:
    index: int
    nproc: int
    devices: tuple[str, ...] | None
    """This group's ``CUDA_VISIBLE_DEVICES`` entries; None: leave it as inherited (CPU)."""
    log_dir: Path

    def describe(self) -> str:
        where = f"devices {','.join(self.devices)}" if self.devices is not None else "CPU"
        return f"group {self.index}: {self.nproc} ranks on {where}"


@dataclass(frozen=True)
class LaunchPlan:
    groups: tuple[GroupPlan, ...]
    script: Path
    script_args: tuple[str, ...]
    max_restarts: int
    log_dir: Path
    unused_devices: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def parse_devices(text: str) -> tuple[str, ...]:
    """``"0,1,2"`` or ``"0-3"`` or a mix, and GPU UUIDs, into entries (duplicates kept)."""
    entries: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise _fail(
                f"--devices {text!r} has an empty entry.",
                "list devices separated by commas, e.g. --devices 0,1,2,3 (or 0-3).",
            )
        low, dash, high = item.partition("-")
        if dash and low.isdigit() and high.isdigit():
            if int(high) < int(low):
                raise _fail(
                    f"--devices range {item!r} runs backwards.",
                    f"write it low to high, e.g. {high}-{low}.",
                )
            entries.extend(str(i) for i in range(int(low), int(high) + 1))
        else:
            entries.append(item)
    return tuple(entries)


def visible_devices(environ: Mapping[str, str], device_count: int) -> tuple[str, ...]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries.

    ``device_count`` is what CUDA reports (0 without GPUs). When ``CUDA_VISIBLE_DEVICES``
    is set, its entries are the visible devices (as many as CUDA counts)."""
    if device_count <= 0:
        return ()
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed:
        return tuple(e.strip() for e in listed.split(",") if e.strip())[:device_count]
    return tuple(str(i) for i in range(device_count))


def _resolve(requested: Sequence[str], visible: Sequence[str]) -> tuple[str, ...]:
    """``--devices`` entries into ``CUDA_VISIBLE_DEVICES`` entries of the children.

    As in CUDA itself, an integer is an index into what this process sees; any other
    entry (a GPU UUID) must be one of the visible entries as written."""
    resolved = []
    for entry in requested:
        if entry.isdigit() and int(entry) < len(visible):
            resolved.append(visible[int(entry)])
        elif entry in visible and not entry.isdigit():
            resolved.append(entry)
        else:
            raise _fail(
                f"--devices names device {entry}, which this process cannot see"
                f" (visible: {','.join(visible)}; {len(visible)} GPU(s)).",
                f"use indexes 0..{len(visible) - 1} into the visible devices"
                " (CUDA_VISIBLE_DEVICES, if set, decides which those are).",
            )
    return tuple(resolved)


def _check_no_duplicates(entries: Sequence[str], what: str) -> None:
    seen: set[str] = set()
    for entry in entries:
        if entry in seen:
            raise _fail(
                f"{what} lists device {entry} twice ({','.join(entries)}): two ranks"
                " (or two groups) would share one device.",
                "list every device once, e.g. --devices 0,1,2,3.",
            )
        seen.add(entry)


def _positive(value: int | None, option: str, meaning: str) -> None:
    if value is not None and value < 1:
        raise _fail(
            f"{option} {value}: {meaning}.",
            f"pass {option} 1 or more.",
        )


def _counts(
    groups: int | None, nproc: int | None, n_devices: int, devices_text: str
) -> tuple[int, int]:
    """K and N, from the options or from the device count when one is missing."""
    if n_devices == 0:
        if nproc is None:
            raise _fail(
                "--nproc-per-group is missing and there are no GPUs to count from.",
                "pass --nproc-per-group N (ranks per DDP group), e.g. --nproc-per-group 2.",
            )
        return groups if groups is not None else 1, nproc
    if groups is None and nproc is None:
        raise _fail(
            f"neither --groups nor --nproc-per-group is given ({n_devices} devices:"
            f" {devices_text}).",
            "pass --nproc-per-group N (GPUs per trial); --groups then defaults to"
            f" {n_devices} // N.",
        )
    if nproc is None or groups is None:
        option, given = ("--groups", groups) if groups is not None else ("--nproc-per-group", nproc)
        assert given is not None  # one of the two is given (checked above)
        if n_devices // given < 1:
            raise _fail(
                f"{option} {given} is more than the {n_devices} devices ({devices_text}).",
                f"pass {option} {n_devices} or fewer, or list more devices with --devices.",
            )
        groups, nproc = (
            (given, n_devices // given) if option == "--groups" else (n_devices // given, given)
        )
    if groups is None or nproc is None:  # pragma: no cover - every case is handled above
        raise _fail("internal: no group size was decided.", "report this as a bug.")
    return groups, nproc


def _check_script(script: Path) -> None:
    if script.is_file():
        return
    where = "" if script.is_absolute() else f" (relative to {Path.cwd()})"
    what = "is a directory, not a script" if script.is_dir() else "does not exist"
    raise _fail(
        f"the script {str(script)!r} {what}{where}.",
        "pass the path of the Python script every rank runs, e.g."
        " neps-bcast launch --groups 2 --nproc-per-group 2 examples/groups.py.",
    )


def _chosen_devices(
    requested: tuple[str, ...] | None, visible: Sequence[str]
) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    """The ``CUDA_VISIBLE_DEVICES`` entries to split among the groups (None: CPU, no
    devices to split), and notes for the user."""
    if requested is None:
        return (tuple(visible) if visible else None), ()
    _check_no_duplicates(requested, "--devices")
    if not visible:
        return requested, (
            "no GPU is visible: the ranks run on CPU (gloo); --devices only sets each"
            " group's CUDA_VISIBLE_DEVICES.",
        )
    resolved = _resolve(requested, visible)
    _check_no_duplicates(resolved, f"--devices (as CUDA_VISIBLE_DEVICES={','.join(visible)})")
    return resolved, ()


def plan(request: LaunchRequest, visible: Sequence[str]) -> LaunchPlan:
    """Check ``request`` and decide every group's ranks, devices and log folder.

    ``visible``: the GPUs this process sees (``visible_devices``); empty on CPU.
    Raises ``LaunchError`` naming the fix; starts nothing."""
    _positive(request.groups, "--groups", "a launch needs at least one DDP group")
    _positive(request.nproc_per_group, "--nproc-per-group", "a DDP group needs at least one rank")
    if request.max_restarts < 0:
        raise _fail(
            f"--max-restarts {request.max_restarts} is negative.",
            "pass --max-restarts 0 (never restart a group) or more.",
        )
    _check_script(request.script)
    devices, notes = _chosen_devices(request.devices, visible)
    n_devices = len(devices) if devices is not None else 0
    groups, nproc = _counts(
        request.groups, request.nproc_per_group, n_devices, ",".join(devices or ())
    )
    if devices is not None and groups * nproc > n_devices:
        raise _fail(
            f"--groups {groups} x --nproc-per-group {nproc} = {groups * nproc} ranks, but"
            f" there are only {n_devices} devices ({','.join(devices)}), one per rank.",
            f"lower --groups or --nproc-per-group so that groups x nproc-per-group <="
            f" {n_devices}, or list more devices with --devices.",
        )

    plans = tuple(
        GroupPlan(
            index=k,
            nproc=nproc,
            devices=devices[k * nproc : (k + 1) * nproc] if devices is not None else None,
            log_dir=request.log_dir / f"group{k}",
        )
        for k in range(groups)
    )
    unused = devices[groups * nproc :] if devices is not None else ()
    extra_notes = (f"devices {','.join(unused)} stay unused.",) if unused else ()
    return LaunchPlan(
        groups=plans,
        script=request.script,
        script_args=request.script_args,
        max_restarts=request.max_restarts,
        log_dir=request.log_dir,
        unused_devices=unused,
        notes=(*notes, *extra_notes),
    )


def group_environment(base: Mapping[str, str], group: GroupPlan, launch_id: str) -> dict[str, str]:
    """The environment group ``group`` starts torchrun with."""
    env = {k: v for k, v in base.items() if k not in SLURM_TASK_VARIABLES}
    env[ENV_LAUNCH_ID] = launch_id
    env[ENV_GROUP] = str(group.index)
    if group.devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(group.devices)
    return env
