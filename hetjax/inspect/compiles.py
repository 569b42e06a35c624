"""Counting XLA compiles through JAX's public ``jax.monitoring`` events.

JAX reports every backend compile (a fresh one, or one loaded from the persistent
compilation cache: the event wraps compile-or-load) as the duration event
``/jax/core/compile/backend_compile_duration``, tagged with the jitted function's name.
Counting those events answers "did anything compile here?" for a whole block of code -
transfers, reshards and small eager ops included - without reaching into a jitted
function's private ``_cache_size()``, which sees only that one function.

Events are process-wide: a counter also counts compiles that other threads start while
it is active.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts backend compiles while active; a context manager or ``start()``/``stop()``.

    Example:
        >>> with CompileCounter() as compiles:  # doctest: +SKIP
        ...     f(x)
        >>> compiles.count, compiles.names  # doctest: +SKIP
        (1, ['jit(f)'])
    """

    def __init__(self) -> None:
        self.count = 0  # compiles seen while active
        self.names: list[str] = []  # what compiled, as JAX names it ("jit(f)"), in order
        self._active = False
        self._registered = False

    def _on_event(self, event: str, duration: float, **kwargs: Any) -> None:
        if self._active and event == BACKEND_COMPILE_EVENT:
            self.count += 1
            self.names.append(str(kwargs.get("fun_name", "?")))

    def start(self) -> CompileCounter:
        """Starts counting (again); returns ``self``."""
        if not self._registered:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._registered = True
        self._active = True
        return self

    def stop(self) -> None:
        """Stops counting; the counts stay. Unregisters the listener where JAX can."""
        self._active = False
        unregister = getattr(jax.monitoring, "unregister_event_duration_listener", None)
        if self._registered and unregister is not None:
            unregister(self._on_event)
            self._registered = False

    def __enter__(self) -> CompileCounter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def expect_compiles(expected: int = 0, what: str = "the block") -> Iterator[CompileCounter]:
    """Asserts that exactly ``expected`` backend compiles happen inside the block.

    ``with expect_compiles(0): ex.step(batch)`` is the "no recompilation" check: it holds
    for everything the block runs, not one jitted function's cache.

    Args:
        expected: how many compiles the block must cause.
        what: names the block in the error.

    Raises:
        AssertionError: on exit, when the count differs; names what compiled.
    """
    with CompileCounter() as counter:
        yield counter
    if counter.count != expected:
        raise AssertionError(
            f"{what} compiled {counter.count} programs, expected {expected}: "
            f"{', '.join(counter.names) or 'none'}"
        )
