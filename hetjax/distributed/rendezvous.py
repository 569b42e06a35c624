"""Compile first, then meet: the first call of a program whose collectives span processes.

XLA:CPU's cross-process collectives (gloo) set up a communicator the first time a
collective runs on a group of processes, and that set-up waits at most 30 s for every
member of the group (hard-coded; no ``--xla_cpu_collective_*`` flag changes it). In a
multi-process run each process compiles only the programs of its own devices, so
processes reach a shared program after different amounts of compiling: on a loaded
machine one can arrive at the first shared collective more than 30 s before another
and fail with ``Gloo context initialization failed: DEADLINE_EXCEEDED``.

So before the first call of such a program per argument signature, :class:`FirstCalls`
compiles it here (``lower(...).compile()``; the jitted call then reuses the executable)
and, if the compiled HLO has collectives, waits at a coordination-service barrier of
exactly the processes that own its devices (:func:`meet`, up to :data:`TIMEOUT_S`).
Past the barrier nothing is left to compile, so every member dispatches at once.

Only first calls meet: a later call with the same signature compiles nothing, and the
communicators its collectives use exist already, so no 30 s set-up limit applies; the
processes are then kept in step by the collectives themselves (every process walks the
same ops in one order). A new signature (a new shape, a new executor) compiles again
and so meets again. In one process nothing here runs: :meth:`FirstCalls.ready` returns
at once.

Barrier ids must be equal on all members and used once: ``hetjax:<name>:<processes>:<n>``
with ``n`` counting this process's meetings of that name and group. Every member decides
to meet from what all members see alike (the program's global argument signature and its
SPMD-partitioned HLO), in the one order of the ops, so the counts agree; were they to
disagree, the ids would not match and the barrier fails after the timeout naming the
program, instead of pairing the wrong meetings.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import jax

TIMEOUT_S = 600  # a barrier's wait: as long as a slow peer may compile (10 min)

# Cross-device communication in a compiled HLO module (async forms start with these too).
_COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute|collective-broadcast"
    r"|ragged-all-to-all)(-start)?\("
)

_met: Counter[tuple[str, tuple[int, ...]]] = Counter()  # (name, processes) -> meetings


def meetings() -> int:
    """How many barriers this process has waited at (:func:`meet` with 2+ processes)."""
    return sum(_met.values())


def has_collectives(compiled: jax.stages.Compiled) -> bool:
    """Whether ``compiled`` runs a cross-device collective (from its optimized HLO)."""
    return _COLLECTIVE.search(compiled.as_text()) is not None


def processes_of(devices: Iterable[jax.Device]) -> tuple[int, ...]:
    """The processes owning ``devices``, sorted."""
    return tuple(sorted({d.process_index for d in devices}))


def compiled_processes(compiled: jax.stages.Compiled) -> tuple[int, ...]:
    """The processes owning a device of ``compiled``'s inputs or outputs."""
    shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    return processes_of(d for s in shardings for d in s.device_set)


def barrier_id(name: str, processes: Sequence[int], n: int) -> str:
    """The id of the ``n``-th meeting (from 0) of ``processes`` named ``name``."""
    return f"hetjax:{name}:{'-'.join(map(str, processes))}:{n}"


def meet(name: str, processes: Sequence[int], *, timeout_s: float = TIMEOUT_S) -> None:
    """Waits until every one of ``processes`` (this one among them) has called
    ``meet(name, processes)`` as often as this one; nothing for one process.

    Raises:
        RuntimeError: a member did not arrive within ``timeout_s`` (it failed, or it runs
            other programs: the processes diverged).
    """
    processes = tuple(sorted(processes))
    if len(processes) < 2:
        return
    if jax.process_index() not in processes:
        raise ValueError(f"{name}: process {jax.process_index()} meets {processes} without them")
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(f"{name}: no distributed client; call hetjax.distributed.initialize()")
    key = (name, processes)
    barrier = barrier_id(name, processes, _met[key])
    _met[key] += 1
    try:
        client.wait_at_barrier(barrier, int(timeout_s * 1000), list(processes))
    except jax.errors.JaxRuntimeError as e:
        raise RuntimeError(
            f"{name}: processes {list(processes)} did not all reach its first call within"
            f" {timeout_s:.0f} s (barrier {barrier}): a peer failed or runs other programs"
        ) from e


def signature(args: tuple) -> Hashable:
    """What decides which executable a call of a jitted function uses (hashable): the tree
    structure, each array's shape, dtype and sharding, other leaves (static arguments)
    by value where hashable."""
    leaves, tree = jax.tree.flatten(args)

    def leaf(a: Any) -> Hashable:
        if isinstance(a, jax.Array):
            return a.shape, a.dtype, a.sharding
        return a if isinstance(a, Hashable) else type(a)

    return tree, tuple(leaf(a) for a in leaves)


def meet_compiled(name: str, compiled: jax.stages.Compiled) -> None:
    """Meets the processes of ``compiled``'s devices if it has collectives and spans
    more than one process (what the first call of it needs; :class:`FirstCalls`)."""
    processes = compiled_processes(compiled)
    mine = jax.process_index() in processes  # else this process runs none of it
    if mine and len(processes) > 1 and has_collectives(compiled):
        meet(name, processes)


class FirstCalls:
    """Meets the first call per argument signature of jitted programs (see the module).

    Keys must be the same on every process for the same program: a name, a stage
    program's own object's record (one :class:`FirstCalls` per owner), or, for programs
    in a process-wide cache, what the cache is keyed by (a plan, a sharding) - never an
    object's ``id``.
    """

    def __init__(self) -> None:
        self._seen: set = set()

    def ready(
        self,
        name: str,
        fn: Callable,
        *args: Any,
        key: Hashable = None,
        on_compiled: Callable[[jax.stages.Compiled], None] | None = None,
    ) -> None:
        """Before ``fn(*args)`` (``fn`` jitted, named ``name`` in errors): in a
        multi-process run, on the first call per ``key`` and signature, compiles it and
        meets the processes of its devices if it runs collectives. Then call ``fn``.

        ``on_compiled`` (e.g. a compile observer) gets that ``Compiled`` first, also in
        one process: then first calls compile ahead in one process too, and only the
        meeting is left out."""
        multiprocess = jax.process_count() > 1
        if not multiprocess and on_compiled is None:
            return
        seen = (name, key, signature(args))
        if seen in self._seen:
            return
        self._seen.add(seen)
        compiled = fn.lower(*args).compile()
        if on_compiled is not None:
            on_compiled(compiled)
        if multiprocess:
            meet_compiled(name, compiled)

    def once(self, name: str, processes: Sequence[int], *, key: Hashable = None) -> None:
        """Meets ``processes`` the first time per ``name`` and ``key``: before a call that
        compiles inside (``multihost_utils.process_allgather``), the same small program
        on every member."""
        if jax.process_count() == 1 or (name, key) in self._seen:
            return
        self._seen.add((name, key))
        meet(name, processes)
