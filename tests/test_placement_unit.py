"""The pool's placement scheduler without processes: FIFO order, backfilling, the drain,
device choice, unavailable devices, and invariants over seeded random workloads."""

from __future__ import annotations

import random

import pytest

from neps_bcast.pool.placement import Placement, Start


def started(pool: Placement, now: float) -> dict[str, tuple[int, ...]]:
    return {s.key: s.devices for s in pool.place(now)}


def fill_with_singles(pool: Placement, keys: str, now: float = 0.0) -> None:
    for key in keys:
        pool.ask(key, 1, now)
    assert [s.key for s in pool.place(now)] == list(keys)


# --- order and placement ---


def test_requests_start_oldest_first_in_start_order() -> None:
    pool = Placement(4)
    pool.ask("a", 2, 0.0)
    pool.ask("b", 1, 1.0)
    pool.ask("c", 1, 2.0)
    pool.ask("d", 1, 3.0)
    assert pool.place(3.0) == [Start("a", (0, 1)), Start("b", (2,)), Start("c", (3,))]
    assert pool.waiting == [("d", 1)]
    pool.ask("e", 1, 4.0)
    pool.release("b", 5.0)
    assert pool.place(5.0) == [Start("d", (2,))]
    assert pool.waiting == [("e", 1)]
    assert list(pool.running) == ["a", "c", "d"]


def test_a_contiguous_run_is_preferred() -> None:
    pool = Placement(4)
    fill_with_singles(pool, "abcd")
    for key in "acd":
        pool.release(key, 1.0)
    assert pool.free == (0, 2, 3)
    pool.ask("e", 2, 1.0)
    assert pool.place(1.0) == [Start("e", (2, 3))]


def test_the_lowest_contiguous_run_is_taken() -> None:
    pool = Placement(6)
    fill_with_singles(pool, "abcdef")
    for key in "abde":
        pool.release(key, 1.0)
    assert pool.free == (0, 1, 3, 4)
    pool.ask("g", 2, 1.0)
    assert started(pool, 1.0) == {"g": (0, 1)}


def test_without_a_run_the_lowest_free_devices_are_taken() -> None:
    pool = Placement(6)
    fill_with_singles(pool, "abcdef")
    for key in "ace":
        pool.release(key, 1.0)
    assert pool.free == (0, 2, 4)
    pool.ask("g", 2, 1.0)
    assert started(pool, 1.0) == {"g": (0, 2)}
    pool.release("d", 2.0)
    assert pool.free == (3, 4)
    pool.ask("h", 3, 2.0)
    pool.release("b", 3.0)
    assert started(pool, 3.0) == {"h": (1, 3, 4)}


# --- backfilling and the drain ---


def test_backfill_starts_a_small_trial_while_a_big_head_waits() -> None:
    pool = Placement(4)
    pool.ask("x", 1, 0.0)
    assert started(pool, 0.0) == {"x": (0,)}
    pool.ask("big", 4, 1.0)
    pool.ask("s", 1, 2.0)
    assert started(pool, 2.0) == {"s": (1,)}
    assert pool.waiting == [("big", 4)]


def test_the_drain_stops_backfill_once_the_head_waited_past_twice_its_size_mean() -> None:
    pool = Placement(4)
    pool.ask("big0", 4, 0.0)
    assert started(pool, 0.0) == {"big0": (0, 1, 2, 3)}
    pool.release("big0", 10.0)  # size 4: mean 10, drain after 20
    pool.ask("s1", 1, 10.0)
    assert started(pool, 10.0) == {"s1": (0,)}
    pool.ask("big", 4, 11.0)
    pool.ask("s2", 1, 12.0)
    assert started(pool, 12.0) == {"s2": (1,)}
    pool.release("s1", 15.0)  # size 1: mean 5; over all sizes 7.5 (drain after 15)
    pool.ask("s3", 1, 30.0)
    # big waited 19: past 2x the mean over all sizes, not past 2x its own size's mean.
    assert not pool.draining(30.0)
    assert started(pool, 30.0) == {"s3": (0,)}
    pool.ask("s4", 1, 31.5)
    assert not pool.draining(31.0)  # waited exactly 20: not more than 2x
    assert pool.draining(31.5)
    assert pool.place(31.5) == []
    assert pool.free == (2, 3)
    assert pool.waiting == [("big", 4), ("s4", 1)]
    pool.release("s2", 32.0)
    assert pool.place(32.0) == []  # three free: the head still does not fit, s4 still held
    pool.release("s3", 33.0)
    assert pool.place(33.0) == [Start("big", (0, 1, 2, 3))]
    assert pool.waiting == [("s4", 1)]
    assert not pool.draining(33.0)


