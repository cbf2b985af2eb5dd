"""Who this process is: its rank in its DDP group and its role (leader or follower)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["leader", "follower"]


@dataclass(frozen=True)
class Identity:
    """This process's place in its DDP group.

    ``world_size`` is ``None`` while the size of the group is not known yet: on the
    leader of a Lightning ``strategy="ddp"`` launch before the first ``fit``.
    """

    group_rank: int
    world_size: int | None

    @property
    def role(self) -> Role:
        return "leader" if self.group_rank == 0 else "follower"

    @property
    def is_leader(self) -> bool:
        return self.group_rank == 0

    @property
    def tag(self) -> str:
        size = "?" if self.world_size is None else str(self.world_size)
        return f"neps_bcast rank {self.group_rank}/{size} {self.role}"
