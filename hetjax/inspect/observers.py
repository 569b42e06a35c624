"""A :class:`Recorder`: the executor observer that benchmarks and tests read a run from.

It keeps what the executor's public hooks report - each stage program's compiled
executable (HLO text, ``memory_analysis()``), how often every program was called, the
bytes every stage edge moved, and the most each stage's stash (what its forwards keep
for their backwards) held at once - instead of wrapping the executor's programs and
transfers. Pass it at construction (``hetjax.Executor(..., observers=[recorder])``).

The executor calls whichever hooks an observer has, so this class needs no base class
from :mod:`hetjax.runtime` (which :mod:`hetjax.inspect` must not import): the events are
read by attribute (``stage``, ``program``; ``op.kind``, ``src``, ``dst``, ``nbytes``,
``live``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

StageKey = tuple[str, int]  # (module, pipeline stage)
ProgramKey = tuple[StageKey, str]  # (stage, program kind: fwd, bwd, zeros, reduce, update)


class Recorder:
    """Records compiles, program calls and transfer bytes of an executor.

    Compiles are recorded always (each signature compiles once); calls and transfers only
    while recording, so a benchmark can count one step and leave the rest out
    (:meth:`pause`). Attach it when the executor is built.

    Example:
        >>> rec = Recorder()  # doctest: +SKIP
        >>> ex = hetjax.Executor(plan, params, devices=devices, observers=[rec])
        >>> ex.step(batch)
        >>> rec.pause()
        >>> rec.compiled[(("llm", 0), "bwd")].as_text()  # the HLO of its first call
    """

    def __init__(self) -> None:
        self.compiled: dict[ProgramKey, Any] = {}  # the first ``jax.stages.Compiled``
        self.compiles: Counter[ProgramKey] = Counter()  # argument signatures compiled
        self.calls: Counter[ProgramKey] = Counter()  # calls while recording
        # (from stage, to stage) in the forward direction -> bytes moved while recording,
        # activations and their gradients together
        self.moved: Counter[tuple[StageKey, StageKey]] = Counter()
        # stage -> the most stash bytes (over all devices) / entries held at once, while
        # recording
        self.stash_bytes: Counter[StageKey] = Counter()
        self.stash_entries: Counter[StageKey] = Counter()
        self._stashed: Counter[StageKey] = Counter()
        self.recording = True

    def pause(self) -> None:
        """Stops counting calls and transfers (compiles are still recorded)."""
        self.recording = False

    def resume(self) -> None:
        """Counts calls and transfers again."""
        self.recording = True

    def moved_from(self, module: str) -> int:
        """Bytes moved along the edges leaving ``module``'s stages: its outgoing links and
        its own stage-to-stage copies, forward and backward."""
        return sum(n for (src, _), n in self.moved.items() if src[0] == module)

    def per_step(self, count: Any, devices: dict[StageKey, int]) -> float:
        """``count(compiled)`` (a per-device figure, e.g. FLOPs) times the stage's
        ``devices``, summed over the recorded calls (e.g. those of one step)."""
        return sum(
            n * count(self.compiled[(key, kind)]) * devices[key]
            for (key, kind), n in self.calls.items()
        )

    def on_compile(self, stage: StageKey, kind: str, compiled: Any) -> None:
        self.compiles[(stage, kind)] += 1
        self.compiled.setdefault((stage, kind), compiled)

    def on_dispatch(self, event: Any) -> None:
        if self.recording:
            self.calls[(event.stage, event.program)] += 1

    def on_transfer(self, event: Any) -> None:
        if self.recording:
            # A gradient (SEND_B) goes back along the edge its activation came down.
            backward = event.op.kind == "SEND_B"
            edge = (event.dst, event.src) if backward else (event.src, event.dst)
            self.moved[edge] += event.nbytes

    def on_stash(self, event: Any) -> None:
        key = event.op.stage
        self._stashed[key] += event.nbytes if event.op.kind == "F" else -event.nbytes
        if self.recording:
            self.stash_bytes[key] = max(self.stash_bytes[key], self._stashed[key])
            self.stash_entries[key] = max(self.stash_entries[key], event.live)
