"""neps_bcast: NePS hyperparameter search over multi-process DDP trials.

Rank 0 of each DDP group alone talks to NePS and hands each trial to its group over
torch.distributed; the other ranks wait without polling and stop when the search ends.
"""

from __future__ import annotations

from neps_bcast.api import run
from neps_bcast.errors import NepsBcastError
from neps_bcast.session import Trial, session

__all__ = ["NepsBcastError", "Trial", "run", "session"]
__version__ = "0.1.0"
