"""This rank's connection to the rest of its group: the leader's store and the channel.

One ``Link`` per ``neps_bcast.run`` call. The leader serves the store; a follower
connects to it (and starts its leader watch). Once the size of the group is known,
every rank joins the control channel, and from then on every message is a control
step on it (``steps``). Before that (trial 1 of a Lightning launch, when the children
do not exist yet) the leader leaves the trial for them in a private file
(``transport/private.py``) whose path the children inherit: not in the store, where an
outsider could overwrite it before the children read it. Every connection made here is
recorded as neps_bcast's own, so that releasing the user's group never shuts it.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from neps_bcast.compat import procfs
from neps_bcast.compat.torch import TCPStore
from neps_bcast.config import Settings
from neps_bcast.errors import LeaderLostError, ProtocolError, format_message
from neps_bcast.log import logger, rank_tag
from neps_bcast.transport import liveness, peers, private, sockets, store, watchdog
from neps_bcast.transport.auth import Context, Signer
from neps_bcast.transport.channel import Channel, ChannelClosedError, GlooChannel, JoinTimeoutError


class Link:
    def __init__(self, group_rank: int, settings: Settings, signer: Signer) -> None:
        self.group_rank = group_rank
        self.settings = settings
        self.signer = signer
        self.loopback = True
        """Serve the store on loopback only (every rank is on this host)."""
        self.store: TCPStore | None = None
        self.channel: Channel | None = None
        self.watch: watchdog.LeaderWatch | None = None
        self.peers = peers.Peers(group_rank, signer)
        self.own: set[int] = set()
        """Inodes of neps_bcast's own connections (never shut when the group is released)."""
        self.stopping = False
        """Follower: the leader said STOP, so losing it from now on is normal."""
        self.trial_dir: Path | None = None
        """Leader: the private directory of the trial left for Lightning's children."""
        self.address: str | None = None
        """Follower: the leader's store (``host:port``)."""
        self.on_silent: Callable[[liveness.Silence], None] | None = None
        """What a silent peer costs (set by the runtime): without it, nothing is watched."""
        self.liveness: liveness.Monitor | liveness.LeaderBeat | None = None

    @property
    def wait_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.settings.wait_timeout_s)

    @contextlib.contextmanager
    def own_connections(self) -> Iterator[None]:
        """Remember the connections made inside this block as neps_bcast's own."""
        before = set(sockets.socket_inodes())
        try:
            yield
        finally:
            self.own |= set(sockets.socket_inodes()) - before

    def serve(self) -> TCPStore:
        """Leader: the store, started on first use."""
        if self.store is None:
            with self.own_connections():
                self.store = store.serve(self.wait_timeout, loopback=self.loopback)
            logger.log(
                logging.INFO,
                "serving the control store on port %d (%s)",
                self.store.port,
                "loopback only" if self.loopback else "every interface",
            )
            self.peers.publish(self.store)
        return self.store

    def connect(self, address: str) -> TCPStore:
        """Follower: reach the leader's store, publish itself, start the leader watch."""
        try:
            with self.own_connections():
                self.store = store.connect(
                    address, self.wait_timeout, self.settings.connect_timeout_s
                )
                self.address = address
                self.watch = watchdog.LeaderWatch(
                    address,
                    self.group_rank,
                    lambda: self.stopping,
                    self.settings,
                    self.signer,
                )
            self.peers.publish(self.store)
        except Exception as exc:
            raise LeaderLostError(
                format_message(
                    rank_tag(),
                    f"cannot reach the leader's store at {address}: {exc}.",
                    "the leader process has probably exited; see its log.",
                )
            ) from exc
        return self.store

    def join(self, world_size: int, lost: Callable[[BaseException], Exception]) -> Channel:
        """Meet the other ranks on the channel (every rank, once the group size is known)."""
        if self.channel is not None:
            return self.channel
        assert self.store is not None
        logger.log(logging.DEBUG, "joining the control channel")
        try:
            with self.own_connections(), _eager_gloo():
                self.channel = GlooChannel.join(
                    self.store,
                    self.group_rank,
                    world_size,
                    datetime.timedelta(seconds=self.settings.join_timeout_s),
                    self.wait_timeout,
                )
        except JoinTimeoutError as exc:
            raise ProtocolError(
                format_message(
                    rank_tag(),
                    f"ranks {exc.missing} of {world_size} never reached the end of"
                    " their first trial.",
                    "every rank must call neps_bcast.run and run the same"
                    " evaluate_pipeline; see the missing ranks' logs.",
                )
            ) from exc
        except ChannelClosedError as exc:
            raise lost(exc) from exc
        logger.log(logging.INFO, "control channel up (%d ranks)", world_size)
        with self.own_connections():
            self._watch_liveness(world_size)
        # Kernel-level detection on the channel's own connections too: a peer whose node
        # is lost fails them by itself (a frozen one needs the heartbeat).
        liveness.guard(self.own, self.settings.peer_timeout_s)
        return self.channel

    def _watch_liveness(self, world_size: int) -> None:
        """Start the heartbeat (``liveness``) once every rank is on the channel."""
        if self.on_silent is None or self.liveness is not None or self.store is None:
            return
        bound = self.settings.peer_timeout_s
        if self.group_rank == 0:
            self.liveness = liveness.Monitor(
                f"127.0.0.1:{self.store.port}",
                world_size,
                self.signer,
                bound,
                self.on_silent,
                self._host_and_pid,
                self._process_of,
            )
        elif self.address is not None:
            self.liveness = liveness.LeaderBeat(
                self.address,
                self.group_rank,
                self.signer,
                bound,
                self.on_silent,
                lambda: self._host_and_pid(0),
                lambda: self._process_of(0),
            )

    def _host_and_pid(self, group_rank: int) -> tuple[str, int | None]:
        peer = self.peers.known(group_rank)
        if peer is None:
            return "unknown", None
        return peer.host, peer.pid

    def _process_of(self, group_rank: int) -> procfs.Process | None:
        """Who the rank is, as its peer record says (None: no record read yet)."""
        peer = self.peers.known(group_rank)
        return peer.process if peer is not None else None

    def stop_liveness(self) -> None:
        """The search ends (STOP): peers leaving from now on are not silent."""
        if self.liveness is not None:
            self.liveness.stop()

    def leave_trial_for_children(self, seq: int, payload: bytes) -> tuple[str, str]:
        """Leader before its group exists: the trial, where Lightning's children find it.

        Returns the store's address and the trial's file (in a fresh private directory)."""
        target = self.serve()
        self.forget_trial()
        self.trial_dir = private.new_dir()
        with private.opened(self.trial_dir, create=False) as folder:
            context = Context(store.Keys.trial(seq), 0, seq)
            path = folder.write("trial", self.signer.sign(context, payload))
        return f"127.0.0.1:{target.port}", str(path)

    def forget_trial(self) -> None:
        """Leader: the children have read the trial (or will never come): remove it."""
        if self.trial_dir is not None:
            with contextlib.suppress(OSError):
                with private.opened(self.trial_dir, create=False) as folder:
                    folder.remove("trial")
                self.trial_dir.rmdir()
            self.trial_dir = None

    def trial_left_by_leader(self, seq: int, path: str) -> bytes:
        """Lightning child: the trial its leader left in ``path`` (file and tag checked)."""
        file = Path(path)
        hint = (
            "the leader writes this file for its Lightning children and passes its path in"
            " their environment: do not set NEPS_BCAST_* variables by hand."
        )
        with private.opened(
            file.parent, create=False, hint=hint, label="the first trial's directory"
        ) as folder:
            signed = folder.read(file.name, hint=hint, label="the first trial's file")
        return self.signer.open(Context(store.Keys.trial(seq), 0, seq), signed)

    def release_followers(self, world_size: int) -> None:
        """Leader at the end: every follower's watch may end quietly from now on."""
        if self.store is None:
            return
        with contextlib.suppress(Exception):  # losing us is normal from now on
            for r in range(1, world_size):
                store.put(self.store, self.signer, store.Keys.released(r), b"1", sender=0)

    def release_watch(self) -> None:
        """Follower leaving (normally or not): end the leader watch first."""
        self.stopping = True
        self.stop_liveness()
        if self.store is not None and self.watch is not None:
            self.watch.release(self.store)
        self.watch = None

    def close(self) -> None:
        self.stop_liveness()
        self.forget_trial()
        if self.channel is not None:
            self.channel.close()
            self.channel = None


@contextlib.contextmanager
def _eager_gloo() -> Iterator[None]:
    """Form the channel's connections now, even when the user asked gloo to be lazy
    (``TORCH_GLOO_LAZY_INIT``): they must exist inside ``own_connections``."""
    saved = os.environ.pop("TORCH_GLOO_LAZY_INIT", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCH_GLOO_LAZY_INIT"] = saved
