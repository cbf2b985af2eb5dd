"""The leader's store: serving it, reaching it, and every key neps_bcast writes to it.

The leader serves a TCP store on a port the OS picks (never a fixed port). It carries
what must exist before or outside the control channel: the first trial of Lightning's
children, who each rank is (host, pid), the channel's rendezvous, the error board (each
rank's failure of a trial, readable by every rank before the group is released), and
the keys that end each follower's leader watch. Every key is built here (``Keys``);
values are bytes, records are JSON (never unpickled), and every value carries an
authentication tag for the key it was written under (``auth.Signer``): a value an
outsider wrote is refused before anything reads it.

When every rank runs on this host (Lightning's own launcher, a single-node torchrun or
srun) the store listens on the loopback interface only.
"""

from __future__ import annotations

import datetime
import json
import logging
import socket

from neps_bcast.compat.torch import PrefixStore, Store, TCPStore, set_bytes
from neps_bcast.errors import AuthError, ErrorRecord
from neps_bcast.log import logger
from neps_bcast.transport.auth import Signer

PREFIX = "neps_bcast"


class Keys:
    """Every key neps_bcast uses on the leader's store, in one place."""

    @staticmethod
    def trial(seq: int) -> str:
        return f"{PREFIX}/trial/{seq}"

    @staticmethod
    def rank(group_rank: int) -> str:
        return f"{PREFIX}/rank/{group_rank}"

    @staticmethod
    def channel() -> str:
        return f"{PREFIX}/ctl"

    @staticmethod
    def group(generation: int) -> str:
        return f"{PREFIX}/pg/{generation}"

    @staticmethod
    def trial_group(seq: int) -> str:
        """The DDP group neps_bcast forms at ``session()`` of trial ``seq`` (if none)."""
        return f"{PREFIX}/pg/trial/{seq}"

    @staticmethod
    def error(seq: int, group_rank: int) -> str:
        return f"{PREFIX}/err/{seq}/{group_rank}"

    @staticmethod
    def error_count(seq: int) -> str:
        return f"{PREFIX}/err/{seq}/n"

    @staticmethod
    def released(group_rank: int) -> str:
        """Set when a follower's leader watch must end quietly (see ``watchdog``)."""
        return f"{PREFIX}/watch/released/{group_rank}"


def serve(timeout: datetime.timedelta, *, loopback: bool) -> TCPStore:
    """Start the leader's store on a port the OS picks.

    TCPStore itself listens on every interface whatever host it is given, so for a
    loopback-only store it is handed a socket already bound to 127.0.0.1.
    """
    if not loopback:
        return TCPStore(
            "0.0.0.0",  # noqa: S104 - followers on other nodes connect here
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
        )
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    return TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timeout,
        master_listen_fd=listener.detach(),  # the store owns the socket from here on
    )


def connect(address: str, timeout: datetime.timedelta, connect_timeout_s: float) -> TCPStore:
    """Connect to the leader's store; fails at once when nothing listens there.

    The store is up before its address is handed out, so a refused connection means
    the leader is gone: without this probe, TCPStore would retry it for ``timeout``.
    """
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=connect_timeout_s):
        pass
    return TCPStore(host, int(port), is_master=False, timeout=timeout)


def prefixed(prefix: str, store: Store) -> PrefixStore:
    return PrefixStore(prefix, store)


def put(store: Store, signer: Signer, key: str, value: bytes) -> None:
    """Write ``value`` under ``key`` with its authentication tag."""
    set_bytes(store, key, signer.sign(key, value))


def take(store: Store, signer: Signer, key: str) -> bytes:
    """Read the value under ``key``; ``AuthError`` if its tag is not valid."""
    return signer.open(key, store.get(key))


def put_json(store: Store, signer: Signer, key: str, value: object) -> None:
    put(store, signer, key, json.dumps(value).encode())


def take_json(store: Store, signer: Signer, key: str) -> object:
    return json.loads(take(store, signer, key).decode())


class ErrorBoard:
    """Each rank's failure of a trial, published before the group is released.

    A rank that failed writes its record, then counts itself in (``add`` is a round
    trip, so the record has landed); any rank reads every record of the trial.
    """

    def __init__(self, store: Store, signer: Signer) -> None:
        self.store = store
        self.signer = signer

    def publish(self, seq: int, record: ErrorRecord) -> None:
        put(self.store, self.signer, Keys.error(seq, record.group_rank), record.to_json())
        self.store.add(Keys.error_count(seq), 1)

    def read(self, seq: int, world_size: int) -> list[ErrorRecord]:
        if self.store.add(Keys.error_count(seq), 0) == 0:
            return []
        found = []
        for group_rank in range(world_size):
            key = Keys.error(seq, group_rank)
            if not self.store.check([key]):
                continue
            try:
                record = ErrorRecord.from_json(take(self.store, self.signer, key))
            except AuthError as exc:
                logger.log(logging.ERROR, "%s", exc)  # refused, and said so
                continue
            if record is not None and record.group_rank == group_rank:
                found.append(record)
        return found
