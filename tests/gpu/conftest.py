"""``make test-gpu``: the GPU tier (not in CI: CI has no GPU). See docs/development.md.

On a machine without CUDA the run fails at once, naming why (never a green run of
skips). Tests that need more GPUs than the machine has are not collected; the run
prints which were left out and why. ``pytest tests/gpu --collect-only`` works anywhere
(the main tier checks that the modules import and collect).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

NO_CUDA = "make test-gpu needs a CUDA device; torch.cuda.is_available() is False here"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpus(n): the test needs n GPUs on this machine")
    if not config.option.collectonly and not torch.cuda.is_available():
        pytest.exit(NO_CUDA, returncode=2)
    # Every launch runs in a folder of its own: a relative PYTHONPATH (src) would not
    # reach it.
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ["PYTHONPATH"] = os.pathsep.join(str(Path(e).resolve()) for e in entries if e)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    left_out = [i for i in items if (m := i.get_closest_marker("gpus")) and m.args[0] > have]
    if not left_out:
        return
    items[:] = [i for i in items if i not in left_out]
    config.hook.pytest_deselected(items=left_out)
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    for item in left_out:
        line = (
            f"left out {item.nodeid}: needs {item.get_closest_marker('gpus').args[0]}"  # type: ignore[union-attr]
            f" GPUs, this machine has {have}"
        )
        if reporter is not None:
            reporter.write_line(line)
