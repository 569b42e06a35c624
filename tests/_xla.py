"""XLA flags every test process uses (conftest sets them; subprocesses that must not
inherit the parent's device count rebuild their XLA_FLAGS from :func:`subprocess_flags`).

``--xla_backend_optimization_level=1``: XLA:CPU's LLVM back end at O1 instead of its
default. Compiling, not running, is most of the suite's time (thousands of small
programs on 2 cores), and O1 compiles them about 1.5x faster. Measured on
``llava_train --steps 3 --devices 2 --global-batch 8`` with a cold cache: 29.2 s of CPU
time at the default, 19.5 s at O1, 18.7 s at O0; the printed losses (5.7801 -> 5.5770)
are the same. O0 is not taken: its programs run slowly enough that the 200-step
``test_encoder_matters`` takes 128 s instead of 67 s (64 s at O1). The flag changes LLVM's
code generation only, not the HLO, so every comparison in the suite (a layout against
the single-device reference, a resumed run against an uninterrupted one) compiles both
sides under it; the entry points and benchmarks keep XLA's defaults.
"""

COMPILE_FLAGS = "--xla_backend_optimization_level=1"  # see above
# XLA:CPU aborts when a collective waits 40 s for a participant; tests start several
# processes on 2 cores, which can starve a device thread that long.
COLLECTIVE_FLAGS = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def subprocess_flags() -> str:
    """XLA_FLAGS for a subprocess that sets its own device count."""
    return f"{COMPILE_FLAGS} {COLLECTIVE_FLAGS}".strip()
