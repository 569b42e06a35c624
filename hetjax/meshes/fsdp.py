"""Fully sharded data parallelism: parameters stored split over ``fsdp``, gathered per layer.

The storage rule is the logical-axis rule ``"embed" -> "fsdp"`` (:mod:`.rules`, MaxText's):
every weight matrix has the model width, so parameters, their gradients and the optimizer
state (sharded like the parameters) all hold ``1 / fsdp`` of it per device. What a layer
computes with is the gathered parameter (the spec less ``"fsdp"``,
:func:`~.rules.gathered_spec`). :class:`FsdpGather` makes that explicit where it must
happen:

- **Forward: all-gather per layer.** It is called on ONE layer's parameters inside the
  scanned block body (``StagedModule.apply_blocks(gather_layer=...)``), so XLA gathers
  layer ``i`` inside loop iteration ``i`` (and may overlap the gather of ``i + 1`` with
  the compute of ``i``) instead of gathering the whole stack up front.
- **Backward: reduce-scatter per layer.** Its VJP constrains the cotangent back to the
  stored (split) sharding, so each layer's gradient leaves its backward iteration
  reduce-scattered over fsdp. Left to the transpose of a plain sharding constraint, the
  cotangent would get the GATHERED sharding: an all-reduce (twice the bytes) and a
  whole gradient per device.
- **Gathered weights are not kept for the backward.** :meth:`FsdpGather.call` runs the
  layer under ``jax.checkpoint`` with a policy that saves everything except the gathered
  weights (by name), so the backward gathers them again (one gather in the forward, one
  in the backward, as MaxText and PyTorch FSDP do) instead of the forward stashing a
  whole copy of every layer's weights per microbatch, which would undo the sharding.

The batch is split over fsdp as over dp (``"batch" -> ("dp", "fsdp", "ep")``), so each
fsdp rank computes its own rows with the whole layer, and GSPMD sums the ranks' partial
weight gradients in the reduce-scatter. Unlike ``dp``, fsdp ranks are not separate
gradient replicas (``hetjax.runtime.replicas`` maps over ``dp`` only): the gradient
accumulator keeps the parameter's fsdp split, so it is reduce-scattered once per
microbatch rather than all-reduced once per step (the price of never holding a whole
gradient), and ZeRO-1 splits what is left over the remaining dp.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .layout import Layout, LayoutError
from .rules import FSDP_AXIS, gathered_spec, is_logical_names, logical_to_spec

GATHERED = "fsdp_gathered"  # checkpoint name of a gathered parameter (recomputed, not saved)
_POLICY = jax.checkpoint_policies.save_anything_except_these_names(GATHERED)


class FsdpGather:
    """Gathers a parameter tree from its fsdp split (see the module docstring).

    Args:
        mesh: the stage's submesh.
        axes: the tree's logical axis names (one tuple per leaf), without ``"layers"``:
            one layer's parameters, or a part's ``pre`` / ``post``.
    """

    def __init__(self, mesh: Mesh, axes: Any):
        self.mesh = mesh
        self.specs = jax.tree.map(
            lambda names: logical_to_spec(names, stage_mesh=True), axes, is_leaf=is_logical_names
        )

    @staticmethod
    def active(mesh: Mesh) -> bool:
        """Whether ``mesh`` splits parameters at all (an ``fsdp`` axis of size > 1)."""
        return mesh.shape.get(FSDP_AXIS, 1) > 1

    def __call__(self, params: Any) -> Any:
        """``params`` with every fsdp-split leaf gathered (named :data:`GATHERED`)."""
        here = jax.sharding.get_abstract_mesh()
        # Inside a shard_map (a stage run per cp rank) a constraint names the region's
        # own abstract mesh; fsdp and tp are left automatic there.
        mesh = here if here.manual_axes else self.mesh

        def leaf(spec: PartitionSpec, x: jax.Array) -> jax.Array:
            if FSDP_AXIS not in jax.tree.leaves(tuple(spec)):
                return x
            stored = NamedSharding(mesh, spec)
            whole = NamedSharding(mesh, gathered_spec(spec))
            return checkpoint_name(_gather(x, stored, whole), GATHERED)

        return jax.tree.map(
            leaf, self.specs, params, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    def call(self, fn: Callable, params: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(gathered params, *args, **kwargs)``, its gathered parameters recomputed
        (gathered again) in the backward rather than saved."""

        def run(p, *a):
            return fn(self(p), *a, **kwargs)

        return jax.checkpoint(run, policy=_POLICY)(params, *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(x: jax.Array, stored: NamedSharding, whole: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, whole)


def _gather_fwd(x, stored, whole):
    return _gather(x, stored, whole), None


def _gather_bwd(stored, whole, _, g):
    del whole
    return (jax.lax.with_sharding_constraint(g, stored),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def validate_fsdp(module: str, layout: Layout, axes: Any, abstract: Any) -> None:
    """Checks that ``fsdp`` splits every parameter dimension it is meant to split.

    Args:
        module: module name for the error message.
        layout: the module's layout.
        axes: the parameters' logical axis names (a tree of tuples).
        abstract: the parameters (arrays or ``ShapeDtypeStruct`` s), same tree.

    Raises:
        LayoutError: a dimension named ``"embed"`` (the one fsdp splits) whose size
            ``fsdp`` does not divide, naming the parameter and the fix.
    """
    if layout.fsdp == 1:
        return
    flat_axes = jax.tree.leaves(axes, is_leaf=is_logical_names)
    flat = jax.tree.leaves_with_path(abstract)
    for names, (path, a) in zip(flat_axes, flat, strict=True):
        for name, size in zip(names, a.shape, strict=True):
            if name == "embed" and size % layout.fsdp:
                divisors = [d for d in range(2, layout.fsdp) if size % d == 0]
                raise LayoutError(
                    f"{module}: fsdp={layout.fsdp} does not divide the model width {size}"
                    f" of parameter {jax.tree_util.keystr(path)} {tuple(a.shape)} (its"
                    f" 'embed' dim is split over fsdp); use fsdp in {[1, *divisors]} or a"
                    f" width that is a multiple of {layout.fsdp}"
                )
