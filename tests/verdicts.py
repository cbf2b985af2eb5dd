"""What the liveness unit tests share: a collector of a judge's verdicts, and a bounded
wait for something another thread or process advances."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

WAIT = 30.0
"""Each wait for a verdict or a count: far above the peer bound the tests use (1 s)."""

V = TypeVar("V")


class Verdicts(Generic[V]):
    """The verdicts a judge reported (on its own thread), in order."""

    def __init__(self) -> None:
        self.seen: list[V] = []
        self.event = threading.Event()

    def __call__(self, verdict: V) -> None:
        self.seen.append(verdict)
        self.event.set()


def wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not check():
        assert time.monotonic() < deadline, f"never saw {what} within {WAIT} s"
        time.sleep(0.02)  # bounded poll of a counter another thread or process advances
