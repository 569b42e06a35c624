"""hetjax.gpu: the suggested XLA:GPU flags (XLA's O1 and MaxText's GPU recipe) are well
formed, known to this jaxlib, and merge into XLA_FLAGS without duplicates; applying them
after the backend starts fails."""

import os
import re

import jax
import pytest

from hetjax import gpu
from tests import launch


def test_flags_are_well_formed():
    flags = gpu.gpu_flags()
    assert flags and len(flags) == len(set(flags))
    for f in flags:
        assert re.fullmatch(r"--xla_gpu_[a-z0-9_]+=(true|false|[0-9]+)", f), f
    maxtext = gpu.gpu_flags("maxtext")
    assert set(flags) < set(maxtext) and len(maxtext) == len(set(maxtext))
    assert "--xla_gpu_enable_triton_gemm=false" in maxtext
    for f in maxtext:
        assert re.fullmatch(r"--xla_[a-z0-9_]+=(true|false|[0-9]+|[a-z_]*)", f), f


def test_merge_keeps_user_values_and_adds_each_flag_once():
    flags = gpu.gpu_flags()
    mine = "--xla_cpu_enable_fast_math=false --xla_gpu_enable_latency_hiding_scheduler=false"
    merged = gpu.merge_flags(mine, flags)
    names = [f.split("=")[0] for f in merged.split()]
    assert len(names) == len(set(names))
    assert merged.startswith(mine)  # the user's flags first, with the user's values
    assert set(flags) - set(merged.split()) == {"--xla_gpu_enable_latency_hiding_scheduler=true"}
    assert gpu.merge_flags(merged, flags) == merged  # idempotent


def test_apply_refuses_after_the_backend_started(monkeypatch):
    jax.devices()  # the test session's backend runs
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_foo=1")
    with pytest.raises(RuntimeError, match="before jax.devices"):
        gpu.apply_gpu_flags()
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_foo=1"


@pytest.mark.parametrize("recipe", ["o1", "maxtext"])
def test_apply_before_the_backend_sets_flags_xla_knows(recipe):
    # XLA aborts on an unknown flag in XLA_FLAGS; a fresh process applies them and runs.
    code = (
        f"import os, hetjax, jax; hetjax.apply_gpu_flags({recipe!r}); "
        "print(jax.numpy.ones(2).sum()); print(os.environ['XLA_FLAGS'])"
    )
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
    out = launch.run_code(code, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    total, flags = out.stdout.splitlines()[-2:]
    assert total == "2.0"
    assert flags.split() == ["--xla_cpu_enable_fast_math=false", *gpu.gpu_flags(recipe)]
