"""Writes the XLA:GPU-compiled HLO that ``tests/inspect/test_hlo.py`` counts matmuls in.

    cd tests/inspect/golden && export PYTHONPATH=../../..
    python make_gpu_hlo.py gpu_matmuls_triton.hlo
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python make_gpu_hlo.py gpu_matmuls_cublas.hlo

Run on a machine with a GPU (the committed files came from an H200, jax 0.11.2). The
program, :func:`program`, is a gradient of a 3-layer scan of ``[256, 512] @ [512, 512]``
matmuls plus a batched ``einsum``. At these sizes XLA:GPU emits its dots as Triton gemm
fusions (``dot`` instructions inside fused computations); with Triton gemms off, as
cuBLASLt custom calls. The test reads both. :data:`MATMUL_FLOPS` is its count by hand.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

LAYERS, ROWS, WIDTH = 3, 256, 512
B, L, D = 4, 128, 64
# forward + two backward matmuls per layer; the einsum and its two cotangents
MATMUL_FLOPS = LAYERS * 3 * 2 * ROWS * WIDTH * WIDTH + 3 * 2 * B * L * L * D


def program():
    """(jitted gradient, its arguments)."""

    def loss(w, x, q, k):
        def layer(h, w_i):
            return jnp.tanh(h @ w_i), None

        h, _ = jax.lax.scan(layer, x, w)
        s = jnp.einsum("bld,bsd->bls", q, k)
        return jnp.sum(jnp.tanh(h).astype(jnp.float32)) + jnp.sum(jnp.tanh(s).astype(jnp.float32))

    keys = jax.random.split(jax.random.key(0), 4)
    args = (
        jax.random.normal(keys[0], (LAYERS, WIDTH, WIDTH), jnp.bfloat16),
        jax.random.normal(keys[1], (ROWS, WIDTH), jnp.bfloat16),
        jax.random.normal(keys[2], (B, L, D), jnp.bfloat16),
        jax.random.normal(keys[3], (B, L, D), jnp.bfloat16),
    )
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), args


if __name__ == "__main__":
    fn, args = program()
    text = fn.lower(*args).compile().as_text()
    with open(sys.argv[1], "w") as f:
        f.write(text)
    from hetjax.inspect.hlo import matmul_flops

    got = matmul_flops(text)
    print(f"{jax.devices()[0].device_kind}: matmul_flops {got:.0f}, by hand {MATMUL_FLOPS}")
