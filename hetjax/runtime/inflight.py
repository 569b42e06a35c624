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

    Only programs with collectives can meet that way: one without (a single-device
    stage, a pure data-parallel forward, a device-to-device copy) runs to the end on
    each device whatever else is queued there. So ``collective=False`` calls neither
    wait nor are waited for; that is most of a schedule's calls, and each wait is a host
    sync that stalls dispatch.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._outputs: dict[frozenset, Any] = {}
        self.syncs = 0  # host syncs so far (what the guard costs dispatch)

    def wait(self, devices: frozenset, collective: bool = True) -> None:
        """Blocks until programs on devices overlapping ``devices`` are done, before a
        ``collective`` program runs there."""
        if self.enabled and collective:
            for other in [d for d in self._outputs if d & devices]:
                jax.block_until_ready(self._outputs.pop(other))
                self.syncs += 1

    def hold(self, devices: frozenset, outputs: Any, collective: bool = True) -> None:
        """Records ``outputs`` of a ``collective`` program as in flight on ``devices``."""
        if self.enabled and collective:
            self._outputs[devices] = outputs

    def clear(self) -> None:
        self._outputs.clear()
