"""``neps-bcast status ROOT --plot FILE``: the search as a picture.

One row per group (its leader's host and pid) or, in a pool, per device; a bar per
attempt from its start to its end, coloured by how it ended, with a marker and the cause
where an attempt was interrupted; below, the best objective so far over wall time. The
title gives the root, the trials by state, the utilization and the idle time between
trials.

Why two steps: ``picture`` turns what ``search_status.read_status(history=True)`` read
into plain data (rows, bars, the best-so-far steps, the figures of the title), which
tests check against the search's own records; ``draw`` only lays that out with
matplotlib (a NePS dependency, imported only here and only when a picture is asked for,
so a plain ``neps-bcast status`` never pays for it). Like the status, it reads files
only: no lock, no NePS, no torch.

What the figures mean:

- a row is available from its first attempt's start to its last attempt's end (a pool's
  devices: those of the whole launch), for as many devices as it stands for (a group:
  its ranks; a pool's device: 1);
- utilization = busy device-time (each attempt's length times its row's devices) over
  available device-time;
- idle time between trials = the time inside a row's span when none of its attempts ran,
  summed over rows (in device-time, as utilization is).
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from neps_bcast.errors import LaunchError, format_message
from neps_bcast.launcher.search_status import TAG, AttemptSpan, SearchStatus

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SUFFIXES = (".png", ".svg")

COLOURS = {
    "success": "#2e9e4f",
    "failed": "#c0392b",
    "crashed": "#c0392b",
    "put back": "#f39c12",
    "running": "#3b7dd8",
}
"""Each ``search_status.OUTCOMES`` value's colour (failed and crashed alike: the trial
ended without a result)."""

WIDTH_IN = 14.0

CAUSES_SHOWN = 24
"""Interrupted attempts whose cause is written beside its marker; past that only the
markers (the text status names every cause)."""

LABELS_SHOWN = 400
"""Bars that may carry their trial id (each label is a text to lay out: 1000 of them
would cost more than the rest of the picture)."""


@dataclass(frozen=True)
class Row:
    """One group (``kind`` ``group``: its leader) or one pool device (``device``)."""

    label: str
    kind: str
    host: str
    devices: int
    """Devices it stands for: a group's ranks (1 where never known), a pool device 1."""
    key: tuple[Any, ...]


@dataclass(frozen=True)
class Bar:
    """One attempt on one row (a pool's attempt on k devices: k bars, one per row)."""

    trial_id: str
    attempt: int
    row: int
    start: float
    """Seconds since ``Picture.t0``."""
    end: float
    outcome: str
    interrupted: bool
    """Put back, crashed past the retry limit, or running with a stale lease: a marker."""
    cause: str | None


@dataclass(frozen=True)
class Step:
    """The best objective so far changed: at ``t`` (seconds since ``Picture.t0``, the
    end of trial ``trial_id``) to ``objective``."""

    t: float
    objective: float
    trial_id: str


