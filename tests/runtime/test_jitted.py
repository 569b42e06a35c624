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
