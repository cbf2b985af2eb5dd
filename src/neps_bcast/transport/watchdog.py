"""A follower's watch on its leader: exit when the leader process is gone.

Why: a follower is not always blocked on neps_bcast's channel when its leader dies.
A Lightning child may be in Lightning's own rendezvous (``init_process_group`` on the
leader's ``MASTER_PORT``), which retries a dead address for the group timeout (30
minutes), and an NCCL collective may wait for its own timeout. The watch is a thread
blocked (no polling) on a key of the leader's store: the leader's store lives in the
leader process, so when that process dies the wait fails at once. (The leader sets the
key when the search is over, so a normal end is quiet.) The follower's own code then
gets a short grace period to raise ``LeaderLostError`` itself; if it is still running
after it, the watch ends the process with exit code 1.

Waiting is bounded by the leader being alive, not by a clock.
"""

from __future__ import annotations

import datetime
import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

from neps_bcast.compat.torch import Store
from neps_bcast.config import Settings
from neps_bcast.errors import AuthError
from neps_bcast.log import exit_now, logger
from neps_bcast.transport import liveness, store
from neps_bcast.transport.auth import Context, Signer

GRACE_S = 3.0
"""Time the follower's own code gets to notice the loss before the watch ends it."""


class LeaderWatch:
    """The watch thread of one follower; ``release()`` ends it.

    The key it waits on is set by the leader when it stops its followers, or by the
    follower when it leaves: a thread still blocked in the store's C++ wait when the
    interpreter exits aborts the process ("terminate called without an active
    exception").
    """

    def __init__(
        self,
        address: str,
        group_rank: int,
        is_done: Callable[[], bool],
        settings: Settings,
        signer: Signer,
    ) -> None:
        self.address = address
        self.group_rank = group_rank
        self._is_done = is_done
        self._released = threading.Event()
        self._signer = signer
        self._timeout = datetime.timedelta(seconds=settings.wait_timeout_s)
        # Before returning: a dead leader raises here.
        self._store = store.connect(address, self._timeout, settings.connect_timeout_s)
        self.thread = threading.Thread(
            target=self._run, name="neps_bcast-leader-watch", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        key = store.Keys.released(self.group_rank)
        # The leader releases every follower at the end; a follower leaving releases its
        # own watch. Nothing else (a forged value, or one recorded from another search).
        writers = [Context(key, 0), Context(key, self.group_rank)]
        refusals = 0
        error = ""
        while True:
            try:
                self._store.wait([key], self._timeout)
                self._signer.open_any(writers, self._store.get(key))
            except AuthError as exc:
                # Someone else set the key: ignore it (and say so), keep watching.
                refusals += 1
                level = logging.ERROR if refusals == 1 else logging.DEBUG
                logger.log(level, "%s (refused %d time(s) so far)", exc, refusals)
                if self._released.is_set():
                    return  # leaving: its own release may have been overwritten
                self._store.delete_key(key)
                continue
            except dist.DistStoreError as exc:
                if "timeout" in str(exc).lower():
                    continue  # the leader is alive, only quiet for a long time
                error = str(exc)
                break
            except Exception as exc:  # noqa: BLE001 - the connection is gone (DistNetworkError)
                error = str(exc)
                break
            else:
                return  # released: the search is over, or this follower is leaving
        if self._is_done() or self._released.wait(GRACE_S) or self._is_done():
            return
        logger.log(
            logging.ERROR,
            "lost the leader (rank 0): its store at %s closed the connection%s, and"
            " this process was still waiting %.0f s later (in a rendezvous or a"
            " collective). Exiting with code 1 (LeaderLostError). HINT: the leader"
            " process exited or was killed; see its log.",
            self.address,
            liveness.why_leader_left(error),
            GRACE_S,
        )
        exit_now(1)

    def release(self, leader_store: Store) -> None:
        """Follower leaving: end the watch before the interpreter exits."""
        self._released.set()
        try:
            key = store.Keys.released(self.group_rank)
            store.put(leader_store, self._signer, key, b"1", sender=self.group_rank)
        except Exception:  # noqa: BLE001, S110 - the leader is gone: the wait ended already
            pass
        self.thread.join(timeout=5.0)
