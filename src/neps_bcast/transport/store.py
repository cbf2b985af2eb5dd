"""The leader's store: serving it, reaching it, and every key neps_bcast writes to it.

The leader serves a TCP store on a port the OS picks (never a fixed port). It carries
what must exist before or outside the control channel: who each rank is (host, pid),
the channel's rendezvous, the error board (each rank's failure of a trial, readable by
every rank before the group is released), and the keys that end each follower's leader
watch. Every key is built here (``Keys``); values are bytes, records are JSON (never
unpickled), and every value carries an authentication tag for its key, its writer's
rank, its trial and this search (``auth.Context``): a value an outsider wrote, or one
recorded from another search or trial, is refused before anything reads it.

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
from neps_bcast.transport.auth import Context, Signer

PREFIX = "neps_bcast"


class Keys:
    """Every key neps_bcast uses on the leader's store, in one place."""

    @staticmethod
    def trial(seq: int) -> str:
        """The context of a trial left for Lightning's children (in a private file)."""
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
    def released(group_rank: int) -> str:
        """Set when a follower's leader watch must end quietly (see ``watchdog``)."""
        return f"{PREFIX}/watch/released/{group_rank}"


def serve(timeout: datetime.timedelta, *, loopback: bool, multi_tenant: bool = False) -> TCPStore:
    """Start the leader's store (or a pool trial's rendezvous store, ``multi_tenant``
    as torch's own) on a port the OS picks.

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
            multi_tenant=multi_tenant,
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
        multi_tenant=multi_tenant,
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


def put(store: Store, signer: Signer, key: str, value: bytes, *, sender: int, seq: int = 0) -> None:
    """Write ``value`` under ``key`` with its authentication tag (``sender``: this rank)."""
    set_bytes(store, key, signer.sign(Context(key, sender, seq), value))


def take(store: Store, signer: Signer, key: str, *, sender: int, seq: int = 0) -> bytes:
    """Read the value under ``key``; ``AuthError`` unless ``sender`` wrote it for ``seq``
    in this search."""
    return signer.open(Context(key, sender, seq), store.get(key))


def put_json(store: Store, signer: Signer, key: str, value: object, *, sender: int) -> None:
    put(store, signer, key, json.dumps(value).encode(), sender=sender)


def take_json(store: Store, signer: Signer, key: str, *, sender: int) -> object:
    """The JSON record under ``key``; ``AuthError`` or ``ValueError`` if it is not one."""
    return json.loads(take(store, signer, key, sender=sender).decode())


class ErrorBoard:
    """Each rank's failure of a trial, published before the group is released.

    A rank that failed writes its record, then checks that it is there (``check`` is a
    round trip, so the record has landed); any rank reads every record of the trial.
    No counter: ``add`` on a key an outsider set to something that is not a number makes
    the store drop the connection, which would cut a follower off its leader.
    """

    def __init__(self, store: Store, signer: Signer) -> None:
        self.store = store
        self.signer = signer

    def publish(self, seq: int, record: ErrorRecord) -> None:
        key = Keys.error(seq, record.group_rank)
        put(self.store, self.signer, key, record.to_json(), sender=record.group_rank, seq=seq)
        self.store.check([key])  # a round trip: the record has landed

    def read(self, seq: int, world_size: int) -> list[ErrorRecord]:
        found = []
        for group_rank in range(world_size):
            key = Keys.error(seq, group_rank)
            if not self.store.check([key]):
                continue
            try:
                raw = take(self.store, self.signer, key, sender=group_rank, seq=seq)
            except AuthError as exc:
                logger.log(logging.ERROR, "%s", exc)  # refused, and said so
                continue
            record = ErrorRecord.from_json(raw)
            if record is None or record.group_rank != group_rank:
                logger.log(logging.ERROR, "refused the error record under %r: not a record", key)
                continue
            found.append(record)
        return found
