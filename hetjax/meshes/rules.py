"""Logical-axis rules: parameter and activation axis names -> PartitionSpecs on a module mesh.

Models name every array dimension with a logical name (``"embed"``, ``"heads"``, ...);
these rules, the same for every module, turn names into mesh axes. Because each module
has its own mesh (its own degrees), the same model code gets a different physical layout
per module, unlike a single global rule set tied to one mesh.

Megatron tensor parallelism falls out of one name -> axis map: the models put
``"heads"``/``"kv_heads"``/``"mlp"`` on the OUTPUT dim of column-parallel weights (QKV,
MLP up/gate) and on the INPUT dim of row-parallel ones (attention out, MLP down), and
``"vocab"`` on the vocabulary dim of the embedding table and LM head.

Fully sharded data parallelism falls out of one more (MaxText's): ``"embed"``, the model
width every weight matrix has, maps to ``"fsdp"``. Parameters are stored sharded there;
what each layer computes with is the same spec less ``"fsdp"`` (:func:`gathered_spec`),
which ``hetjax.runtime.fsdp`` gathers inside the layer scan.

Mesh axes of size 1 are kept in the specs (they shard nothing), so a spec does not change
with the degrees; ``"layers"`` maps to ``"pp"`` on a full module mesh and to nothing on a
pipeline-stage submesh, which has no ``"pp"`` axis.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .layout import LayoutError

MeshAxes = str | tuple[str, ...] | None

LOGICAL_AXIS_RULES: Mapping[str, MeshAxes] = {
    # Parameters.
    "embed": "fsdp",  # model width: split over the fsdp ranks (gathered per layer)
    "heads": "tp",  # flattened q heads * head_dim: column-parallel in, row-parallel out
    "kv_heads": "tp",  # kv heads: the fused q/k/v kernel's kv-group dim (whole groups per rank)
    "mlp": "tp",  # MLP hidden: column-parallel up/gate, row-parallel down
    "vocab": "tp",  # vocabulary-parallel embedding table and LM head
    "layers": "pp",  # stacked block axis (full mesh only)
    "experts": "ep",  # MoE experts
    # Activations.
    "batch": ("dp", "fsdp", "ep"),  # data batch over all data-parallel ranks
    "seq": "cp",  # sequence (tokens) over context-parallel ranks
    "act_embed": None,
    "act_heads": "tp",
    "act_kv_heads": "tp",
    "act_mlp": "tp",
    "act_vocab": "tp",
}

LogicalNames = Sequence[str | None]

BATCH_AXES: tuple[str, ...] = LOGICAL_AXIS_RULES["batch"]  # type: ignore[assignment]
"""Mesh axes a batch dimension is split over (every data-parallel rank, experts' too)."""

FSDP_AXIS: str = LOGICAL_AXIS_RULES["embed"]  # type: ignore[assignment]
"""The mesh axis parameters are sharded over (and gathered from, per layer)."""


def gathered_spec(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` less the fsdp axis: how a parameter stored as ``spec`` is computed with.

    Example:
        >>> gathered_spec(PartitionSpec("fsdp", "tp"))
        PartitionSpec(None, 'tp')
    """

    def drop(entry: MeshAxes) -> MeshAxes:
        if entry is None or isinstance(entry, str):
            return None if entry == FSDP_AXIS else entry
        kept = tuple(a for a in entry if a != FSDP_AXIS)
        return kept or None

    return PartitionSpec(*(drop(e) for e in spec))


def sequence_axes(mesh: Mesh, *, tp: bool = False) -> MeshAxes:
    """Mesh axes a sequence dimension is split over on ``mesh``.

    The ``"seq"`` rule (``cp``) where ``cp > 1``; with ``tp`` (Megatron sequence
    parallelism: the residual stream between TP regions) the tensor-parallel ranks too.
    None when nothing splits it.
    """
    seq = LOGICAL_AXIS_RULES["seq"]
    split = mesh.shape[seq] > 1
    if tp:
        return (seq, "tp") if split else "tp"
    return seq if split else None


def activation_sharding(
    mesh: Mesh, ndim: int, *, batch_axes: MeshAxes = BATCH_AXES, sequence: MeshAxes = None
) -> NamedSharding:
    """``[B, L, ...]`` activations: batch over ``batch_axes`` (the ``"batch"`` rule, or the
    axes left inside a per-replica ``vmap``), sequence over ``sequence`` (see
    :func:`sequence_axes`), the rest replicated."""
    if ndim < 2:
        return NamedSharding(mesh, PartitionSpec(batch_axes))
    return NamedSharding(mesh, PartitionSpec(batch_axes, sequence, *([None] * (ndim - 2))))


@functools.lru_cache(maxsize=1024)
def batch_sharding(mesh: Mesh, ndim: int, *, sequence: bool = False) -> NamedSharding:
    """An activation or batch array on a stage mesh: ``("batch", "seq", None, ...)``.

    The leading axis is split by the ``"batch"`` rule; with ``sequence``, dim 1 by the
    ``"seq"`` rule (when the mesh has ``cp > 1``); everything else is replicated. Every
    place that lays out a batch (microbatches, stage transfers, boundaries, the stage
    programs) asks this function, so the rule is written once. Cached: the executor asks
    per send and per microbatch input, and building a ``NamedSharding`` is host time.
    """
    names: list[str | None] = ["batch"] + [None] * (ndim - 1)
    if sequence and ndim >= 2 and mesh.shape[LOGICAL_AXIS_RULES["seq"]] > 1:
        names[1] = "seq"
    return logical_to_sharding(names, mesh)


def logical_to_spec(names: LogicalNames, *, stage_mesh: bool) -> PartitionSpec:
    """Turns one array's logical axis names into a PartitionSpec.

    Args:
        names: one entry per array dimension; ``None`` means unsharded.
        stage_mesh: True for a pipeline-stage submesh (no ``"pp"`` axis, so ``"layers"``
            is unsharded), False for a module's full mesh.

    Returns:
        The PartitionSpec, one entry per dimension.

    Raises:
        LayoutError: an unknown logical name, or two dimensions mapped to one mesh axis.

    Example:
        >>> logical_to_spec(("embed", "mlp"), stage_mesh=True)
        PartitionSpec('fsdp', 'tp')
    """
    entries: list[MeshAxes] = []
    used: dict[str, str] = {}
    for name in names:
        if name is None:
            entries.append(None)
            continue
        if name not in LOGICAL_AXIS_RULES:
            raise LayoutError(
                f"logical axis name {name!r} in {tuple(names)} is unknown; use one of"
                f" {sorted(LOGICAL_AXIS_RULES)} or None"
            )
        axes = LOGICAL_AXIS_RULES[name]
        if stage_mesh and axes == "pp":
            axes = None
        for axis in (axes,) if isinstance(axes, str) else axes or ():
            if axis in used:
                raise LayoutError(
                    f"logical names {used[axis]!r} and {name!r} in {tuple(names)} both map to"
                    f" mesh axis {axis!r}; rename one dimension or set it to None"
                )
            used[axis] = name
        entries.append(axes)
    return PartitionSpec(*entries)


def logical_to_sharding(names: LogicalNames, mesh: Mesh) -> NamedSharding:
    """NamedSharding of an array with logical ``names`` on a module or stage mesh.

    A mesh without a ``"pp"`` axis is treated as a pipeline-stage submesh; one without an
    ``"fsdp"`` axis (a user's own, built with the axes before fsdp) as one with fsdp = 1.
    """
    spec = logical_to_spec(names, stage_mesh="pp" not in mesh.axis_names)
    if FSDP_AXIS not in mesh.axis_names:
        spec = gathered_spec(spec)
    return NamedSharding(mesh, spec)


def is_logical_names(x: Any) -> bool:
    """Whether ``x`` is one array's logical axis names (a tuple of str / None): the leaf
    test of a tree of names (``jax.tree.map(..., is_leaf=is_logical_names)``)."""
    return isinstance(x, tuple) and all(e is None or isinstance(e, str) for e in x)


def param_shardings(tree_of_names: Any, mesh: Mesh) -> Any:
    """Maps a pytree whose leaves are logical-name tuples to NamedShardings on ``mesh``.

    Args:
        tree_of_names: pytree with tuple leaves such as ``("embed", "mlp")``.
        mesh: a module's full mesh or one of its stage submeshes.

    Returns:
        The same tree structure with a `NamedSharding` per leaf, ready for
        ``jax.device_put`` or ``jit(out_shardings=...)``.
    """
    return jax.tree.map(
        lambda names: logical_to_sharding(names, mesh), tree_of_names, is_leaf=is_logical_names
    )
