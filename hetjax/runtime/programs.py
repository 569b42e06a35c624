"""Compiled per-stage programs: forward, backward with gradient accumulation, update.

The executor is MPMD (see DESIGN.md): one set of jitted programs per (module, pipeline
stage), each on that stage's own submesh. Inside a program, parallelism is SPMD (GSPMD
shardings from the logical-axis rules).

Two choices that matter for speed and equality with the reference:

- **What the backward starts from is the module's activation policy**
  (``ModuleSpec.recompute``). ``none``: the forward runs ``jax.vjp`` of the stage (under
  the same replica vmap as the backward, so every residual carries the replica axis) and
  returns the residuals beside the output; the backward applies them to the cotangent
  and replays nothing. Residuals that ARE parameters (the stacked block weights a scan
  forwards) are not returned: the backward takes them from its own parameter argument,
  so a stash never holds a copy of the weights. ``selective``: the same, with the stage
  function under ``jax.checkpoint(policy=dots_with_no_batch_dims_saveable)``: it saves
  the outputs of the weight matmuls (dot_generals without batch dimensions) and
  recomputes the element-wise ops and the attention core (QK^T, softmax, PV, whose
  dot_generals batch over heads), as Megatron's selective recompute does. ``full``: the
  stage keeps only its input and the backward replays the forward (``jax.vjp`` on the
  stashed input): one input activation per in-flight microbatch, one more forward.
  The sink's last stage runs its forward inside its backward whatever the policy (its
  F only stashes the input), so there the policies differ only inside that one program
  (``selective`` applies the checkpoint policy there too).
- **Gradients stay per data-parallel replica while accumulating.** The backward maps
  the stage over the ``R`` replicas of the mesh's ``dp`` axis with ``jax.vmap(...,
  spmd_axis_name="dp")``, so its parameter gradient has a leading replica axis sharded
  over DP and XLA inserts no all-reduce. (With expert parallelism the ``ep`` ranks of a
  replica exchange tokens inside it, so ``R = dp / ep`` and the gradients of the
  non-expert weights are summed over ``ep`` within the microbatch.)
  :meth:`StageProgram.reduce` sums that axis once per step: one DP reduction per
  parameter per step, whatever the microbatch count.
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
- **Frozen parts are constants.** The backward differentiates (``jax.vjp``) only with
  respect to the stage's trainable parts and to the inputs whose gradient some trainable
  parameter upstream needs; frozen parameters are closed over, so XLA emits no
  weight-gradient matmuls for them (through a frozen LLM only activation gradients flow).
  Accumulators, the reduction and the optimizer state cover the trainable parts only; a
  frozen part's parameters pass through the update unchanged (their norm is still
  reported, so ``param_norm/<part>`` stays constant). Where a frozen encoder with
  nothing trainable upstream shares its last stage with a trained projector, the
  forward keeps the encoder's output and the backward starts there, so the encoder is
  not recomputed (``stash_frozen_output``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.distributed.rendezvous import FirstCalls
from hetjax.meshes import BATCH_AXES, param_shardings, sequence_axes
from hetjax.ops.context import auto_axes, parallel_context, region_activation_sharding
from hetjax.ops.token_routing import Routed
from hetjax.runtime.graph import ModuleSpec
from hetjax.runtime.jitted import Program, program_name
from hetjax.runtime.observers import Observers
from hetjax.runtime.optim import OptimizerConfig, make_optimizer
from hetjax.runtime.state import slice_stage

REPLICA_AXIS = "dp"  # gradients are kept per replica of this axis until the step ends
CP_AXIS = "cp"  # and, where the stage runs per cp rank (StageProgram.cp_local), of this one
# The axes a per-cp-rank stage (StageProgram.cp_local) is manual over: cp, and dp with
# it (each device runs its one replica), so that only tp is left to the partitioner.
MANUAL_AXES_ORDER = (REPLICA_AXIS, CP_AXIS)
MANUAL_AXES = frozenset(MANUAL_AXES_ORDER)
PER_RANK = P(REPLICA_AXIS, CP_AXIS)  # [B or R, L or cp, ...] split over both
# Checkpoint policy of `selective`: saves dot_generals without batch dimensions (x @ W,
# the weight matmuls) and recomputes the rest. `checkpoint_dots` would also save the
# attention scores (batched over heads: L^2 per head), which selective recompute is
# meant to drop.
SELECTIVE_POLICY = jax.checkpoint_policies.dots_with_no_batch_dims_saveable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Residuals:
    """What a ``none`` / ``selective`` forward keeps for its backward: the leaves of the
    stage's ``jax.vjp`` function, less those that are parameters (``slots``: position in
    the flattened vjp -> index into the stage's parameter leaves; the backward puts its
    own parameters back there)."""

    leaves: tuple[jax.Array, ...]  # [R, ...] per replica
    tree: Any = dataclasses.field(metadata=dict(static=True))  # the vjp's treedef
    slots: tuple[tuple[int, int], ...] = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """Per-run switches that change what every stage program does."""

    zero1: bool = False  # shard optimizer moments (and reduced gradients) over dp
    sequence_parallel: bool = False  # residual stream sharded on sequence over tp
    skip_nonfinite: bool = False  # a step whose global gradient norm is NaN/inf: no update


def zero1_sharding(
    sharding: NamedSharding, shape: tuple[int, ...], axes: tuple[str, ...] = BATCH_AXES
) -> NamedSharding:
    """``sharding`` with its first unsharded, evenly divisible dimension split over the
    data-parallel ``axes`` (ZeRO-1; a stage run per cp rank adds cp, as Megatron's
    distributed optimizer shards over dp x cp). Leaves that cannot be split stay as
    they are."""
    mesh = sharding.mesh
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    used = {a for entry in spec if entry for a in ((entry,) if isinstance(entry, str) else entry)}
    axes = tuple(a for a in axes if a not in used and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if size == 1:
        return sharding
    for i, (entry, n) in enumerate(zip(spec, shape, strict=True)):
        if entry is None and n % size == 0:
            spec[i] = axes
            return NamedSharding(mesh, P(*spec))
    return sharding


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
    tp is left, and both compile as they should."""
    return (
        mesh.shape[CP_AXIS] > 1
        and is_sink
        and bool(spec.seq_inputs)
        and mesh.shape["ep"] == 1
        and not moe
    )


