"""This process's place in the job, as :func:`~hetjax.distributed.initialize` recorded it.

A module of its own so that :mod:`~hetjax.distributed.initialize` and the watchdog it
installs (:mod:`~hetjax.distributed.watchdog`) both read it without importing each other.
"""

from __future__ import annotations

_where: tuple[int, int] | None = None


def record(process_id: int, num_processes: int) -> None:
    """Remembers this process's id and the job's process count (called by initialize)."""
    global _where
    _where = (process_id, num_processes)


def where() -> tuple[int, int]:
    """(process id, number of processes), from :func:`initialize` or else from JAX."""
    if _where is not None:
        return _where
    import jax

    return jax.process_index(), jax.process_count()
