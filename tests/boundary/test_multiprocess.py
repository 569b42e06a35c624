"""Two local JAX processes (gloo CPU collectives): encoder island on process 0, LLM island
on process 1. Forward values and gradients must equal a single-device run."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._xla import subprocess_flags

from . import _mp_worker as worker

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = subprocess_flags()  # no device count: the launcher sets it
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    port = str(_free_port())
    script = str(Path(worker.__file__))
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(i), port, str(tmp_path)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"multi-process boundary run hung for more than {TIMEOUT_S} s")
    for i, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"process {i} failed:\n{log[-4000:]}"

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