def put_global(value: Any, sharding: NamedSharding) -> jax.Array:
    """A global array from a host value that every process holds; only local shards are
    built, so this works when ``sharding`` spans several processes.

    ``value`` may be a lazy array-like (``shape``, ``dtype`` and slicing that reads, e.g.
    :class:`models.hf.LazyTensor` or a numpy memmap): then only the slices of this
    process's shards are read."""
    if isinstance(value, jax.Array) or not hasattr(value, "__getitem__"):
        value = np.asarray(value)
    return jax.make_array_from_callback(
        value.shape, sharding, lambda idx: np.asarray(value[idx]), dtype=value.dtype
    )


def owns_any(devices: Any) -> bool:
    """Whether this process owns one of ``devices`` (always, in a single process)."""
    me = jax.process_index()
    return any(d.process_index == me for d in devices)


def stand_in(abstract: Any, sharding: NamedSharding) -> Any:
    """Arrays with no local shards in place of ``abstract`` (``ShapeDtypeStruct`` s, e.g.
    from ``jax.eval_shape``), for a process that owns none of their devices: each leaf
    takes its own sharding, or ``sharding`` where it has none (an output left to XLA).
    Nothing compiles or runs; a transfer issued with them moves only shape and dtype."""

    def leaf(a: jax.ShapeDtypeStruct) -> jax.Array:
        where = a.sharding if a.sharding is not None else sharding
        if owns_any(where.device_set):
            raise ValueError(f"a stand-in on devices this process owns ({where}): run the program")
        return jax.make_array_from_single_device_arrays(a.shape, where, [], dtype=a.dtype)

    return jax.tree.map(leaf, abstract)


def sqnorms_by_key(tree: dict[str, Any]) -> dict[str, jax.Array]:
    return {k: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(v)) for k, v in tree.items()}


