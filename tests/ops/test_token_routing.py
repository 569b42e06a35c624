"""Routing modality tokens to the cp ranks owning their placeholders, against the
replicated merge (``merge_modality_tokens``) on the un-permuted sequence.

Routing is exact data movement, so values and routed gradients are compared exactly
(gradients of the reference to atol 1e-6).

Shape key: B batch, L sequence, N modality tokens per sample, D width, R cp ranks,
K routed slots per rank.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hetjax.ops import inverse_permutation, zigzag_permutation
from hetjax.ops.token_routing import (
    Routed,
    exchange_routed,
    exchange_routes,
    gather_routes,
    merge_modality_tokens,
    merge_routed,
    merge_whole_per_rank,
    owner_rank,
    scatter_routes,
    token_routes,
)

ATOL = 1e-6


def slot_masks(b, seq, n, seed, contiguous=True):
    """``[B, L]`` masks with exactly ``n`` placeholders per sample at random positions;
    with ``contiguous`` the last sample's placeholders are one random run."""
    rng = np.random.default_rng(seed)
    mask_BxL = np.zeros((b, seq), bool)
    for i in range(b):
        mask_BxL[i, rng.choice(seq, n, replace=False)] = True
    if contiguous:
        start = rng.integers(0, seq - n + 1)
        mask_BxL[-1] = False
        mask_BxL[-1, start : start + n] = True
    return mask_BxL


def normal(shape, seed):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# -- owner_rank -------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_owner_rank_matches_zigzag_shards(cp):
    seq = 16 * cp
    owner_L = owner_rank(seq, cp)
    assert owner_L.shape == (seq,)
    for r, stored in enumerate(np.split(zigzag_permutation(seq, cp), cp)):
        # Exact order too: a rank's storage order is the original order of what it owns.
        np.testing.assert_array_equal(np.flatnonzero(owner_L == r), stored, err_msg=f"rank {r}")


@pytest.mark.parametrize("seq, cp", [(12, 4), (6, 2), (3, 1)])
def test_owner_rank_rejects_indivisible_length(seq, cp):
    with pytest.raises(ValueError, match="multiple of 2\\*cp"):
        owner_rank(seq, cp)


# -- token_routes -----------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("n", [1, 5, 12, 32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_routes_properties(cp, n, seed):
    b, seq = 6, 32
    is_slot_BxL = slot_masks(b, seq, n, seed)
    idx_BxRxK = token_routes(is_slot_BxL, n, cp)
    owner_L = owner_rank(seq, cp)
    k = idx_BxRxK.shape[2]
    assert idx_BxRxK.shape[:2] == (b, cp) and idx_BxRxK.dtype == np.int32

    max_count = 0
    for i in range(b):
        slot_pos_N = np.flatnonzero(is_slot_BxL[i])  # token k replaces placeholder k
        routed = idx_BxRxK[i][idx_BxRxK[i] >= 0]
        np.testing.assert_array_equal(np.sort(routed), np.arange(n), err_msg=f"sample {i}")
        for r in range(cp):
            row = idx_BxRxK[i, r]
            count = int((row >= 0).sum())
            max_count = max(max_count, count)
            np.testing.assert_array_equal(row[count:], -1, err_msg=f"padding {i}, {r}")
            assert np.all(np.diff(row[:count]) > 0), (i, r, row)
            np.testing.assert_array_equal(owner_L[slot_pos_N[row[:count]]], r)
            # Every token this rank owns is routed here (with the checks above: once).
            assert count == int((owner_L[slot_pos_N] == r).sum()), (i, r)

    quantum = math.ceil(n / (4 * cp))
    assert max_count <= k <= n
    assert k % quantum == 0 or k == n, (k, quantum)
    assert k - quantum < max_count, (k, quantum, max_count)  # the smallest such K


