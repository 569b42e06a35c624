"""How a stage's backward maps over data-parallel replicas and context-parallel ranks.

- **Gradients stay per data-parallel replica while accumulating.** The backward maps
  the stage over the ``R`` replicas of the mesh's ``dp`` axis with ``jax.vmap(...,
  spmd_axis_name="dp")``, so its parameter gradient has a leading replica axis sharded
  over DP and XLA inserts no all-reduce. (With expert parallelism the ``ep`` ranks of a
  replica exchange tokens inside it, so ``R = dp / ep`` and the gradients of the
  non-expert weights are summed over ``ep`` within the microbatch.)
  ``StageProgram.reduce`` sums that axis once per step: one DP reduction per parameter
  per step, whatever the microbatch count.
- **And per context-parallel rank** (:func:`cp_local`: the dense LLM). Under GSPMD a
  parameter replicated over cp has a replicated cotangent, so every backward would
  all-reduce its cp ranks' partial sums (the weight-gradient matmuls contract the
  cp-split sequence). Instead the vjp runs inside a ``shard_map`` manual over ``dp`` and
  ``cp`` (each device runs its own replica's token block; tp, with sequence parallelism,
  is left to the partitioner): a rank differentiates its own block, so its parameter
  cotangent is its partial sum and nothing is summed; the ops that ``shard_map`` over cp
  (ring attention, ``merge_routed``) call their per-rank kernels there
  (``hetjax.ops.context.cp_is_manual``), and sharding constraints name only the axes
  left automatic (``hetjax.ops.context.auto_axes``). The accumulator is ``[R, cp, ...]``
  split over dp x cp and ``reduce`` sums both axes in one collective over the dp x cp
  group (Megatron's ``data_parallel_group_with_cp``); under ZeRO-1 the reduced gradients
  and moments are split over dp x cp. Memory: the accumulator is cp times larger
  globally, but each device still holds one parameter-sized slice of it, as before
  (then it was replicated over cp) and as in Megatron, whose cp ranks each keep a full
  ``main_grad`` buffer of their (tp/pp-sharded) parameters. Why not broadcast the
  parameters to ``[cp, ...]`` and differentiate outside the ``shard_map``: inside, the
  cotangents are per rank by construction and the parameters need no copy. Why dp is
  manual too: a region manual over cp alone leaves the replica vmap's dp axis and tp to
  the partitioner, which on jax 0.10.2 aborts with tp > 1 (Shardy) or leaves dp
  unpartitioned (GSPMD: every device computed both replicas' blocks).

- **Not per fsdp rank.** The fsdp ranks of a replica (:mod:`hetjax.runtime.fsdp`) split
  its batch like data ranks but are no replica axis: inside the vmap the batch stays
  split over fsdp (GSPMD's), parameters are gathered per layer, and each backward
  reduce-scatters the parameter gradient onto the fsdp split, so the accumulator
  ``[R, ...]`` keeps the parameter's sharding and ``reduce`` sums over dp (x cp) only.
  Why not replicas over fsdp too: their accumulators would hold a whole gradient each,
  which is what fsdp exists to avoid.

:class:`ReplicaMap` holds that mapping for one stage; the vjp (:mod:`hetjax.runtime.vjp`)
runs inside it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hetjax.meshes import FSDP_AXIS
from hetjax.ops.token_routing import Routed
from hetjax.runtime.graph import ModuleSpec
from hetjax.runtime.stage_fn import split_parts

REPLICA_AXIS = "dp"  # gradients are kept per replica of this axis until the step ends
CP_AXIS = "cp"  # and, where the stage runs per cp rank (StageProgram.cp_local), of this one
# The axes a per-cp-rank stage (StageProgram.cp_local) is manual over: cp, and dp with
# it (each device runs its one replica), so that only tp is left to the partitioner.
MANUAL_AXES_ORDER = (REPLICA_AXIS, CP_AXIS)
MANUAL_AXES = frozenset(MANUAL_AXES_ORDER)
PER_RANK = P(REPLICA_AXIS, CP_AXIS)  # [B or R, L or cp, ...] split over both


def cp_local(spec: ModuleSpec, mesh: Mesh, *, is_sink: bool, moe: bool) -> bool:
    """Whether a stage's programs run per cp rank (gradients reduced over cp once per
    step, in ``reduce``). Yes for a context-parallel loss module (the LLM) whose data
    arrives split over cp, with any tp. Not (their cp gradients are still all-reduced by
    GSPMD in every backward) for: an encoder with cp > 1 (it gets whole inputs and splits
    its tokens itself); expert parallelism (its token dispatch ``shard_map`` s over cp
    itself); MoE layers even at ep = 1 (capacity and balancing statistics are taken over
    all of a replica's tokens, not one rank's). Modality tokens that arrive whole over cp
    (the homogeneous baseline's, not routed) are merged per rank too
    (:func:`hetjax.ops.token_routing.merge_whole_per_rank`: the slot mask is gathered
    over cp, the tokens' cotangent summed over cp in the backward).

    History: this was tp = 1 only while the region was manual over cp alone; with tp > 1
    left to the partitioner inside it, jax 0.10.2's Shardy aborted
    (``spmd_partitioner_util.cc``: "Check failed: partition_group_list.num_replica_groups()
    * ...") and GSPMD left the replica vmap's dp axis unpartitioned (every device computed
    both dp replicas' attention blocks; 1.7x the cost model's backward FLOPs in
    ``tests/plan/test_validation.py``'s ``colocated_cp``). Manual over dp as well, only
    tp is left, and both compile as they should. For the same reason a stage with fsdp
    runs manual over fsdp too (left automatic beside tp, jax 0.10.2 aborts with the same
    check): its parameters enter split over fsdp and :mod:`hetjax.runtime.fsdp` gathers
    and reduce-scatters them with explicit collectives there."""
    return (
        mesh.shape[CP_AXIS] > 1
        and is_sink
        and bool(spec.seq_inputs)
        and mesh.shape["ep"] == 1
        and not moe
    )


@dataclasses.dataclass(frozen=True)
class ReplicaMap:
    """One stage's mapping over its dp replicas and (with ``cp_local``) its cp ranks."""

    mesh: Mesh  # the stage's submesh
    cp_local: bool  # run per cp rank (:func:`cp_local`)
    seq_inputs: tuple[str, ...]  # batch keys with a sequence axis (ModuleSpec.seq_inputs)
    # The stage's parameter specs (stage-shaped), for the fsdp split they enter cp_map with.
    param_specs: Any = dataclasses.field(default=None, compare=False)

    @property
    def fsdp_manual(self) -> bool:
        """Per cp rank with fsdp: the region is manual over fsdp too (:func:`cp_local`)."""
        return self.cp_local and self.mesh.shape[FSDP_AXIS] > 1

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes :meth:`cp_map` is manual over, in mesh order."""
        return (REPLICA_AXIS, FSDP_AXIS, CP_AXIS) if self.fsdp_manual else MANUAL_AXES_ORDER

    @property
    def rank_spec(self) -> P:
        """``[B or R, L or cp, ...]`` split per device of :meth:`cp_map`: the batch (or
        replica) axis over dp (and fsdp, manual), the sequence (or cp) axis over cp."""
        return P(self.manual_axes[:-1], CP_AXIS) if self.fsdp_manual else PER_RANK

    @property
    def loss_spec(self) -> P:
        """One partial loss per device of :meth:`cp_map` (summed outside)."""
        return P(self.manual_axes)

    def grad_specs(self, trainable: tuple[str, ...]) -> Any:
        """Out specs of the per-rank parameter gradients ``[R, cp, ...]``: split over dp
        and cp, and (manual fsdp) over fsdp where the parameter is."""
        if not self.fsdp_manual:
            return PER_RANK
        return jax.tree.map(
            lambda s: P(REPLICA_AXIS, CP_AXIS, *_fsdp_only(s)),
            split_parts(self.param_specs, trainable)[0],
            is_leaf=lambda x: isinstance(x, P),
        )

    @property
    def replicas(self) -> int:
        """``R``: the number of data-parallel replicas."""
        return self.mesh.shape[REPLICA_AXIS]

    @property
    def acc_axes(self) -> tuple[str, ...]:
        """Accumulator axes before the parameter's own: [R] or, per cp rank, [R, cp]."""
        return (REPLICA_AXIS, CP_AXIS) if self.cp_local else (REPLICA_AXIS,)

    def cp_map(
        self, fn: Callable, data: tuple, out_specs: tuple, trainable: tuple[str, ...] = ()
    ) -> Callable:
        """``fn(trained, frozen, *data)`` as it is, or (:attr:`cp_local`) per cp rank: in
        a ``shard_map`` manual over dp and cp (tp stays the partitioner's; each device
        runs its one replica), every leaf of ``data`` split over dp on dim 0 and, where
        it has a sequence axis, over cp on dim 1 (:meth:`seq_specs`), parameters whole
        over dp and cp (still split over tp; with manual fsdp, as stored over fsdp: the
        parts in ``trainable`` first, then the others). ``fn`` differentiates
        inside, so a parameter's cotangent is this rank's partial sum: no psum over cp.
        ``check_vma=False``: nothing here is differentiated through the ``shard_map``
        itself (the ring's custom VJP passes its own cotangents around)."""
        if not self.cp_local:
            return fn
        params = (P(), P())
        if self.fsdp_manual:
            specs = jax.tree.map(_fsdp_only, self.param_specs, is_leaf=lambda x: isinstance(x, P))
            params = split_parts(specs, trainable)
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=(*params, *(self.seq_specs(d) for d in data)),
            out_specs=out_specs,
            axis_names=frozenset(self.manual_axes),
            check_vma=False,
        )

    def seq_specs(self, tree: Any) -> Any:
        """``shard_map`` specs of stage data, all split over dp on dim 0 (the batch, or
        the replica axis): and over cp on dim 1 for activations, their cotangents,
        residuals (``[R, cp, ...]``, :meth:`per_rank`), routed tokens and the batch's
        ``seq_inputs``; whole over cp otherwise."""
        split, whole = self.rank_spec, P(self.rank_spec[0])
        if tree is None:
            return P()
        if isinstance(tree, dict):  # a batch, or a first stage's link inputs
            return {
                k: split if isinstance(v, Routed) or k in self.seq_inputs else whole
                for k, v in tree.items()
            }
        return split

    def sum_whole_over_cp(self, gx: Any) -> Any:
        """Inside :meth:`cp_map`: a first stage's link inputs that arrive whole over cp
        (not :class:`Routed`: the homogeneous baseline's image tokens) got from each rank
        the cotangent of its own slots only; summed over cp here (an activation
        gradient, once per microbatch, as GSPMD would; parameters stay per rank)."""
        if not self.cp_local or not isinstance(gx, dict):
            return gx
        return {k: g if isinstance(g, Routed) else jax.lax.psum(g, CP_AXIS) for k, g in gx.items()}

    def per_rank(self, tree: Any) -> Any:
        """Inside :meth:`cp_map`: a cp axis of size 1 after the replica axis (a scalar
        gets one leading axis), so the rank's partial gradient leaves as ``[R, cp, ...]``."""
        if not self.cp_local:
            return tree
        return jax.tree.map(lambda a: a[None] if a.ndim == 0 else a[:, None], tree)

    def of_rank(self, tree: Any) -> Any:
        """Inverse of :meth:`per_rank` on ``[R, 1, ...]`` leaves."""
        if not self.cp_local:
            return tree
        return jax.tree.map(lambda a: a[:, 0], tree)

    def vmap(self, fn: Callable) -> Callable:
        """``fn`` mapped over the leading replica axis: split over dp by GSPMD
        (``spmd_axis_name``), or, inside :meth:`cp_map` (manual over dp), this device's
        one replica."""
        if self.cp_local:
            return jax.vmap(fn)
        return jax.vmap(fn, spmd_axis_name=REPLICA_AXIS)

    def split(self, trees: tuple) -> tuple:
        """Splits the batch dimension of every leaf into ``[R, batch / R, ...]`` (inside
        :meth:`cp_map`, manual over dp: ``R`` is this device's one replica)."""
        r = 1 if self.cp_local else self.replicas
        return jax.tree.map(lambda a: a.reshape(r, a.shape[0] // r, *a.shape[1:]), trees)

    @staticmethod
    def merge(tree: Any) -> Any:
        """Inverse of :meth:`split`: ``[R, batch / R, ...]`` back to ``[batch, ...]``."""
        return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)


def _fsdp_only(spec: P) -> P:
    """``spec`` with only its fsdp entries (what a region manual over fsdp names)."""
    return P(*(FSDP_AXIS if FSDP_AXIS in jax.tree.leaves(e) else None for e in spec))