class StageProgram:
    """Parameters slice and compiled programs of one pipeline stage of one module.

    Args:
        spec: the module.
        stage: pipeline stage index within the module.
        mesh: the stage's submesh (axes ``dp, ep, cp, tp``).
        is_sink: whether the module returns the loss.
        optimizer: an optax transformation, or AdamW settings (then built with the
            weight-decay mask of this stage's logical axes). Every stage runs it on its
            own parameters, so it must be elementwise across stages, except for
            :func:`hetjax.clip_by_global_norm`, which ``update`` feeds the GLOBAL
            gradient norm of all stages (as the ``global_norm`` extra argument).
        observers: told of every compile.
    """

    def __init__(
        self,
        spec: ModuleSpec,
        stage: int,
        mesh: Mesh,
        *,
        is_sink: bool,
        optimizer: OptimizerConfig | optax.GradientTransformation,
        options: ParallelOptions = ParallelOptions(),
        observers: Observers | None = None,
        backward: bool = True,
        input_grad: bool | frozenset[str] = True,
        stash_frozen_output: bool = False,
    ):
        self.spec, self.stage, self.mesh = spec, stage, mesh
        self.options = options
        self.first = stage == 0
        self.last = stage == spec.layout.pp - 1
        self.is_sink = is_sink
        self.backward = backward  # False: forward only (frozen, nothing trains upstream)
        # Which inputs the backward differentiates: later stages all or nothing; a first
        # stage the link inputs named (True: all of them).
        self.input_grad = input_grad
        # The forward also returns the frozen first part's output, which the backward
        # starts from (TrainGraph.stashes_frozen_output): no frozen encoder recompute.
        self.stash_frozen_output = stash_frozen_output
        self.recompute = spec.recompute
        # The forward returns vjp residuals (none / selective) that the backward consumes.
        # The loss stage's forward runs inside its backward, so it never does.
        self.keeps_residuals = backward and spec.recompute != "full" and not (is_sink and self.last)
        # The forward returns (output, what B starts from) instead of the output alone.
        self.forward_stashes = self.keeps_residuals or stash_frozen_output
        self.trainable = spec.trainable(stage)  # part names whose parameters train here
        self.replicas = mesh.shape[REPLICA_AXIS]
        self.axes = self.slice_params({p.name: p.logical_axes() for p in spec.parts})
        moe = any(
            "router" in jax.tree_util.keystr(k) for k, _ in jax.tree.leaves_with_path(self.axes)
        )
        self.cp_local = cp_local(spec, mesh, is_sink=is_sink, moe=moe)
        # Accumulator axes before the parameter's own: [R] or, per cp rank, [R, cp].
        self.acc_axes = (REPLICA_AXIS, CP_AXIS) if self.cp_local else (REPLICA_AXIS,)
        self.param_shardings = param_shardings(self.axes, mesh)
        self.replicated = NamedSharding(mesh, P())
        self.devices = frozenset(mesh.devices.flat)
        # Whether this process owns a device of the stage. If not (a multi-process run,
        # the stage on other processes' devices), its programs are never compiled or
        # called here: stand-ins (:meth:`stand_in`) take the place of their outputs.
        self.local = owns_any(self.devices)
        self.acc_shardings = jax.tree.map(
            lambda s: NamedSharding(mesh, P(*self.acc_axes, *s.spec)),
            self.trainable_of(self.param_shardings),
        )
        if isinstance(optimizer, OptimizerConfig):
            optimizer = make_optimizer(optimizer, logical_axes=self.trainable_of(self.axes))
        self.optimizer = optax.with_extra_args_support(optimizer)
        key = (spec.name, stage)
        observers = observers or Observers()

        def program(fn, kind, **jit_kwargs):
            return Program(fn, stage=key, kind=kind, observers=observers, **jit_kwargs)

        self.fwd = program(self._forward, "fwd")
        # Output shardings are pinned so that step 2 sees the same input shardings as
        # step 1: nothing recompiles after the first step.
        # Residuals are the backward's own: donated to it (a stage input is not, it may
        # still be read by the transfer that brought it).
        self.bwd = program(
            self._backward_residuals if self.keeps_residuals else self._backward,
            "bwd",
            donate_argnums=(1, 2) if self.keeps_residuals else (1,),
            out_shardings=(self.acc_shardings, None, None),
        )
        self.zeros = program(self._zeros, "zeros", out_shardings=self.acc_shardings)
        # ZeRO-1: reduced gradients and optimiser moments split over dp (x cp, with
        # cp_local), so the one reduction is a reduce-scatter and the update's output an
        # all-gather.
        self.grad_shardings = self.trainable_of(self.param_shardings)
        if options.zero1:
            self.grad_shardings = jax.tree.map(
                lambda sh, a: zero1_sharding(sh, a.shape, BATCH_AXES + self.acc_axes[1:]),
                self.grad_shardings,
                self._abstract_trainable(),
            )
        self.reduce = program(self._reduce, "reduce", out_shardings=(self.grad_shardings, None))
        # Optimiser moments are sharded like their gradients; counters are replicated. A
        # stage that trains nothing keeps no optimizer state at all (an empty tuple).
        self.state_shardings = ()
        if self.trainable:
            self.state_shardings = optax.tree_map_params(
                self.optimizer,
                lambda _, sharding: sharding,
                jax.eval_shape(self.optimizer.init, self._abstract_trainable()),
                self.grad_shardings,
                transform_non_params=lambda _: self.replicated,
            )
        self._init_opt = jax.jit(self._opt_init, out_shardings=self.state_shardings)
        self._first_calls = FirstCalls()  # the optimizer-state init's (multi-process)
        self.update = program(
            self._update,
            "update",
            donate_argnums=(0, 1, 2),
            out_shardings=(self.param_shardings, self.state_shardings, None),
        )

    def collectives(self, kind: str, *args: Any) -> bool:
        """Whether the ``kind`` program's call with ``args`` runs cross-device collectives
        (a one-device stage never does; otherwise its compiled HLO says)."""
        return len(self.devices) > 1 and getattr(self, kind).collectives(*args)

    # -- parameters ---------------------------------------------------------------------

    def slice_params(self, full: dict[str, Any]) -> dict[str, Any]:
        """This stage's part of a full parameter (or logical-axes) tree."""
        return slice_stage(self.spec, self.stage, full)

    def trainable_of(self, tree: dict[str, Any]) -> dict[str, Any]:
        """The trainable parts of a stage-shaped tree."""
        return {k: v for k, v in tree.items() if k in self.trainable}

    def _opt_init(self, trainable: dict[str, Any]) -> Any:
        return self.optimizer.init(trainable) if self.trainable else ()

    def init_opt_state(self, params: dict[str, Any]) -> Any:
        """The optimizer state of this stage's (placed) parameters' trainable parts
        (stand-ins on a process that owns none of the stage's devices)."""
        trained = self.trainable_of(params)
        if not self.local:
            return stand_in(jax.eval_shape(self._init_opt, trained), self.replicated)
        name = program_name((self.spec.name, self.stage), "opt_init")
        self._first_calls.ready(name, self._init_opt, trained)
        return self._init_opt(trained)

    def stand_in(self, kind: str, *args: Any) -> Any:
        """What program ``kind`` (``fwd``, ``bwd``, ``zeros``, ...) returns for ``args``,
        as arrays with no local shards (:func:`stand_in`; outputs whose sharding XLA
        picks are replicated on the stage mesh): traced once per signature, never
        compiled. For a process that owns none of the stage's devices."""
        return stand_in(getattr(self, kind).eval_shape(*args), self.replicated)

    def abstract_state(self) -> tuple[Any, Any]:
        """This stage's parameters and optimizer state as ``ShapeDtypeStruct`` s carrying
        their shardings (what a checkpoint restores into)."""

        def sds(a, sharding):
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

        params = self._abstract_stage()
        opt = jax.eval_shape(self._opt_init, self.trainable_of(params))
        return (
            jax.tree.map(sds, params, self.param_shardings),
            jax.tree.map(sds, opt, self.state_shardings),
        )

    def place_params(self, full: dict[str, Any]) -> dict[str, Any]:
        return jax.tree.map(put_global, self.slice_params(full), self.param_shardings)

    # -- the stage function -------------------------------------------------------------

    def apply(
        self,
        params: dict[str, Any],
        x: Any,
        batch: dict[str, jax.Array],
        *,
        per_replica: bool = False,
        loss_scale: Any = None,
        segment: str = "all",
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
            sequence_parallel=self.options.sequence_parallel,
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
            h = main.apply_pre(mine["pre"], *args, **x) if "pre" in mine else args[0]
        else:
            h = x
        if "blocks" in mine:
            start, stop = self.spec.stage_layers(self.stage)
            h = main.apply_blocks(
                mine["blocks"],
                h,
                start=start,
                stop=stop,
                carry_sharding=self._carry_sharding(h, batch_axes=self.batch_axes(per_replica)),
                **{k: batch[k] for k in self.spec.block_inputs},
            )
        if not self.last:
            return h
        if self.is_sink:
            return main.apply_post(mine["post"], h, *[batch[k] for k in self.spec.loss_inputs])
        if "post" in mine:
            h = main.apply_post(mine["post"], h)
        return h

    def _apply_rest(self, params, h, per_replica):
        """The further parts of a non-sink module's last stage, and its output layout."""
        for part in self.spec.parts[1:]:
            h = part(params[part.name], h)
        if sequence_axes(self.mesh) is not None:
            # A module's output leaves batch-split and whole over cp (the boundary's
            # source layout), so its cp ranks' token slices are gathered here.
            batch = self.batch_axes(per_replica)
            h = jax.lax.with_sharding_constraint(h, NamedSharding(self.mesh, P(batch)))
        return h

    def batch_axes(self, per_replica: bool) -> tuple[str, ...] | None:
        """Mesh axes the batch dimension is split over, here or inside the replica vmap."""
        if not per_replica:
            return BATCH_AXES
        return ("ep",) if self.mesh.shape["ep"] > 1 else None

    def _carry_sharding(self, h: Any, *, batch_axes: Any) -> NamedSharding | None:
        """The residual stream between blocks.

        Context parallelism: the sequence axis is split over cp - for the LLM its inputs
        already are; an encoder with cp > 1 (one that inherits the LLM's layout) splits
        its tokens here, and its attention rings K/V over cp (it is not replicated).
        Sequence parallelism: split over tp (and cp) too, so GSPMD turns the row-parallel
        all-reduce into a reduce-scatter and gathers the sequence before the next
        column-parallel matmul."""
        sp = self.options.sequence_parallel and self.mesh.shape["tp"] > 1
        # Per cp rank (cp_local, manual over dp and cp) the block is this rank's: only
        # sequence parallelism's tp split is left to name.
        seq = sequence_axes(self.mesh, tp=sp)
        if auto_axes(seq) is None:
            return None
        return region_activation_sharding(self.mesh, h.ndim, batch_axes=batch_axes, sequence=seq)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        keys = (self.spec.inputs if self.first else ()) + self.spec.block_inputs
        return keys + (self.spec.loss_inputs if self.last and self.is_sink else ())

    # -- programs -----------------------------------------------------------------------

    def _forward(self, params, x, batch, normalizer):
        """The stage output; with :attr:`forward_stashes` also what the backward starts
        from: the frozen first part's output, or the residuals (:class:`Residuals`)."""
        start = x
        if self.stash_frozen_output:
            start = self.apply(params, x, batch, segment="main")
            if not self.keeps_residuals:
                return self.apply(params, start, batch, segment="rest"), start
        if not self.keeps_residuals:
            return self.apply(params, x, batch)

        def replicas(trained, frozen, start, batch):
            own = jax.tree.leaves((trained, frozen))

            def per_replica(x_r, batch_r):
                y, vjp = self._stage_vjp(trained, frozen, x_r, batch_r, normalizer)
                leaves, tree = jax.tree.flatten(vjp)
                index = {id(p): i for i, p in enumerate(own)}
                slots = tuple((j, index[id(a)]) for j, a in enumerate(leaves) if id(a) in index)
                dropped = {j for j, _ in slots}
                kept = tuple(a for j, a in enumerate(leaves) if j not in dropped)
                self._residual_meta = (tree, slots)  # static: read right after the vmap
                return y, kept

            y, kept = self._vmap_replicas(per_replica)(*self._per_replica((start, batch)))
            return self._merge_replicas(y), self._per_rank(kept)

        data = (start, batch)
        y, kept = self._cp_map(replicas, data, (PER_RANK, PER_RANK))(
            self.trainable_of(params), self._frozen_of(params), *data
        )
        return y, Residuals(kept, *self._residual_meta)

    def _backward(self, params, acc, x, batch, g_out, normalizer):
        """Runs the stage forward from its stashed input under ``jax.vjp`` (``full``: a
        replay; the loss stage in every policy: its only forward) and accumulates the
        per-replica parameter gradient."""

        def replicas(trained, frozen, x, batch, g_out):
            def per_replica(x_r, batch_r, g_r):
                y, vjp = self._stage_vjp(trained, frozen, x_r, batch_r, normalizer)
                cot = jnp.ones_like(y) if g_r is None else g_r
                gp, gx = vjp(cot)
                loss = y if self.is_sink and self.last else jnp.zeros((), jnp.float32)
                return gp, gx, loss

            gp, gx, loss = self._vmap_replicas(per_replica)(*self._per_replica((x, batch, g_out)))
            gx = self._sum_whole_over_cp(self._merge_replicas(gx))
            return self._per_rank(gp), gx, self._per_rank(jnp.sum(loss))

        data = (x, batch, g_out)
        x_diff = self._split_input(x)[0]
        gp, gx, loss = self._cp_map(
            replicas, data, (PER_RANK, self._seq_specs(x_diff), P(MANUAL_AXES_ORDER))
        )(self.trainable_of(params), self._frozen_of(params), *data)
        return jax.tree.map(jnp.add, acc, gp), gx, jnp.sum(loss)

    def _backward_residuals(self, params, acc, res, batch, g_out, normalizer):
        """Applies the forward's residuals to the output cotangent (``none`` /
        ``selective``): nothing of the forward runs again. ``batch`` and ``normalizer``
        are unused (the residuals hold what they contributed); the signature is the
        other backward's."""
        del batch, normalizer

        def replicas(trained, frozen, kept, g_out):
            own = jax.tree.leaves((trained, frozen))

            def per_replica(kept, g_r):
                leaves, rest = [None] * (len(kept) + len(res.slots)), iter(kept)
                for j, i in res.slots:
                    leaves[j] = own[i]
                leaves = [next(rest) if a is None else a for a in leaves]
                return res.tree.unflatten(leaves)(g_r)

            kept = self._of_rank(kept)
            (g_out,) = self._per_replica((g_out,))
            gp, gx = self._vmap_replicas(per_replica)(kept, g_out)
            return self._per_rank(gp), self._sum_whole_over_cp(self._merge_replicas(gx))

        data = (res.leaves, g_out)
        gp, gx = self._cp_map(replicas, data, (PER_RANK, PER_RANK))(
            self.trainable_of(params), self._frozen_of(params), *data
        )
        zero = jnp.zeros((), jnp.float32)
        return jax.tree.map(jnp.add, acc, gp), gx, zero

    def _stage_vjp(self, trained, frozen, x_r, batch_r, normalizer):
        """``jax.vjp`` of one replica's stage function with respect to the trainable
        parameters and the differentiated inputs (frozen parameters and the other inputs
        are constants); on the sink's last stage of the loss over ``normalizer``."""
        x_diff, rebuild = self._split_input(x_r)

        def f(p, xd):
            y = self.apply(
                {**frozen, **p},
                rebuild(xd),
                batch_r,
                per_replica=True,
                loss_scale=1.0 / normalizer,
                segment="rest" if self.stash_frozen_output else "all",
            )
            return y / normalizer if self.is_sink and self.last else y

        if self.recompute == "selective":
            f = jax.checkpoint(f, policy=SELECTIVE_POLICY)
        return jax.vjp(f, trained, x_diff)

    def _cp_map(self, fn, data: tuple, out_specs: tuple):
        """``fn(trained, frozen, *data)`` as it is, or (:attr:`cp_local`) per cp rank: in
        a ``shard_map`` manual over dp and cp (tp stays the partitioner's; each device
        runs its one replica), every leaf of ``data`` split over dp on dim 0 and, where
        it has a sequence axis, over cp on dim 1 (:meth:`_seq_specs`), parameters whole
        over dp and cp (still split over tp). ``fn`` differentiates
        inside, so a parameter's cotangent is this rank's partial sum: no psum over cp.
        ``check_vma=False``: nothing here is differentiated through the ``shard_map``
        itself (the ring's custom VJP passes its own cotangents around)."""
        if not self.cp_local:
            return fn
        return jax.shard_map(
            fn,
            mesh=self.mesh,
            in_specs=(P(), P(), *(self._seq_specs(d) for d in data)),
            out_specs=out_specs,
            axis_names=MANUAL_AXES,
            check_vma=False,
        )

    def _seq_specs(self, tree: Any) -> Any:
        """``shard_map`` specs of stage data, all split over dp on dim 0 (the batch, or
        the replica axis): and over cp on dim 1 for activations, their cotangents,
        residuals (``[R, cp, ...]``, :meth:`_per_rank`), routed tokens and the batch's
        ``seq_inputs``; whole over cp otherwise."""
        split, whole = PER_RANK, P(REPLICA_AXIS)
        if tree is None:
            return P()
        if isinstance(tree, dict):  # a batch, or a first stage's link inputs
            return {
                k: split if isinstance(v, Routed) or k in self.spec.seq_inputs else whole
                for k, v in tree.items()
            }
        return split

    def _sum_whole_over_cp(self, gx: Any) -> Any:
        """Inside :meth:`_cp_map`: a first stage's link inputs that arrive whole over cp
        (not :class:`Routed`: the homogeneous baseline's image tokens) got from each rank
        the cotangent of its own slots only; summed over cp here (an activation
        gradient, once per microbatch, as GSPMD would; parameters stay per rank)."""
        if not self.cp_local or not isinstance(gx, dict):
            return gx
        return {k: g if isinstance(g, Routed) else jax.lax.psum(g, CP_AXIS) for k, g in gx.items()}

    def _per_rank(self, tree: Any) -> Any:
        """Inside :meth:`_cp_map`: a cp axis of size 1 after the replica axis (a scalar
        gets one leading axis), so the rank's partial gradient leaves as ``[R, cp, ...]``."""
        if not self.cp_local:
            return tree
        return jax.tree.map(lambda a: a[None] if a.ndim == 0 else a[:, None], tree)

    def _of_rank(self, tree: Any) -> Any:
        """Inverse of :meth:`_per_rank` on ``[R, 1, ...]`` leaves."""
        if not self.cp_local:
            return tree
        return jax.tree.map(lambda a: a[:, 0], tree)

    def _vmap_replicas(self, fn):
        """``fn`` mapped over the leading replica axis: split over dp by GSPMD
        (``spmd_axis_name``), or, inside :meth:`_cp_map` (manual over dp), this device's
        one replica."""
        if self.cp_local:
            return jax.vmap(fn)
        return jax.vmap(fn, spmd_axis_name=REPLICA_AXIS)

    def _per_replica(self, trees: tuple) -> tuple:
        """Splits the batch dimension of every leaf into ``[R, batch / R, ...]`` (inside
        :meth:`_cp_map`, manual over dp: ``R`` is this device's one replica)."""
        r = 1 if self.cp_local else self.replicas
        return jax.tree.map(lambda a: a.reshape(r, a.shape[0] // r, *a.shape[1:]), trees)

    @staticmethod
    def _merge_replicas(tree: Any) -> Any:
        return jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), tree)

    def _frozen_of(self, tree: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in tree.items() if k not in self.trainable}

    def _split_input(self, x: Any) -> tuple[Any, Any]:
        """The stage input's parts to differentiate, and how to rebuild the input from
        them (the rest are constants of the backward)."""
        if isinstance(x, dict):
            names = set(x) if self.input_grad is True else set(self.input_grad or ())
            const = {k: v for k, v in x.items() if k not in names}
            return {k: v for k, v in x.items() if k in names}, lambda d: {**d, **const}
        if self.input_grad:
            return x, lambda d: d
        return None, lambda _: x

    def _abstract_trainable(self):
        return self.trainable_of(self._abstract_stage())

    def _abstract_stage(self):
        full = {p.name: p.abstract_params() for p in self.spec.parts}
        return jax.eval_shape(self.slice_params, full)

    def _zeros(self):
        lead = tuple(self.mesh.shape[a] for a in self.acc_axes)
        return jax.tree.map(
            lambda s: jnp.zeros((*lead, *s.shape), jnp.float32),
            self._abstract_trainable(),
        )

    def _reduce(self, acc):
        # The one DP (x CP) reduction of the step. [R, cp, ...] is first viewed as
        # [R * cp, ...] (split over dp x cp: no data moves), so the sum is one collective
        # over the dp x cp group, not one over cp and another over dp.
        n = len(self.acc_axes)
        grads = jax.tree.map(lambda a: jnp.sum(a.reshape(-1, *a.shape[n:]), axis=0), acc)
        return grads, sqnorms_by_key(grads)

    def _update(self, params, opt_state, grads, global_norm):
        if not self.trainable:  # nothing to update; the norms are still reported
            return params, opt_state, sqnorms_by_key(params)
        old_state, trained = opt_state, self.trainable_of(params)
        # hetjax.clip_by_global_norm in the chain clips with the norm of ALL stages.
        updates, opt_state = self.optimizer.update(
            grads, opt_state, trained, global_norm=global_norm
        )
        new = optax.apply_updates(trained, updates)
        if self.options.skip_nonfinite:  # every stage sees the same global norm
            keep = ~jnp.isfinite(global_norm)
            new, opt_state = jax.tree.map(
                lambda n, o: jnp.where(keep, o, n), (new, opt_state), (trained, old_state)
            )
        new = {**params, **new}  # frozen parts pass through unchanged
        return new, opt_state, sqnorms_by_key(new)