def test_backfill_resumes_after_the_drained_head_starts() -> None:
    pool = Placement(2)
    pool.ask("x", 1, 0.0)
    pool.place(0.0)
    pool.release("x", 1.0)  # mean 1
    pool.ask("y", 1, 1.0)
    pool.place(1.0)  # y on device 0
    pool.ask("big", 2, 1.0)
    pool.ask("z", 1, 4.0)
    assert pool.draining(4.0)
    assert pool.place(4.0) == []
    pool.release("y", 4.0)
    assert started(pool, 4.0) == {"big": (0, 1)}
    pool.ask("big2", 2, 5.0)
    pool.release("big", 5.0)  # size 2: mean 4
    pool.ask("w", 1, 5.0)
    assert pool.waiting == [("z", 1), ("big2", 2), ("w", 1)]
    # z (waited 1 of its limit 2 x 2.5) starts; big2 does not fit on one device; w backfills.
    assert started(pool, 5.0) == {"z": (0,), "w": (1,)}


def test_no_drain_before_any_duration_is_known() -> None:
    pool = Placement(2)
    pool.ask("x", 1, 0.0)
    pool.place(0.0)
    pool.ask("big", 2, 0.0)
    pool.ask("y", 1, 1e9)
    assert not pool.draining(1e9)
    assert started(pool, 1e9) == {"y": (1,)}


def test_the_mean_over_all_sizes_is_used_while_the_heads_size_has_none() -> None:
    pool = Placement(4)
    pool.ask("a", 1, 0.0)
    pool.place(0.0)
    pool.release("a", 3.0)  # size 1: mean 3; size 4: none yet
    pool.ask("b", 1, 3.0)
    pool.place(3.0)
    pool.ask("big", 4, 3.0)
    pool.ask("c", 1, 5.0)
    assert started(pool, 5.0) == {"c": (1,)}
    assert not pool.draining(9.0)  # waited 6: not more than 2 x 3
    assert pool.draining(9.5)
    pool.ask("d", 1, 9.5)
    assert pool.place(9.5) == []


def test_the_drain_factor_is_used() -> None:
    pool = Placement(2, drain_factor=0.5)
    pool.ask("a", 1, 0.0)
    pool.place(0.0)
    pool.release("a", 4.0)  # mean 4: drain after 2 with factor 0.5
    pool.ask("b", 1, 4.0)
    pool.place(4.0)
    pool.ask("big", 2, 4.0)
    pool.ask("c", 1, 6.5)
    assert pool.draining(6.5)
    assert pool.place(6.5) == []


# --- unavailable devices ---


def test_unavailable_devices_are_never_given_out() -> None:
    pool = Placement(4)
    pool.set_available(1, False)
    assert pool.free == (0, 2, 3)
    pool.ask("a", 2, 0.0)
    pool.ask("b", 1, 0.0)
    pool.ask("c", 1, 0.0)
    assert started(pool, 0.0) == {"a": (2, 3), "b": (0,)}
    assert pool.free == ()
    pool.set_available(1, True)
    assert started(pool, 1.0) == {"c": (1,)}


def test_a_busy_device_made_unavailable_stays_with_its_trial_then_is_held_back() -> None:
    pool = Placement(2)
    pool.ask("a", 2, 0.0)
    pool.place(0.0)
    pool.set_available(0, False)
    assert pool.running == {"a": (0, 1)}
    pool.release("a", 1.0)
    assert pool.free == (1,)
    pool.ask("b", 2, 1.0)
    pool.ask("c", 1, 1.0)
    assert started(pool, 1.0) == {"c": (1,)}  # backfill: b needs both
    pool.release("c", 2.0)
    assert pool.place(2.0) == []
    pool.set_available(0, True)
    assert started(pool, 2.0) == {"b": (0, 1)}


def test_set_available_refuses_a_device_outside_the_pool() -> None:
    pool = Placement(2)
    with pytest.raises(ValueError, match=r"device 2 is outside 0\.\.1"):
        pool.set_available(2, False)


# --- cancel ---


def test_cancel_of_a_waiting_request_withdraws_it() -> None:
    pool = Placement(1)
    pool.ask("a", 1, 0.0)
    pool.place(0.0)
    pool.ask("b", 1, 0.0)
    pool.ask("c", 1, 0.0)
    pool.cancel("b")
    assert pool.waiting == [("c", 1)]
    pool.release("a", 1.0)
    assert started(pool, 1.0) == {"c": (0,)}
    pool.ask("b", 1, 2.0)  # the key may be asked again
    assert pool.waiting == [("b", 1)]


