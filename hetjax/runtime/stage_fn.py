"""The stage function: what one pipeline stage of one module computes.

A first stage runs the main part's ``pre`` on its batch inputs (and link inputs), every
stage its range of the stacked blocks, the last stage the main part's ``post`` (on the
sink: the summed loss) and the module's further parts. It is a pure function of
(parameters, input, batch); the vjp (:mod:`hetjax.runtime.vjp`) differentiates it and
the stage programs (:mod:`hetjax.runtime.programs`) compile it. It also fixes the
activation shardings inside the stage (the residual stream between blocks, a module's
output layout), which depend on whether it runs inside the replica vmap.

With ``fsdp > 1`` every part runs on its gathered parameters (:class:`hetjax.runtime.
fsdp.FsdpGather`): the blocks gather one layer at a time inside the layer scan, ``pre`` and
``post`` (and the further parts) where they run; the gradients leave reduce-scattered.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.meshes import BATCH_AXES, FSDP_AXIS, is_logical_names, sequence_axes
from hetjax.ops.context import auto_axes, parallel_context, region_activation_sharding
from hetjax.ops.token_routing import Routed
from hetjax.runtime.fsdp import FsdpGather
from hetjax.runtime.graph import ModuleSpec

Segment = Literal["all", "main", "rest"]


def split_parts(tree: dict[str, Any], names: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A stage-shaped tree (keyed by part name) split into the parts in ``names`` (e.g.
    the trainable ones) and the others."""
    return (
        {k: v for k, v in tree.items() if k in names},
        {k: v for k, v in tree.items() if k not in names},
    )


