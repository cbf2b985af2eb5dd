"""The pool against fixed layouts at real trial lengths (epochs of minutes): a projection
from the placement model, with the per-trial costs measured at bench scale.

    .venv/bin/python benchmarks/studies/pool_projection.py                  # curves A, B, C, D; 1 s and 60 s epochs
    .venv/bin/python benchmarks/studies/pool_projection.py --t-epoch 1 60 600 --gap 0.55

Why: ``make bench-full`` measures with 1 s epochs on a loaded 2-core machine, where a
trial's fixed costs (its group's start, NePS's work between an agent's trials) are a large
share of each trial. This replays the same searches at other lengths, as an event
simulation: the trials NePS's hyperband samples for the curve's budget (one worker, in
sampling order), each trial's device time from the curve (``PoolCurve.trial_seconds``),
plus the measured costs, placed by the pool's own placement (``neps_bcast.pool.placement``,
FIFO, backfilling, drain) on D devices with D agents, or run by G groups of N ranks.

The measured costs (defaults; docs/benchmarks.md and benchmarks/pool_bench.md, load
4.5-26 on 2 cores): a trial's start, placed -> every rank in the function, by size (1: 6
ms, 2: 144 ms, 4: 187 ms, 8: 252 ms; fixed layouts: 30 ms); between two trials of one
agent or group, NePS's recording, sampling and the ask: ``--gap`` 0.55 s (measured
between two 8-rank trials). Not modelled: hyperband's promotions waiting for their rung
(the order is NePS's one-worker order), agents waiting on each other at NePS's lock
(the gap is each one's own: under Bayesian optimization it is longer, ``--gap``).

Prints, per curve and epoch length: each layout's search wall, the pool's wall against its
own device-second bound (the trials' device-seconds / D), utilization (busy device-seconds
with starts / D x wall), and each wall against the best fixed layout's. A projection, not a
measurement: nothing here is asserted anywhere.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the pipeline's curves

from configuration import CURVE_A, CURVE_B, CURVE_C, CURVE_D, PoolCurve, fixed_layouts
from neps_bcast.pool.placement import Placement

START_S = {1: 0.006, 2: 0.144, 4: 0.187, 8: 0.252}
"""A pool trial's start by size (placed -> last rank in the function), the bench's
medians at load (pool_bench.md; 8 ranks: curve B)."""
FIXED_START_S = 0.030
"""A fixed layout's start (NePS start -> last rank in the function), the bench's median."""
CURVES = {c.name: c for c in (CURVE_A, CURVE_B, CURVE_C, CURVE_D)}


def hyperband_epochs(curve: PoolCurve) -> list[int]:
    """The epochs of each trial NePS's hyperband (eta 3) samples for the curve's budget,
    one worker, in sampling order (objectives from a fixed function of the config)."""
    import neps

    class Space(neps.PipelineSpace):
        lr = neps.Float(1e-4, 1e-1, log=True)
        epochs = neps.IntegerFidelity(1, curve.max_epochs)

    seen: list[int] = []

    def evaluate(lr: float, epochs: int) -> float:
        seen.append(int(epochs))
        return abs(lr - 0.01) / epochs

    logging.getLogger("neps").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as root:
        neps.run(
            evaluate,
            Space(),
            root_directory=Path(root) / "root",
            optimizer=("hyperband", {"eta": 3}),
            total_evaluations_to_spend=curve.evaluations,
        )
    return seen


@dataclass(frozen=True)
class Outcome:
    wall: float
    device_seconds: float
    """The trials' device time by the curve, starts left out (the bound's numerator)."""
    busy: float
    """Device-seconds held, starts included."""


def pool(epochs: list[int], curve: PoolCurve, devices: int, t_epoch: float, gap: float) -> Outcome:
    """D agents, each asking for its next trial ``gap`` after its last one ended; the
    pool's placement decides what starts, whenever a trial ends or is asked for."""
    placement = Placement(devices)
    trials = iter(enumerate(epochs))
    events: list[tuple[float, int, str, int]] = []  # (time, order, kind, trial or agent)
    order = itertools.count()
    owner: dict[str, int] = {}
    spec: dict[str, tuple[int, int]] = {}
    for agent in range(devices):
        heapq.heappush(events, (0.0, next(order), "ask", agent))
    device_s = busy = end = 0.0
    while events:
        now, _, kind, who = heapq.heappop(events)
        if kind == "ask":
            nxt = next(trials, None)
            if nxt is None:
                continue
            key = f"t{nxt[0]}"
            ranks = curve.ranks_for(nxt[1])
            owner[key], spec[key] = who, (nxt[1], ranks)
            placement.ask(key, ranks, now)
        else:
            key = f"t{who}"
            placement.release(key, now)
            heapq.heappush(events, (now + gap, next(order), "ask", owner[key]))
            end = max(end, now)
        for start in placement.place(now):
            e, ranks = spec[start.key]
            work = curve.trial_seconds(e, ranks, t_epoch)
            held = START_S.get(ranks, max(START_S.values())) + work
            device_s += work * ranks
            busy += held * ranks
            heapq.heappush(events, (now + held, next(order), "end", int(start.key[1:])))
    return Outcome(end, device_s, busy)


def fixed(
    epochs: list[int], curve: PoolCurve, groups: int, ranks: int, t_epoch: float, gap: float
) -> Outcome:
    """G groups of N ranks, each taking the next trial ``gap`` after its last one ended."""
    ready = [(0.0, g) for g in range(groups)]
    heapq.heapify(ready)
    device_s = busy = end = 0.0
    for e in epochs:
        now, g = heapq.heappop(ready)
        work = curve.trial_seconds(e, ranks, t_epoch)
        held = FIXED_START_S + work
        device_s += work * ranks
        busy += held * ranks
        end = max(end, now + held)
        heapq.heappush(ready, (now + held + gap, g))
    return Outcome(end, device_s, busy)


def project(curve: PoolCurve, devices: int, t_epoch: float, gap: float, epochs: list[int]) -> str:
    rows = {"pool": pool(epochs, curve, devices, t_epoch, gap)}
    for groups, ranks in fixed_layouts(devices):
        if curve.feasible(ranks):  # curve D: narrower groups cannot hold the top rung
            rows[f"{groups} x {ranks}"] = fixed(epochs, curve, groups, ranks, t_epoch, gap)
    best = min(o.wall for k, o in rows.items() if k != "pool")
    lines = [
        f"curve {curve.name}, {len(epochs)} trials, t_epoch {t_epoch:g} s, gap {gap:g} s:",
        "| layout | search wall (s) | / best fixed | / own bound | utilization |",
        "|---|---|---|---|---|",
    ]
    for key, o in rows.items():
        bound = o.device_seconds / devices
        lines.append(
            f"| {key} | {o.wall:.1f} | {o.wall / best:.2f}x | {o.wall / bound:.2f}x"
            f" | {o.busy / (devices * o.wall):.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curves", nargs="+", default=sorted(CURVES), choices=sorted(CURVES))
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--t-epoch", nargs="+", type=float, default=[1.0, 60.0])
    parser.add_argument("--gap", type=float, default=0.55)
    args = parser.parse_args()
    for name in args.curves:
        curve = CURVES[name]
        epochs = hyperband_epochs(curve)
        for t_epoch in args.t_epoch:
            print(project(curve, args.devices, t_epoch, args.gap, epochs), end="\n\n")


if __name__ == "__main__":
    main()