def test_cancel_of_a_running_trial_frees_its_devices_and_records_no_duration() -> None:
    pool = Placement(2)
    pool.ask("a", 2, 0.0)
    pool.place(0.0)
    pool.cancel("a")
    assert pool.running == {}
    assert pool.free == (0, 1)
    pool.ask("b", 1, 1.0)
    pool.place(1.0)
    pool.ask("big", 2, 1.0)
    assert not pool.draining(1e9)  # no duration known: a's would have made one
    pool.cancel("nobody")  # unknown: nothing happens
    assert pool.running == {"b": (0,)}
    assert pool.waiting == [("big", 2)]


# --- refusals ---


@pytest.mark.parametrize(
    ("size", "text"),
    [
        (0, r"size 0 is outside 1\.\.4"),
        (5, r"size 5 is outside 1\.\.4"),
        (-1, r"size -1 is outside 1\.\.4"),
        (1.5, r"size 1\.5 is not an integer.*1\.\.4"),
        (True, r"size True is not an integer.*1\.\.4"),
        ("2", r"size '2' is not an integer.*1\.\.4"),
    ],
)
def test_invalid_sizes_are_refused(size: object, text: str) -> None:
    pool = Placement(4)
    with pytest.raises(ValueError, match=text):
        pool.ask("t", size, 0.0)  # type: ignore[arg-type]
    assert pool.waiting == []


def test_a_key_already_waiting_or_running_is_refused() -> None:
    pool = Placement(2)
    pool.ask("a", 1, 0.0)
    with pytest.raises(ValueError, match=r"'a' was already asked for and is still waiting"):
        pool.ask("a", 1, 0.0)
    pool.place(0.0)
    with pytest.raises(ValueError, match=r"'a' was already asked for and is still running"):
        pool.ask("a", 2, 0.0)
    pool.release("a", 1.0)
    pool.ask("a", 2, 1.0)
    assert pool.waiting == [("a", 2)]


@pytest.mark.parametrize("devices", [0, -1, True, 2.0])
def test_a_pool_needs_at_least_one_device(devices: object) -> None:
    with pytest.raises(ValueError, match="devices"):
        Placement(devices)  # type: ignore[arg-type]


@pytest.mark.parametrize("factor", [-1.0, float("nan")])
def test_a_negative_or_nan_drain_factor_is_refused(factor: float) -> None:
    with pytest.raises(ValueError, match="drain_factor"):
        Placement(2, drain_factor=factor)


def test_release_refuses_a_trial_that_is_not_running_or_ends_before_it_started() -> None:
    pool = Placement(1)
    with pytest.raises(ValueError, match="'x': it is not running"):
        pool.release("x", 0.0)
    pool.ask("a", 1, 0.0)
    with pytest.raises(ValueError, match="'a': it is waiting, not running"):
        pool.release("a", 0.0)
    pool.place(5.0)
    with pytest.raises(ValueError, match="before its start"):
        pool.release("a", 4.0)
    assert pool.running == {"a": (0,)}


# --- invariants over seeded workloads ---


def reference_pick(free: list[int], size: int) -> tuple[int, ...]:
    """The placement rule, written out: the lowest run of ``size`` consecutive free
    devices, else the ``size`` lowest free ones."""
    for low in free:
        run = tuple(range(low, low + size))
        if set(run) <= set(free):
            return run
    return tuple(free[:size])


def check_place(pool: Placement, now: float, down: set[int]) -> list[Start]:
    """``place``, checked against the policy and the device invariants."""
    free_before = set(pool.free)
    assert not free_before & down
    waiting_before = pool.waiting
    draining = pool.draining(now)
    starts = pool.place(now)
    sizes = dict(waiting_before)
    given: set[int] = set()
    for start in starts:
        assert start.key in sizes
        assert len(start.devices) == sizes[start.key]
        assert list(start.devices) == sorted(set(start.devices))
        # only devices free (available, not busy) when it started, enough of them
        assert set(start.devices) <= free_before - given
        assert not set(start.devices) & down
        assert start.devices == reference_pick(sorted(free_before - given), len(start.devices))
        given.update(start.devices)
    order = [k for k, _ in waiting_before]
    assert [s.key for s in starts] == sorted((s.key for s in starts), key=order.index)
    if draining and (not starts or starts[0].key != order[0]):
        assert starts == []  # nothing jumps a draining head that does not fit
    # what is left: the head does not fit, and while not draining nothing else does
    free_after = len(pool.free)
    waiting_after = pool.waiting
    if waiting_after:
        assert waiting_after[0][1] > free_after
        if not pool.draining(now):
            assert all(size > free_after for _, size in waiting_after)
    check_state(pool)
    return starts


