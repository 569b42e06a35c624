"""Mixture-of-experts SwiGLU FFN with top-k routing, capacity, and expert parallelism.

Routing (per token, float32): ``probs = softmax(x @ W_router)``; the ``top_k`` experts
(``k`` = 1 or 2) with the largest probabilities are chosen. Gates are the chosen
probabilities renormalised to sum to 1 over the top-k (Mixtral / GShard top-2) when
``renormalize`` is true, which is the default for ``k > 1``. For ``k == 1`` the default
is the raw probability (Switch Transformer): a renormalised top-1 gate is always 1, so the
router would learn only from the auxiliary loss.

Auxiliary load-balancing loss (Switch / GShard): ``E * sum_e f_e * P_e`` where
``f_e = (tokens routed to e, counting every top-k slot, before capacity) / (T * k)`` and
``P_e`` is the mean router probability of expert ``e`` over the ``T`` tokens. It equals 1
for a perfectly uniform router; gradients flow only through ``P_e``.

Capacity: every expert has ``C = ceil(capacity_factor * T * k / E)`` slots (at most
``T``). Slots are filled GShard-style: all first choices in token order, then all second
choices, so a token's second choice is dropped before anyone's first choice. An
assignment beyond an expert's capacity is dropped: it contributes zero to the MoE output
(the residual connection around the FFN carries the token). ``capacity_factor=None`` is
dropless: ``C = T`` so nothing is ever dropped, and results are identical (up to float
reordering) for every layout.

Dispatch fills GShard's ``[E, C, D]`` expert buffers by index (a scatter of each kept
(token, choice) to its (expert, slot); combine is the matching gather weighted by the
gates) - the same maths as GShard's one-hot ``[T, E, C]`` dispatch/combine einsums
without their ``O(T E C)`` tensors. Without a mesh (or ``ep == 1``) that is the whole
computation. With ``ep > 1`` it runs in a ``jax.shard_map``: each rank routes ITS tokens
(batch sharded over ``batch_axes``, sequence over ``seq_axis``), fills ``[E, C_local, D]``
buffers, ``all_to_all`` over ``ep_axis`` sends each expert's buffer to the rank that owns
it (rank ``i`` owns experts ``[i*E/ep, (i+1)*E/ep)``), the local experts run on what
arrived from all ``ep`` ranks, a second ``all_to_all`` returns the outputs, and each rank
combines.

Capacity with a mesh is per (source rank, expert): ``C_local`` is computed from the
rank's own token count, so expert ``e`` receives at most ``ranks * C_local`` (about the
same total as without a mesh), but which tokens are dropped is decided locally and
differs from the no-mesh run. Dropless results equal the no-mesh ones. Expert weights
may also be sharded over ``tp_axis`` on their ``F`` dimension (``"mlp"``); the partial
down-projections are summed over ``tp_axis`` before the return ``all_to_all``.

Memory is the buffers' ``O(E * C * D)``; dropless (``C = T``) that is ``O(T E D)``,
linear in the tokens. (A grouped-GEMM kernel over tokens sorted by expert would avoid the
padding to ``C``; plain XLA has none.)

Shape key: B batch, L sequence, D width, F expert hidden width, E experts, T tokens,
C capacity (slots per expert), K top-k.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

__all__ = ["MoEFFN", "expert_capacity", "moe_ffn", "route"]

MoEParams = dict[str, jax.Array]  # "router" [D, E], "gate"/"up" [E, D, F], "down" [E, F, D]


def expert_capacity(
    num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None
) -> int:
    """Slots per expert: ``min(T, ceil(capacity_factor * T * k / E))``; ``T`` if dropless."""
    if capacity_factor is None:
        return num_tokens
    if capacity_factor <= 0:
        raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (or None: dropless)")
    return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_experts)))


def route(
    x_TxD: jax.Array, router_DxE: jax.Array, *, top_k: int, renormalize: bool
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Top-k router in float32.

    Returns:
        ``(gates_TxK, experts_TxK, probs_TxE)``: gate values (renormalised over the top-k
        if ``renormalize``), chosen expert ids in decreasing probability, all probabilities.
    """
    logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32))
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    top_TxK, experts_TxK = jax.lax.top_k(probs_TxE, top_k)
    if renormalize:
        top_TxK = top_TxK / jnp.sum(top_TxK, axis=-1, keepdims=True)
    return top_TxK, experts_TxK, probs_TxE


