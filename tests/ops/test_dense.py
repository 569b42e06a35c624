"""``hetjax.ops.dense``: the plain matmul's values, the weight gradient written in float32."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hetjax.ops import dense
from hetjax.runtime.vjp import SELECTIVE_POLICY


def plain(x, kernel):
    return jnp.tensordot(x, kernel.astype(x.dtype), axes=1)


def operands(kernel_shape, dtype):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (2, 8, kernel_shape[0])).astype(dtype)
    kernel = jax.random.normal(kw, kernel_shape)  # float32 master weights
    g = jax.random.normal(kg, (2, 8, *kernel_shape[1:])).astype(dtype)
    return x, kernel, g


@pytest.mark.parametrize("kernel_shape", [(16, 24), (16, 2, 12)], ids=["2d", "fused"])
def test_float32_is_bit_identical_to_the_plain_vjp(kernel_shape):
    x, kernel, g = operands(kernel_shape, jnp.float32)
    y, vjp = jax.vjp(dense, x, kernel)
    y0, vjp0 = jax.vjp(plain, x, kernel)
    for a, b in zip((y, *vjp(g)), (y0, *vjp0(g)), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kernel_shape", [(16, 24), (16, 2, 12)], ids=["2d", "fused"])
def test_bf16_weight_gradient_is_not_rounded_to_bf16(kernel_shape):
    x, kernel, g = operands(kernel_shape, jnp.bfloat16)
    y, vjp = jax.vjp(dense, x, kernel)
    dx, dkernel = vjp(g)
    y0, vjp0 = jax.vjp(plain, x, kernel)
    dx0, dkernel0 = vjp0(g)
    np.testing.assert_array_equal(y, y0)
    np.testing.assert_array_equal(dx, dx0)
    assert dkernel.dtype == dkernel0.dtype == jnp.float32
    # the float32 product of the same bf16 operands, not its bf16 rounding (the plain
    # form's weight gradient)
    exact = jnp.einsum(
        "bli,blo->io", x.astype(jnp.float32), g.reshape(2, 8, -1).astype(jnp.float32)
    )
    exact = exact.reshape(kernel_shape)
    np.testing.assert_allclose(dkernel, exact, rtol=1e-6, atol=1e-5)
    assert np.abs(dkernel0 - exact).max() > 10 * np.abs(dkernel - exact).max()


def test_residuals_hold_the_kernel_itself_and_selective_saves_the_output():
    x, kernel, _ = operands((16, 24), jnp.bfloat16)
    _, vjp = jax.vjp(dense, x, kernel)
    leaves = jax.tree.leaves(vjp)
    # the float32 parameter, which a stage's stash drops (runtime.vjp.Residuals), and no
    # bf16 copy of it
    assert any(a is kernel for a in leaves)
    assert not any(a.shape == kernel.shape and a.dtype == jnp.bfloat16 for a in leaves)

    def block(kernel, x):
        return jnp.tanh(dense(x, kernel))

    _, vjp = jax.vjp(jax.checkpoint(block, policy=SELECTIVE_POLICY), kernel, x)
    # selective recompute keeps the weight matmul's output (it recomputes only the tanh)
    assert any(a.shape == (2, 8, 24) and a.dtype == jnp.bfloat16 for a in jax.tree.leaves(vjp))


def test_a_frozen_kernel_gets_no_weight_gradient_matmul():
    """Frozen parameters are constants of a stage's vjp (hetjax.runtime.vjp): the
    custom backward still forms the kernel's cotangent, and XLA must drop it, also in a
    scan over stacked layers."""
    x, kernel, g = operands((16, 16), jnp.bfloat16)
    kernels = jnp.stack([kernel] * 3)

    def blocks(kernels, x):
        return jax.lax.scan(lambda h, k: (jnp.tanh(dense(h, k)), None), x, kernels)[0]

    def trained(kernels, x, g):
        return jax.vjp(blocks, kernels, x)[1](g)

    def frozen(kernels, x, g):
        return jax.vjp(lambda x: blocks(kernels, x), x)[1](g)

    def dots(f):  # in the compiled program (a loop body's once)
        text = jax.jit(f).lower(kernels, x, g.reshape(2, 8, 16)).compile().as_text()
        return len(re.findall(r"\sdot\(", text))

    # forward, dx and dW in the loop bodies; frozen: no dW
    assert (dots(trained), dots(frozen)) == (3, 2)
