"""``python -m neps_bcast launch ...`` / ``status ROOT``: the same commands as the ``neps-bcast`` script."""

from __future__ import annotations

from neps_bcast.cli import console_main

if __name__ == "__main__":
    console_main()
