"""What the liveness unit tests share: a collector of a judge's verdicts, a bounded wait
for something another thread or process advances, and a leader's store served by a
process of its own (a test may freeze it)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


SERVE = """
import datetime, sys
import torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=60))
print(s.port, flush=True)
sys.stdin.read()
"""


@contextmanager
def store_process() -> Iterator[subprocess.Popen[str]]:
    """A process serving a store, as a leader does (its port on its first line of
    stdout); killed and reaped at the end."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(WAIT)
