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
knows at once that the search is over (``SearchStopped``); any other pair of steps
that do not belong together raises ``ProtocolError`` on every rank involved.

Every message is authenticated (``auth.Signer``) before it is decoded, and only a
trial's arguments are ever unpickled (``messages``). Its tag binds the step's number
(every rank counts its steps the same way), the sender's group rank (slot r of the
gather must have been signed by rank r) and the group generation, so a message
recorded from another step, rank, generation or search is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from neps_bcast.errors import ProtocolError, SearchStopped, format_message
from neps_bcast.transport.auth import Context, Signer, channel_context
from neps_bcast.transport.channel import Channel
from neps_bcast.transport.messages import (
    Goodbye,
    Message,
    Ready,
    Report,
    StopMessage,
    TrialMessage,
    decode,
    encode,
)

KIND = "step"
"""The kind every control-channel message's context names (``auth.channel_context``)."""
_BUG = "this is a bug in neps_bcast; please report it with every rank's log."


class Steps:
    """This rank's control steps, and what it learnt of the leader's end from them."""

    def __init__(self, group_rank: int, signer: Signer, generation: Callable[[], int]) -> None:
        self.group_rank = group_rank
        self.signer = signer
        self.generation = generation
        """The group generation this rank is in (bound into every tag)."""
        self.count = 0
        """How many steps this rank has taken on the channel: each tag binds its number."""
        self.handed_seq = 0
        """Leader: the last trial its followers received."""
        self.leader_stop: StopMessage | None = None
        """The leader's STOP, once a step brought it (the search is over)."""
        self.said_goodbye = False
        """The last step (every rank's goodbye, or the leader's) is done."""

    def take(self, channel: Channel, mine: Message, tag: str) -> list[Message]:
        """One step: ``mine`` in, every rank's message out, by group rank."""
        raw = self._exchange(channel, mine, tag)
        messages = [self._open(sender, r, tag) for sender, r in enumerate(raw)]
        self._took(mine, messages[0])
        return messages

    def _take_leaders(self, channel: Channel, mine: Message, tag: str) -> Message:
        """One step of which this follower needs only the leader's message: the others'
        are neither checked nor read (the leader checks them). At world 8 on 2 cores,
        reading all eight cost each follower ~0.1 ms of CPU at every hand-over, seven
        followers on the path to the last one's start of the trial."""
        leaders = self._open(0, self._exchange(channel, mine, tag)[0], tag)
        self._took(mine, leaders)
        return leaders

    def _exchange(self, channel: Channel, mine: Message, tag: str) -> list[bytes]:
        signed = self.signer.sign(self._context(self.group_rank), encode(mine, tag=tag))
        return channel.allgather(signed)

    def _open(self, sender: int, signed: bytes, tag: str) -> Message:
        """Slot ``sender`` of this step, authenticated as that rank's, then decoded."""
        return decode(self.signer.open(self._context(sender), signed), tag=tag)

    def _took(self, mine: Message, leaders: Message) -> None:
        """The step is done: count it, and note the leader's STOP or goodbye."""
        self.count += 1
        if isinstance(leaders, StopMessage) and self.leader_stop is None:
            self.leader_stop = leaders
        if isinstance(leaders, Goodbye) or isinstance(mine, Goodbye):
            self.said_goodbye = True
            if self.leader_stop is None:
                self.leader_stop = StopMessage("the leader said goodbye")

    def _context(self, sender: int) -> Context:
        return channel_context(KIND, sender=sender, seq=self.count, generation=self.generation())

    def hand_over(self, channel: Channel, message: TrialMessage | StopMessage, tag: str) -> None:
        """Leader: every follower gets ``message``. At STOP, a follower still in a trial
        finds it in that trial's meeting; a trial must find every follower ready."""
        others = self.take(channel, message, tag)[1:]
        if not isinstance(message, TrialMessage):
            return
        self.handed_seq = message.seq
        late = [m for m in others if not isinstance(m, Ready)]
        if late:
            what = f"handed trial {message.trial_id} over while {describe(late)}."
            raise ProtocolError(format_message(tag, what, _BUG))

    def next_message(self, channel: Channel, tag: str) -> TrialMessage | StopMessage:
        """Follower: wait (blocked, no polling) for the leader's next message."""
        if self.leader_stop is not None:
            return self.leader_stop
        leaders = self._take_leaders(channel, Ready(self.group_rank), tag)
        if isinstance(leaders, TrialMessage | StopMessage):
            return leaders
        if self.leader_stop is not None:  # the leader's goodbye
            return self.leader_stop
        what = f"waited for the next trial while {describe([leaders])}."
        raise ProtocolError(format_message(tag, what, _BUG))

    def meet(self, channel: Channel, report: Report, tag: str) -> list[Report]:
        """A meeting of a trial: every rank's report, by group rank."""
        self.check_stopped(tag)
        messages = self.take(channel, report, tag)
        self.check_stopped(tag)
        reports = [m for m in messages if isinstance(m, Report)]
        if len(reports) != len(messages):
            others = [m for m in messages if not isinstance(m, Report)]
            what = (
                f"was at trial {report.trial_id}'s {report.phase.value} while {describe(others)}."
            )
            raise ProtocolError(format_message(tag, what, _BUG))
        return reports

    def check_stopped(self, tag: str) -> None:
        """Follower: raise ``SearchStopped`` once a step brought the leader's STOP."""
        stop = self.leader_stop
        if stop is not None and self.group_rank != 0:
            raise SearchStopped(
                format_message(
                    tag,
                    f"the leader stopped the search during this trial: {stop.reason}.",
                    "nothing to do: this rank ends the trial and stops.",
                ),
                stop.reason,
            )

    def goodbye(self, channel: Channel, tag: str) -> None:
        """The last step, once: the leader closes only after every rank's goodbye."""
        if not self.said_goodbye:
            self.take(channel, Goodbye(self.group_rank), tag)


def describe(messages: Sequence[Message]) -> str:
    """What out-of-step ranks were doing, for an error text."""
    parts = []
    for m in messages:
        if isinstance(m, Report):
            parts.append(f"rank {m.group_rank} was at trial {m.trial_id}'s {m.phase.value}")
        elif isinstance(m, Ready):
            parts.append(f"rank {m.group_rank} was waiting for the next trial")
        elif isinstance(m, Goodbye):
            parts.append(f"rank {m.group_rank} was saying goodbye")
        elif isinstance(m, TrialMessage):
            parts.append(f"the leader handed trial {m.trial_id} over")
        else:
            parts.append(f"the leader stopped the search ({m.reason})")
    return ", ".join(parts)
