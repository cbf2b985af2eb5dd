"""A Lightning leader's children: the trial they start with, and where they find it.

Under Lightning's own launch the leader is one process until its Trainer starts the
other ranks, inside the user's function, after NePS handed the leader its first trial:
that trial cannot be sent on a channel that does not exist yet. The leader leaves it on
its store and in a private file, and names both in variables set just before
Lightning starts the children (``Children``); each child reads it back, tag and file
checked, before its first step (``first_trial``).
"""

from __future__ import annotations

import os

from neps_bcast.config import ENV_CHILD_SECRET, ENV_FIRST_SEQ, ENV_FIRST_TRIAL, ENV_LEADER
from neps_bcast.errors import ProtocolError, format_message
from neps_bcast.transport.auth import Signer, secret_text
from neps_bcast.transport.link import Link
from neps_bcast.transport.messages import Message, StopMessage, TrialMessage, decode


class Children:
    """Leader before its group exists: the trial Lightning's children start with, and
    the variables that tell them where it is (set just before they start)."""

    def __init__(self) -> None:
        self.first: tuple[int, bytes] | None = None
        self._set_env: list[str] = []

    def prepare(self, link: Link, signer: Signer) -> None:
        if self.first is None:
            return
        seq, payload = self.first
        address, trial_file = link.leave_trial_for_children(seq, payload)
        env = {
            ENV_LEADER: address,
            ENV_FIRST_SEQ: str(seq),
            ENV_FIRST_TRIAL: trial_file,
            ENV_CHILD_SECRET: f"{secret_text(signer.secret)}.{signer.search.hex()}",
        }
        os.environ.update(env)
        self._set_env = list(env)

    def forget(self, link: Link) -> None:
        """The children have joined (or the run ends): nothing left to inherit."""
        for name in self._set_env:
            os.environ.pop(name, None)
        if self._set_env:
            link.forget_trial()
        self._set_env = []


def first_trial(link: Link, leader_store: str, seq: int, trial_file: str, tag: str) -> TrialMessage:
    """A child: reach the leader's store, read back trial ``seq`` from ``trial_file``."""
    link.connect(leader_store)
    payload = link.trial_left_by_leader(seq, trial_file)
    message = _expect_order(decode(payload, tag=tag), tag)
    if not isinstance(message, TrialMessage):
        raise ProtocolError(format_message(tag, "expected a trial, got a stop."))
    return message


def _expect_order(message: Message, tag: str) -> TrialMessage | StopMessage:
    if not isinstance(message, TrialMessage | StopMessage):
        raise ProtocolError(format_message(tag, f"expected a trial, got {message!r}."))
    return message
