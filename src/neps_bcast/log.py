"""The library's logger and the rank tag every line and every error text starts with.

Why one place: a line in any rank's log must say where it came from
(``[neps_bcast rank 1/4 follower] ...``), from every module and every thread (the leader
watch, the lease heartbeat), and the text is built here only (``role_tag``). The tag
follows the running ``neps_bcast.run`` call: ``api.run`` names where it comes from
(``tagged``), and everything below logs through ``logger`` and asks ``rank_tag()``
for its error texts, instead of being handed a tag.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, NoReturn

_source: Callable[[], str] | None = None


def role_tag(group_rank: int | None, world_size: int | None) -> str:
    """``neps_bcast rank 1/4 follower``; ``?`` for what is not known yet."""
    rank = "?" if group_rank is None else str(group_rank)
    size = "?" if world_size is None else str(world_size)
    role = "" if group_rank is None else (" leader" if group_rank == 0 else " follower")
    return f"neps_bcast rank {rank}/{size}{role}"


def rank_tag() -> str:
    """The tag of the ``neps_bcast.run`` call running in this process."""
    source = _source
    return source() if source is not None else f"neps_bcast pid {os.getpid()}"


@contextmanager
def tagged(source: Callable[[], str]) -> Iterator[None]:
    """Inside the block (and in threads started from it), lines carry ``source()``."""
    global _source  # noqa: PLW0603 - one tag per process, read by every thread
    previous, _source = _source, source
    try:
        yield
    finally:
        _source = previous


class _RankAdapter(logging.LoggerAdapter):  # type: ignore[type-arg]
    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{rank_tag()}] {msg}", kwargs


logger = _RankAdapter(logging.getLogger("neps_bcast"), {})
"""Log through this: ``logger.info("trial %s received", trial_id)``."""


def exit_now(code: int = 1) -> NoReturn:
    """End this process at once, from any thread (the main one may be blocked in C++
    for ever), after every log line so far is written: the rank's error is its last
    line. Used where a peer is lost or silent, or a trial hangs, and nothing can unblock
    the thread stuck behind it."""
    for handler in logging.getLogger().handlers + logger.logger.handlers:
        handler.flush()
    os._exit(code)
