"""Every private Lightning name neps_bcast depends on, in one place.

``tests/test_lightning_compat.py`` fails loudly when a Lightning release changes one.

Lightning's subprocess launcher (``strategy="ddp"`` run as ``python script.py``)
starts a ``_ChildProcessObserver`` thread in the leader: every 5 s it polls the
children, and when one has exited non-zero it SIGKILLs the other children and the
leader itself. When a follower is killed mid-trial, the leader needs a few hundred
milliseconds to learn it, record the trial as crashed in NePS and stop; measured
here, about one run in ten was killed by the observer first, leaving the trial
"evaluating" in NePS for ever. The observer is kept (it still ends a launch whose
leader hangs), but before it kills, it lets the leader finish recording.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_OBSERVER_MODULE = "lightning.fabric.strategies.launchers.subprocess_script"


def before_observer_kills(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in Lightning's observer thread before it SIGKILLs the launch.

    Installed once per process; the latest ``hook`` wins.
    """
    module = importlib.import_module(_OBSERVER_MODULE)
    observer: Any = module._ChildProcessObserver
    current = observer._terminate_all
    original = getattr(current, "__wrapped__", current)

    def _terminate_all(self: Any) -> None:
        try:
            hook()
        finally:
            original(self)

    _terminate_all.__wrapped__ = original  # type: ignore[attr-defined]
    observer._terminate_all = _terminate_all
