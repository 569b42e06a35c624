"""Test set-up: 8 simulated CPU devices, configured before JAX starts its backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU aborts when a collective waits 40 s for a participant; tests start several
# processes on 2 cores, which can starve a device thread that long. Subprocesses inherit it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_cpu_collective_call_terminate_timeout_seconds=600"
).strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)