@dataclass(frozen=True)
class Picture:
    root: str
    t0: float
    """``time.time()`` of the first attempt's start (the taken-at time if none)."""
    now: float
    """The status's time, in seconds since ``t0`` (where running bars end)."""
    rows: list[Row]
    bars: list[Bar]
    best: list[Step]
    counts: dict[str, int]
    trials: int
    busy_s: float
    available_s: float
    idle_s: float
    multi_objective: bool

    @property
    def utilization(self) -> float | None:
        return self.busy_s / self.available_s if self.available_s > 0 else None

    def title(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.t0))
        states = ", ".join(f"{n} {s}" for s, n in self.counts.items()) or "no trials yet"
        use = self.utilization
        busy = (
            f"utilization {100 * use:.1f}% ({_duration(self.busy_s)} busy of"
            f" {_duration(self.available_s)} device-time)"
            if use is not None
            else "utilization -"
        )
        return (
            f"{self.root}  (from {when})\n"
            f"trials: {states} ({self.trials} in all); {busy};"
            f" idle between trials {_duration(self.idle_s)}"
        )


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def picture(status: SearchStatus) -> Picture:
    """What ``draw`` shows, from a status read with ``history=True``."""
    spans = [(t.trial_id, a) for t in status.trials for a in t.attempts]
    t0 = min((a.start for _, a in spans), default=status.taken_at)
    now = status.taken_at - t0
    launches: dict[tuple[str, str | None], float] = {}
    """A pool launch (host, launch id) -> its first attempt's start."""
    for _, a in spans:
        if a.devices is not None:
            launch = (_host(a), a.launch_id)
            launches[launch] = min(launches.get(launch, a.start), a.start)
    firsts: dict[RowKey, float] = {}
    ranks: dict[RowKey, int] = {}
    for _, a in spans:
        for key in _keys(a, launches):
            firsts[key] = min(firsts.get(key, a.start), a.start)
            if key[0] == "group" and a.ranks is not None:
                ranks[key] = max(ranks.get(key, 0), a.ranks)
    keys = sorted(firsts, key=lambda k: _row_order(k, firsts[k]))
    index = {key: i for i, key in enumerate(keys)}
    rows = [_row(key, ranks.get(key), launches) for key in keys]
    bars: list[Bar] = []
    for trial_id, a in spans:
        end = a.end if a.end is not None else status.taken_at
        interrupted = a.outcome == "put back" or a.cause is not None
        for key in _keys(a, launches):
            bars.append(
                Bar(
                    trial_id=trial_id,
                    attempt=a.number,
                    row=index[key],
                    start=a.start - t0,
                    end=max(end, a.start) - t0,
                    outcome=a.outcome,
                    interrupted=interrupted,
                    cause=a.cause if interrupted else None,
                )
            )
    busy, available, idle = _use(rows, bars)
    return Picture(
        root=status.root,
        t0=t0,
        now=now,
        rows=rows,
        bars=bars,
        best=_best(status, t0),
        counts=dict(status.counts),
        trials=len(status.trials),
        busy_s=busy,
        available_s=available,
        idle_s=idle,
        multi_objective=any(isinstance(t.objective, list) for t in status.trials),
    )


RowKey = tuple[Any, ...]
"""``("group", host, pid)`` or ``("device", host, launch's first start, launch id, device)``."""


def _host(a: AttemptSpan) -> str:
    return a.host or "unknown host"


def _keys(a: AttemptSpan, launches: dict[tuple[str, str | None], float]) -> list[RowKey]:
    """The rows an attempt is drawn on: its group's, or each of its pool devices'."""
    if a.devices is None:
        return [("group", _host(a), a.pid)]
    first = launches[(_host(a), a.launch_id)]
    return [("device", _host(a), first, a.launch_id, d) for d in a.devices]


def _row_order(key: RowKey, first: float) -> tuple[Any, ...]:
    """By host; a host's groups by their first start; a pool's devices by launch, index."""
    if key[0] == "device":
        return (key[1], key[2], 1, key[4])
    return (key[1], first, 0, 0)


def _row(key: RowKey, ranks: int | None, launches: dict[tuple[str, str | None], float]) -> Row:
    host = key[1]
    if key[0] == "device":
        same_host = sorted(start for (h, _), start in launches.items() if h == host)
        launch = f" (launch {same_host.index(key[2]) + 1})" if len(same_host) > 1 else ""
        return Row(f"{host} device {key[4]}{launch}", "device", host, 1, key)
    pid = key[2]
    size = f", {ranks} ranks" if ranks is not None and ranks != 1 else ""
    label = f"{host} pid {pid}{size}" if pid is not None else f"{host}{size}"
    return Row(label, "group", host, ranks or 1, key)


def _use(rows: list[Row], bars: list[Bar]) -> tuple[float, float, float]:
    """Busy, available and idle device-time (the module docstring says how)."""
    by_row: dict[int, list[tuple[float, float]]] = {}
    for b in bars:
        by_row.setdefault(b.row, []).append((b.start, b.end))
    spans: dict[tuple[Any, ...], tuple[float, float]] = {}
    for i, intervals in by_row.items():
        row = rows[i]
        group = row.key[:4] if row.kind == "device" else row.key
        lo = min(s for s, _ in intervals)
        hi = max(e for _, e in intervals)
        old = spans.get(group, (lo, hi))
        spans[group] = (min(old[0], lo), max(old[1], hi))
    busy = available = idle = 0.0
    for i, intervals in by_row.items():
        row = rows[i]
        lo, hi = spans[row.key[:4] if row.kind == "device" else row.key]
        covered = 0.0
        end = -math.inf
        for s, e in sorted(intervals):
            if e <= end:
                continue
            covered += e - max(s, end)
            end = e
        busy += covered * row.devices
        available += (hi - lo) * row.devices
        idle += (hi - lo - covered) * row.devices
    return busy, available, idle


