"""The executor's guard against XLA:CPU's unordered executions on shared devices."""

from __future__ import annotations

from typing import Any

import jax


class InFlight:
    """XLA:CPU only: wait for in-flight programs on overlapping device sets.

    The CPU runtime does not order two executions per device, so a program on devices
    0-7 and one on devices 4-7 can meet their collectives in opposite orders and
    deadlock (seen with 8 simulated devices, also with identical device sets under
    heavy load). GPU streams execute in dispatch order per device, so there this is off
    and stages overlap freely; on CPU, disjoint islands still run concurrently.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._outputs: dict[frozenset, Any] = {}

    def wait(self, devices: frozenset) -> None:
        """Blocks until programs on devices overlapping ``devices`` are done."""
        if self.enabled:
            for other in [d for d in self._outputs if d & devices]:
                jax.block_until_ready(self._outputs.pop(other))

    def hold(self, devices: frozenset, outputs: Any) -> None:
        """Records ``outputs`` as in flight on ``devices``."""
        if self.enabled:
            self._outputs[devices] = outputs

    def clear(self) -> None:
        self._outputs.clear()
