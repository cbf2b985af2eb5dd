"""Every trial on its way through a pool: asked by its agent, placed on free devices
(``placement``), its order relayed to its ranks, its outcome relayed back, released.
The ways it can end without an outcome are ``endings``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from neps_bcast.launcher import status, trial_placement
from neps_bcast.pool.devices import Devices
from neps_bcast.pool.members import Member, Members, Order
from neps_bcast.pool.placement import Placement


class Trials:
    """The orders of one pool launch, by key, and what is told about each."""

    def __init__(
        self, members: Members, devices: Devices, display: status.Display, launch_id: str
    ) -> None:
        self.members = members
        self.plan = members.plan
        self.devices = devices
        self.display = display
        self.launch_id = launch_id
        self.placement = Placement(self.plan.size)
        for device in range(self.plan.size):
            self.placement.set_available(device, False)  # until its rank says hello
        self.orders: dict[str, Order] = {}
        self.done = 0

    # -- what agents and ranks say -------------------------------------------------
    def ask(self, agent: Member, record: dict[str, Any]) -> None:
        key = str(record["order"])
        order = Order(
            key,
            agent.index,
            str(record["trial"]),
            int(record["size"]),
            int(record["port"]),
            str(record["payload"]),
            asked_at=time.monotonic(),
            directory=str(record["directory"]) if record.get("directory") else None,
        )
        try:
            self.placement.ask(key, order.size, time.monotonic())
        except ValueError as exc:
            self.members.tell(agent, {"op": "outcome", "order": key, "refused": str(exc)})
            return
        self.orders[key] = order
        if order.size > self.devices.left():
            self.refuse(order)

    def outcome(self, rank: Member, record: dict[str, Any]) -> None:
        ended = self.orders.get(str(record["order"]))
        if ended is None or not ended.members or rank is not ended.members[0]:
            return  # only the trial's own rank 0 answers for it
        if ended.answered:
            return
        ended.answered = True
        ended.succeeded = "result" in record
        ended.clean = ended.clean and bool(record.get("clean"))
        self._tell_agent(ended, {**record, "op": "outcome"})

    def free(self, rank: Member, record: dict[str, Any]) -> None:
        freed = self.orders.get(str(record["order"]))
        rank.order = None
        if freed is None:
            return
        freed.clean = freed.clean and bool(record.get("clean"))
        freed.free.add(rank.index)
        self.release_if_free(freed)

    def hear(self, rank: Member) -> None:
        """A rank's last words (an outcome it sent wins over its loss)."""
        for record in self.members.read(rank):
            if record.get("op") == "outcome":
                self.outcome(rank, record)
            elif record.get("op") == "free":
                self.free(rank, record)

    # -- placing and releasing -------------------------------------------------------
    def place(self, now: float) -> None:
        for start in self.placement.place(now):
            order = self.orders[start.key]
            order.ranks = start.devices
            order.placed_at = now
            for group_rank, device in enumerate(start.devices):
                rank = self.members.ranks[device]
                rank.order = order.key
                order.members.append(rank)
                self.members.tell(
                    rank,
                    {
                        "op": "order",
                        "order": order.key,
                        "trial": order.trial,
                        "rank": group_rank,
                        "world": order.size,
                        "port": order.port,
                        "devices": list(start.devices),
                        "payload": order.payload if group_rank == 0 else None,
                    },
                )
            self._tell_agent(
                order, {"op": "placed", "order": order.key, "devices": list(start.devices)}
            )
            self._write_placement(order)

    def release_if_free(self, order: Order) -> None:
        if not order.free.issuperset(order.ranks):
            return
        self.placement.release(order.key, time.monotonic(), measured=order.succeeded)
        self.orders.pop(order.key, None)
        self.done += 1
        if not order.answered:
            self.lost(
                order,
                order.first_lost or f"the ranks of trial {order.trial} left it without an outcome",
            )
        self._tell_agent(order, {"op": "released", "order": order.key})
        if not order.clean:
            for rank in order.members:
                if rank.proc.poll() is None and self.members.ranks.get(rank.index) is rank:
                    rank.retiring = True
                    self.placement.set_available(rank.index, False)
                    self.members.tell(
                        rank, {"op": "exit", "why": "recycled after an unclean trial"}
                    )

    def waiting(self) -> list[Order]:
        return [o for o in self.orders.values() if not o.ranks]

    def of_agent(self, index: int) -> list[Order]:
        return [o for o in self.orders.values() if o.agent == index]

    def withdraw(self, order: Order) -> None:
        self.placement.cancel(order.key)
        self.orders.pop(order.key, None)

    def refuse(self, order: Order) -> None:
        """A waiting trial that no longer fits the devices left: withdrawn, and its agent
        told why (NePS records the trial crashed with it)."""
        self.withdraw(order)
        self._tell_agent(
            order, {"op": "outcome", "order": order.key, "refused": self.devices.refusal(order)}
        )

    # -- trials that end without an outcome ----------------------------------------------
    def lost(self, order: Order, why: str) -> None:
        """The trial's outcome, when its rank 0 cannot send one: its ranks were lost."""
        order.answered = True
        self._tell_agent(order, {"op": "outcome", "order": order.key, "lost": why})

    # -- helpers -------------------------------------------------------------------
    def _tell_agent(self, order: Order, record: dict[str, Any]) -> None:
        agent = self.members.agents.get(order.agent)
        if agent is not None:
            self.members.tell(agent, record)

    def _write_placement(self, order: Order) -> None:
        """``neps-bcast status`` shows which devices a trial runs on from this file."""
        if order.directory is None:
            return
        gpus = self.plan.devices
        placement = trial_placement.placed_now(
            order.trial,
            order.ranks,
            tuple(gpus[d] for d in order.ranks) if gpus is not None else None,
            self.plan.size,
            tuple(m.proc.pid for m in order.members),
            self.launch_id,
        )
        try:
            trial_placement.write(Path(order.directory), placement)
        except OSError as exc:
            self.display.say(f"could not write trial {order.trial}'s placement: {exc}")

    def status(self) -> str:
        running = ", ".join(
            f"trial {o.trial} on {','.join(map(str, o.ranks))}"
            for o in self.orders.values()
            if o.ranks
        )
        return (
            f"pool: {len(self.placement.free)} of {self.plan.size} devices free{self._not_free()};"
            f" running: {running or 'nothing'}; {len(self.waiting())} waiting; {self.done} done"
        )

    def _not_free(self) -> str:
        """Devices neither free nor running a trial, and why: their rank is starting (a
        fresh one, or the first), leaving (recycled, or the search is over), or the
        device is retired; without it a pool starting up read as a stalled one."""
        busy = {d for o in self.orders.values() for d in o.ranks if d not in o.free}
        starting = leaving = 0
        for index, rank in self.members.ranks.items():
            if index in self.devices.retired or index in busy or index in self.placement.free:
                continue
            if rank.retiring or rank.proc.poll() is not None:
                leaving += 1
            elif not rank.said_hello:
                starting += 1
        parts = [
            f"{n} {what}"
            for n, what in (
                (starting, "starting"),
                (leaving, "leaving"),
                (len(self.devices.retired), "retired"),
            )
            if n
        ]
        return f" ({', '.join(parts)})" if parts else ""
