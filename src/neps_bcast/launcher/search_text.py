"""``neps-bcast status ROOT`` as text: one line per trial, the counts by state, the best
trial, the budget and a pool's devices (what ``search_status.read_status`` read)."""

from __future__ import annotations

import time

from neps_bcast.launcher.search_status import SearchStatus, TrialStatus


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _objective(value: float | list[float] | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:.6g}" for v in value) + "]"
    return f"{value:.6g}"


def _where(t: TrialStatus) -> str:
    if t.host is None:
        return "-"
    ranks = f", {t.ranks} rank{'s' if t.ranks != 1 else ''}" if t.ranks is not None else ""
    devices = f", devices {','.join(map(str, t.devices))}" if t.devices is not None else ""
    if t.rank_pids:
        devices += f" (rank pids {','.join(map(str, t.rank_pids))})"
    return f"{t.host} pid {t.pid}{ranks}{devices}"


def _heartbeat(t: TrialStatus) -> str:
    if t.state != "evaluating":
        return "-"
    if t.stale is not None:
        return f"STALE: {t.stale}"
    if t.silent is not None:
        return f"SUSPECT: {t.silent}"
    if t.heartbeat_age_s is None:
        return "no lease yet"
    off = t.clock_offset_s
    skew = (
        f" (its clock {off:+.0f} s off the filesystem's)"
        if off is not None and abs(off) > 5
        else ""
    )
    return f"{_age(t.heartbeat_age_s)} ago{skew}"


def render(status: SearchStatus) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(status.taken_at))
    head = ("trial", "state", "attempt", "where", "heartbeat", "elapsed", "objective")
    rows = [
        (
            t.trial_id,
            t.state,
            str(t.attempt),
            _where(t),
            _heartbeat(t),
            _age(t.elapsed_s),
            _objective(t.objective),
        )
        for t in status.trials
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]])

    out = [f"{status.root}  ({when})", line(head), *map(line, rows)]
    if not rows:
        out.append("(no trials yet)")
    out.append(
        "trials: "
        + (", ".join(f"{n} {s}" for s, n in status.counts.items()) or "none")
        + f" ({len(status.trials)} in all)"
    )
    if status.best is not None:
        config = (
            " " + ", ".join(f"{k}={v}" for k, v in status.best_config.items())
            if status.best_config
            else ""
        )
        out.append(
            f"best: trial {status.best.trial_id}, objective {_objective(status.best.objective)};{config}"
        )
    else:
        out.append("best: none yet (no successful trial)")
    b = status.budget
    limit = f" of {b.evaluations_limit:g}" if b.evaluations_limit is not None else ""
    cost = f"; cost {b.cost:g}" + (f" of {b.cost_limit:g}" if b.cost_limit is not None else "")
    out.append(f"budget: {b.evaluations}{limit} evaluations used{cost if b.cost else ''}")
    for d in status.devices:
        gpu = f" (GPU {d.gpu})" if d.gpu is not None else ""
        trial = f"trial {d.trial_id}" if d.trial_id is not None else "free"
        out.append(f"pool {d.host} device {d.device}{gpu}: {trial}")
    return "\n".join(out)
