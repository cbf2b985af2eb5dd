"""A pool's devices that keep failing: retired, so that a broken device is not
restarted for ever and the trials that no longer fit are refused, naming the sizes."""

from __future__ import annotations

from neps_bcast.errors import format_message
from neps_bcast.launcher import status
from neps_bcast.launcher.plan import TAG
from neps_bcast.pool.members import Member, Order, PoolPlan

DEVICE_START_FAILURES = 3
"""A device whose rank exits before it says hello (it proves its device first:
``pool.rank.prove_device``) this many times in a row is retired: no rank is started
for it again, trials that no longer fit the devices left are refused, and when no
device is left the launch ends. Without it a broken device's rank was restarted for
ever and the launch never ended."""


class Devices:
    """Each device's failed starts in a row, and the devices retired for them."""

    def __init__(self, plan: PoolPlan, display: status.Display) -> None:
        self.plan = plan
        self.display = display
        self.start_failures: dict[int, list[int]] = {}
        """A device's rank exits before its hello, in a row (exit codes)."""
        self.retired: dict[int, str] = {}
        """Retired devices, each with why."""

    def left(self) -> int:
        return self.plan.size - len(self.retired)

    def started(self, index: int) -> None:
        """Its rank said hello: the count starts again."""
        self.start_failures.pop(index, None)

    def failed_start(self, rank: Member, code: int) -> bool:
        """A rank exited before its hello (its device failed to prove itself, or the
        script failed before ``neps_bcast.run``); True when its device is now retired
        (``DEVICE_START_FAILURES`` in a row)."""
        index = rank.index
        codes = self.start_failures.setdefault(index, [])
        codes.append(code)
        if len(codes) < DEVICE_START_FAILURES:
            return False
        self.retired[index] = (
            f"its rank failed to start {len(codes)} times in a row, exit codes"
            f" {', '.join(map(str, codes))}"
        )
        self.display.say(
            format_message(
                TAG,
                f"device {index} is retired: its rank failed to start {len(codes)} times in"
                f" a row (exit codes {', '.join(map(str, codes))}; expected it to prove its"
                f" device and say hello); {self.left()} of {self.plan.size} device(s) left.",
                f"see {rank.log} for why; check the device (nvidia-smi) or leave it out of"
                " CUDA_VISIBLE_DEVICES.",
            )
            + f" The end of {rank.log}:\n{status.tail(rank.log, 12)}"
        )
        return True

    def refusal(self, order: Order) -> str:
        """Why a trial that no longer fits the devices left is refused (its agent's
        NePS records it crashed with this)."""
        left, size = self.left(), self.plan.size
        return (
            f"trial {order.trial} needs {order.size} device(s), but {left}"
            f" of the pool's {size} are left ({self._each()}); expected {order.size} <="
            f" {left}. HINT: fix or replace the retired device(s) and start the pool"
            f" again, or make ranks_per_trial ask for at most {max(left, 1)}."
        )

    def none_left(self) -> str:
        """Why the launch ends when no device is left."""
        return format_message(
            TAG,
            f"no device of the pool is left ({self._each()}): no trial can run, so the"
            " launch ends.",
            f"see the ranks' logs in {self.plan.log_dir}/ for why they failed; check"
            " the devices (nvidia-smi, CUDA_VISIBLE_DEVICES) and run the same"
            " command again (its trials stay in the NePS root).",
        )

    def _each(self) -> str:
        return "; ".join(f"device {d}: {why}" for d, why in sorted(self.retired.items()))