def _slots(experts_TxK: jax.Array, num_experts: int, capacity: int):
    """GShard slot assignment: ``slot_KxT`` (position of token ``t``'s ``k``-th choice in
    its expert's buffer) and ``keep_KxT`` (within capacity). Priority is slot-major:
    every token's first choice before any second choice."""
    t, k = experts_TxK.shape
    onehot_KxTxE = jax.nn.one_hot(experts_TxK.T, num_experts, dtype=jnp.int32)
    slot_KTxE = jnp.cumsum(onehot_KxTxE.reshape(k * t, num_experts), axis=0) - 1
    slot_KxT = jnp.sum(slot_KTxE.reshape(k, t, num_experts) * onehot_KxTxE, axis=-1)
    return slot_KxT, slot_KxT < capacity


def _dispatch(x_TxD, experts_TxK, slot_KxT, keep_KxT, num_experts: int, capacity: int):
    """``[E, C, D]`` expert buffers: token ``t`` at ``(expert, slot)`` of each kept choice.

    A scatter by index - ``O(T k D)`` work - where the one-hot einsum it replaces costs
    ``O(T E C D)`` (``O(T^2 E D)`` dropless). Every kept (expert, slot) is unique, so the
    scatter-add writes each slot once (bit-identical to the one-hot form) and its
    transpose is a gather. Dropped choices point past the buffer and are dropped.
    """
    k, t = slot_KxT.shape
    expert_KxT = jnp.where(keep_KxT, experts_TxK.T, num_experts)
    x_KxTxD = jnp.broadcast_to(x_TxD, (k, t, x_TxD.shape[-1]))
    buf = jnp.zeros((num_experts, capacity, x_TxD.shape[-1]), x_TxD.dtype)
    return buf.at[expert_KxT, slot_KxT].add(x_KxTxD, mode="drop")


def _combine(out_ExCxD, gates_TxK, experts_TxK, slot_KxT, keep_KxT):
    """``y[t] = sum_k gate[t, k] * out[expert[t, k], slot[k, t]]`` over kept choices."""
    e, c, _ = out_ExCxD.shape
    got_KxTxD = out_ExCxD[jnp.clip(experts_TxK.T, 0, e - 1), jnp.clip(slot_KxT, 0, c - 1)]
    w_KxT = jnp.where(keep_KxT, gates_TxK.T.astype(jnp.float32), 0.0).astype(out_ExCxD.dtype)
    return jnp.sum(w_KxT[..., None] * got_KxTxD, axis=0)


def _swiglu_experts(gate_ExDxF, up_ExDxF, down_ExFxD, x_ExCxD):
    dt = x_ExCxD.dtype
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", x_ExCxD, gate_ExDxF.astype(dt)))
    h = h * jnp.einsum("ecd,edf->ecf", x_ExCxD, up_ExDxF.astype(dt))
    return jnp.einsum("ecf,efd->ecd", h, down_ExFxD.astype(dt))


def _moe_tokens(
    params: MoEParams,
    x_TxD: jax.Array,
    *,
    top_k: int,
    capacity_factor: float | None,
    renormalize: bool,
    experts_fn: Callable[[jax.Array], jax.Array],
    token_sum: Callable[[jax.Array], jax.Array],
) -> tuple[jax.Array, jax.Array]:
    """Route, dispatch, ``experts_fn [E, C, D] -> [E, C, D]``, combine; plus the aux loss.

    ``token_sum`` sums a per-rank statistic over all token shards (identity without a mesh).
    """
    t = x_TxD.shape[0]
    e = params["router"].shape[1]
    gates_TxK, experts_TxK, probs_TxE = route(
        x_TxD, params["router"], top_k=top_k, renormalize=renormalize
    )
    capacity = expert_capacity(t, e, top_k, capacity_factor)
    slot_KxT, keep_KxT = _slots(experts_TxK, e, capacity)
    xin_ExCxD = _dispatch(x_TxD, experts_TxK, slot_KxT, keep_KxT, e, capacity)
    out_ExCxD = experts_fn(xin_ExCxD)
    y_TxD = _combine(out_ExCxD, gates_TxK, experts_TxK, slot_KxT, keep_KxT)

    counts_E = jnp.sum(jax.nn.one_hot(experts_TxK, e, dtype=jnp.float32), axis=(0, 1))
    counts_E, prob_sum_E = token_sum((counts_E, jnp.sum(probs_TxE, axis=0)))
    total = jnp.sum(counts_E) / top_k  # global token count, exact in float32
    aux = e * jnp.sum((counts_E / (total * top_k)) * (prob_sum_E / total))
    return y_TxD.astype(x_TxD.dtype), aux


