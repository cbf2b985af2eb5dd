"""Device utilization of three packing policies for a pool of D devices (a simulation).

    .venv/bin/python benchmarks/studies/pool_policy_sim.py [--devices 8] [--trials 3000] [--seeds 5]

Why: docs/pool-design.md proposes how `neps-bcast launch --pool D` packs trials of different
sizes. This simulates the proposed model, not NePS: D warm processes, one per device, each a
NePS worker that always holds one sampled trial (its own, running or queued); a trial of
size k starts on its own process plus k - 1 free ones. A finished trial's leader samples its
next trial at once. Trial mix: hyperband-like with `ranks_per_trial = 1 if epochs <= 3 else
4` (epochs 1, 3, 9 in proportion 9:3:1 per bracket, with the two higher brackets mixed in).
Duration = epochs / (ranks * 0.8 efficiency for ranks > 1) * lognormal noise, plus a start
cost. Policies, each time a trial ends:
- fifo: start queued trials in sampling order while the oldest fits; the oldest that does
  not fit blocks every later one (head-of-line blocking).
- greedy: start any queued trial that fits, oldest first; nothing is reserved.
- easy: like fifo, but while the oldest does not fit, a later trial may start if it fits
  now and its expected end (mean duration of its size so far) is before the oldest's
  expected start (EASY backfilling); once the oldest has waited longer than `--drain` times
  the mean duration of its size, nothing more starts before it (drain).
- aging: greedy until the oldest has waited `--drain` times the mean duration of its size,
  then drain as easy does.
Prints utilization (busy device-time / D x makespan), throughput, and the wait of the
big trials (p50 / max), per policy, the median over seeds.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass, field


@dataclass(order=True)
class Trial:
    sampled_at: float
    size: int = field(compare=False)
    duration: float = field(compare=False)
    owner: int = field(compare=False)
    started: float = field(default=0.0, compare=False)


EPOCHS_MIX = [1] * 9 + [3] * 3 + [9] * 1 + [3] * 5 + [9] * 2 + [9] * 3  # brackets 0, 1, 2


def sample(rng: random.Random, now: float, owner: int, start_cost: float) -> Trial:
    epochs = rng.choice(EPOCHS_MIX)
    size = 1 if epochs <= 3 else 4
    speed = size * (0.8 if size > 1 else 1.0)
    duration = epochs / speed * rng.lognormvariate(0.0, 0.3) + start_cost
    return Trial(now, size, duration, owner)


def simulate(
    policy: str,
    devices: int,
    trials: int,
    seed: int,
    start_cost: float,
    drain: float,
    central: bool = False,
) -> dict[str, float]:
    rng = random.Random(seed)
    held = {p: sample(rng, 0.0, p, start_cost) for p in range(devices)}  # each process's own trial
    free = set(range(devices))
    running: list[tuple[float, int, Trial, list[int]]] = []  # (end, tiebreak, trial, procs)
    durations: dict[int, list[float]] = {1: [1.0], 4: [1.0]}
    busy = 0.0
    now = 0.0
    done = 0
    waits_big: list[float] = []
    tiebreak = 0

    def start(trial: Trial) -> None:
        nonlocal busy, tiebreak
        if trial.owner in free:  # its own process leads
            procs = [trial.owner, *sorted(free - {trial.owner})[: trial.size - 1]]
        else:  # central: any free processes
            procs = sorted(free)[: trial.size]
        free.difference_update(procs)
        trial.started = now
        heapq.heappush(running, (now + trial.duration, tiebreak, trial, procs))
        tiebreak += 1
        busy += trial.duration * trial.size
        if trial.size > 1:
            waits_big.append(now - trial.sampled_at)

    def fits(trial: Trial) -> bool:
        return (central or trial.owner in free) and len(free) >= trial.size

    def shadow(head: Trial) -> float:  # when the head could start, from expected ends
        available = set(free)
        mean = statistics.fmean
        for _, _, trial, procs in sorted(
            running, key=lambda r: r[2].started + mean(durations[r[2].size])
        ):
            available.update(procs)
            if len(available) >= head.size and (central or head.owner in available):
                return trial.started + mean(durations[trial.size])
        return now

    def schedule() -> None:
        while True:
            queued = sorted(t for p, t in held.items() if not any(t is r[2] for r in running))
            if not queued:
                return
            head = queued[0]
            if fits(head):
                start(head)
                continue
            if policy == "fifo":
                return
            candidates = [t for t in queued[1:] if fits(t)]
            mean = statistics.fmean
            waited = now - head.sampled_at
            if policy in ("easy", "aging") and waited > drain * mean(durations[head.size]):
                return  # drain: the head waited long enough, nothing more jumps it
            if policy == "easy":
                limit = shadow(head)
                candidates = [t for t in candidates if now + mean(durations[t.size]) <= limit]
            if not candidates:
                return
            start(candidates[0])

    schedule()
    while done < trials:
        end, _, trial, procs = heapq.heappop(running)
        now = end
        done += 1
        durations[trial.size].append(trial.duration)
        free.update(procs)
        held[trial.owner] = sample(rng, now, trial.owner, start_cost)
        schedule()
    return {
        "utilization": busy / (devices * now) if now else 0.0,
        "trials_per_unit": done / now,
        "big_wait_p50": statistics.median(waits_big) if waits_big else 0.0,
        "big_wait_max": max(waits_big, default=0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--trials", type=int, default=3000)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--start-cost", type=float, default=0.0, help="in epochs of one rank")
    parser.add_argument("--drain", type=float, default=2.0)
    parser.add_argument(
        "--central",
        action="store_true",
        help="a trial may start on any free processes, not only with its own one leading",
    )
    args = parser.parse_args()
    print(
        f"D={args.devices}, {'central' if args.central else 'own leader'}, {args.trials} trials, "
        f"start cost {args.start_cost} epoch, drain {args.drain}, "
        f"median of {args.seeds} seeds; times in epochs of one rank"
    )
    print("| policy | utilization | trials per epoch | size-4 wait p50 | size-4 wait max |")
    print("|---|---|---|---|---|")
    for policy in ("fifo", "greedy", "easy", "aging"):
        runs = [
            simulate(
                policy, args.devices, args.trials, seed, args.start_cost, args.drain, args.central
            )
            for seed in range(args.seeds)
        ]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {policy} | {med['utilization']:.1%} | {med['trials_per_unit']:.2f} "
            f"| {med['big_wait_p50']:.2f} | {med['big_wait_max']:.2f} |"
        )


if __name__ == "__main__":
    main()
