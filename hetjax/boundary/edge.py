"""Edge specs: which layout an activation leaves one module in and enters the next in.

An `Endpoint` is one side of a module edge: a module, the pipeline stage the activation
lives on and its `NamedSharding` there, plus the module's whole device set (its island,
or the shared devices when colocated). An `EdgeSpec` joins a source and a destination
and derives, instead of being told, the two things a plan needs:

* the placement: colocated when both modules span the same devices, non-colocated when
  their device sets are disjoint (anything in between is a configuration error);
* the batch transform from the two data-parallel degrees (numbers of batch slices):
  DP-Equal, Fan-In (src > dst), Fan-Out (dst > src) or, beyond the reference, a
  non-dividing pair such as 3 -> 2, which works whenever the batch divides both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Literal

import jax
from jax.sharding import NamedSharding, PartitionSpec

from hetjax.meshes import LOGICAL_AXIS_RULES, ModuleMesh

Transform = Literal["dp_equal", "fan_in", "fan_out", "non_dividing"]
PlacementKind = Literal["colocated", "non-colocated"]


class BoundaryError(ValueError):
    """An edge, its shapes or its use disagree; the message says how to fix it."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One side of a module edge."""

    module: str  # module name, for errors and reports
    sharding: NamedSharding  # the activation's layout on this side
    island: frozenset[jax.Device]  # all devices of the module (its island / shared set)
    stage: int | None = None  # pipeline stage of `sharding`'s mesh; None: full module mesh

    @classmethod
    def of(cls, module_mesh: ModuleMesh, spec: PartitionSpec, *, stage: int | None) -> Endpoint:
        """Endpoint with an explicit PartitionSpec on a stage submesh or the full mesh."""
        if stage is None:
            mesh = module_mesh.mesh
        else:
            mesh = module_mesh.stage_mesh(stage)
            stage %= module_mesh.num_stages
        return cls(
            module=module_mesh.name,
            sharding=NamedSharding(mesh, spec),
            island=frozenset(module_mesh.devices),
            stage=stage,
        )

    @classmethod
    def source(cls, module_mesh: ModuleMesh, *, stage: int = -1) -> Endpoint:
        """Encoder-side default: batch over the stage's dp ranks, replicated over tp/cp.

        Args:
            module_mesh: the source module.
            stage: pipeline stage producing the activation; the last one by default.
        """
        return cls.of(module_mesh, PartitionSpec(LOGICAL_AXIS_RULES["batch"]), stage=stage)

    @classmethod
    def destination(
        cls, module_mesh: ModuleMesh, *, stage: int = 0, shard_tokens: bool = False
    ) -> Endpoint:
        """LLM-side default: batch over dp, replicated over tp, tokens over cp or not.

        Args:
            module_mesh: the destination module.
            stage: pipeline stage consuming the activation; the first one by default.
            shard_tokens: shard the token dimension (dim 1) over ``cp``; otherwise the
                activation is replicated over the cp ranks.
        """
        batch, seq = LOGICAL_AXIS_RULES["batch"], LOGICAL_AXIS_RULES["seq"]
        spec = PartitionSpec(batch, seq) if shard_tokens else PartitionSpec(batch)
        return cls.of(module_mesh, spec, stage=stage)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Devices of `sharding` in mesh flat order."""
        return tuple(self.sharding.mesh.devices.flat)

    @property
    def batch_lanes(self) -> int:
        """Number of distinct slices of dim 0 (the data-parallel degree on this side)."""
        return self.lanes(0)

    def lanes(self, dim: int) -> int:
        """Number of slices the sharding cuts dimension ``dim`` into."""
        spec = tuple(self.sharding.spec)
        if dim >= len(spec) or spec[dim] is None:
            return 1
        axes = (spec[dim],) if isinstance(spec[dim], str) else spec[dim]
        return math.prod(self.sharding.mesh.shape[a] for a in axes)

    def where(self) -> str:
        """Short human description, e.g. ``llm stage 0``."""
        return self.module if self.stage is None else f"{self.module} stage {self.stage}"


@dataclasses.dataclass(frozen=True)
class EdgeSpec:
    """A directed edge from a source endpoint to a destination endpoint."""

    src: Endpoint  # where the activation is produced
    dst: Endpoint  # where it is consumed

    def __post_init__(self) -> None:
        shared = self.src.island & self.dst.island
        if shared and self.src.island != self.dst.island:
            raise BoundaryError(
                f"edge {self.src.module}->{self.dst.module}: the modules share"
                f" {len(shared)} of their {len(self.src.island)} and {len(self.dst.island)}"
                " devices; place them colocated (same devices) or on disjoint islands"
            )

    @property
    def placement(self) -> PlacementKind:
        """``"colocated"`` if both modules span the same devices, else ``"non-colocated"``."""
        return "colocated" if self.src.island == self.dst.island else "non-colocated"

    @property
    def transform(self) -> Transform:
        """Batch transform from the two data-parallel degrees."""
        s, d = self.src.batch_lanes, self.dst.batch_lanes
        if s == d:
            return "dp_equal"
        if s % d == 0:
            return "fan_in"
        if d % s == 0:
            return "fan_out"
        return "non_dividing"

    def reversed(self) -> EdgeSpec:
        """The edge gradients travel: destination -> source."""
        return EdgeSpec(src=self.dst, dst=self.src)

    def name(self) -> str:
        """Short human description, e.g. ``vit stage 1 -> llm stage 0``."""
        return f"{self.src.where()} -> {self.dst.where()}"

    def validate(self, shape: Sequence[int]) -> None:
        """Checks that an activation of ``shape`` fits both shardings.

        Raises:
            BoundaryError: the spec has more entries than the array has dims, or a
                dimension is not divisible by the number of slices on one side.
        """
        for end, role in ((self.src, "source"), (self.dst, "destination")):
            spec = tuple(end.sharding.spec)
            if len(spec) > len(shape):
                raise BoundaryError(
                    f"edge {self.name()}: {role} spec {end.sharding.spec} has {len(spec)}"
                    f" entries but the activation has shape {tuple(shape)}; drop entries"
                )
            for dim, size in enumerate(shape):
                parts = end.lanes(dim)
                if size % parts:
                    what = "batch" if dim == 0 else f"dim {dim}"
                    raise BoundaryError(
                        f"edge {self.name()}: {what} {size} is not divisible by the {parts}"
                        f" slices of {end.where()} ({role} spec {end.sharding.spec}); use a"
                        f" {what} that is a multiple of {parts} or change the layout"
                    )
