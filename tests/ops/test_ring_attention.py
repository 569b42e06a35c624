"""Context-parallel ring attention against plain causal attention on the unpermuted sequence.

Checks values and gradients (FP32, rtol 1e-5 / atol 1e-6) over CP/DP/EP/TP layouts, the
zigzag layout's load balance, arbitrary storage orders, and the collectives in the HLO.

Shape key: B batch, L sequence, H query heads, G kv heads, K head dim.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.ops import causal_attention, inverse_permutation, ring_attention, zigzag_permutation
from models.layers import attention

RTOL, ATOL = 1e-5, 1e-6
AXES = ("dp", "ep", "cp", "tp")


def stage_mesh(dp=1, ep=1, cp=1, tp=1) -> Mesh:
    n = dp * ep * cp * tp
    return Mesh(np.array(jax.devices()[:n]).reshape(dp, ep, cp, tp), AXES)


def qkv(b=2, l=16, h=4, g=2, k=8, seed=0):
    """Reference ``[B, L, H, K]`` queries and ``[B, L, G, K]`` keys/values."""
    rng = np.random.default_rng(seed)
    shapes = [(b, l, h, k), (b, l, g, k), (b, l, g, k)]
    return [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in shapes]


def cotangent_weights(shape, seed=7):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def value_and_grads(attn):
    """Jitted ``(out, d(sum(sin(out) * w))/d(q, k, v))`` with w ~ N(0, 1) fixed.

    Order-1 cotangents keep gradients of order 1, so atol 1e-6 is a few float32 ulps of
    the gradient scale (the tolerance is absolute; scaling the loss would scale it).
    """

    @jax.jit
    def f(q, k, v):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(jnp.cos(out) * cotangent_weights(out.shape))

    return f


@functools.cache
def reference_result(shape_key):
    q, k, v = qkv(*shape_key)
    return value_and_grads(lambda q, k, v: attention(q, k, v, causal=True))(q, k, v)


def qkv_and_reference(b=2, l=16, h=4, g=2, k=8, seed=0):
    return (*qkv(b, l, h, g, k, seed), reference_result((b, l, h, g, k, seed)))


def permuted(perm, **kw):
    """Attention computed in storage order ``perm`` and returned in the original order."""
    inv = inverse_permutation(perm)

    def f(q, k, v):
        pos = jnp.asarray(perm)
        return ring_attention(q[:, perm], k[:, perm], v[:, perm], pos, **kw)[:, inv]

    return f


def assert_matches_reference(f, q, k, v, want):
    got_out, got_grads = value_and_grads(f)(q, k, v)
    want_out, want_grads = want
    np.testing.assert_allclose(got_out, want_out, rtol=RTOL, atol=ATOL)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"d{name}")


# -- zigzag layout ----------------------------------------------------------------------


def test_zigzag_example_and_inverse():
    perm = zigzag_permutation(8, 2)
    np.testing.assert_array_equal(perm, [0, 1, 6, 7, 2, 3, 4, 5])
    x = np.arange(8) * 10
    np.testing.assert_array_equal(x[perm][inverse_permutation(perm)], x)
    np.testing.assert_array_equal(zigzag_permutation(6, 1), np.arange(6))


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_zigzag_balances_causal_work(cp):
    seq = 16 * cp
    perm = zigzag_permutation(seq, cp)
    assert sorted(perm) == list(range(seq))
    chunk = seq // (2 * cp)
    work = []
    for r, pos in enumerate(np.split(perm, cp)):  # rank r's shard of the stored sequence
        np.testing.assert_array_equal(pos[:chunk] // chunk, r)
        np.testing.assert_array_equal(pos[chunk:] // chunk, 2 * cp - 1 - r)
        work.append(int(np.sum(pos[:, None] >= np.arange(seq)[None, :])))
    assert len(set(work)) == 1, work
    # A contiguous split would not be balanced.
    contiguous = [int(np.sum(p[:, None] >= np.arange(seq))) for p in np.split(np.arange(seq), cp)]
    assert cp == 1 or len(set(contiguous)) == cp


def test_zigzag_rejects_indivisible_length():
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        zigzag_permutation(12, 4)


# -- values and gradients ---------------------------------------------------------------


def test_cp1_is_plain_causal_attention():
    q, k, v, want = qkv_and_reference()
    perm = np.arange(q.shape[1])
    assert_matches_reference(permuted(perm, mesh=None), q, k, v, want)
    assert_matches_reference(permuted(perm, mesh=stage_mesh(dp=2, tp=2)), q, k, v, want)


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_cp1_kernels_when_asked(impl):
    # dense_at_cp1=False runs the impl's per-rank kernel on one rank (what gpu_check
    # times): the ring's one diagonal block and custom backward give the same values.
    q, k, v, want = qkv_and_reference()
    perm = np.arange(q.shape[1])
    assert_matches_reference(
        permuted(perm, mesh=stage_mesh(dp=2), impl=impl, dense_at_cp1=False), q, k, v, want
    )


@pytest.mark.parametrize(
    "layout, impl, zigzag, heads",
    [
        (dict(cp=2), "ring", False, (4, 2)),
        (dict(cp=4), "ring", False, (4, 2)),
        (dict(cp=4), "ring", True, (4, 2)),
        (dict(dp=2, cp=4), "ring", True, (4, 2)),
        (dict(dp=2, cp=2, tp=2), "ring", False, (4, 2)),
        (dict(ep=2, cp=2, tp=2), "ring", True, (4, 4)),  # MHA
        (dict(cp=2, tp=2), "ring", True, (4, 1)),  # G < tp: kv heads repeated
        (dict(dp=2, cp=4), "allgather", False, (4, 2)),
        (dict(cp=2, tp=2), "allgather", False, (4, 1)),
    ],
    ids=str,
)
def test_matches_reference(layout, impl, zigzag, heads):
    h, g = heads
    q, k, v, want = qkv_and_reference(h=h, g=g)
    perm = zigzag_permutation(q.shape[1], layout["cp"])
    f = permuted(perm, mesh=stage_mesh(**layout), impl=impl, zigzag=zigzag)
    assert_matches_reference(f, q, k, v, want)


@pytest.mark.parametrize(
    "layout, head_axis",
    [(dict(cp=2), None), (dict(dp=2, cp=4), None), (dict(dp=2, cp=2, tp=2), "tp")],
    ids=str,
)
def test_noncausal_ring_matches_bidirectional_attention(layout, head_axis):
    """``causal=False``: contiguous split, no positions, every key visible (encoders)."""
    q, k, v = qkv(seed=11)
    want = value_and_grads(lambda q, k, v: attention(q, k, v, causal=False))(q, k, v)
    mesh = stage_mesh(**layout)
    f = lambda q, k, v: ring_attention(
        q, k, v, None, mesh=mesh, causal=False, batch_axes=("dp",), head_axis=head_axis
    )
    assert_matches_reference(f, q, k, v, want)
    with pytest.raises(ValueError, match="zigzag"):
        ring_attention(q, k, v, None, mesh=mesh, causal=False, zigzag=True)
    with pytest.raises(ValueError, match="positions"):
        ring_attention(q, k, v, None, mesh=mesh, causal=True)


def test_mask_follows_positions_not_storage_order():
    q, k, v, want = qkv_and_reference(seed=2)
    perm = np.random.default_rng(3).permutation(q.shape[1])
    assert_matches_reference(permuted(perm, mesh=stage_mesh(dp=2, cp=4)), q, k, v, want)


def test_per_sample_positions():
    """``positions [B, L]``: each sample has its own storage order."""
    q, k, v, want = qkv_and_reference(seed=4)
    b, seq = q.shape[:2]
    rng = np.random.default_rng(5)
    perms = np.stack([rng.permutation(seq) for _ in range(b)])
    inv = np.stack([inverse_permutation(p) for p in perms])
    take = lambda x, idx: jnp.take_along_axis(x, jnp.asarray(idx)[:, :, None, None], axis=1)
    mesh = stage_mesh(dp=2, cp=4)

    def f(q, k, v):
        out = ring_attention(take(q, perms), take(k, perms), take(v, perms), perms, mesh=mesh)
        return take(out, inv)

    assert_matches_reference(f, q, k, v, want)


def test_same_positions_same_result_without_mesh():
    """``causal_attention`` with positions equals ``ring_attention`` on any storage order."""
    q, k, v = qkv(seed=6)
    perm = zigzag_permutation(q.shape[1], 4)
    pos = jnp.asarray(perm)
    qs, ks, vs = q[:, perm], k[:, perm], v[:, perm]
    mesh = stage_mesh(cp=4, tp=2)
    got = jax.jit(lambda *a: ring_attention(*a, pos, mesh=mesh, zigzag=True))(qs, ks, vs)
    np.testing.assert_allclose(got, causal_attention(qs, ks, vs, pos), rtol=RTOL, atol=ATOL)


def packed_rows(lengths: list[list[int]], seq: int) -> tuple[np.ndarray, np.ndarray]:
    """``segment_ids`` (1, 2, ... per sample, 0 padding) and per-sample ``positions``."""
    seg = np.zeros((len(lengths), seq), np.int32)
    pos = np.zeros_like(seg)
    for row, ns in enumerate(lengths):
        at = 0
        for s, n in enumerate(ns, start=1):
            seg[row, at : at + n], pos[row, at : at + n] = s, np.arange(n)
            at += n
    return seg, pos


@pytest.mark.parametrize(
    "layout, impl, zigzag",
    [
        (dict(cp=4), "ring", True),
        (dict(dp=2, cp=2, tp=2), "ring", False),
        (dict(cp=2), "allgather", False),
    ],
    ids=str,
)
def test_packed_rows_attend_within_their_samples(layout, impl, zigzag):
    """``segment_ids``: each sample of a packed row (stored zigzag) gets the attention it
    would get alone; padding (segment 0) is never seen by a sample."""
    q, k, v = qkv(seed=12)
    seg, pos = packed_rows([[5, 7, 2], [9, 3, 4]], q.shape[1])  # row 0 ends in padding

    def alone(q, k, v):
        out = jnp.zeros_like(q)
        for row in range(q.shape[0]):
            for s in set(seg[row].tolist()) - {0}:
                idx = np.flatnonzero(seg[row] == s)
                a = attention(q[row, idx][None], k[row, idx][None], v[row, idx][None], causal=True)
                out = out.at[row, idx].set(a[0])
        return out

    real = jnp.asarray(seg > 0)[:, :, None, None]
    perm = zigzag_permutation(q.shape[1], layout["cp"])
    inv = inverse_permutation(perm)
    mesh = stage_mesh(**layout)

    def ring(q, k, v):
        out = ring_attention(
            *(x[:, perm] for x in (q, k, v)),
            jnp.asarray(pos[:, perm]),
            segment_ids=jnp.asarray(seg[:, perm]),
            mesh=mesh,
            batch_axes=("dp",),
            impl=impl,
            zigzag=zigzag,
        )
        return jnp.where(real, out[:, inv], 0.0)

    single = lambda q, k, v: jnp.where(
        real, causal_attention(q, k, v, jnp.asarray(pos), segment_ids=jnp.asarray(seg)), 0.0
    )
    want = value_and_grads(alone)(q, k, v)
    assert_matches_reference(single, q, k, v, want)
    assert_matches_reference(ring, q, k, v, want)


def test_inside_scanned_layers_on_a_full_module_mesh():
    """As a model uses it: a jitted grad through a scan over stacked layers, on a module's
    full ``("pp", "dp", "ep", "cp", "tp")`` mesh (inputs replicated over ``pp``)."""
    q, k, v = qkv(seed=8)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 1, 2, 1), ("pp", *AXES))
    perm = zigzag_permutation(q.shape[1], 2)
    pos = jnp.asarray(perm)
    scales = jnp.asarray([1.0, 0.5])

    def model(attn, q, k, v):
        def layer(h, s):
            return attn(h * s, k, v), None

        return jnp.sum(jnp.sin(jax.lax.scan(layer, q, scales)[0]))

    ring = lambda q, k, v: ring_attention(q, k, v, pos, mesh=mesh, zigzag=True)
    plain = lambda q, k, v: causal_attention(q, k, v, pos)
    qs, ks, vs = q[:, perm], k[:, perm], v[:, perm]
    got = jax.jit(jax.grad(functools.partial(model, ring), argnums=(0, 1, 2)))(qs, ks, vs)
    want = jax.jit(jax.grad(functools.partial(model, plain), argnums=(0, 1, 2)))(qs, ks, vs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("impl", ["ring", "allgather"])
def test_under_replica_vmap(impl):
    """The executor's per-replica backward: ``vmap(grad(...), spmd_axis_name="dp")`` over
    replicas, each with its batch split over ``ep`` only."""
    q, k, v = qkv(b=4, seed=10)
    mesh = stage_mesh(dp=2, ep=2, cp=2)
    pos = jnp.asarray(zigzag_permutation(q.shape[1], 2))
    replicas = lambda x: x.reshape(2, x.shape[0] // 2, *x.shape[1:])

    def loss(attn, q, k, v):
        return jnp.sum(jnp.sin(attn(q, k, v)))

    ring = lambda *a: ring_attention(
        *a, pos, mesh=mesh, batch_axes=("ep",), impl=impl, zigzag=impl == "ring"
    )
    per_replica = jax.grad(functools.partial(loss, ring), argnums=(0, 1, 2))
    got = jax.jit(lambda *a: jax.vmap(per_replica, spmd_axis_name="dp")(*map(replicas, a)))(q, k, v)
    plain = lambda *a: causal_attention(*a, pos)
    want = jax.jit(jax.grad(functools.partial(loss, plain), argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.reshape(w.shape), w, rtol=RTOL, atol=ATOL)


def test_bfloat16_inputs_keep_their_dtype():
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(seed=9))
    pos = jnp.asarray(zigzag_permutation(q.shape[1], 4))
    out = jax.jit(lambda *a: ring_attention(*a, pos, mesh=stage_mesh(cp=4)))(q, k, v)
    assert out.dtype == jnp.bfloat16
    want = causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)), pos)
    np.testing.assert_allclose(out.astype(jnp.float32), want, rtol=2e-2, atol=2e-2)


# -- distributed properties -------------------------------------------------------------


def compiled_text(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_ring_hlo_has_collective_permute_and_no_allgather():
    q, k, v = qkv(l=32)
    mesh = stage_mesh(dp=2, cp=4)
    spec = PartitionSpec(("dp", "ep"), "cp", "tp", None)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in (q, k, v))
    pos = jnp.asarray(zigzag_permutation(32, 4))

    def fwd(q, k, v):
        return ring_attention(q, k, v, pos, mesh=mesh)

    out = jax.jit(fwd)(q, k, v)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim)
    for text in (
        compiled_text(fwd, q, k, v),
        compiled_text(jax.grad(lambda *a: jnp.sum(fwd(*a) ** 2), argnums=(0, 1, 2)), q, k, v),
    ):
        assert "collective-permute" in text
        assert not re.search(r"all-gather", text)
    text = compiled_text(lambda *a: ring_attention(*a, pos, mesh=mesh, impl="allgather"), q, k, v)
    assert "all-gather" in text and "collective-permute" not in text


def grad_temp_bytes(cp: int, impl: str, local_len: int = 128) -> int:
    mesh = stage_mesh(cp=cp)
    seq = local_len * cp
    q, k, v = (jax.ShapeDtypeStruct((1, seq, 4, 16), jnp.float32) for _ in range(3))
    pos = jnp.asarray(zigzag_permutation(seq, cp))
    loss = lambda *a: jnp.sum(ring_attention(*a, pos, mesh=mesh, impl=impl) ** 2)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_ring_memory_per_rank_does_not_grow_with_cp():
    """At fixed L/cp a ring rank's scratch for forward + backward stays flat as cp grows
    (custom VJP: O(L/cp) residuals; scan: one block in flight), while the all-gather
    variant holds [L/cp, L] scores, growing with cp."""
    ring4, ring8 = grad_temp_bytes(4, "ring"), grad_temp_bytes(8, "ring")
    gather4, gather8 = grad_temp_bytes(4, "allgather"), grad_temp_bytes(8, "allgather")
    assert ring8 <= 1.1 * ring4, (ring4, ring8)
    assert gather8 >= 1.5 * gather4, (gather4, gather8)
    assert ring8 < gather8 / 2, (ring8, gather8)


def test_errors_name_the_problem():
    q, k, v = qkv(l=12)
    with pytest.raises(ValueError, match="sequence length 12 over cp=8"):
        ring_attention(q, k, v, jnp.arange(12), mesh=stage_mesh(cp=8))
    with pytest.raises(ValueError, match="batch 2 over"):
        ring_attention(q, k, v, jnp.arange(12), mesh=stage_mesh(dp=4, cp=2))
    with pytest.raises(ValueError, match="impl"):
        ring_attention(q, k, v, jnp.arange(12), mesh=stage_mesh(cp=2), impl="ulysses")
