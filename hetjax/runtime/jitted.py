"""A stage program: ``jax.jit`` plus the ``on_compile`` hook.

Dispatch goes through the jitted function itself (JAX's C++ fast path). When an observer
listens for compiles, the first call with a new argument signature (tree structure,
shapes, dtypes, shardings) also lowers and compiles the function ahead of time and hands
the ``Compiled`` object over; JAX shares that executable with the jitted call, so the
program is still compiled once. In a multi-process run every first call does so, then
meets the other processes of the program's devices if its collectives span them
(:mod:`hetjax.distributed.rendezvous`). Otherwise no signature is computed.

Every program is named after its stage and kind (:func:`program_name`, e.g.
``llm_s1_bwd``): that name is the jitted function's, so XLA's module is ``jit_llm_s1_bwd``
and a ``jax.profiler`` trace (TensorBoard's profile plugin, Perfetto) shows which stage
program ran on which device; the body also runs under ``jax.named_scope`` of the name,
so the HLO ops carry it in their metadata.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from hetjax.distributed.rendezvous import FirstCalls, has_collectives, signature
from hetjax.runtime.observers import Observers


def program_name(stage: tuple[str, int], kind: str) -> str:
    """The readable name of stage ``(module, index)``'s ``kind`` program: ``vision_s0_fwd``."""
    return f"{stage[0]}_s{stage[1]}_{kind}"


def _named(fn: Callable, name: str) -> Callable:
    """``fn`` under ``name`` (what ``jax.jit`` names its module after) and its scope."""

    @functools.wraps(fn)
    def program(*args: Any, **kwargs: Any) -> Any:
        with jax.named_scope(name):
            return fn(*args, **kwargs)

    program.__name__ = program.__qualname__ = name
    return program


class Program:
    """``jax.jit(fn, **jit_kwargs)`` of stage ``stage``, reporting compiles as ``kind``."""

    def __init__(
        self,
        fn: Callable,
        *,
        stage: tuple[str, int],
        kind: str,
        observers: Observers,
        **jit_kwargs: Any,
    ):
        self.name = program_name(stage, kind)
        self.jitted = jax.jit(_named(fn, self.name), **jit_kwargs)
        self.stage, self.kind = stage, kind
        self._observers = observers
        # Multi-process: a first call compiles ahead and meets the processes of the
        # program's devices when its collectives span them (hetjax.distributed.rendezvous:
        # no peer waits at a first collective while another still compiles). One process
        # never meets; its calls pay only the check below, as with no compile observer.
        self._multiprocess = jax.process_count() > 1
        self._first_calls = FirstCalls()
        self._collectives: dict[Any, bool] = {}
        self._abstract: dict = {}  # signature -> jax.eval_shape of the call

    def __call__(self, *args: Any) -> Any:
        if self._multiprocess or self._observers.compile:
            report = self._report if self._observers.compile else None
            self._first_calls.ready(self.name, self.jitted, *args, on_compiled=report)
        return self.jitted(*args)

    def _report(self, compiled: jax.stages.Compiled) -> None:
        self._observers.on_compile(self.stage, self.kind, compiled)

    def collectives(self, *args: Any) -> bool:
        """Whether the executable a call with ``args`` runs has cross-device collectives.

        Compiles ahead of the call the first time per signature (the jitted call then
        reuses that executable) and caches the answer; what the executor's CPU in-flight
        guard asks before it waits (:class:`~hetjax.runtime.inflight.InFlight`).
        """
        key = signature(args)
        known = self._collectives.get(key)
        if known is None:
            known = self._collectives[key] = has_collectives(self.lower(*args).compile())
        return known

    def eval_shape(self, *args: Any) -> Any:
        """The call's outputs as ``ShapeDtypeStruct`` s (with the pinned output shardings),
        traced once per argument signature and never compiled: what a process that owns
        none of the program's devices stands in for them with."""
        key = signature(args)
        if key not in self._abstract:
            self._abstract[key] = self.jitted.eval_shape(*args)
        return self._abstract[key]

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Lowers for ``args`` (arrays or ``jax.ShapeDtypeStruct``), like ``jit(...).lower``."""
        return self.jitted.lower(*args)
