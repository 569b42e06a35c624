"""Activation transfers used by the executor.

- :func:`stage_transfer`: between consecutive pipeline stages of ONE module. Both stages
  have the same layout, so each device's shard goes to exactly one device of the next
  stage - a direct device-to-device copy, no host bounce.
- :class:`LinkTransfer`: between modules, a :class:`hetjax.boundary.Boundary` from the
  source's last stage to the destination's first stage (forward: activation; backward:
  its cotangent, routed back to exactly the source's sharding).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh

from hetjax.boundary import Boundary, EdgeSpec, Endpoint
from hetjax.meshes import ModuleMesh
from hetjax.runtime.programs import batch_sharding


def stage_transfer(x: Any, mesh: Mesh) -> Any:
    """Moves a (pytree of) batch-sharded activation(s) onto ``mesh`` with the same layout."""
    return jax.tree.map(lambda a: jax.device_put(a, batch_sharding(mesh, a.ndim)), x)


class LinkTransfer:
    """The boundary communicator of one module link (``src`` last stage -> ``dst`` stage 0)."""

    def __init__(self, src: ModuleMesh, dst: ModuleMesh, *, src_stage: int, dst_stage: int):
        source = Endpoint.source(src, stage=src_stage)
        destination = Endpoint.destination(dst, stage=dst_stage)
        # The homogeneous baseline puts the encoder on the LLM's first stage with the same
        # layout: the activation is already where it must be, nothing to move.
        self.identity = source.sharding == destination.sharding
        self.boundary = None if self.identity else Boundary(EdgeSpec(source, destination))

    def forward(self, x: jax.Array) -> jax.Array:
        return x if self.boundary is None else self.boundary.forward(x)

    def backward(self, ct: jax.Array) -> jax.Array:
        return ct if self.boundary is None else self.boundary.backward(ct)
