"""One status line per group, read from the group's leader log, and how they are shown.

Why from the log: the launcher must not talk to NePS or to the ranks (it would need the
root directory, which only the script knows, or a channel of its own). The leader's log
already says what happened: neps_bcast logs ``trial <id> (#n) handed to the group`` and
NePS logs ``evaluated trial: <id> as State.<STATE>`` (both at INFO level, so the counts
need the script to log at INFO, as the examples do); the wrapper that starts each rank
writes one header line per attempt. Reading appended bytes every few seconds is cheap.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from neps_bcast.launcher.plan import TAG

HANDED = re.compile(r"trial (\S+) \(#\d+\) handed to the group")
EVALUATED = re.compile(r"evaluated trial: (\S+) as (?:State\.)?(\w+)")
ATTEMPT = re.compile(r"^===== neps-bcast launch: group \S+ rank \S+ attempt (\d+) ", re.MULTILINE)


@dataclass
class LeaderLog:
    """What a group's rank-0 log has said so far; ``feed`` it the new text."""

    attempt: int = 0
    trial: str | None = None
    trial_since: float | None = None
    finished: int = 0
    failed: int = 0
    _partial: str = field(default="", repr=False)

    def feed(self, text: str, now: float) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()  # an unfinished last line waits for the rest
        for line in lines:
            self._line(line, now)

    def _line(self, line: str, now: float) -> None:
        if found := ATTEMPT.match(line):
            self.attempt = max(self.attempt, int(found.group(1)))
            self.trial, self.trial_since = None, None
        elif found := HANDED.search(line):
            self.trial, self.trial_since = found.group(1), now
        elif found := EVALUATED.search(line):
            if found.group(2).upper() == "SUCCESS":
                self.finished += 1
            else:
                self.failed += 1
            if self.trial == found.group(1):
                self.trial, self.trial_since = None, None


class LogFollower:
    """Reads what was appended to one file since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0

    def read_new(self) -> str:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return ""
        self._offset += len(data)
        return data.decode(errors="replace")


def status_line(
    index: int, state: str, log: LeaderLog, now: float, devices: str | None = None
) -> str:
    where = f" [{devices}]" if devices else ""
    if log.trial is not None and log.trial_since is not None:
        trial = f"trial {log.trial} for {now - log.trial_since:.0f}s"
    else:
        trial = "no trial"
    return (
        f"group {index}{where}: {state:<9} restarts {log.attempt}  {trial:<22}"
        f" finished {log.finished}  failed {log.failed}"
    )


class Display:
    """Status lines: redrawn in place every ``interval_s`` on a terminal; otherwise (a
    file, a pipe) plain lines, written when a group's state or counts change, and at
    least every ``quiet_s``, so a log does not fill with identical lines."""

    def __init__(self, stream: IO[str], interval_s: float, quiet_s: float = 60.0) -> None:
        self.stream = stream
        self.interval_s = interval_s
        self.quiet_s = quiet_s
        self.is_tty = stream.isatty()
        self._drawn = 0
        self._next = 0.0
        self._last_key: object = None
        self._last_plain = 0.0

    def say(self, text: str) -> None:
        self._drawn = 0  # whatever was drawn stays above this message
        self.stream.write(f"[{TAG}] {text}\n")
        self.stream.flush()

    def show(self, lines: Sequence[str], key: object, now: float, *, force: bool = False) -> None:
        """``key``: what the lines say apart from the clock (plain lines on change)."""
        if not force and now < self._next:
            return
        self._next = now + self.interval_s
        if not self.is_tty:
            if not force and key == self._last_key and now - self._last_plain < self.quiet_s:
                return
            self._last_key, self._last_plain = key, now
        elif self._drawn:
            self.stream.write(f"\x1b[{self._drawn}F")
        for line in lines:
            self.stream.write(("\x1b[2K" if self.is_tty else "") + line + "\n")
        self._drawn = len(lines) if self.is_tty else 0
        self.stream.flush()


def tail(path: Path, n: int) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-n:])
