"""XLA flags every test process uses (conftest sets them; subprocesses that must not
inherit the parent's device count rebuild their XLA_FLAGS from :func:`subprocess_flags`).

Tried and rejected: LLVM optimisation level 0 (``--xla_backend_optimization_level=0``)
compiles these programs about 3x faster, but it changes float results (vectorised
reductions), and the 200-step training test ``test_encoder_matters`` then lands on the
other side of its bound. Tests must judge the code as it runs, so XLA's defaults stay.
"""

COMPILE_FLAGS = ""  # XLA's defaults (see above)
# XLA:CPU aborts when a collective waits 40 s for a participant; tests start several
# processes on 2 cores, which can starve a device thread that long.
COLLECTIVE_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def subprocess_flags() -> str:
    """XLA_FLAGS for a subprocess that sets its own device count."""
    return f"{COMPILE_FLAGS} {COLLECTIVE_FLAGS}".strip()