def test_token_routes_spread_placeholders_route_fewer_than_n():
    """Placeholders spread evenly over the sequence: each rank gets ``N / cp`` slots."""
    seq, n, cp = 64, 16, 4
    is_slot_BxL = np.zeros((2, seq), bool)
    is_slot_BxL[:, ::4] = True
    idx_BxRxK = token_routes(is_slot_BxL, n, cp)
    assert idx_BxRxK.shape == (2, cp, n // cp)
    assert (idx_BxRxK >= 0).all()


def test_token_routes_rejects_extra_placeholders():
    is_slot_BxL = slot_masks(4, 16, 3, seed=0, contiguous=False)
    is_slot_BxL[2, np.flatnonzero(~is_slot_BxL[2])[0]] = True
    with pytest.raises(ValueError, match="sample 2 has 4 placeholders"):
        token_routes(is_slot_BxL, 3, 2)


# -- gather / scatter -------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_gather_and_scatter_are_transposes(cp):
    b, seq, n, d = 5, 32, 7, 3
    idx_BxRxK = token_routes(slot_masks(b, seq, n, seed=cp), n, cp)
    flat_BxRK = idx_BxRxK.reshape(b, -1)
    x_BxNxD = normal((b, n, d), seed=10)
    got_BxRKxD = np.asarray(gather_routes(jnp.asarray(x_BxNxD), jnp.asarray(idx_BxRxK)))
    want_BxRKxD = np.zeros((b, flat_BxRK.shape[1], d), np.float32)
    for i, j in zip(*np.nonzero(flat_BxRK >= 0), strict=True):
        want_BxRKxD[i, j] = x_BxNxD[i, flat_BxRK[i, j]]
    np.testing.assert_array_equal(got_BxRKxD, want_BxRKxD)

    g_BxRKxD = normal(want_BxRKxD.shape, seed=11)
    scattered_BxNxD = scatter_routes(jnp.asarray(g_BxRKxD), jnp.asarray(idx_BxRxK), n)
    _, vjp = jax.vjp(lambda x: gather_routes(x, jnp.asarray(idx_BxRxK)), jnp.asarray(x_BxNxD))
    np.testing.assert_array_equal(scattered_BxNxD, vjp(jnp.asarray(g_BxRKxD))[0])
    # Each token is routed once, so the transpose is a permutation of the routed rows.
    want_BxNxD = np.zeros_like(x_BxNxD)
    for i, j in zip(*np.nonzero(flat_BxRK >= 0), strict=True):
        want_BxNxD[i, flat_BxRK[i, j]] = g_BxRKxD[i, j]
    np.testing.assert_array_equal(scattered_BxNxD, want_BxNxD)
    np.testing.assert_allclose(
        np.vdot(got_BxRKxD, g_BxRKxD), np.vdot(x_BxNxD, scattered_BxNxD), rtol=1e-6
    )


# -- merge_routed -----------------------------------------------------------------------


@pytest.mark.parametrize("dp, cp", [(2, 4), (4, 2)])
def test_merge_routed_matches_replicated_merge(dp, cp):
    b, seq, n, d = 4, 32, 6, 8
    mesh = Mesh(np.array(jax.devices()).reshape(dp, cp), ("dp", "cp"))
    is_slot_BxL = slot_masks(b, seq, n, seed=dp)
    h_BxLxD = normal((b, seq, d), seed=1)
    img_BxNxD = normal((b, n, d), seed=2)
    w_BxLxD = normal((b, seq, d), seed=3)  # linear functional for the gradients
    perm = zigzag_permutation(seq, cp)
    idx_BxRxK = jnp.asarray(token_routes(is_slot_BxL, n, cp))
    put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, PartitionSpec(*spec)))
    h_stored = put(h_BxLxD[:, perm], "dp", "cp", None)
    slot_stored = put(is_slot_BxL[:, perm], "dp", "cp")
    img = put(img_BxNxD, "dp", None, None)
    merge = functools.partial(merge_routed, mesh=mesh, batch_axes=("dp",))

    routed = put(gather_routes(img_BxNxD, idx_BxRxK), "dp", "cp", None)
    got_stored = jax.jit(merge)(h_stored, slot_stored, routed)
    out_spec = NamedSharding(mesh, PartitionSpec("dp", "cp", None))
    assert got_stored.sharding.is_equivalent_to(out_spec, 3)
    want = merge_modality_tokens(h_BxLxD, is_slot_BxL, img_BxNxD)
    np.testing.assert_array_equal(np.asarray(got_stored)[:, inverse_permutation(perm)], want)
    np.testing.assert_array_equal(got_stored, np.asarray(want)[:, perm])

    def routed_loss(h_stored, img):
        merged = merge(h_stored, slot_stored, gather_routes(img, idx_BxRxK))
        return jnp.sum(merged * w_BxLxD[:, perm])

    def reference_loss(h, img):
        return jnp.sum(merge_modality_tokens(h, is_slot_BxL, img) * w_BxLxD)

    got_dh, got_dimg = jax.jit(jax.grad(routed_loss, argnums=(0, 1)))(h_stored, img)
    want_dh, want_dimg = jax.grad(reference_loss, argnums=(0, 1))(h_BxLxD, img_BxNxD)
    np.testing.assert_allclose(got_dh, np.asarray(want_dh)[:, perm], rtol=0, atol=ATOL)
    np.testing.assert_allclose(got_dimg, want_dimg, rtol=0, atol=ATOL)


