"""Fails loudly when Lightning changes what ``neps_bcast.compat.lightning`` relies on:
its subprocess launcher's observer SIGKILLs the launch through ``_terminate_all``
when a child exits non-zero, and our hook runs first."""

from __future__ import annotations

import subprocess
import sys

from lightning.fabric.strategies.launchers import subprocess_script
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

from neps_bcast.compat import lightning as lightning_compat


def test_the_hook_runs_before_lightnings_observer_kills() -> None:
    calls: list[str] = []
    lightning_compat.before_observer_kills(lambda: calls.append("hook"))
    main = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    child.wait(timeout=30)
    try:
        observer = subprocess_script._ChildProcessObserver(main.pid, [child])
        assert observer._run() is True  # a child exited non-zero: it ends the launch
        assert calls == ["hook"]
        assert main.wait(timeout=30) == -9  # then it killed the "leader", as before
    finally:
        main.kill()
        main.wait()


def test_installing_twice_keeps_one_wrapper() -> None:
    lightning_compat.before_observer_kills(lambda: None)
    first = subprocess_script._ChildProcessObserver._terminate_all
    lightning_compat.before_observer_kills(lambda: None)
    second = subprocess_script._ChildProcessObserver._terminate_all
    assert first.__wrapped__ is second.__wrapped__
    assert not hasattr(second.__wrapped__, "__wrapped__")


def test_lightnings_sigterm_handler_is_wrapped_once() -> None:
    original = getattr(
        _SignalConnector._sigterm_notifier_fn, "__wrapped__", _SignalConnector._sigterm_notifier_fn
    )
    assert callable(original)
    lightning_compat.sigterm_without_broadcast(lambda: True)
    lightning_compat.sigterm_without_broadcast(lambda: True)
    assert _SignalConnector._sigterm_notifier_fn.__wrapped__ is original


def test_the_standalone_packages_get_the_same_hooks() -> None:
    # Users who `import pytorch_lightning` (and so lightning_fabric) keep every
    # protection: the observer hook, the SIGTERM handler and the group-size check.
    import lightning_fabric.strategies.launchers.subprocess_script as standalone_script
    import pytorch_lightning as pl
    from pytorch_lightning.trainer.connectors import signal_connector

    from neps_bcast import lightning_callback

    lightning_compat.before_observer_kills(lambda: None)
    assert hasattr(standalone_script._ChildProcessObserver._terminate_all, "__wrapped__")
    lightning_compat.sigterm_without_broadcast(lambda: True)
    assert hasattr(signal_connector._SignalConnector._sigterm_notifier_fn, "__wrapped__")
    check = lightning_callback._check_class("pytorch_lightning")
    assert issubclass(check, pl.Callback)
    from importlib.metadata import entry_points

    names = {ep.value for ep in entry_points(group="pytorch_lightning.callbacks_factory")}
    assert "neps_bcast.lightning_callback:pytorch_lightning_callbacks" in names


def test_the_children_hook_runs_before_lightning_starts_them() -> None:
    from lightning.fabric.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as FabricLauncher,
    )
    from lightning.pytorch.strategies.launchers.subprocess_script import (
        _SubprocessScriptLauncher as TrainerLauncher,
    )

    calls: list[str] = []
    lightning_compat.before_children_start(lambda: calls.append("hook"))
    lightning_compat.before_children_start(lambda: calls.append("latest"))
    for launcher in (FabricLauncher, TrainerLauncher):
        wrapper = launcher._call_children_scripts
        original = wrapper.__wrapped__
        assert not hasattr(original, "__wrapped__")  # one wrapper, however often installed
        launcher._call_children_scripts = lambda self: calls.append("children")  # type: ignore[method-assign]
        try:
            lightning_compat.before_children_start(lambda: calls.append("hook"))
            launcher._call_children_scripts(object())  # type: ignore[arg-type]
        finally:
            launcher._call_children_scripts = wrapper  # type: ignore[method-assign]
        assert calls[-2:] == ["hook", "children"]


def test_the_size_check_survives_ddp_spawns_pickling_and_knows_the_spawn_launcher() -> None:
    # ddp_spawn pickles the Trainer, callbacks included, to its workers.
    import pickle

    import lightning as L

    from neps_bcast import lightning_callback

    check = lightning_callback._check_class("lightning.pytorch")()
    assert type(pickle.loads(pickle.dumps(check))) is type(check)
    spawn = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", logger=False)
    script = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert lightning_compat.is_spawn_launcher(spawn.strategy, "lightning.pytorch")
    assert not lightning_compat.is_spawn_launcher(script.strategy, "lightning.pytorch")
