"""A follower's watch on its leader: exit when the leader process is gone.

Why: a follower is not always blocked on neps_bcast's channel when its leader dies.
A Lightning child may be in Lightning's own rendezvous (``init_process_group`` on the
leader's ``MASTER_PORT``), which retries a dead address for the group timeout (30
minutes), and an NCCL collective may wait for its own timeout. The watch is a thread
blocked (no polling) on a key of the leader's store: the leader's
store lives in the leader process, so when that process dies the wait fails at once.
(The leader sets the key when the search is over, so a normal end is quiet.)
The follower's own code then gets a short grace period to raise ``LeaderLostError``
itself; if it is still running after it, the watch ends the process with exit code 1.

Waiting is bounded by the leader being alive, not by a clock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from neps_bcast import _log
from neps_bcast.channel import WAIT_TIMEOUT, connect_store

GRACE_S = 3.0
"""Time the follower's own code gets to notice the loss before the watch ends it."""
RELEASED = "neps_bcast/watch/released"
"""Set by the leader only when it stops its followers: their watches end quietly."""


def watch_leader(address: str, tag: Callable[[], str],
                 is_done: Callable[[], bool]) -> threading.Thread:
    """Start the watch (a daemon thread) on the leader's store at ``address``.

    ``is_done()`` tells that this follower was told to stop: the leader may then exit
    first, and losing it is normal.
    """
    store = connect_store(address)  # before returning: a dead leader raises here

    def run() -> None:
        while True:
            try:
                store.wait([RELEASED], WAIT_TIMEOUT)
            except dist.DistStoreError as exc:
                if "timeout" in str(exc).lower():
                    continue  # the leader is alive, only quiet for a long time
                break
            except Exception:  # noqa: BLE001 - the connection is gone (DistNetworkError)
                break
            else:
                return  # released: the search is over
        if is_done():
            return
        time.sleep(GRACE_S)
        if is_done():
            return
        _log.log(logging.ERROR, tag(),
                 "lost the leader (rank 0): its store at %s closed the connection, and"
                 " this process was still waiting %.0f s later (in a rendezvous or a"
                 " collective). Exiting with code 1 (LeaderLostError). HINT: the leader"
                 " process exited or was killed; see its log.", address, GRACE_S)
        for handler in logging.getLogger().handlers + _log.logger.handlers:
            handler.flush()
        os._exit(1)

    thread = threading.Thread(target=run, name="neps_bcast-leader-watch", daemon=True)
    thread.start()
    return thread