@pytest.mark.parametrize("cp", [2, 4])
def test_merge_whole_per_rank_matches_the_whole_merge(cp):
    """Per cp rank with the tokens whole on every rank (the homogeneous baseline): each
    rank's block is the whole-sequence merge's, and the tokens' gradient, each rank's
    partial summed over cp, is the whole merge's."""
    b, seq, n, d = 2, 32, 6, 8
    mesh = Mesh(np.array(jax.devices()[:cp]), ("cp",))
    is_slot_BxL = slot_masks(b, seq, n, seed=cp)
    h_BxLxD, img_BxNxD = normal((b, seq, d), seed=1), normal((b, n, d), seed=2)
    w_BxLxD = normal((b, seq, d), seed=3)  # linear functional for the gradient
    perm = zigzag_permutation(seq, cp)

    def per_rank(h, slot, img, w):
        def loss(img):
            merged = merge_whole_per_rank(h, slot, img, cp=cp)
            return jnp.sum(merged * w), merged

        (_, merged), g_img = jax.value_and_grad(loss, has_aux=True)(img)
        return merged, jax.lax.psum(g_img, "cp")

    split, whole = PartitionSpec(None, "cp"), PartitionSpec()
    fn = jax.shard_map(
        per_rank,
        mesh=mesh,
        in_specs=(split, split, whole, split),
        out_specs=(split, whole),
        check_vma=False,
    )
    got, got_dimg = jax.jit(fn)(h_BxLxD[:, perm], is_slot_BxL[:, perm], img_BxNxD, w_BxLxD[:, perm])
    want = merge_modality_tokens(h_BxLxD, is_slot_BxL, img_BxNxD)
    np.testing.assert_array_equal(got, np.asarray(want)[:, perm])
    want_dimg = jax.grad(
        lambda img: jnp.sum(merge_modality_tokens(h_BxLxD, is_slot_BxL, img) * w_BxLxD)
    )(img_BxNxD)
    np.testing.assert_allclose(got_dimg, want_dimg, rtol=0, atol=ATOL)


# -- Routed -----------------------------------------------------------------------------


def test_routed_is_a_distinct_pytree_node():
    x_BxNxD = jnp.arange(6.0).reshape(1, 2, 3)
    doubled = jax.tree.map(lambda a: 2 * a, Routed(x_BxNxD))
    assert isinstance(doubled, Routed)
    np.testing.assert_array_equal(doubled.tokens, 2 * x_BxNxD)
    assert jax.tree.structure(Routed(x_BxNxD)) != jax.tree.structure(x_BxNxD)
    out = jax.jit(lambda r: Routed(r.tokens + 1))(Routed(x_BxNxD))
    assert isinstance(out, Routed)
    np.testing.assert_array_equal(out.tokens, x_BxNxD + 1)


@pytest.mark.parametrize("dp, cp", [(2, 4), (4, 2), (1, 8)])
@pytest.mark.parametrize("contiguous", [True, False])
def test_exchange_equals_gather_at_the_source(dp, cp, contiguous):
    """Tokens split evenly over cp, then exchanged (the across-islands path), give the
    routed layout bit for bit - and the same gradient - as packing at the source."""
    b, n, d = 4, 8, 3
    seq = 4 * cp
    mesh = Mesh(np.array(jax.devices()[: dp * cp]).reshape(dp, cp), ("dp", "cp"))
    is_slot = slot_masks(b, seq, n, seed=cp, contiguous=contiguous)
    idx = token_routes(is_slot, n, cp)
    send, recv = exchange_routes(idx, n)
    k2 = send.shape[-1]
    assert 1 <= k2 <= n // cp
    split = NamedSharding(mesh, PartitionSpec("dp", "cp"))
    x = normal((b, n, d), seed=1)
    fn = jax.jit(functools.partial(exchange_routed, mesh=mesh, batch_axes=("dp",)))
    args = (jax.device_put(send, split), jax.device_put(recv, split))
    got = fn(jax.device_put(x, split), *args)
    want = gather_routes(jnp.asarray(x), jnp.asarray(idx))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.sharding.spec[:2] == ("dp", "cp")

    g = normal(want.shape, seed=2)
    gx = jax.vjp(lambda v: fn(v, *args), jax.device_put(x, split))[1](g)[0]
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(scatter_routes(g, idx, n)))


def test_exchange_routes_needs_tokens_divisible_by_cp():
    idx = token_routes(slot_masks(2, 8, 3, seed=0), 3, 2)
    with pytest.raises(ValueError, match="do not split evenly over cp=2"):
        exchange_routes(idx, 3)
