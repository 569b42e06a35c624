"""Probes: observers that measure one step of an executor from inside it.

- :class:`LiveSampler` samples ``jax.live_arrays()`` after every ``fwd``/``bwd`` call of
  one step and attributes what each stage keeps for its backward (its stash) to that
  stage: peak activation bytes per stage, the figure behind 1F1B's memory bound.
- :class:`AsyncTimer` times every ``fwd``/``bwd`` of one *unprofiled* step with one
  watcher thread per stage, so stages overlap as they do in training: the measured
  pipeline bubble per stage.

Unlike :class:`~hetjax.inspect.Recorder` (what was compiled, called and moved) and the
executor's ``profile=True`` (which waits for every op, so stages never overlap), these
read device timing and memory while the step runs asynchronously. Like the Recorder they
use only the executor's public observer hooks, read by attribute (``stage``,
``program``, ``inputs``, ``outputs``, ``t0``), and import nothing from
:mod:`hetjax.runtime`.

Example:
    >>> timer, sampler = AsyncTimer(), LiveSampler()  # doctest: +SKIP
    >>> ex = hetjax.Executor(plan, params, devices=devices, observers=[timer, sampler])
    >>> timer.start(stage_of, num_stages)
    >>> ex.step(batch)  # waited for in full
    >>> bubble = timer.bubble({k: p.devices for k, p in ex.programs.items()})
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import jax

from .memory import array_bytes_per_device, live_arrays

StageKey = tuple[str, int]  # (module, pipeline stage)


class LiveSampler:
    """An observer sampling ``jax.live_arrays()`` after every ``fwd``/``bwd`` of one step
    (from :meth:`start` to :meth:`stop`); attributes the stash to stages.

    Arrays get serial numbers (an ``id`` may be reused once an array is freed, a weak
    reference tells the two apart). A stage input counts as stashed from its F to its B:
    from the ``fwd`` call that receives it, or - on the loss stage, whose F only stashes -
    from the first sample where the microbatch data the executor places at F is live.
    It reads the stage programs' arguments by their place in the call (``FWD_X``,
    ``BWD_STASH``, ``BWD_DATA``: the executor's F/B calls).
    """

    FWD_X = 1  # fwd(params, x, data, normalizer)
    BWD_STASH, BWD_DATA = 2, 3  # bwd(params, acc, stash, data, g_out, normalizer)

    def __init__(self) -> None:
        self.stage_of: Callable[[StageKey], int] | None = None  # set by start()
        self._refs: dict[int, tuple[weakref.ref, int]] = {}
        self.bytes: dict[int, dict] = {}  # serial -> {device: bytes}
        self.first_seen: dict[int, int] = {}  # serial -> first sample holding it
        self.fwd_at: dict[int, int] = {}  # serial of a fwd input -> sample after that call
        self.samples: list[set[int]] = []
        self.stashed: list[tuple[int, set[int], int, int]] = []  # (stage, serials, from, to)
        self.skip: set[int] = set()  # arrays older than the step, then accumulators

    def start(self, stage_of: Callable[[StageKey], int]) -> None:
        """Starts sampling; ``stage_of`` maps a stage key to its schedule stage index."""
        self.stage_of = stage_of
        self.skip = {self._serial(a) for a in live_arrays()}

    def stop(self) -> None:
        """Stops sampling (what was sampled stays)."""
        self.stage_of = None

    def _serial(self, a: jax.Array) -> int:
        seen = self._refs.get(id(a))
        if seen is not None and seen[0]() is a:
            return seen[1]
        serial = len(self.bytes)
        self._refs[id(a)] = (weakref.ref(a), serial)
        self.bytes[serial] = array_bytes_per_device(a)
        return serial

    def sample(self) -> int:
        """Records the live arrays now; returns the sample's index."""
        now = {self._serial(a) for a in live_arrays()}
        for k in now:
            self.first_seen.setdefault(k, len(self.samples))
        self.samples.append(now)
        return len(self.samples) - 1

    def on_dispatch(self, event: Any) -> None:
        if self.stage_of is None:
            return
        name, args, out = event.program, event.inputs, event.outputs
        if name in ("zeros", "bwd"):  # bwd -> (acc, gx, loss)
            acc = out if name == "zeros" else out[0]
            self.skip.update(self._serial(a) for a in jax.tree.leaves(acc))
        if name == "fwd":
            i = self.sample()
            for a in jax.tree.leaves(args[self.FWD_X]):
                self.fwd_at.setdefault(self._serial(a), i)
        elif name == "bwd":
            i = self.sample()  # the event holds the inputs: x and the data are live
            xs = {self._serial(a) for a in jax.tree.leaves(args[self.BWD_STASH])}
            data = {self._serial(a) for a in jax.tree.leaves(args[self.BWD_DATA])}
            starts = [self.fwd_at[k] for k in xs if k in self.fwd_at]
            start = min(starts or [self.first_seen.get(k, i) for k in (data or xs)] or [i])
            self.stashed.append((self.stage_of(event.stage), xs | data, start, i))

    def stash_peaks(self, num_stages: int) -> list[int]:
        """Per schedule stage, the most stash bytes (over its devices) live at a sample."""
        peaks = [0] * num_stages
        for i, live in enumerate(self.samples):
            held = [0] * num_stages
            for stage, serials, start, end in self.stashed:
                if start <= i <= end:
                    held[stage] += sum(sum(self.bytes[k].values()) for k in serials & live)
            peaks = [max(p, h) for p, h in zip(peaks, held, strict=True)]
        return peaks

    def live_peaks(self, stage_devices: list[set]) -> list[int]:
        """Per stage (its devices), the most bytes of arrays created during the step
        (accumulators left out) live at a sample."""
        return [
            max(
                (
                    sum(b for k in live - self.skip for d, b in self.bytes[k].items() if d in devs)
                    for live in self.samples
                ),
                default=0,
            )
            for devs in stage_devices
        ]


