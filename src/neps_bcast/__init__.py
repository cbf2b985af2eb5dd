"""neps_bcast: NePS hyperparameter search over multi-process DDP trials.

Rank 0 of each DDP group alone talks to NePS and hands each trial to its group over
torch.distributed; the other ranks wait without polling and stop when the search ends.

The public names are loaded on first use (``__getattr__``): importing the package, the
``neps-bcast`` command or a helper such as ``neps_bcast.compat.procfs`` does not import
torch, Lightning or NePS.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from neps_bcast.errors import NepsBcastError

if TYPE_CHECKING:
    from neps_bcast.api import run
    from neps_bcast.trial.session import Trial, session

__all__ = ["NepsBcastError", "Trial", "run", "session"]
__version__ = "0.1.0"

_LAZY = {
    "run": "neps_bcast.api",
    "Trial": "neps_bcast.trial.session",
    "session": "neps_bcast.trial.session",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'neps_bcast' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
