"""Two local JAX processes (gloo CPU collectives): encoder island on process 0, LLM island
on process 1. Forward values and gradients must equal a single-device run."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import launch

from . import _mp_worker as worker

TIMEOUT_S = 120


def _reference(data):
    f = lambda w, w1, w2: worker.llm_loss(worker.encode(w, data["x"]), w1, w2)
    loss, grads = jax.value_and_grad(f, argnums=(0, 1, 2))(data["w"], data["w1"], data["w2"])
    y = worker.encode(data["w"], data["x"])
    g_y = jax.grad(lambda y: worker.llm_loss(y, data["w1"], data["w2"]))(y)
    return dict(y=y, loss=loss, g_w=grads[0], g_w1=grads[1], g_w2=grads[2], g_y_src=g_y)


def _close(got, want):
    # DP/TP partial sums reorder float additions: rtol 1e-6 with a floor of 1e-6 of the
    # largest entry for entries that cancel towards zero.
    scale = float(jnp.max(jnp.abs(want)))
    chex.assert_trees_all_close(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6 * scale)


@pytest.mark.multiprocess
def test_two_processes_match_single_device(tmp_path):
    procs = launch.start_job(
        2, lambda i, coordinator: [worker.__name__, str(i), coordinator, str(tmp_path)]
    )
    done = launch.finish({f"process {i}": proc for i, proc in enumerate(procs)}, TIMEOUT_S)
    for name, result in done.items():
        assert result.returncode == 0, f"{name} failed:\n{(result.stdout + result.stderr)[-4000:]}"

    shards = {}
    for i in range(2):
        with np.load(tmp_path / f"p{i}.npz") as saved:
            shards.update({(i, key): saved[key] for key in saved.files})
    ref = _reference(worker.inputs())
    # Non-colocated: the encoder side lives on process 0, the LLM side on process 1.
    owner = dict(y={1}, loss={1}, g_w1={1}, g_w2={1}, g_w={0}, g_y_src={0})
    for name, _, _, placement, _, _ in worker.CASES:
        for key, want in ref.items():
            got, processes = _assemble(shards, f"{name}/{key}", np.shape(want))
            assert processes == ({0, 1} if placement == "colocated" else owner[key]), (name, key)
            _close(got, want)


def _assemble(shards, key: str, shape) -> tuple[np.ndarray, set[int]]:
    """Rebuilds a global array from the shards both processes saved."""
    out = np.full(shape, np.nan, np.float32)
    processes = set()
    for (process, name), data in shards.items():
        if name.startswith(key + "@") and not name.endswith(":index"):
            bounds = shards[process, name + ":index"]
            out[tuple(slice(lo, hi) for lo, hi in bounds)] = data
            processes.add(process)
    assert not np.isnan(out).any(), f"{key}: shards do not cover the array"
    return out, processes
