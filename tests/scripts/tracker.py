"""A user's experiment-tracker client: each rank keeps one TCP connection of its own (an
experiment tracker's keep-alive connection, a database) and sends a line per trial.

``--tracker PORT`` names the server (on 127.0.0.1; tests/e2e/test_e2e_release.py runs one);
``--tracker-from WHEN`` says when each rank connects: ``before_run`` (before
``neps_bcast.run``), ``trial_1`` (first thing in trial 1's session block) or ``trial_2``
(in trial 2's). Every use is recorded ("tracker": rank, trial, whether the round trip
worked); the connection must survive a failed trial.
"""

from __future__ import annotations

import socket

from probe import SEQ, record

CONNECTION: dict[str, socket.socket] = {}
SETTINGS: dict[str, object] = {}


def configure(port: int | None, when: str) -> None:
    if port is not None:
        SETTINGS.update(port=port, when=when)


def connect_if(when: str, rank: int) -> None:
    """Open this rank's connection if the tracker is configured to connect now."""
    if SETTINGS.get("when") != when:
        return
    sock = socket.create_connection(("127.0.0.1", int(SETTINGS["port"])), timeout=10)  # type: ignore[call-overload]
    CONNECTION["sock"] = sock
    record("tracker_open", rank=rank, seq=SEQ["n"], local_port=sock.getsockname()[1])


def log_trial(rank: int) -> None:
    """In a trial's session block: connect if it is time, then one round trip (recorded,
    never raises)."""
    connect_if(f"trial_{SEQ['n']}", rank)
    sock = CONNECTION.get("sock")
    if sock is None:
        return
    line = f"rank {rank} trial {SEQ['n']}\n"
    try:
        sock.sendall(line.encode())
        got = b""
        while not got.endswith(b"\n"):
            chunk = sock.recv(256)
            if not chunk:
                raise ConnectionError("closed by the server")
            got += chunk
        ok, error = got.decode() == line, None if got.decode() == line else f"got {got!r}"
    except OSError as exc:
        ok, error = False, f"{type(exc).__name__}: {exc}"
    record("tracker", rank=rank, seq=SEQ["n"], ok=ok, error=error)