def wait_alive(tree: Any) -> None:
    """Waits until every array of ``tree`` that is not deleted is ready.

    A program call may donate its arguments (the stash, the accumulator) and a later
    call may donate this one's outputs, so which of a call's arrays still exist when a
    watcher gets to them depends on the program, not on a fixed position. The ones
    donated were consumed by calls on the same devices, whose ordering the timer
    accounts for separately; every array of one call's outputs is ready at once, so any
    that survives tells when the call finished.
    """
    for a in jax.tree.leaves(tree):
        if not isinstance(a, jax.Array) or a.is_deleted():
            continue
        try:
            a.block_until_ready()
        except Exception as e:  # donated between the check and the wait
            # (another jax.Array over the same buffers may have been the one donated:
            # this one then does not say it is deleted, but its buffers are gone)
            if not (a.is_deleted() or "deleted or donated" in str(e)):
                raise


class AsyncTimer:
    """An observer with per-stage watcher threads timing each F/B of one unprofiled step
    (from :meth:`start` to :meth:`bubble`).

    Each F/B runs from max(dispatch, its inputs seen ready, the end of every earlier F/B
    on devices it shares) to its outputs seen ready. Dispatch is the event's ``t0``,
    taken before the executor waits for in-flight programs on shared devices (XLA:CPU),
    so an op starts no earlier than those ended. A watcher that fails records the error
    and :meth:`bubble` raises it in the caller's thread.
    """

    def __init__(self) -> None:
        self.stage_of: Callable[[StageKey], int] | None = None  # set by start()
        self.ops: list[tuple] = []  # (stage key, dispatched, [ready, end]) in dispatch order
        self.errors: list[BaseException] = []  # what the watchers raised

    def start(self, stage_of: Callable[[StageKey], int], num_stages: int) -> None:
        """Starts one watcher per schedule stage; ``stage_of`` maps a stage key to one."""
        self.stage_of, self.num_stages = stage_of, num_stages
        self.ops, self.errors = [], []
        self.queues: list[queue.Queue] = [queue.Queue() for _ in range(num_stages)]
        self.threads = [
            threading.Thread(target=self._watch, args=(s,), daemon=True) for s in range(num_stages)
        ]
        for t in self.threads:
            t.start()

    def _watch(self, stage: int) -> None:
        failed = False
        while (item := self.queues[stage].get()) is not None:
            if failed:  # drain, so that bubble() can stop this thread
                continue
            times, inputs, outputs = item
            try:
                self._wait(inputs)
                times.append(time.perf_counter())
                self._wait(outputs)
                times.append(time.perf_counter())
            except BaseException as e:  # surfaces in bubble(), in the caller's thread
                self.errors.append(e)
                failed = True

    def _wait(self, tree: Any) -> None:
        wait_alive(tree)

    def on_dispatch(self, event: Any) -> None:
        if self.stage_of is None or event.program not in ("fwd", "bwd"):
            return
        times: list[float] = []
        self.ops.append((event.stage, event.t0, times))
        self.queues[self.stage_of(event.stage)].put((times, event.inputs, event.outputs))

    def bubble(self, devices_of: Mapping[StageKey, frozenset]) -> list[float]:
        """Stops the watchers; per stage ``1 - busy / window``, the window from the first
        op's start to the last op's end (F/B only, as in the simulator).

        Args:
            devices_of: each stage key's devices.

        Raises:
            BaseException: what a watcher raised, re-raised here.
            RuntimeError: no F/B call was timed.
        """
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()
        self.stage_of, stage_of = None, self.stage_of
        if self.errors:
            raise self.errors[0]  # with its traceback in the watcher
        if not self.ops:
            raise RuntimeError("AsyncTimer: no fwd/bwd call between start() and bubble()")
        spans: list[list[tuple[float, float]]] = [[] for _ in range(self.num_stages)]
        ends: list[tuple[frozenset, float]] = []  # earlier ops: devices, end
        for key, dispatched, (ready, end) in self.ops:
            devices = devices_of[key]
            # The hook's t0 precedes the executor's wait for in-flight programs on shared
            # devices (XLA:CPU), so the op also starts no earlier than when they ended.
            free = max((e for d, e in ends if d & devices), default=dispatched)
            spans[stage_of(key)].append((max(dispatched, ready, free), end))
            ends.append((devices, end))
        flat = [s for row in spans for s in row]
        window = max(e for _, e in flat) - min(s for s, _ in flat)
        return [1.0 - _covered(row) / window for row in spans]


def _covered(spans: list[tuple[float, float]]) -> float:
    """The time the union of ``(start, end)`` spans covers. A watcher thread that a busy
    host wakes late records an op's end after the next op of its stage started (summing
    the spans would count that overlap twice: a negative bubble), or after the end of an
    op that waited for it (whose start, the later of the two, then falls after its own
    end: such a span covers nothing)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        begin = max(start, reach)
        if end > begin:
            total += end - begin
            reach = end
    return total
