"""``Scenario(trials=, strategy=, root=)``: the short spelling of a launch that
tests/test_root_guard.py uses. It stands for the user-shaped command line it names
(``command()``); tests/harness.py's ``run`` and ``start`` take either. New tests write
the command line itself (``harness.python(harness.SINGLE, "--trials", "2")``).
Nothing here imports torch, NePS or Lightning.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

SCRIPTS = Path(__file__).parent / "scripts"
SCRIPT = {
    "ddp": "lightning_search.py",
    "none": "single_search.py",
    "plain_ddp": "torch_ddp_search.py",
    "fabric": "fabric_search.py",
}


@dataclass(frozen=True)
class Scenario:
    trials: int = 5
    strategy: Literal["ddp", "none", "plain_ddp", "fabric"] = "ddp"
    """Which script: Lightning ddp, a single process, a plain DDP loop, Fabric."""
    root: str | None = None
    """Its --root (None: the script's default, ``results`` under the launch's cwd)."""

    def command(self) -> list[str]:
        root = ["--root", self.root] if self.root else []
        script = SCRIPTS / SCRIPT[self.strategy]
        return [sys.executable, str(script), "--trials", str(self.trials), *root]
