from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_finish(session):  # type: ignore[no-untyped-def]
    # A selection that runs zero tests is a failure, not a green run.
    if not session.items and not session.config.option.collectonly:
        raise SystemExit("no tests were selected")