def check_state(pool: Placement) -> None:
    seen = [d for devices in pool.running.values() for d in devices]
    assert len(seen) == len(set(seen)), "a device is in two running trials"
    assert not set(seen) & set(pool.free)
    assert list(pool.free) == sorted(pool.free)
    assert not set(pool.running) & {k for k, _ in pool.waiting}


WORKLOADS = [
    # (devices, seed, requests, sizes drawn from)
    (1, 0, 40, (1,)),
    (2, 1, 60, (1, 2)),
    (4, 2, 80, (1, 1, 1, 4)),
    (4, 3, 80, (1, 2, 3, 4)),
    (8, 4, 120, (1, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4, 4)),
    (8, 5, 120, (1, 2, 3, 4, 5, 6, 7, 8)),
    (3, 6, 60, (1, 2, 3)),
]


@pytest.mark.parametrize(("devices", "seed", "requests", "sizes"), WORKLOADS)
def test_invariants_over_a_seeded_workload(
    devices: int, seed: int, requests: int, sizes: tuple[int, ...]
) -> None:
    rng = random.Random(seed)
    pool = Placement(devices)
    now = 0.0
    ends: dict[str, float] = {}  # running key -> when it ends
    asked: dict[str, int] = {}
    withdrawn: set[str] = set()
    starts_of: dict[str, int] = {}
    down: set[int] = set()  # devices made unavailable
    next_key = 0
    steps = 0
    while next_key < requests or ends or pool.waiting:
        steps += 1
        assert steps < 20 * requests, f"stuck: waiting {pool.waiting}, free {pool.free}"
        now += rng.uniform(0.0, 1.0)
        action = rng.random()
        if next_key < requests and action < 0.45:
            key = f"t{next_key}"
            next_key += 1
            asked[key] = rng.choice(sizes)
            pool.ask(key, asked[key], now)
        elif next_key < requests and action < 0.5:
            device = rng.randrange(devices)
            if device in down:
                if rng.random() < 0.7:
                    down.discard(device)
                    pool.set_available(device, True)
            else:  # free or busy: a busy one stays with its trial
                down.add(device)
                pool.set_available(device, False)
        elif next_key < requests and action < 0.53:
            victims = [k for k, _ in pool.waiting] + sorted(ends)
            if victims:
                victim = rng.choice(victims)
                pool.cancel(victim)
                withdrawn.add(victim)
                ends.pop(victim, None)
        elif ends:
            key = min(ends, key=lambda k: (ends[k], k))
            now = max(now, ends.pop(key))
            pool.release(key, now)
        if next_key >= requests:  # the tail: every device back, so everything can start
            for device in sorted(down):
                pool.set_available(device, True)
            down.clear()
        check_state(pool)
        for start in check_place(pool, now, down):
            starts_of[start.key] = starts_of.get(start.key, 0) + 1
            ends[start.key] = now + rng.uniform(0.5, 5.0) * len(start.devices) ** 0.5
    assert set(starts_of) | withdrawn == set(asked)  # each started or was withdrawn
    assert all(n == 1 for n in starts_of.values())
    assert sum(starts_of.values()) >= requests // 2  # the workload did run
    assert pool.running == {}
    assert pool.free == tuple(range(devices))


def test_a_trial_that_did_not_succeed_feeds_no_duration_to_the_drain() -> None:
    """A crashed or lost trial's short run is not a duration of its size: counted, the
    mean of size 2 would fall from 10 to 5.5 and the head would drain after 11 s, not 20."""
    pool = Placement(2)
    pool.ask("ok", 2, 0.0)
    assert started(pool, 0.0) == {"ok": (0, 1)}
    pool.release("ok", 10.0)
    pool.ask("lost", 2, 10.0)
    assert started(pool, 10.0) == {"lost": (0, 1)}
    pool.release("lost", 11.0, measured=False)
    assert pool._mean_duration(2) == 10.0
    pool.ask("a", 1, 11.0)
    assert started(pool, 11.0) == {"a": (0,)}
    pool.ask("head", 2, 12.0)
    assert not pool.draining(24.0)  # waited 12: more than 2 x 5.5, not more than 2 x 10
    assert pool.draining(32.5)
