"""Fully sharded data parallelism inside a stage: gather a layer's weights where it runs.

Parameters are stored split over the ``fsdp`` mesh axis (the logical rule ``"embed" ->
"fsdp"``, :mod:`hetjax.meshes.rules`); what a layer computes with is the same spec less
``"fsdp"`` (:func:`hetjax.meshes.gathered_spec`). :meth:`FsdpGather.call` runs a piece
of the model (one layer inside the scanned block body, a part's ``pre`` or ``post``) on
its gathered weights, as a ``custom_vjp``:

- **Forward: one all-gather per layer**, inside the scan iteration that uses it, so XLA
  gathers layer ``i`` in iteration ``i`` (and may overlap the gather of ``i + 1`` with
  the compute of ``i``) rather than the whole stack up front.
- **Backward: one more all-gather, and a reduce-scatter of the gradient.** The gathered
  weights are not among the residuals the forward keeps (:class:`Residuals` drops the
  leaves that are the gathered weights themselves, which :func:`hetjax.ops.dense` keeps
  as they came): the backward gathers them again, as MaxText and PyTorch FSDP do, rather
  than a stash holding a whole copy of every layer's weights per microbatch. The weight
  cotangent is constrained back to the stored (split) sharding, so each layer's gradient
  leaves its backward iteration reduce-scattered over fsdp.

Why a ``custom_vjp`` and not a sharding constraint alone: the transpose of a constraint
gives the cotangent the GATHERED sharding (an all-reduce, twice the bytes, and a whole
gradient per device); and a remat policy that saves everything but the gathered weights
(by name) still saves the residual outputs of a ``custom_vjp`` layer such as
:func:`hetjax.ops.dense`, which are new values to the policy: the weights were stashed.

Inside a stage run per cp rank (a ``shard_map`` manual over dp, fsdp and cp:
:func:`hetjax.runtime.replicas.cp_local`) the parameters arrive as this rank's fsdp
shard and the same two steps are explicit collectives: ``all_gather`` and
``psum_scatter`` over fsdp.

**XLA:CPU: one order of collectives on every device.** XLA:CPU runs a program's
independent branches concurrently and in no fixed order per device, on a thread pool as
large as the host's cores; a collective blocks its thread until its group's other
devices arrive. With fsdp a layer has collectives that depend on nothing but the
parameters (its gathers, a later part's gathers, the reduce-scatters beside the input
cotangent's tensor-parallel all-reduce), so two devices can enter two different
collectives first and wait on each other for ever (seen: every fsdp parity file hung
now and then on the 2-core machine, more often with programs from the warm compile
cache). On CPU meshes :meth:`FsdpGather.call` therefore chains them: the gathers start
once the piece's inputs are ready, one after another, the piece computes once all are
done, and in the backward the reduce-scatters follow the input cotangent one by one
(``optimization_barrier``, :func:`_after`). GPU streams run a device's collectives in
program order, so there the chain is off and XLA may overlap a gather with compute.

The batch is split over fsdp as over dp (``"batch" -> ("dp", "fsdp", "ep")``): each
fsdp rank runs its own rows with the whole layer, and the reduce-scatter sums the ranks'
partial weight gradients. Unlike dp, fsdp ranks are not separate gradient replicas
(:mod:`hetjax.runtime.replicas` maps over ``dp`` only), so the accumulator keeps the
parameter's split: a reduce-scatter per microbatch rather than an all-reduce once per
step, the price of never holding a whole gradient; ZeRO-1 splits what is left over dp.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.meshes import FSDP_AXIS, gathered_spec, is_logical_names, logical_to_spec
from hetjax.runtime.residuals import Residuals


class FsdpGather:
    """Runs a piece of a model on its gathered parameters (see the module docstring).

    Args:
        mesh: the stage's submesh.
        axes: the piece's logical axis names (a tree of tuples, one per parameter) as
            they are where it runs: one layer's without ``"layers"``.
    """

    def __init__(self, mesh: Mesh, axes: Any):
        self.mesh = mesh
        self.specs = jax.tree.map(
            lambda names: logical_to_spec(names, stage_mesh=True), axes, is_leaf=is_logical_names
        )

        # XLA:CPU runs independent collectives in any order per device (module docstring).
        self.ordered = mesh.devices.flat[0].platform == "cpu"

    @staticmethod
    def active(mesh: Mesh) -> bool:
        """Whether ``mesh`` splits parameters at all (an ``fsdp`` axis of size > 1)."""
        return mesh.shape.get(FSDP_AXIS, 1) > 1

    def call(self, fn: Callable, params: Any, *args: Any) -> Any:
        """``fn(gathered params, *args)``, differentiable in ``params`` and ``args``."""
        return _gathered_call(self, fn, params, args)

    def gather(self, params: Any, after: Any = None) -> Any:
        """``params`` with every fsdp-split leaf gathered: constrained to its gathered
        sharding, or inside a region manual over fsdp (a stage run per cp rank,
        :mod:`hetjax.runtime.replicas`) all-gathered explicitly. On CPU the gathers
        start once ``after`` is ready, one after another."""
        manual = functools.partial(jax.lax.all_gather, axis_name=FSDP_AXIS, tiled=True)
        return self._each(
            params, lambda s: s, gathered_spec, lambda x, dim: manual(x, axis=dim), after
        )

    def scatter(self, grads: Any, after: Any = None) -> Any:
        """Gradients of the gathered ``params`` back on the stored split: a constraint,
        or (manual over fsdp) an explicit reduce-scatter; on CPU after ``after``, one
        after another."""
        manual = functools.partial(jax.lax.psum_scatter, axis_name=FSDP_AXIS, tiled=True)
        return self._each(
            grads,
            gathered_spec,
            lambda s: s,
            lambda g, dim: manual(g, scatter_dimension=dim),
            after,
        )

    def _each(
        self, tree: Any, source_of: Callable, spec_of: Callable, manual: Callable, after: Any
    ) -> Any:
        here = jax.sharding.get_abstract_mesh()
        explicit = FSDP_AXIS in here.manual_axes
        # Inside a shard_map a constraint names the region's own abstract mesh.
        mesh = here if here.manual_axes else self.mesh

        last = [after]  # the previous collective's output (CPU: the next one waits for it)

        def leaf(spec: PartitionSpec, x: jax.Array) -> jax.Array:
            dims = [i for i, e in enumerate(spec) if FSDP_AXIS in jax.tree.leaves(e)]
            if not dims:
                return x
            if self.ordered:
                x = _after(x, last[0])
                if not explicit:  # pinned, so that the partitioner keeps the collective here
                    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, source_of(spec)))
            if explicit:
                y = manual(x, dims[0])
            else:
                y = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_of(spec)))
            last[0] = y
            return y

        return jax.tree.map(leaf, self.specs, tree, is_leaf=lambda x: isinstance(x, PartitionSpec))

    def then(self, x: Any, after: Any) -> Any:
        """``x``, used only once ``after`` is ready (on CPU; as it is elsewhere)."""
        return _after(x, after) if self.ordered else x


def _after(x: Any, after: Any) -> Any:
    """``x`` that no computation reads before ``after`` is computed: an
    ``optimization_barrier`` over both (XLA schedules nothing that reads one of its
    outputs before all its inputs are ready)."""
    xs, tree = jax.tree.flatten(x)
    arrays = [i for i, v in enumerate(xs) if isinstance(v, jax.Array)]
    deps = [v for v in jax.tree.leaves(after) if isinstance(v, jax.Array)]
    if not arrays or not deps:
        return x
    out, _ = jax.lax.optimization_barrier(([xs[i] for i in arrays], deps))
    for i, v in zip(arrays, out, strict=True):
        xs[i] = v
    return jax.tree.unflatten(tree, xs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _gathered_call(gather: FsdpGather, fn: Callable, params: Any, args: tuple) -> Any:
    whole = gather.gather(params, after=args)
    return fn(whole, *gather.then(args, whole))


def _gathered_call_fwd(gather, fn, params, args):
    whole = gather.gather(params, after=args)
    out, vjp = jax.vjp(lambda w, a: fn(w, *a), whole, gather.then(args, whole))
    return out, (Residuals.of(vjp, jax.tree.leaves(whole)), params)


def _gathered_call_bwd(gather, fn, saved, g):
    del fn
    residuals, params = saved
    whole = gather.gather(params, after=g)  # gathered again, not kept from the forward
    g_whole, g_args = residuals.vjp(jax.tree.leaves(whole))(gather.then(g, whole))
    g_params = gather.scatter(g_whole, after=g_args)
    return g_params, gather.then(g_args, g_params)


_gathered_call.defvjp(_gathered_call_fwd, _gathered_call_bwd)


def expected_bytes_per_device(tree: Any) -> int:
    """What :func:`hetjax.inspect.memory.shard_bytes_per_device` should be under fsdp:
    each leaf's bytes per device with its sharding less fsdp (as without it), divided by
    the fsdp degree where the leaf is split over fsdp (the largest per-device share over
    the leaves' devices)."""
    total = 0
    for a in jax.tree.leaves(tree):
        sharding = getattr(a, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            continue
        spec, mesh = sharding.spec, sharding.mesh
        whole = NamedSharding(mesh, gathered_spec(spec)).shard_shape(a.shape)
        nbytes = math.prod(whole) * a.dtype.itemsize
        split = FSDP_AXIS in jax.tree.leaves(tuple(spec))
        total += nbytes // mesh.shape[FSDP_AXIS] if split else nbytes
    return total