def _ep_kernel(params, x_bxlxD, *, ep_axis, ep, token_axes, tp_axis, **kw):
    b, l, d = x_bxlxD.shape
    e_local = params["gate"].shape[0]

    def experts_fn(xin_ExCxD):
        c = xin_ExCxD.shape[1]
        send = xin_ExCxD.reshape(ep, e_local, c, d)
        # recv[i] = rank i's tokens for this rank's experts.
        recv = jax.lax.all_to_all(send, ep_axis, 0, 0)
        xin = jnp.transpose(recv, (1, 0, 2, 3)).reshape(e_local, ep * c, d)
        out = _swiglu_experts(params["gate"], params["up"], params["down"], xin)
        if tp_axis is not None:
            out = jax.lax.psum(out, tp_axis)
        out = jnp.transpose(out.reshape(e_local, ep, c, d), (1, 0, 2, 3))
        back = jax.lax.all_to_all(out, ep_axis, 0, 0)  # back[i] = outputs of rank i's experts
        return back.reshape(ep * e_local, c, d)

    y_TxD, aux = _moe_tokens(
        params,
        x_bxlxD.reshape(b * l, d),
        experts_fn=experts_fn,
        token_sum=lambda tree: jax.lax.psum(tree, token_axes),
        **kw,
    )
    return y_TxD.reshape(b, l, d), aux


