"""One rank of plain_search.py (or lightning_search.py) with NePS's sampler timed.

Is Bayesian optimization slower under neps_bcast than under NePS's own DDP mode, and if
so, is the BO problem the same? (benchmarks/studies/bo_gap.md)

    python benchmarks/workloads/plain_launch.py --world 2 --script ../studies/bo_probe.py \
        --system ours|builtin --root R --timings T --trials 14 --optimizer bayesian_optimization
    BO_PROBE_WORKLOAD=lightning_search python benchmarks/studies/bo_probe.py \
        --system ours|builtin --root R --timings T --trials 14 --optimizer bayesian_optimization

Every rank seeds ``random``, ``numpy`` and ``torch`` with ``BO_PROBE_SEED`` (default 0) at
start and again right before ``neps.run`` (NePS captures the global RNG state when it
creates its state and restores it before every sample), so with a deterministic objective
two runs that sample the same configs solve the same BO problem. On rank 0, every
``NePSState._sample_trial`` call appends one line to ``<timings>/sample.jsonl``: wall and
CPU time (this thread, this process), CPU of every other thread of the process and of the
sibling ranks (the launcher's other children) over the call, torch's thread counts, the
OMP/MKL environment and the sampled config. Lease recovery between trials is timed too.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workloads"))  # the searches it times
WORKLOAD = os.environ.get("BO_PROBE_WORKLOAD", "plain_search")
"""plain_search (started by plain_launch.py) or lightning_search (run directly)."""
if WORKLOAD == "lightning_search":
    import lightning_search as workload
else:
    import plain_search as workload
from plain_search import seed_everything  # noqa: E402 - needs the sys.path entry above

SEED = os.environ.get("BO_PROBE_SEED", "0")
"""The seed; "none": no seeding (as the benchmark's bo section runs)."""
RANK = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
TICK = os.sysconf("SC_CLK_TCK")


def seed() -> None:
    if SEED != "none":
        seed_everything(int(SEED))


def cpu_of(stat_path: str) -> float:
    """utime + stime in seconds of a /proc/<pid>[/task/<tid>]/stat file (0 if gone)."""
    try:
        text = Path(stat_path).read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def now() -> float:
    return time.clock_gettime(time.CLOCK_REALTIME)


def siblings() -> list[int]:
    """The follower ranks: the launcher's other children (plain_launch.py), or this
    process's own children (Lightning's launcher starts rank 1 from rank 0)."""
    me = os.getpid()
    parent = os.getppid() if WORKLOAD == "plain_search" else me
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            status = (entry / "stat").read_text()
        except OSError:
            continue
        if int(status[status.rindex(")") + 2 :].split()[1]) == parent:
            found.append(int(entry.name))
    return found


def other_threads() -> dict[str, float]:
    me = threading.get_native_id()
    out = {}
    for task in Path("/proc/self/task").iterdir():
        if int(task.name) == me:
            continue
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        out[f"{task.name}:{name}"] = cpu_of(str(task / "stat"))
    return out


def log(name: str, record: dict[str, object]) -> None:
    with (Path(workload.ARGS.timings) / name).open("a") as out:
        out.write(json.dumps(record) + "\n")


PHASES: dict[str, list[float]] = {}
"""Per sample: [calls, wall s, thread CPU s, scipy nfev] of the GP fit and the acquisition."""


def phase(name: str, fn):  # type: ignore[no-untyped-def]
    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        w, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            total = PHASES.setdefault(name, [0, 0.0, 0.0, 0])
            total[0] += 1
            total[1] += time.perf_counter() - w
            total[2] += time.thread_time() - c

    return timed


def count_nfev(fn):  # type: ignore[no-untyped-def]
    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = fn(*args, **kwargs)
        total = PHASES.setdefault("scipy", [0, 0.0, 0.0, 0])
        total[0] += 1
        total[3] += int(getattr(result, "nfev", 0) or 0)
        return result

    return counted


def install_hooks() -> None:
    import botorch.generation.gen as gen
    import neps.optimizers.models.gp as gp
    from neps.state.neps_state import NePSState

    gp.optimize_acqf = phase("optimize_acqf", gp.optimize_acqf)
    gp.fit_gpytorch_mll = phase("fit_gpytorch_mll", gp.fit_gpytorch_mll)
    gen.minimize_with_timeout = count_nfev(gen.minimize_with_timeout)

    original = NePSState._sample_trial

    def timed(self, optimizer, *, worker_id, trials, n):  # type: ignore[no-untyped-def]
        PHASES.clear()
        peers = siblings()
        peers_before = {pid: cpu_of(f"/proc/{pid}/stat") for pid in peers}
        threads_before = other_threads()
        t_real, t_wall = now(), time.perf_counter()
        t_thread, t_proc = time.thread_time(), time.process_time()
        result = original(self, optimizer, worker_id=worker_id, trials=trials, n=n)
        wall = time.perf_counter() - t_wall
        thread_cpu = time.thread_time() - t_thread
        proc_cpu = time.process_time() - t_proc
        threads_after = other_threads()
        sampled = result if isinstance(result, list) else [result]
        log(
            "sample.jsonl",
            {
                "n_trials_before": len(trials),
                "t_start": t_real,
                "wall_s": wall,
                "thread_cpu_s": thread_cpu,
                "process_cpu_s": proc_cpu,
                "other_threads_cpu_s": {
                    k: round(v - threads_before.get(k, 0.0), 3)
                    for k, v in threads_after.items()
                    if v - threads_before.get(k, 0.0) > 0
                },
                "n_threads": len(threads_after) + 1,
                "phases": {k: [round(x, 4) for x in v] for k, v in PHASES.items()},
                "py_threads": {str(t.native_id): t.name for t in threading.enumerate()},
                "peers_cpu_s": {
                    str(pid): round(cpu_of(f"/proc/{pid}/stat") - before, 3)
                    for pid, before in peers_before.items()
                },
                "torch_threads": torch.get_num_threads(),
                "torch_interop_threads": torch.get_num_interop_threads(),
                "env": {
                    k: v
                    for k, v in os.environ.items()
                    if k.startswith(("OMP_", "MKL_", "OPENBLAS_", "GOMP_", "KMP_"))
                },
                "gc_enabled": gc.isenabled(),
                "gc_counts": gc.get_count(),
                "gc_frozen": gc.get_freeze_count(),
                "switch_interval": sys.getswitchinterval(),
                "configs": [t.config for t in sampled],
                "ids": [t.id for t in sampled],
            },
        )
        return result

    NePSState._sample_trial = timed

    original_report = NePSState._report_trial_evaluation

    def timed_report(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = now()
        try:
            return original_report(self, *args, **kwargs)
        finally:
            log("report.jsonl", {"t_start": t0, "t_end": now()})

    NePSState._report_trial_evaluation = timed_report

    try:
        from neps_bcast.recovery.lease import Leases
    except ImportError:
        return
    original_recover = Leases.recover_orphans

    def timed_recover(self):  # type: ignore[no-untyped-def]
        t0, c0 = now(), time.thread_time()
        try:
            return original_recover(self)
        finally:
            log(
                "recover.jsonl",
                {"t_start": t0, "t_end": now(), "cpu_s": time.thread_time() - c0},
            )

    Leases.recover_orphans = timed_recover


def main() -> None:
    import neps

    seed()
    original_run = neps.run

    def seeded_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        seed()
        return original_run(*args, **kwargs)

    neps.run = seeded_run
    if RANK == 0:
        # The workload sets its ARGS in its main(); the hooks read it lazily.
        install_hooks()
    workload.main()


if __name__ == "__main__":
    main()
