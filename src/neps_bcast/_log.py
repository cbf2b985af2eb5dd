"""The library's logger: every line names the rank and role it comes from."""

from __future__ import annotations

import logging

logger = logging.getLogger("neps_bcast")


def log(level: int, tag: str, message: str, *args: object, exc_info: bool = False) -> None:
    if logger.isEnabledFor(level):
        logger.log(level, f"[{tag}] {message}", *args, exc_info=exc_info)
