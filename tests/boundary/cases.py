"""Shared boundary-test data: the case matrix {colocated, non-colocated} x {DP-Equal,
Fan-In, Fan-Out, non-dividing DP} x {destination tp > 1, cp > 1, a pipeline-stage
submesh}, and a tiny encoder -> LLM function with its single-device gradients."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np

from hetjax.boundary import EdgeSpec, Endpoint
from hetjax.meshes import Layout, place_modules

# Activation [B, N, D]: B divides every dp below (1, 2, 3, 4, 8), N every cp (2, 3).
B, N, D = 24, 6, 8


@dataclasses.dataclass(frozen=True)
class Case:
    placement: str  # "colocated" | "non-colocated"
    transform: str  # expected batch transform
    variant: str  # "tp" | "cp" | "stage": what is special about the destination
    enc: str  # encoder layout; the source is its last pipeline stage
    llm: str  # LLM layout; the destination is its first pipeline stage
    shard_tokens: bool = False  # destination tokens split over cp (else replicated)

    @property
    def id(self) -> str:
        return f"{self.placement}-{self.transform}-{self.variant}"

    def edge(self) -> EdgeSpec:
        layouts = {"enc": self.enc, "llm": self.llm}
        if self.placement == "colocated":
            n = Layout.parse(self.enc).num_devices
            meshes = place_modules(layouts, jax.devices()[:n], placement="colocated")
        else:
            meshes = place_modules(layouts, placement="non-colocated")
        return EdgeSpec(
            Endpoint.source(meshes["enc"]),
            Endpoint.destination(meshes["llm"], shard_tokens=self.shard_tokens),
        )


CASES = (
    Case("non-colocated", "dp_equal", "tp", "dp=2", "dp=2,tp=2"),
    Case("non-colocated", "dp_equal", "cp", "dp=2", "dp=2,cp=2", shard_tokens=True),
    Case("non-colocated", "dp_equal", "stage", "dp=2,pp=2", "dp=2,pp=2"),
    Case("non-colocated", "fan_in", "tp", "dp=4", "dp=2,tp=2"),
    Case("non-colocated", "fan_in", "cp", "dp=4", "dp=2,cp=2"),
    Case("non-colocated", "fan_in", "stage", "dp=4", "dp=2,pp=2"),
    Case("non-colocated", "fan_out", "tp", "dp=1,tp=2", "dp=2,tp=2"),
    Case("non-colocated", "fan_out", "cp", "dp=1", "dp=2,cp=2", shard_tokens=True),
    Case("non-colocated", "fan_out", "stage", "dp=1,pp=2", "dp=2,pp=2"),
    Case("non-colocated", "non_dividing", "tp", "dp=3", "dp=2,tp=2"),
    Case("non-colocated", "non_dividing", "cp", "dp=3", "dp=2,cp=2", shard_tokens=True),
    Case("non-colocated", "non_dividing", "stage", "dp=3", "dp=2,pp=2"),
    Case("colocated", "dp_equal", "tp", "dp=2,cp=2,tp=2", "dp=2,tp=4"),
    Case("colocated", "dp_equal", "cp", "dp=2,tp=4", "dp=2,cp=2,tp=2", shard_tokens=True),
    Case("colocated", "dp_equal", "stage", "dp=2,tp=2", "dp=2,pp=2"),
    Case("colocated", "fan_in", "tp", "dp=8", "dp=2,tp=4"),
    Case("colocated", "fan_in", "cp", "dp=8", "dp=2,cp=2,tp=2", shard_tokens=True),
    Case("colocated", "fan_in", "stage", "dp=8", "dp=2,tp=2,pp=2"),
    Case("colocated", "fan_out", "tp", "dp=2,tp=4", "dp=4,tp=2"),
    Case("colocated", "fan_out", "cp", "dp=2,tp=4", "dp=4,cp=2"),
    Case("colocated", "fan_out", "stage", "dp=2,tp=4", "dp=4,pp=2"),
    Case("colocated", "non_dividing", "tp", "dp=3,tp=2", "dp=2,tp=3"),
    Case("colocated", "non_dividing", "cp", "dp=3,tp=2", "dp=2,cp=3", shard_tokens=True),
    Case("colocated", "non_dividing", "stage", "dp=2,tp=3", "dp=3,pp=2"),
)


F, H = 5, 12  # encoder input features, LLM MLP width (divisible by tp in 2, 3, 4)

RNG = np.random.default_rng(0)
X_BxNxD = RNG.standard_normal((B, N, D)).astype(np.float32)
X_BxNxF = RNG.standard_normal((B, N, F)).astype(np.float32)
W_FxD = (RNG.standard_normal((F, D)) / np.sqrt(F)).astype(np.float32)
W1_DxH = (RNG.standard_normal((D, H)) / np.sqrt(D)).astype(np.float32)
W2_HxD = (RNG.standard_normal((H, D)) / np.sqrt(H)).astype(np.float32)
LLM_NAMES = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}  # column-, then row-parallel


@jax.jit
def encode(w_FxD, x_BxNxF):
    return jnp.tanh(x_BxNxF @ w_FxD)


@jax.jit
def llm_loss(y_BxNxD, w1_DxH, w2_HxD):
    return jnp.mean((jnp.tanh(y_BxNxD @ w1_DxH) @ w2_HxD) ** 2)


def _reference_grads():
    f = lambda w, w1, w2: llm_loss(encode(w, X_BxNxF), w1, w2)
    return jax.value_and_grad(f, argnums=(0, 1, 2))(W_FxD, W1_DxH, W2_HxD)


REFERENCE = _reference_grads()


def assert_grads_close(grads, want_grads) -> None:
    """rtol 1e-6 per entry, with a floor of 1e-6 of the largest entry.

    DP and TP partial sums reorder float additions; entries that cancel to ~1e-3 of the
    largest lose relative (not absolute) precision, hence the floor.
    """
    for got, want in zip(grads, want_grads, strict=True):
        scale = float(jnp.max(jnp.abs(want)))
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6 * scale)
