"""Compiled per-stage programs: forward, backward with gradient accumulation, update.

The executor is MPMD (see DESIGN.md): one set of jitted programs per (module, pipeline
stage), each on that stage's own submesh. Inside a program, parallelism is SPMD (GSPMD
shardings from the logical-axis rules). :class:`StageProgram` composes one concept per
module:

- the stage function, a pure function of (parameters, input, batch)
  (:mod:`hetjax.runtime.stage_fn`);
- its forward and backward: ``jax.vjp``, the activation policy and the residuals the
  forward keeps (:mod:`hetjax.runtime.vjp`);
- the mapping over data-parallel replicas and context-parallel ranks that keeps
  gradients unreduced while accumulating (:mod:`hetjax.runtime.replicas`);
- the accumulator, the one reduction per step and the optimizer update
  (:mod:`hetjax.runtime.update`);
- placement: global arrays from host values, the ZeRO-1 rule, stand-ins for stages on
  other processes (:mod:`hetjax.runtime.placement`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.distributed.rendezvous import FirstCalls
from hetjax.meshes import param_shardings
from hetjax.runtime.graph import ModuleSpec
from hetjax.runtime.jitted import Program, program_name
from hetjax.runtime.observers import Observers
from hetjax.runtime.optim import AdamWConfig
from hetjax.runtime.placement import owns_any, put_global, stand_in
from hetjax.runtime.replicas import ReplicaMap, cp_local
from hetjax.runtime.stage_fn import StageFunction, split_parts
from hetjax.runtime.state import as_stored, slice_stage, stored_params
from hetjax.runtime.update import StageUpdate
from hetjax.runtime.vjp import StageVjp

__all__ = ["ParallelOptions", "StageProgram", "owns_any", "put_global", "stand_in"]


@dataclasses.dataclass(frozen=True)
class ParallelOptions:
    """Per-run switches that change what every stage program does."""

    zero1: bool = False  # shard optimizer moments (and reduced gradients) over dp
    sequence_parallel: bool = False  # residual stream sharded on sequence over tp
    skip_nonfinite: bool = False  # a step whose global gradient norm is NaN/inf: no update
    frozen_dtype: str | None = None  # the compute dtype: frozen parts' matrices are held in
    # it, with no float32 master (hetjax.runtime.state.stored_params); None: float32


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
        optimizer: AdamWConfig | optax.GradientTransformation,
        options: ParallelOptions = ParallelOptions(),
        observers: Observers | None = None,
        backward: bool = True,
        input_grad: bool | frozenset[str] = True,
        stash_frozen_output: bool = False,
    ):
        self.spec, self.stage, self.mesh = spec, stage, mesh
        self.options = options
        self.is_sink = is_sink
        self.backward = backward  # False: forward only (frozen, nothing trains upstream)
        self.input_grad = input_grad
        self.stash_frozen_output = stash_frozen_output
        self.recompute = spec.recompute
        self.fn = StageFunction(spec, stage, mesh, is_sink, options.sequence_parallel)
        self.first, self.last = self.fn.first, self.fn.last
        self.trainable = spec.trainable(stage)  # part names whose parameters train here
        self.axes = self.slice_params({p.name: p.logical_axes() for p in spec.parts})
        moe = any(
            "router" in jax.tree_util.keystr(k) for k, _ in jax.tree.leaves_with_path(self.axes)
        )
        self.cp_local = cp_local(spec, mesh, is_sink=is_sink, moe=moe)
        self.param_shardings = param_shardings(self.axes, mesh)
        specs = jax.tree.map(lambda s: s.spec, self.param_shardings)
        self.map = ReplicaMap(mesh, self.cp_local, spec.seq_inputs, specs)
        self.replicas, self.acc_axes = self.map.replicas, self.map.acc_axes
        self.vjp = StageVjp(
            self.fn,
            self.map,
            trainable=self.trainable,
            backward=backward,
            input_grad=input_grad,
            stash_frozen_output=stash_frozen_output,
        )
        self.keeps_residuals = self.vjp.keeps_residuals
        self.forward_stashes = self.vjp.forward_stashes
        self.replicated = NamedSharding(mesh, P())
        self.devices = frozenset(mesh.devices.flat)
        # Whether this process owns a device of the stage. If not (a multi-process run,
        # the stage on other processes' devices), its programs are never compiled or
        # called here: stand-ins (:meth:`stand_in`) take the place of their outputs.
        self.local = owns_any(self.devices)
        self._abstract = stored_params(
            jax.eval_shape(self.slice_params, {p.name: p.abstract_params() for p in spec.parts}),
            self.axes,
            spec.frozen,
            options.frozen_dtype,
        )
        self.step = StageUpdate(
            optimizer,
            mesh=mesh,
            trainable=self.trainable,
            axes=self.axes,
            abstract=self._abstract,
            param_shardings=self.param_shardings,
            acc_axes=self.acc_axes,
            zero1=options.zero1,
            skip_nonfinite=options.skip_nonfinite,
        )
        self.optimizer = self.step.optimizer
        self.acc_shardings = self.step.acc_shardings
        self.grad_shardings = self.step.grad_shardings
        self.state_shardings = self.step.state_shardings
        key = (spec.name, stage)
        observers = observers or Observers()

        def program(fn, kind, **jit_kwargs):
            return Program(fn, stage=key, kind=kind, observers=observers, **jit_kwargs)

        self.fwd = program(self.vjp.forward, "fwd")
        # Output shardings are pinned so that step 2 sees the same input shardings as
        # step 1: nothing recompiles after the first step.
        # Residuals are the backward's own: donated to it (a stage input is not, it may
        # still be read by the transfer that brought it).
        self.bwd = program(
            self.vjp.backward_residuals if self.keeps_residuals else self.vjp.backward,
            "bwd",
            donate_argnums=(1, 2) if self.keeps_residuals else (1,),
            out_shardings=(self.acc_shardings, None, None),
        )
        # The accumulator of a stage with several backwards per step (with one, its
        # backward takes None and writes the gradients itself: update.accumulate).
        self.zeros = program(self.step.zeros, "zeros", out_shardings=self.acc_shardings)
        self.reduce = program(self.step.reduce, "reduce", out_shardings=(self.grad_shardings, None))
        self._init_opt = jax.jit(self._opt_init, out_shardings=self.state_shardings)
        self._first_calls = FirstCalls()  # the optimizer-state init's (multi-process)
        self.update = program(
            self.step.update,
            "update",
            donate_argnums=(0, 1, 2),
            out_shardings=(self.param_shardings, self.state_shardings, None),
        )

    def collectives(self, kind: str, *args: Any) -> bool:
        """Whether the ``kind`` program's call with ``args`` runs cross-device collectives
        (a one-device stage never does; otherwise its compiled HLO says)."""
        return len(self.devices) > 1 and getattr(self, kind).collectives(*args)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The batch keys this stage reads."""
        return self.fn.batch_keys

    # -- parameters ---------------------------------------------------------------------

    def slice_params(self, full: dict[str, Any]) -> dict[str, Any]:
        """This stage's part of a full parameter (or logical-axes) tree."""
        return slice_stage(self.spec, self.stage, full)

    def trainable_of(self, tree: dict[str, Any]) -> dict[str, Any]:
        """The trainable parts of a stage-shaped tree."""
        return split_parts(tree, self.trainable)[0]

    def _opt_init(self, trainable: dict[str, Any]) -> Any:
        # Jitted under this name: compile counters match ``jit(_opt_init)``.
        return self.step.opt_init(trainable)

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

        opt = jax.eval_shape(self._opt_init, self.trainable_of(self._abstract))
        return (
            jax.tree.map(sds, self._abstract, self.param_shardings),
            jax.tree.map(sds, opt, self.state_shardings),
        )

    def place_params(self, full: dict[str, Any]) -> dict[str, Any]:
        """This stage's part of ``full`` placed on its mesh, each leaf in the dtype it is
        held in (frozen matrices cast shard by shard: no float32 copy on the devices)."""
        return jax.tree.map(
            lambda v, a, s: put_global(as_stored(v, a), s),
            self.slice_params(full),
            self._abstract,
            self.param_shardings,
        )
