"""XLA flags every test process uses (conftest sets them; subprocesses that must not
inherit the parent's device count rebuild their XLA_FLAGS from :data:`COMPILE_FLAGS`).

Most of the suite's time is XLA:CPU compiling small programs. LLVM's optimisation level
0 (and skipping its expensive passes) cuts compile time about 3x on these tests, while
steps run a little slower: the trade is right for tests, where a program runs a few
times. Every comparison the tests make is between programs compiled the same way, and
bit-exact checks compare a run with itself, so no check depends on the level; the
product (``make train``, benchmarks, GPU runs) keeps XLA's defaults.
"""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA:CPU aborts when a collective waits 40 s for a participant; tests start several
# processes on 2 cores, which can starve a device thread that long.
COLLECTIVE_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def subprocess_flags() -> str:
    """XLA_FLAGS for a subprocess that sets its own device count."""
    return f"{COMPILE_FLAGS} {COLLECTIVE_FLAGS}"
