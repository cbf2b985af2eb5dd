"""One rank of a two-process group that the "user" formed (a file store), running the
start-up handshake of an external launch several times in a row, one case after the
other, and printing each case's outcome as a JSON line.

    python handshake_ranks.py RANK STORE_FILE

Used by tests/test_handshake.py. Every case runs ``neps_bcast.startup.external.start``
on the already formed group (the user's-group path), with the case's
``NEPS_BCAST_SECRET`` and arguments. A case that raises leaves the group usable: every
rank raises at the same point.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from typing import Any

import torch.distributed as dist

from neps_bcast.config import Settings
from neps_bcast.startup import external, handshake
from neps_bcast.startup.launch import Launch
from neps_bcast.transport.auth import Signer, new_secret
from neps_bcast.transport.link import Link

SECRET = "9d41c0e7a25b6f38d1e4c7a09b2f5d83e6a1c4b7f0d3e6a9c2b5f8e1d4a7c0b3"
OTHER = "0b3e8c1f6a4d9e2b7c0f5a8d3e6b1c4f7a0d9e2c5b8f1a4d7e0c3b6f9a2d5e8c"

RANK = int(sys.argv[1])
RECORDED: dict[str, bytes] = {}
"""The leader's broadcast payloads, by case (an attacker's recording)."""
REPLAY: dict[str, str] = {}
"""case -> the earlier case whose leader payload rank 0 sends instead of its own."""

_broadcast = handshake.broadcast
LINKS: list[Link] = []
"""Every case's link stays alive (the leader's store lives in it)."""


def recording_broadcast(group: Any, data: bytes | None, tag: str) -> bytes:
    if data is not None:
        RECORDED[CASE["name"]] = data
        if CASE["name"] in REPLAY:
            data = RECORDED[REPLAY[CASE["name"]]]
    return _broadcast(group, data, tag)


handshake.broadcast = recording_broadcast  # type: ignore[assignment]
CASE: dict[str, str] = {"name": ""}


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


def one_case(
    name: str,
    secret: str | None,
    root: str = "root",
    *,
    host: str | None = None,
    single_node: bool | None = True,
) -> dict[str, Any]:
    """One handshake; ``host``: the name this rank reports (another host, as it were)."""
    CASE["name"] = name
    real_hostname = socket.gethostname
    if host is not None:
        socket.gethostname = lambda: host  # type: ignore[assignment]
    warnings = Warnings()
    logging.getLogger("neps_bcast").addHandler(warnings)
    if secret is None:
        os.environ.pop("NEPS_BCAST_SECRET", None)
    else:
        os.environ["NEPS_BCAST_SECRET"] = secret
    launch = Launch(
        kind="external",
        launcher="env",
        global_rank=RANK,
        world_size=2,
        local_rank=RANK,
        node_rank=0,
        main_address="127.0.0.1",
        main_port=1,
        identity=(("NB_HANDSHAKE_CASE", name),),
        rank_variable="RANK",
        is_single_node=single_node,
    )
    signer = Signer(new_secret())
    link = Link(RANK, Settings(), signer)
    LINKS.append(link)
    outcome: dict[str, Any] = {"case": name, "rank": RANK}
    try:
        external.start(launch, Settings(), link, signer, {"root_directory": repr(root)})
    except Exception as exc:
        outcome["error"] = f"{type(exc).__name__}: {exc}"
    else:
        outcome["search"] = signer.search.hex()
        outcome["key"] = signer.secret.hex()
        outcome["connected"] = link.store is not None
        outcome["loopback"] = link.loopback
    finally:
        socket.gethostname = real_hostname  # type: ignore[assignment]
        logging.getLogger("neps_bcast").removeHandler(warnings)
    outcome["warnings"] = warnings.seen
    return outcome


def main() -> None:
    dist.init_process_group("gloo", init_method=f"file://{sys.argv[2]}", rank=RANK, world_size=2)
    REPLAY["replayed"] = "first"
    cases = [
        one_case("first", SECRET),
        one_case("restart", SECRET),
        one_case("replayed", SECRET),
        one_case("another secret", SECRET if RANK == 0 else OTHER),
        one_case("weak secret", "the search's secret" if RANK == 1 else SECRET),
        one_case("different arguments", SECRET, root="root" if RANK == 0 else "elsewhere"),
        one_case("no secret, one host", None),
        one_case("one node, two hosts", SECRET, host="elsewhere" if RANK == 1 else None),
        one_case(
            "several hosts, no secret",
            None,
            host="elsewhere" if RANK == 1 else None,
            single_node=None,
        ),
    ]
    for outcome in cases:
        print(json.dumps(outcome), flush=True)
    dist.barrier()  # no leader's store goes before every follower is done with it
    for link in LINKS:
        link.release_watch()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
