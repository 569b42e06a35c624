"""Stage-sliceable modules: a Flax NNX module seen as ``pre`` -> ``L`` identical blocks -> ``post``.

Pipeline parallelism needs to run an arbitrary contiguous range of a module's layers on
a stage, and dispatch cost grows with the number of parameter leaves. So instead of
holding ``L`` separate block modules, a :class:`StagedModule` keeps ONE block graph and
the parameters of all blocks stacked on a leading ``layers`` axis; running blocks
``[i, j)`` is a ``lax.scan`` over the slice ``[i:j]`` of that stack.

Parameters are plain nested dicts of arrays (``{"pre": ..., "blocks": ..., "post": ...}``),
so they flow through ``jit``, optax and sharding utilities as ordinary pytrees. The NNX
graph definitions are static and live on the :class:`StagedModule`.

Logical axis names come from an ``axes=(...)`` metadata entry on each ``nnx.Param``
(one name or ``None`` per array dimension). We use our own metadata key rather than
Flax's ``sharding_names`` because the latter triggers eager sharding at construction,
which needs a mesh; the mapping from logical names to mesh axes is done later by
``hetjax.meshes``. Block parameters get ``"layers"`` prepended.

Example:
    >>> enc = StagedModule("vision", pre=make_patch_embed, block=make_block,
    ...                    post=make_final_norm, num_layers=4)
    >>> params = enc.init(jax.random.key(0))
    >>> h = enc.apply_pre(params["pre"], images_BxHxWxC)
    >>> h = enc.apply_blocks(params["blocks"], h, start=0, stop=2)  # stage 0 of 2
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

Params = dict[str, Any]
ModuleFactory = Callable[[nnx.Rngs], nnx.Module]

PARTS = ("pre", "blocks", "post")


def _split_params(module: nnx.Module) -> tuple[nnx.GraphDef, Params, Params]:
    """Splits a module into (graphdef, pure parameter dict, logical-axes dict)."""
    graphdef, state = nnx.split(module, nnx.Param)
    params = nnx.to_pure_dict(state)
    axes = jax.tree.map(
        lambda v: tuple(v.get_metadata().get("axes", (None,) * v.get_value().ndim)),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    axes = nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes
    for leaf_axes, leaf in zip(_leaves(axes), jax.tree.leaves(params), strict=True):
        if len(leaf_axes) != leaf.ndim:
            raise ValueError(
                f"parameter of shape {leaf.shape} has axes {leaf_axes}: give one logical "
                "name (or None) per dimension in nnx.Param(..., axes=...)"
            )
    return graphdef, params, axes


def _leaves(axes_tree: Any) -> list[tuple]:
    return jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))


class StagedModule:
    """A module as pure functions of stacked parameters: ``post(blocks[i:j](pre(x)))``.

    Args:
        name: module name (``"vision"``, ``"llm"``, ...), used in errors and metrics.
        pre: factory ``rngs -> nnx.Module`` for the part before the blocks, or None.
        block: factory ``rngs -> nnx.Module`` for ONE block; called ``num_layers`` times.
        post: factory for the part after the blocks, or None.
        num_layers: number of identical blocks (0 allowed when ``block`` is None).
        unroll: layers per iteration of the block scan (``jax.lax.scan``'s ``unroll``): 1
            (default) a loop over layers; ``N`` N layers per iteration; ``True`` no loop
            at all (MaxText's ``scan_layers=False``, its GPU recipes' choice): XLA then
            schedules across layer boundaries, at the cost of compile time.
    """

    def __init__(
        self,
        name: str,
        *,
        pre: ModuleFactory | None = None,
        block: ModuleFactory | None = None,
        post: ModuleFactory | None = None,
        num_layers: int = 0,
        unroll: int | bool = 1,
    ):
        if (block is None) != (num_layers == 0):
            raise ValueError(
                f"module {name!r}: num_layers={num_layers} but block is "
                f"{'missing' if block is None else 'given'}; pass both or neither"
            )
        self.name = name
        self.num_layers = num_layers
        self.unroll = unroll
        self._factories = {"pre": pre, "blocks": block, "post": post}
        self._defs: dict[str, nnx.GraphDef | None] = {}
        self._abstract: Params = {}
        self._axes: Params = {}
        for part, factory in self._factories.items():
            if factory is None:
                self._defs[part] = None
                continue
            module = nnx.eval_shape(lambda f=factory: f(nnx.Rngs(0)))
            graphdef, abstract, axes = _split_params(module)
            if part == "blocks":
                abstract = jax.tree.map(
                    lambda s: jax.ShapeDtypeStruct((num_layers, *s.shape), s.dtype), abstract
                )
                axes = jax.tree.map(
                    lambda a: ("layers", *a), axes, is_leaf=lambda x: isinstance(x, tuple)
                )
            self._defs[part] = graphdef
            self._abstract[part] = abstract
            self._axes[part] = axes

    def with_unroll(self, unroll: int | bool) -> StagedModule:
        """The same module (shared graph definitions) whose block scan unrolls ``unroll``
        layers per iteration (see the class)."""
        other = copy.copy(self)
        other.unroll = unroll
        return other

    # -- parameters ---------------------------------------------------------------------

    def init(self, key: jax.Array) -> Params:
        """Initialises parameters; block ``i`` uses ``fold_in(key_blocks, i)``."""
        keys = dict(zip(PARTS, jax.random.split(key, 3), strict=True))
        params: Params = {}
        for part, factory in self._factories.items():
            if factory is None:
                continue
            if part == "blocks":
                layers = [
                    _split_params(factory(nnx.Rngs(jax.random.fold_in(keys[part], i))))[1]
                    for i in range(self.num_layers)
                ]
                params[part] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
            else:
                params[part] = _split_params(factory(nnx.Rngs(keys[part])))[1]
        return params

    def abstract_params(self) -> Params:
        """Parameter shapes and dtypes (``jax.ShapeDtypeStruct``), without allocating."""
        return self._abstract

    def logical_axes(self) -> Params:
        """Same tree as the parameters, with a tuple of logical axis names per leaf."""
        return self._axes

    def num_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self._abstract))

    # -- application --------------------------------------------------------------------

    def bind(self, part: str, params: Params) -> nnx.Module:
        """Part ``pre``/``post`` as an NNX module holding ``params`` (to call any of its
        methods, e.g. the LM head's ``logits``)."""
        return nnx.merge(self._defs[part], params)

    def apply_pre(self, params: Params, *args: Any, **kwargs: Any) -> Any:
        return self.bind("pre", params)(*args, **kwargs)

    def apply_post(self, params: Params, *args: Any, **kwargs: Any) -> Any:
        return self.bind("post", params)(*args, **kwargs)

    def apply_blocks(
        self,
        params: Params,
        h: Any,
        *,
        start: int = 0,
        stop: int | None = None,
        carry_sharding: jax.sharding.Sharding | None = None,
        unroll: int | bool | None = None,
        call_layer: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Runs blocks ``[start, stop)`` of the stack with a scan.

        ``params`` may hold the full stack (then it is sliced here) or exactly the
        ``stop - start`` layers of a pipeline stage (then it is used as is).
        ``carry_sharding``, if given, constrains the activation between blocks (used for
        sequence parallelism); ``unroll`` overrides the module's layers per scan
        iteration; ``kwargs`` go to every block. ``call_layer(block, layer_params, h,
        kwargs)``, if given, runs one block inside the scan body in its own way (fully
        sharded data parallelism gathers the layer's weights there:
        ``hetjax.runtime.fsdp.FsdpGather.call``); by default ``block(layer_params, h,
        kwargs)``.
        """
        if self._defs["blocks"] is None:
            return h
        stop = self.num_layers if stop is None else stop
        depth = jax.tree.leaves(params)[0].shape[0]
        if depth == self.num_layers and (start, stop) != (0, self.num_layers):
            params = jax.tree.map(lambda a: a[start:stop], params)
        elif depth != stop - start:
            raise ValueError(
                f"module {self.name!r}: block params hold {depth} layers, range "
                f"[{start}, {stop}) needs {stop - start}"
            )
        block_def = self._defs["blocks"]

        def block(layer_params, carry, kw):
            return nnx.merge(block_def, layer_params)(carry, **kw)

        def body(carry, layer_params):
            if carry_sharding is not None:
                carry = jax.lax.with_sharding_constraint(carry, carry_sharding)
            if call_layer is not None:
                return call_layer(block, layer_params, carry, kwargs), None
            return block(layer_params, carry, kwargs), None

        unroll = self.unroll if unroll is None else unroll
        h, _ = jax.lax.scan(body, h, params, unroll=unroll)
        return h

    def __call__(self, params: Params, *args: Any, **kwargs: Any) -> Any:
        """Whole module: pre -> all blocks -> post (post gets no extra arguments)."""
        h = self.apply_pre(params["pre"], *args, **kwargs) if "pre" in params else args[0]
        h = self.apply_blocks(params["blocks"], h) if "blocks" in params else h
        return self.apply_post(params["post"], h) if "post" in params else h

    def __repr__(self) -> str:
        return f"StagedModule({self.name!r}, num_layers={self.num_layers})"
