"""A stage program: ``jax.jit`` plus the ``on_compile`` hook.

Dispatch goes through the jitted function itself (JAX's C++ fast path). When an observer
listens for compiles, the first call with a new argument signature (tree structure,
shapes, dtypes, shardings) also lowers and compiles the function ahead of time and hands
the ``Compiled`` object over; JAX shares that executable with the jitted call, so the
program is still compiled once. Without such an observer no signature is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from hetjax.runtime.observers import Observers


def signature(args: tuple) -> Any:
    """What decides which executable a call uses (hashable)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple(
        (a.shape, a.dtype, a.sharding) if isinstance(a, jax.Array) else type(a) for a in leaves
    )


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
        self.jitted = jax.jit(fn, **jit_kwargs)
        self.stage, self.kind = stage, kind
        self._observers = observers
        self._seen: set = set()

    def __call__(self, *args: Any) -> Any:
        if self._observers.compile:
            key = signature(args)
            if key not in self._seen:
                self._seen.add(key)
                self._observers.on_compile(self.stage, self.kind, self.lower(*args).compile())
        return self.jitted(*args)

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Lowers for ``args`` (arrays or ``jax.ShapeDtypeStruct``), like ``jit(...).lower``."""
        return self.jitted.lower(*args)
