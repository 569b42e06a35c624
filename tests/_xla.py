"""XLA flags every test process uses (conftest sets them; subprocesses that must not
inherit the parent's device count rebuild their XLA_FLAGS from :func:`subprocess_flags`).

``--xla_backend_optimization_level=0``: XLA:CPU's LLVM back end at O0 instead of its
default. Compiling, not running, is most of the suite's time (thousands of small
programs on 2 cores). Measured on ``llava_train --steps 3 --devices 2 --global-batch 8``
with a cold cache: 11.9 s of CPU time at the default, 9.6 s at O1, 7.6 s at O0, with the
same printed losses (5.7801 -> 5.5770). The whole ``make test`` from a fresh clone
(2 cores): 869 s at O1, 763 s at O0 (main suite 582 -> 501 s, multi-process 263 -> 241
s). The few tests whose run time outweighs their compiles ask for O1 per program
(:data:`OPTIMISED`, ``jax.jit``'s ``compiler_options``): the 200-step
``test_encoder_matters`` takes 54 s at O0 and 29 s so. The flag changes LLVM's code
generation only, not the HLO, so every comparison in the suite (a layout against the
single-device reference, a resumed run against an uninterrupted one) compiles both sides
under it; the entry points and benchmarks keep XLA's defaults.

``--xla_cpu_use_fusion_emitters=false``: XLA:CPU's older loop emitters instead of its
MLIR fusion emitters, which take longer to compile. Measured with a cold cache on the
2-core machine (CPU time, both with O0, the same printed losses): ``llava_train --steps 3
--devices 2 --global-batch 8`` 9.1 -> 5.1 s, ``llava_train --steps 4 --layout
vision:dp=4,tp=2 --layout llm:dp=2,tp=2,pp=2`` 14.2 -> 8.7 s. Like O0 it changes code
generation, not the HLO, and both sides of every comparison compile under it. The
200-step ``test_encoder_matters`` runs about 12% slower with it, so :data:`OPTIMISED`
turns the fusion emitters back on with O1.

``--xla_cpu_parallel_codegen_split_count=1``: XLA:CPU splits each program's LLVM module
into parts compiled on a thread pool (for many cores); on 2 cores that are already both
busy compiling (two pytest workers, the multi-process runs), the split and its thread
hand-offs are pure overhead. Measured with a cold cache (CPU time, 2-core machine under
the same load, two runs each): ``llava_train --steps 4 --layout vision:dp=4,tp=2
--layout llm:dp=2,tp=2,pp=2`` 9.18 / 9.09 s -> 7.75 / 8.12 s. The losses agree to 4
decimals; some losses and gradient norms differ in their last bits from the default
split's (the HLO is the same, LLVM's code for it is not); as with the flags above, both
sides of every comparison compile under it. The whole ``make test`` from a fresh clone
(2 cores, 18:57-19:38 UTC, nothing else of this project running): 821 s without it, 782 s
with it (CPU 1551 -> 1477 s; the 1724 tests pass in both).
"""

COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
)
# Appended to XLA_FLAGS (the last setting wins) by a test that compares two DIFFERENT
# programs' shared maths bit for bit: the loop emitters reduced the same gradients in
# another order in a program with one select more (1-ulp differences in the checkpoint
# CLI's skip test); XLA:CPU's default fusion emitters gave identical bits there.
FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=true"
# What a test whose run time outweighs its compiles passes as jax.jit compiler_options.
OPTIMISED = {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": True}
# XLA:CPU aborts when a collective waits 40 s for a participant; tests start several
# processes on 2 cores, which can starve a device thread that long.
COLLECTIVE_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def subprocess_flags() -> str:
    """XLA_FLAGS for a subprocess that sets its own device count."""
    return f"{COMPILE_FLAGS} {COLLECTIVE_FLAGS}".strip()