def _best(status: SearchStatus, t0: float) -> list[Step]:
    """Each time the best objective so far fell: successful trials in the order they
    ended (the end of their last attempt), a single objective each."""
    done = []
    for t in status.trials:
        if t.state != "success" or not isinstance(t.objective, float) or not t.attempts:
            continue
        end = t.attempts[-1].end
        if end is not None:
            done.append((end, t.trial_id, t.objective))
    steps: list[Step] = []
    for end, trial_id, objective in sorted(done):
        if not steps or objective < steps[-1].objective:
            steps.append(Step(end - t0, objective, trial_id))
    return steps


# -- drawing ---------------------------------------------------------------------------------
def check_path(path: Path) -> Path:
    """``path`` if a picture can be written there (a known suffix, an existing folder)."""
    if path.suffix.lower() not in SUFFIXES:
        raise LaunchError(
            format_message(
                TAG,
                f"--plot {path}: the picture's format is taken from the file's suffix, and"
                f" {path.suffix or 'none'} is not one of {', '.join(SUFFIXES)}.",
                f"name the file e.g. {path.with_suffix('.png').name} or"
                f" {path.with_suffix('.svg').name}.",
            )
        )
    if not path.parent.is_dir():
        raise LaunchError(
            format_message(
                TAG,
                f"--plot {path}: the folder {path.parent} does not exist.",
                "create it first, or name a file in an existing folder.",
            )
        )
    return path


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise LaunchError(
            format_message(
                TAG,
                f"--plot needs matplotlib, which is not installed here ({exc}).",
                "pip install matplotlib (neps-bcast and NePS depend on it: a full"
                " pip install neps-bcast installs it).",
            )
        ) from exc
    return matplotlib


def _clock(span: float) -> tuple[Callable[[float, object], str], str]:
    """The time axis's ticks for a search ``span`` seconds long, and their unit: seconds
    under two minutes, m:ss under two hours, h:mm past that."""

    def seconds(t: float, _pos: object = None) -> str:
        return f"{t:g}"

    def minutes(t: float, _pos: object = None) -> str:
        return f"{int(t // 60)}:{int(t % 60):02d}"

    def hours(t: float, _pos: object = None) -> str:
        return f"{int(t // 3600)}:{int(t % 3600 // 60):02d}"

    if span < 120:
        return seconds, "s"
    if span < 7200:
        return minutes, "m:ss"
    return hours, "h:mm"