def moe_ffn(
    params: MoEParams,
    x_BxLxD: jax.Array,
    *,
    top_k: int,
    capacity_factor: float | None,
    mesh: Mesh | None = None,
    ep_axis: str = "ep",
    batch_axes: Sequence[str] | None = ("dp", "ep"),
    seq_axis: str | None = "cp",
    tp_axis: str | None = "tp",
    renormalize: bool | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Top-k mixture of SwiGLU experts over all tokens of ``x``.

    Args:
        params: ``{"router": [D, E], "gate": [E, D, F], "up": [E, D, F], "down": [E, F, D]}``
            (the parameter dict of :class:`MoEFFN`). Expert weights compute in
            ``x.dtype``; the router in float32.
        x_BxLxD: tokens, a global-view array.
        top_k: experts per token, 1 or 2.
        capacity_factor: slots per expert relative to an even split of the ``T * k``
            assignments; ``None`` is dropless. With a mesh, capacity is per source rank.
        mesh: module or stage mesh; ``None`` or ``ep_axis`` of size 1 gives the dense
            GShard einsum path (no ``shard_map``; GSPMD shards whatever it likes).
        ep_axis: mesh axis over which experts are sharded; must be in ``batch_axes``.
        batch_axes: mesh axes sharding the batch dimension of ``x``. Inside
            ``jax.vmap(..., spmd_axis_name="dp")`` pass ``("ep",)``: vmap adds ``"dp"``.
        seq_axis: mesh axis sharding the sequence dimension of ``x`` (or None).
        tp_axis: mesh axis sharding the experts' ``F`` dimension (or None).
        renormalize: renormalise gates over the top-k; default ``top_k > 1``.

    Returns:
        ``(y_BxLxD, aux_loss)``: output in ``x.dtype`` (zero for fully dropped tokens),
        and the float32 scalar load-balancing loss over all tokens of this call (under
        a replica ``vmap``: per replica; ``f * P`` is a product of means, so the mean of
        per-replica losses is close to, but not exactly, the global-batch loss).

    Raises:
        ValueError: bad ``top_k``, unknown axis, or a dimension not divisible by its axes.
    """
    if top_k not in (1, 2):
        raise ValueError(f"moe_ffn: top_k={top_k}; use 1 or 2")
    e = params["router"].shape[1]
    if top_k > e:
        raise ValueError(f"moe_ffn: top_k={top_k} exceeds the {e} experts")
    kw = dict(
        top_k=top_k,
        capacity_factor=capacity_factor,
        renormalize=top_k > 1 if renormalize is None else renormalize,
    )
    b, l, d = x_BxLxD.shape
    ep = 1 if mesh is None or ep_axis not in mesh.axis_names else int(mesh.shape[ep_axis])
    if ep == 1:
        y_TxD, aux = _moe_tokens(
            params,
            x_BxLxD.reshape(b * l, d),
            experts_fn=functools.partial(
                _swiglu_experts, params["gate"], params["up"], params["down"]
            ),
            token_sum=lambda tree: tree,
            **kw,
        )
        return y_TxD.reshape(b, l, d), aux

    batch_axes = tuple(batch_axes or ())
    for a in (*batch_axes, seq_axis, tp_axis):
        if a is not None and a not in mesh.axis_names:
            raise ValueError(
                f"moe_ffn: axis {a!r} is not a mesh axis {mesh.axis_names}; pass one of"
                " them or None"
            )
    if ep_axis not in batch_axes:
        raise ValueError(
            f"moe_ffn: ep_axis {ep_axis!r} must shard the tokens, i.e. be in batch_axes"
            f" {batch_axes}"
        )
    size = lambda a: 1 if a is None else int(mesh.shape[a])
    n_batch = math.prod(size(a) for a in batch_axes)
    f = params["gate"].shape[2]
    problems = [
        f"{what} {n} over {axes}={k}"
        for what, n, axes, k in [
            ("experts", e, ep_axis, ep),
            ("batch", b, batch_axes, n_batch),
            ("sequence", l, seq_axis, size(seq_axis)),
            ("expert hidden width", f, tp_axis, size(tp_axis)),
        ]
        if n % k
    ]
    if problems:
        raise ValueError(
            "moe_ffn: cannot shard " + "; ".join(problems) + ". Change the layout or sizes."
        )
    w_in = PartitionSpec(ep_axis, None, tp_axis)
    p_specs = {
        "router": PartitionSpec(),
        "gate": w_in,
        "up": w_in,
        "down": PartitionSpec(ep_axis, tp_axis, None),
    }
    x_spec = PartitionSpec(batch_axes, seq_axis, None)
    token_axes = batch_axes + ((seq_axis,) if seq_axis is not None else ())
    fn = jax.shard_map(
        functools.partial(
            _ep_kernel, ep_axis=ep_axis, ep=ep, token_axes=token_axes, tp_axis=tp_axis, **kw
        ),
        mesh=mesh,
        in_specs=({k: p_specs[k] for k in params}, x_spec),
        out_specs=(x_spec, PartitionSpec()),
    )
    return fn(dict(params), x_BxLxD)


class MoEFFN(nnx.Module):
    """Top-k MoE of SwiGLU experts as an NNX module; drop-in for a dense SwiGLU MLP.

    Parameters (float32, logical axes for ``hetjax.meshes`` rules): ``router [D, E]``
    ``("embed", None)``; ``gate``, ``up [E, D, F]`` ``("experts", "embed", "mlp")``;
    ``down [E, F, D]`` ``("experts", "mlp", "embed")``. Its parameter dict is the
    ``params`` of :func:`moe_ffn`. Calling it returns ``(y, aux_loss)``: add
    ``aux_weight * aux_loss`` to the training loss.
    """

    def __init__(
        self,
        width: int,
        mlp: int,
        num_experts: int,
        *,
        top_k: int = 2,
        capacity_factor: float | None = None,
        renormalize: bool | None = None,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        init_std: float = 0.02,
    ):
        def param(shape, axes):
            w = init_std * jax.random.normal(rngs.params(), shape, jnp.float32)
            return nnx.Param(w, axes=axes)

        self.router = param((width, num_experts), ("embed", None))
        self.gate = param((num_experts, width, mlp), ("experts", "embed", "mlp"))
        self.up = param((num_experts, width, mlp), ("experts", "embed", "mlp"))
        self.down = param((num_experts, mlp, width), ("experts", "mlp", "embed"))
        self.top_k = top_k
        self.capacity_factor = capacity_factor
        self.renormalize = renormalize
        self.dtype = dtype

    def __call__(
        self, x_BxLxD: jax.Array, *, mesh: Mesh | None = None, **axes: Any
    ) -> tuple[jax.Array, jax.Array]:
        """``(y_BxLxD, aux_loss)``; ``mesh`` and ``axes`` (``ep_axis=...``, ...) as in
        :func:`moe_ffn`."""
        params = {
            "router": self.router[...],
            "gate": self.gate[...],
            "up": self.up[...],
            "down": self.down[...],
        }
        return moe_ffn(
            params,
            x_BxLxD.astype(self.dtype),
            top_k=self.top_k,
            capacity_factor=self.capacity_factor,
            renormalize=self.renormalize,
            mesh=mesh,
            **axes,
        )
