"""Compile first, then meet (hetjax.distributed.rendezvous), in one process: the barrier
ids, who meets, and when a first call meets. A fake coordination client stands in for
the other processes; tests/distributed/test_own_compiles.py and test_train_multiprocess.py
run the real barriers."""

from __future__ import annotations

import types
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import distributed
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.distributed import rendezvous
from hetjax.inspect import CompileCounter
from hetjax.runtime.jitted import Program
from hetjax.runtime.observers import Observers


class FakeClient:
    """Records barriers; raises ``error`` instead when given one."""

    def __init__(self, error: Exception | None = None):
        self.barriers: list[tuple[str, int, list[int]]] = []
        self.error = error

    def wait_at_barrier(self, barrier_id, timeout_in_ms, process_ids=None):
        if self.error is not None:
            raise self.error
        self.barriers.append((barrier_id, timeout_in_ms, process_ids))


def as_process(monkeypatch, index: int, client: FakeClient | None) -> None:
    """This test process acts as process ``index`` of several, with a fresh record."""
    monkeypatch.setattr(jax, "process_index", lambda: index)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(rendezvous, "_met", Counter())
    monkeypatch.setattr(distributed.global_state, "client", client)


def meetings_of(monkeypatch, index: int) -> list[tuple[str, int, list[int]]]:
    client = FakeClient()
    as_process(monkeypatch, index, client)
    rendezvous.meet("llm_s0_fwd", (1, 0))
    rendezvous.meet("llm_s0_fwd", (0, 1))
    rendezvous.meet("llm_s0_fwd", (0, 1, 2))
    rendezvous.meet("permute edge a -> b", (0, 1))
    return client.barriers


def test_barrier_ids_agree_across_processes_and_are_unique_per_meeting(monkeypatch):
    first, second = meetings_of(monkeypatch, 0), meetings_of(monkeypatch, 1)
    assert first == second  # what both members of a group wait at
    ids = [b[0] for b in first]
    assert ids == [
        "hetjax:llm_s0_fwd:0-1:0",
        "hetjax:llm_s0_fwd:0-1:1",
        "hetjax:llm_s0_fwd:0-1-2:0",
        "hetjax:permute edge a -> b:0-1:0",
    ]
    assert [b[2] for b in first] == [[0, 1], [0, 1], [0, 1, 2], [0, 1]]  # only the members
    assert {b[1] for b in first} == {rendezvous.TIMEOUT_S * 1000}
    assert rendezvous.meetings() == 4


def test_one_process_never_meets(monkeypatch):
    client = FakeClient()
    as_process(monkeypatch, 0, client)
    rendezvous.meet("llm_s0_fwd", (0,))
    assert client.barriers == [] and rendezvous.meetings() == 0


def test_a_peer_that_never_arrives_fails_naming_the_program_and_processes(monkeypatch):
    late = jax.errors.JaxRuntimeError("DEADLINE_EXCEEDED: barrier timed out")
    as_process(monkeypatch, 0, FakeClient(late))
    with pytest.raises(RuntimeError, match=r"llm_s1_bwd: processes \[0, 1\] did not all reach"):
        rendezvous.meet("llm_s1_bwd", (0, 1), timeout_s=1)


def test_meeting_needs_the_distributed_client_and_membership(monkeypatch):
    as_process(monkeypatch, 0, None)
    with pytest.raises(RuntimeError, match=r"hetjax.distributed.initialize\(\)"):
        rendezvous.meet("llm_s0_fwd", (0, 1))
    as_process(monkeypatch, 2, FakeClient())
    with pytest.raises(ValueError, match="process 2 meets"):
        rendezvous.meet("llm_s0_fwd", (0, 1))


def sharded(n: int = 8) -> NamedSharding:
    return NamedSharding(Mesh(np.array(jax.devices()[:n]), ("dp",)), P("dp"))


def test_only_members_of_a_spanning_program_with_collectives_meet(monkeypatch):
    x = jax.device_put(jnp.ones(8), sharded())
    summed = jax.jit(lambda a: a.sum()).lower(x).compile()  # an all-reduce
    local = jax.jit(lambda a: a * 2).lower(x).compile()  # none
    assert rendezvous.compiled_processes(summed) == (0,)  # the simulated devices: one process
    fake = [types.SimpleNamespace(process_index=i) for i in (3, 1, 1, 0)]
    assert rendezvous.processes_of(fake) == (0, 1, 3)
    met = []
    monkeypatch.setattr(rendezvous, "meet", lambda name, procs: met.append((name, procs)))
    for index in (0, 1, 2):
        monkeypatch.setattr(jax, "process_index", lambda i=index: i)
        for procs in [(0,), (0, 1)]:
            monkeypatch.setattr(rendezvous, "compiled_processes", lambda c, p=procs: p)
            rendezvous.meet_compiled("sum", summed)
            rendezvous.meet_compiled("double", local)
    # Spanning (0, 1), with collectives, and this process a member; never the others.
    assert met == [("sum", (0, 1)), ("sum", (0, 1))]


def test_first_calls_compile_ahead_and_meet_once_per_signature(monkeypatch):
    met = []
    monkeypatch.setattr(rendezvous, "meet_compiled", lambda name, c: met.append((name, c)))
    fn = jax.jit(lambda a, n: a[:n] * 2, static_argnums=(1,))
    first = rendezvous.FirstCalls()
    x = jax.device_put(jnp.ones(8), sharded())
    first.ready("one", fn, x, 4)  # one process: returns at once
    assert met == []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with CompileCounter() as compiles:
        first.ready("cut", fn, x, 4)
        fn(x, 4)  # the call reuses the executable compiled ahead
    assert compiles.count == 1 and isinstance(met[0][1], jax.stages.Compiled)
    first.ready("cut", fn, x, 4)  # the same signature: nothing
    first.ready("cut", fn, x, 2)  # a static argument is part of it
    first.ready("cut", fn, jax.device_put(jnp.ones(16), sharded()), 4)  # a new shape
    first.ready("cut", fn, x, 4, key="another cache entry")
    assert [name for name, _ in met] == ["cut"] * 4
    direct = []
    monkeypatch.setattr(rendezvous, "meet", lambda name, procs: direct.append((name, procs)))
    for size in (3, 3, 5):
        first.once("gather", (0, 1), key=(size,))
    assert direct == [("gather", (0, 1))] * 2  # the first time per key


def test_a_stage_program_meets_on_its_first_call_per_signature_in_multiple_processes(
    monkeypatch,
):
    met = []
    monkeypatch.setattr(rendezvous, "meet_compiled", lambda name, c: met.append(name))
    prog = Program(lambda a: a.sum(), stage=("llm", 1), kind="bwd", observers=Observers())
    x = jax.device_put(jnp.ones(8), sharded())
    prog(x)
    assert met == []  # one process: never
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    prog._multiprocess = True  # what a multi-process run sets at construction
    other = jax.device_put(jnp.ones(16), sharded())
    with CompileCounter() as compiles:
        for a in (other, other, x):
            prog(a)
    assert compiles.count == 1  # the new signature, compiled once (ahead of its call)
    # x's executable existed already, but its first call in this mode still meets: the
    # decision is the signature's, the same on every process.
    assert met == ["llm_s1_bwd", "llm_s1_bwd"]