def draw(pic: Picture) -> Figure:
    """The figure: attempts by row on top, the best objective so far below."""
    _matplotlib()
    from matplotlib.collections import PolyCollection
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter

    n_rows = max(len(pic.rows), 1)
    bars_in = max(0.32 * n_rows, 1.2)
    height = min(1.1 + bars_in + 0.5 + 2.0 + 0.7, 80.0)
    fig = Figure(figsize=(WIDTH_IN, height), dpi=100)
    # Fixed margins in inches (a layout engine would lay the figure out twice: 0.6 s
    # of the 2 s a 1000-trial picture may take): row labels left, the legend right.
    fig.subplots_adjust(
        left=2.4 / WIDTH_IN,
        right=1 - 2.5 / WIDTH_IN,
        top=1 - 1.1 / height,
        bottom=0.7 / height,
        hspace=0.5 / ((bars_in + 2.0) / 2),
    )
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[bars_in, 2.0], squeeze=True)
    fig.suptitle(pic.title(), fontsize=10, ha="left", x=0.01, y=1 - 0.15 / height, va="top")

    span = max(max((b.end for b in pic.bars), default=0.0), 1.0)  # a running bar: now
    for outcome, colour in COLOURS.items():
        mine = [b for b in pic.bars if b.outcome == outcome]
        if not mine:
            continue
        # One collection per outcome (one artist of 1000 rectangles draws in
        # milliseconds; 1000 patches took over a second). Its paths follow the order
        # of ``pic.bars``.
        top.add_collection(
            PolyCollection(
                [
                    [(b.start, b.row - 0.35), (b.start, b.row + 0.35),
                     (b.end, b.row + 0.35), (b.end, b.row - 0.35)]
                    for b in mine
                ],
                facecolors=colour,
                edgecolors="white",
                linewidths=0.4,
                gid=f"attempts {outcome}",
            )
        )  # fmt: skip
    _label_bars(fig, top, pic, span)
    cut = [b for b in pic.bars if b.interrupted]
    if cut:
        top.plot(
            [b.end for b in cut],
            [b.row for b in cut],
            linestyle="none",
            marker="X",
            markersize=8,
            color="black",
            gid="interruptions",
        )
        for b in cut[:CAUSES_SHOWN]:
            left = b.end > 0.6 * span  # near the right edge: the text runs leftwards
            top.annotate(
                _short(b.cause or b.outcome, 60),
                (b.end, b.row),
                xytext=(-4 if left else 4, 6),
                textcoords="offset points",
                ha="right" if left else "left",
                fontsize=7,
                color="#333333",
            )
    top.set_yticks(range(len(pic.rows)), [r.label for r in pic.rows], fontsize=8)
    top.set_ylim(len(pic.rows) - 0.5 if pic.rows else 0.5, -0.5)
    top.set_xlim(0, span * 1.02)
    top.grid(axis="x", alpha=0.3)
    shown = Counter(o for o, _, _ in {(b.outcome, b.trial_id, b.attempt) for b in pic.bars})
    handles = [Patch(color=COLOURS[o], label=f"{o} ({shown[o]})") for o in COLOURS if shown[o]]
    if cut:
        handles.append(_marker_handle(f"interrupted ({len(cut)}): cause beside it"))
    if handles:
        top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    top.set_title("attempts: one bar each, on its group (leader host, pid) or pool device",
                  fontsize=9, loc="left")  # fmt: skip

    if pic.best:
        xs = [s.t for s in pic.best] + [span]
        ys = [s.objective for s in pic.best] + [pic.best[-1].objective]
        bottom.step(xs, ys, where="post", color="#2e9e4f", gid="best so far")
        bottom.plot(xs[:-1], ys[:-1], linestyle="none", marker="o", color="#2e9e4f")
        for s in pic.best[-12:]:
            bottom.annotate(
                f"trial {s.trial_id}",
                (s.t, s.objective),
                xytext=(3, 4),
                textcoords="offset points",
                fontsize=7,
            )
    else:
        reason = (
            "a multi-objective search: no single best"
            if pic.multi_objective
            else "no successful trial yet"
        )
        bottom.text(0.5, 0.5, reason, ha="center", va="center", transform=bottom.transAxes)
    bottom.set_ylabel("best objective so far", fontsize=9)
    bottom.grid(alpha=0.3)
    ticks, unit = _clock(span)
    bottom.xaxis.set_major_formatter(FuncFormatter(ticks))
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(pic.t0))
    bottom.set_xlabel(f"wall time since {when} ({unit})", fontsize=9)
    return fig


def _marker_handle(label: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D([], [], linestyle="none", marker="X", color="black", label=label)


def _short(text: str, width: int) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def _label_bars(fig: Figure, ax: Any, pic: Picture, span: float) -> None:
    """The trial id on each bar wide enough to hold it (at most ``LABELS_SHOWN``)."""
    inches = WIDTH_IN - 2.4 - 2.5  # the axes' width, less the row labels and legend
    per_s = inches * fig.dpi / (span * 1.02)
    placed = 0
    for b in pic.bars:
        text = b.trial_id
        if (b.end - b.start) * per_s < 7.0 * len(text) + 6:  # ~7 px per character at 8 pt
            continue
        ax.text(
            (b.start + b.end) / 2,
            b.row,
            text,
            ha="center",
            va="center",
            fontsize=8,
            color="white",
            gid=f"label {b.trial_id} {b.attempt} {b.row}",
        )
        placed += 1
        if placed >= LABELS_SHOWN:
            return


def save(pic: Picture, path: Path) -> None:
    """Draw ``pic`` into ``path`` (PNG or SVG by its suffix), replacing it atomically so
    that a viewer never shows a half-written picture (``--watch`` redraws it)."""
    fig = draw(pic)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        fig.savefig(tmp, format=path.suffix.lower().lstrip("."))
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LaunchError(
            format_message(
                TAG,
                f"--plot {path}: could not write the picture: {type(exc).__name__}: {exc}.",
                "name a file in a folder you can write to.",
            )
        ) from exc