@dataclasses.dataclass(frozen=True)
class StageFunction:
    """One pipeline stage of one module as a function of its parameters."""

    spec: ModuleSpec  # the module
    stage: int  # pipeline stage index within the module
    mesh: Mesh  # the stage's submesh (axes dp, ep, cp, tp)
    is_sink: bool  # the module returns the loss (its last stage: the summed loss)
    sequence_parallel: bool = False  # the residual stream sharded on sequence over tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.spec.layout.pp - 1

    def apply(
        self,
        params: dict[str, Any],
        x: Any,
        batch: dict[str, jax.Array],
        *,
        per_replica: bool = False,
        loss_scale: Any = None,
        segment: Segment = "all",
    ) -> jax.Array:
        """Stage forward; ``x`` is ``{link name: tokens}`` on a first stage, else an array.

        ``segment``: ``"all"``; ``"main"``, only the first part (its output); ``"rest"``,
        from the first part's output ``x`` through the further parts.

        On the sink's last stage the result is the SUMMED loss. ``per_replica``: called
        inside the backward's vmap over data-parallel replicas (the batch axes are the
        vmapped axis there, so sharding constraints must not name them). ``loss_scale``:
        d(loss)/d(summed loss), for auxiliary losses inside blocks (MoE balancing).
        """
        routed = frozenset()
        if isinstance(x, dict):  # link inputs routed to their cp ranks arrive marked
            routed = frozenset(k for k, v in x.items() if isinstance(v, Routed))
            x = {k: v.tokens if isinstance(v, Routed) else v for k, v in x.items()}
        with parallel_context(
            self.mesh,
            batch_axes=self.batch_axes(per_replica),
            loss_scale=loss_scale,
            routed=routed,
            sequence_parallel=self.sequence_parallel,
        ):
            if segment == "rest":
                return self._apply_rest(params, x, per_replica)
            h = self._apply_main(params, x, batch, per_replica)
            if segment == "main" or not self.last or self.is_sink:
                return h
            return self._apply_rest(params, h, per_replica)

    def _apply_main(self, params, x, batch, per_replica):
        """The first part's pre (first stage), blocks and post (last stage); on the sink's
        last stage the summed loss."""
        main = self.spec.parts[0]
        mine = params[main.name]
        if self.first:
            args = [batch[k] for k in self.spec.inputs]
            if "pre" in mine:

                def pre(p, args, links):  # link inputs by name, as pytrees
                    return main.apply_pre(p, *args, **links)

                h = self._run((main.name, "pre"), pre, mine["pre"], args, x)
            else:
                h = args[0]
        else:
            h = x
        if "blocks" in mine:
            start, stop = self.spec.stage_layers(self.stage)
            layer = self._gathers.get((main.name, "blocks"))
            h = main.apply_blocks(
                mine["blocks"],
                h,
                start=start,
                stop=stop,
                carry_sharding=self._carry_sharding(h, batch_axes=self.batch_axes(per_replica)),
                call_layer=None if layer is None else layer.call,
                **{k: batch[k] for k in self.spec.block_inputs},
            )
        if not self.last:
            return h
        post = main.apply_post
        if self.is_sink:
            loss_inputs = [batch[k] for k in self.spec.loss_inputs]
            return self._run((main.name, "post"), post, mine["post"], h, *loss_inputs)
        if "post" in mine:
            h = self._run((main.name, "post"), post, mine["post"], h)
        return h

    def _apply_rest(self, params, h, per_replica):
        """The further parts of a non-sink module's last stage, and its output layout."""
        for part in self.spec.parts[1:]:
            h = self._run((part.name,), part, params[part.name], h)
        if sequence_axes(self.mesh) is not None:
            # A module's output leaves batch-split and whole over cp (the boundary's
            # source layout), so its cp ranks' token slices are gathered here.
            batch = self.batch_axes(per_replica)
            h = jax.lax.with_sharding_constraint(h, NamedSharding(self.mesh, P(batch)))
        return h

    def batch_axes(self, per_replica: bool) -> tuple[str, ...] | None:
        """Mesh axes the batch dimension is split over, here or inside the replica vmap
        (there the vmap adds ``dp``; what is left: fsdp and ep where they split it)."""
        if not per_replica:
            return BATCH_AXES
        inner = tuple(a for a in (FSDP_AXIS, "ep") if self.mesh.shape[a] > 1)
        return inner or None

    @functools.cached_property
    def _gathers(self) -> dict[tuple[str, ...], FsdpGather]:
        """Under fsdp: how each piece's parameters are gathered, keyed ``(main part,
        "pre" | "blocks" | "post")`` (``"blocks"``: ONE layer's, gathered inside the
        scan) and ``(further part,)``. Empty without fsdp: nothing changes then."""
        if not FsdpGather.active(self.mesh):
            return {}
        main, *rest = self.spec.parts
        axes = main.logical_axes()
        gathers = {(main.name, k): FsdpGather(self.mesh, v) for k, v in axes.items()}
        if "blocks" in axes:  # one layer: its names less the leading "layers"
            layer = jax.tree.map(lambda n: n[1:], axes["blocks"], is_leaf=is_logical_names)
            gathers[(main.name, "blocks")] = FsdpGather(self.mesh, layer)
        gathers.update({(p.name,): FsdpGather(self.mesh, p.logical_axes()) for p in rest})
        return gathers

    def _run(self, key: tuple[str, ...], fn: Callable, params: Any, *args: Any) -> Any:
        """``fn(params, *args)``; under fsdp on the gathered ``params`` (:attr:`_gathers`)."""
        gather = self._gathers.get(key)
        return fn(params, *args) if gather is None else gather.call(fn, params, *args)

    def _carry_sharding(self, h: Any, *, batch_axes: Any) -> NamedSharding | None:
        """The residual stream between blocks.

        Context parallelism: the sequence axis is split over cp - for the LLM its inputs
        already are; an encoder with cp > 1 (one that inherits the LLM's layout) splits
        its tokens here, and its attention rings K/V over cp (it is not replicated).
        Sequence parallelism: split over tp (and cp) too, so GSPMD turns the row-parallel
        all-reduce into a reduce-scatter and gathers the sequence before the next
        column-parallel matmul."""
        sp = self.sequence_parallel and self.mesh.shape["tp"] > 1
        # Per cp rank (cp_local, manual over dp and cp) the block is this rank's: only
        # sequence parallelism's tp split is left to name.
        seq = sequence_axes(self.mesh, tp=sp)
        if auto_axes(seq) is None:
            return None
        return region_activation_sharding(self.mesh, h.ndim, batch_axes=batch_axes, sequence=seq)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The batch keys this stage reads."""
        keys = (self.spec.inputs if self.first else ()) + self.spec.block_inputs
        return keys + (self.spec.loss_inputs if self.last and self.is_sink else ())
