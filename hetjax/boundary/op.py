"""The differentiable boundary op: forward along the plan, backward along its reverse.

``Boundary(edge)(x)`` is a ``jax.custom_vjp`` whose forward moves ``x`` from the source
sharding to the destination sharding with a transport, and whose backward moves the
cotangent back to exactly the source sharding along the reverse plan (the same leaders,
the other way round). A boundary changes only the layout of a global array, never its
value, so ``jax.grad`` through it equals the gradient of the same function on one device.

Colocated edges on one device set are traceable: inside one ``jit`` both directions are
sharding constraints. Edges between different device sets run eagerly, between the
jitted stage programs; ``jax.grad`` / ``jax.vjp`` of an un-jitted composition call the
forward on concrete arrays and the backward on concrete cotangents, which is all the
executor needs.

Outputs may share device buffers with the input where a destination device already
held its block (colocated plans): donate neither while the other is still needed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from .edge import EdgeSpec
from .plan import TransferPlan, make_plan
from .transport import InProcessTransport, Transport


@dataclasses.dataclass(frozen=True, eq=False)
class Boundary:
    """A differentiable boundary communicator on one edge.

    Example:
        >>> edge = EdgeSpec(Endpoint.source(meshes["vit"]), Endpoint.destination(meshes["llm"]))
        >>> y_BxNxD = Boundary(edge)(x_BxNxD)  # in the LLM's first-stage layout
    """

    edge: EdgeSpec  # source and destination endpoints
    transport: Transport = dataclasses.field(default_factory=InProcessTransport)

    def plan(self, shape: tuple[int, ...], dtype) -> TransferPlan:
        """The forward plan for an activation of ``shape`` and ``dtype``."""
        return make_plan(self.edge, shape, dtype)

    def forward(self, x: jax.Array) -> jax.Array:
        """Source -> destination (no autodiff rule; use ``__call__`` under ``jax.grad``)."""
        return self.transport.transfer(self.plan(x.shape, x.dtype), x)

    def backward(self, ct: jax.Array) -> jax.Array:
        """Destination -> source for a cotangent, along the reverse plan."""
        return self.transport.transfer(self.plan(ct.shape, ct.dtype).reverse(), ct)

    @functools.cached_property
    def _op(self) -> Callable[[jax.Array], jax.Array]:
        op = jax.custom_vjp(self.forward)
        op.defvjp(lambda x: (self.forward(x), None), lambda _, ct: (self.backward(ct),))
        return op

    def __call__(self, x: jax.Array) -> jax.Array:
        """Differentiable transfer of ``x`` (in the source sharding) to the destination."""
        return self._op(x)


@functools.lru_cache(maxsize=256)
def _cached(edge: EdgeSpec, transport: Transport) -> Boundary:
    return Boundary(edge, transport)


_DEFAULT_TRANSPORT = InProcessTransport()


def boundary(x: jax.Array, edge: EdgeSpec, *, transport: Transport | None = None) -> jax.Array:
    """Functional form of `Boundary`: ``boundary(x, edge)`` is ``Boundary(edge)(x)``.

    Args:
        x: activation in ``edge.src.sharding``.
        edge: the edge to cross.
        transport: defaults to a shared `InProcessTransport`.

    Returns:
        ``x`` in ``edge.dst.sharding``; differentiable.
    """
    return _cached(edge, transport or _DEFAULT_TRANSPORT)(x)
