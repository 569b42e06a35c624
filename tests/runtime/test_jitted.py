"""Stage programs are named after their module, stage and kind, in HLO and in traces."""

import jax.numpy as jnp

from hetjax.runtime.jitted import Program, program_name
from hetjax.runtime.observers import Observers


def test_program_carries_its_stage_name_into_the_module_and_op_metadata():
    assert program_name(("llm", 1), "bwd") == "llm_s1_bwd"
    prog = Program(lambda x: jnp.sin(x) * 2, stage=("llm", 1), kind="bwd", observers=Observers())
    lowered = prog.lower(jnp.ones(4))
    assert prog.name == "llm_s1_bwd"
    assert "jit_llm_s1_bwd" in lowered.as_text()
    assert "llm_s1_bwd/sin" in lowered.as_text(debug_info=True)  # jax.named_scope
    assert float(prog(jnp.zeros(4))[0]) == 0.0


def test_collectives_are_read_from_the_compiled_program_per_signature():
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:4]), ("dp",))
    split = NamedSharding(mesh, P("dp"))
    summed = Program(
        lambda x: x.sum(), stage=("llm", 0), kind="fwd", observers=Observers()
    )  # a sharded sum: an all-reduce
    local = Program(lambda x: x * 2, stage=("llm", 0), kind="bwd", observers=Observers())
    x = jax.device_put(jnp.arange(8.0), split)
    assert summed.collectives(x)
    assert not local.collectives(x)  # element-wise on each shard: nothing crosses
    # A single-device signature of the same program has none; each is cached apart.
    assert not summed.collectives(jax.device_put(jnp.arange(8.0), jax.devices()[0]))
    assert summed.collectives(x)
    assert float(summed(x)) == 28.0  # the call reuses what was compiled


def test_inflight_guard_waits_only_between_collective_programs():
    import jax

    from hetjax.runtime.inflight import InFlight

    class Output:  # records when the guard syncs on it
        waited = False

        def block_until_ready(self):
            self.waited = True
            return self

    guard = InFlight(enabled=True)
    devices = frozenset(jax.devices()[:4])
    quiet, loud = Output(), Output()
    guard.hold(devices, quiet, collective=False)
    guard.wait(devices, collective=True)
    assert not quiet.waited  # never held: a program without collectives cannot deadlock
    guard.hold(devices, loud, collective=True)
    guard.wait(devices, collective=False)
    assert not loud.waited  # a program without collectives need not wait
    guard.wait(frozenset(jax.devices()[4:]), collective=True)
    assert not loud.waited  # disjoint devices
    guard.wait(frozenset(jax.devices()[2:6]), collective=True)
    assert loud.waited
