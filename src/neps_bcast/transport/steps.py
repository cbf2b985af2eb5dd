"""One control step: every rank contributes one message and receives every rank's.

Why every step is the same operation: a rank that leaves its loop between two steps
(a signal right after the leader handed a trial over, a second signal while a failure
is being reported) must not leave its peers blocked in another collective. With a
broadcast for hand-overs and an allgather for a trial's meetings, a leader that
broadcast STOP while its followers gathered a trial's reports hung every rank, all
alive, until the last-resort timeout (seven days by default). Here the hand-over, each
meeting of a trial, STOP and goodbye are all one allgather of one frame size (see
``channel``): ranks at different steps meet in the same collective, each sees what the
others sent and its kind, and a follower that finds STOP where it expected a report
knows at once that the search is over.

Every message is authenticated (``auth.Signer``) before it is decoded, and only a
trial's arguments are ever unpickled (``messages``).
"""

from __future__ import annotations

from neps_bcast.transport.auth import Signer
from neps_bcast.transport.channel import Channel
from neps_bcast.transport.messages import Goodbye, Message, StopMessage, decode, encode

CONTEXT = "channel"
"""Authentication context of every message on the control channel."""


class Steps:
    """This rank's control steps, and what it learnt of the leader's end from them."""

    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self.leader_stop: StopMessage | None = None
        """The leader's STOP, once a step brought it (the search is over)."""
        self.said_goodbye = False
        """The last step (every rank's goodbye, or the leader's) is done."""

    def take(self, channel: Channel, mine: Message, tag: str) -> list[Message]:
        """One step: ``mine`` in, every rank's message out, by group rank."""
        raw = channel.allgather(self.signer.sign(CONTEXT, encode(mine, tag=tag)))
        messages = [decode(self.signer.open(CONTEXT, r), tag=tag) for r in raw]
        leaders = messages[0]
        if isinstance(leaders, StopMessage) and self.leader_stop is None:
            self.leader_stop = leaders
        if isinstance(leaders, Goodbye) or isinstance(mine, Goodbye):
            self.said_goodbye = True
            if self.leader_stop is None:
                self.leader_stop = StopMessage("the leader said goodbye")
        return messages
