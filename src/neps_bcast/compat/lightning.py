"""Every private Lightning name neps_bcast depends on, in one place.

``tests/test_lightning_compat.py`` fails loudly when a Lightning release changes one.

Lightning's subprocess launcher (``strategy="ddp"`` run as ``python script.py``)
starts a ``_ChildProcessObserver`` thread in the leader: every 5 s it polls the
children, and when one has exited non-zero it SIGKILLs the other children and the
leader itself (1). When a follower is killed mid-trial, the leader needs a few hundred
milliseconds to learn it, record the trial as crashed in NePS and stop; measured
here, about one run in ten was killed by the observer first, leaving the trial
"evaluating" in NePS for ever. The observer is kept (it still ends a launch whose
leader hangs), but before it kills, it lets the leader finish recording.

(2) Lightning's children inherit the leader's environment when they start: the leader
sets what they need (its store's address, the first trial, the search's secret) just
before ``_call_children_scripts`` runs, and not before, so a search whose function never
starts children never serves a store.

(3) During ``fit`` Lightning's ``_SignalConnector`` handles SIGTERM on every rank by
forwarding it to its children and then issuing a ``dist.broadcast`` on the training
group from inside the signal handler. Sent to one rank only, that broadcast meets no
partner (its peers are in their own training collectives): measured here, a SIGTERM
to one follower hung the whole launch. Inside ``neps_bcast.run`` the broadcast is
skipped; the previous handler (neps_bcast's, raising ``Terminated``) then runs and the
trial fails on every rank like any error.

Both distributions of Lightning are covered: the unified ``lightning`` package
(``lightning.fabric``, ``lightning.pytorch``) and the standalone ``lightning_fabric`` /
``pytorch_lightning`` packages, which carry their own copies of these classes. A hook
is installed in every copy that the process has imported.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

LAUNCHER_MODULES = (
    "lightning.fabric.strategies.launchers.subprocess_script",
    "lightning_fabric.strategies.launchers.subprocess_script",
    "lightning.pytorch.strategies.launchers.subprocess_script",
    "pytorch_lightning.strategies.launchers.subprocess_script",
)
OBSERVER_MODULES = (
    "lightning.fabric.strategies.launchers.subprocess_script",
    "lightning_fabric.strategies.launchers.subprocess_script",
)
SIGNAL_MODULES = (
    "lightning.pytorch.trainer.connectors.signal_connector",
    "pytorch_lightning.trainer.connectors.signal_connector",
)


def _imported(module_names: tuple[str, ...]) -> list[Any]:
    """The modules whose top-level package this process has imported."""
    return [
        importlib.import_module(name)
        for name in module_names
        if name.partition(".")[0] in sys.modules
    ]


def is_spawn_launcher(strategy: Any, package: str) -> bool:
    """Does this strategy start its processes with ``ddp_spawn`` / ``ddp_fork``
    (Lightning's private ``_MultiProcessingLauncher``)?"""
    module: Any = importlib.import_module(f"{package}.strategies.launchers.multiprocessing")
    return isinstance(getattr(strategy, "launcher", None), module._MultiProcessingLauncher)


def _replace_method(cls: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """Replace ``cls.name`` by ``make(original)``; installing twice keeps one wrapper."""
    current = getattr(cls, name)
    original = getattr(current, "__wrapped__", current)
    wrapper = make(original)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(cls, name, wrapper)


def before_observer_kills(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in Lightning's observer thread before it SIGKILLs the launch.

    Installed once per process and Lightning copy; the latest ``hook`` wins.
    """

    def make(original: Any) -> Callable[..., Any]:
        def _terminate_all(self: Any) -> None:
            try:
                hook()
            finally:
                original(self)

        return _terminate_all

    for module in _imported(OBSERVER_MODULES):
        _replace_method(module._ChildProcessObserver, "_terminate_all", make)


def before_children_start(hook: Callable[[], None]) -> None:
    """Run ``hook()`` in the leader just before Lightning's subprocess launcher starts
    the child processes (``_SubprocessScriptLauncher._call_children_scripts``, Fabric's
    and the Trainer's), so what the children inherit is set only when they exist.

    Installed once per process and Lightning copy; the latest ``hook`` wins.
    """

    def make(original: Any) -> Callable[..., Any]:
        def _call_children_scripts(self: Any) -> None:
            hook()
            original(self)

        return _call_children_scripts

    for module in _imported(LAUNCHER_MODULES):
        _replace_method(module._SubprocessScriptLauncher, "_call_children_scripts", make)


def sigterm_without_broadcast(is_active: Callable[[], bool]) -> None:
    """While ``is_active()``, Lightning's SIGTERM handler skips its group broadcast.

    Only in the Lightning copies imported already (Lightning scripts import them at the
    top): importing one here would cost every other user seconds.
    """
    names = tuple(n for n in SIGNAL_MODULES if n.rpartition(".trainer")[0] in sys.modules)
    for module in [importlib.import_module(n) for n in names]:

        def make(original: Any, module: Any = module) -> Callable[..., Any]:
            def _sigterm_notifier_fn(self: Any, signum: Any, frame: Any) -> None:
                if not is_active():
                    original(self, signum, frame)
                    return
                module.log.info(f"[rank: {self.trainer.local_rank}] Received SIGTERM: {signum}")
                launcher = self.trainer.strategy.launcher
                if not self.received_sigterm and launcher is not None:
                    launcher.kill(signum)  # as Lightning does: its children get it too
                self.received_sigterm = True

            return _sigterm_notifier_fn

        _replace_method(module._SignalConnector, "_sigterm_notifier_fn", make)
