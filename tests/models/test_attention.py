"""Attention maths: RoPE against its definition, GQA against MHA, and causality of the LLM.

Shape key: B batch, L query length, S key length, H query heads, G kv heads, K head dim.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.layers import apply_rope, attention
from models.llm import LMHeadLoss
from models.mllm import MLLM

THETA = 10000.0


def rope_reference(x_BxLxHxK: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotates the complex number x[i] + j x[i + K/2] by pos * theta^(-2i/K) (float64)."""
    k = x_BxLxHxK.shape[-1]
    x = x_BxLxHxK.astype(np.float64)
    z = x[..., : k // 2] + 1j * x[..., k // 2 :]
    i = np.arange(k // 2)
    angle_LxI = positions[:, None].astype(np.float64) * theta ** (-2.0 * i / k)[None, :]
    z = z * np.exp(1j * angle_LxI)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


@pytest.mark.parametrize("head_dim", [8, 16])
def test_rope_matches_complex_rotation(head_dim):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 64, 3, head_dim)).astype(np.float32)
    positions = np.arange(64)
    got = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(positions), THETA))
    np.testing.assert_allclose(got, rope_reference(x, positions, THETA), rtol=1e-5, atol=1e-5)
    # Position 0 is the identity; a rotation keeps each pair's norm.
    np.testing.assert_array_equal(got[:, 0], x[:, 0])
    half = head_dim // 2
    pair_norm = np.hypot(got[..., :half], got[..., half:])
    np.testing.assert_allclose(pair_norm, np.hypot(x[..., :half], x[..., half:]), rtol=1e-5)


def test_rope_preserves_dtype():
    x = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    assert apply_rope(x, jnp.arange(4), THETA).dtype == jnp.bfloat16


def test_rope_dot_product_depends_only_on_relative_position():
    rng = np.random.default_rng(1)
    k_dim = 16
    q = jnp.asarray(rng.normal(size=(1, 1, 1, k_dim)).astype(np.float32))
    k = jnp.asarray(rng.normal(size=(1, 1, 1, k_dim)).astype(np.float32))

    def score(m: int, n: int) -> float:
        qm = apply_rope(q, jnp.asarray([m]), THETA)
        kn = apply_rope(k, jnp.asarray([n]), THETA)
        return float(jnp.sum(qm * kn))

    for m, n in [(5, 2), (2, 5), (7, 7), (20, 3)]:
        base = score(m, n)
        for shift in (1, 9, 40):
            assert score(m + shift, n + shift) == pytest.approx(base, rel=1e-5, abs=1e-5)
    # ... and it does depend on the relative position.
    assert abs(score(5, 2) - score(5, 3)) > 1e-3


def naive_attention(q, k, v, causal):
    """softmax(Q K^T / sqrt(K)) V per head, float64; q [B,L,H,K], k/v [B,S,H,K]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    scores = np.einsum("blhk,bshk->bhls", q, k) / np.sqrt(q.shape[-1])
    if causal:
        l, s = scores.shape[-2:]
        scores = np.where(np.tril(np.ones((l, s), bool)), scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhls,bshk->blhk", p, v)


def _qkv(h, g, seed=0, b=2, l=12, k=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, l, h, k)).astype(np.float32)
    kk = rng.normal(size=(b, l, g, k)).astype(np.float32)
    v = rng.normal(size=(b, l, g, k)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(kk), jnp.asarray(v)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (8, 2), (8, 1), (4, 4)])
def test_gqa_equals_mha_with_repeated_kv(heads, kv_heads, causal):
    q, k, v = _qkv(heads, kv_heads)
    rep = heads // kv_heads
    gqa = attention(q, k, v, causal=causal)
    # Query head h reads kv head h // rep (consecutive query heads share a kv head).
    mha = attention(q, jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2), causal=causal)
    assert gqa.shape == q.shape
    np.testing.assert_allclose(np.asarray(gqa), np.asarray(mha), rtol=1e-5, atol=1e-6)
    ref = naive_attention(q, np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2), causal)
    np.testing.assert_allclose(np.asarray(gqa), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_mha_matches_naive_softmax(causal):
    q, k, v = _qkv(4, 4, seed=3)
    got = np.asarray(attention(q, k, v, causal=causal))
    np.testing.assert_allclose(got, naive_attention(q, k, v, causal), rtol=1e-5, atol=1e-6)


def test_causal_attention_ignores_future_keys():
    q, k, v = _qkv(4, 2, seed=4)
    t = 5
    k2 = k.at[:, t + 1 :].set(100.0)
    v2 = v.at[:, t + 1 :].set(-100.0)
    a = np.asarray(attention(q, k, v, causal=True))
    b = np.asarray(attention(q, k2, v2, causal=True))
    np.testing.assert_array_equal(a[:, : t + 1], b[:, : t + 1])


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    params = model.init(jax.random.key(1))
    batch = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=3)).batch(0, 2)
    return cfg, model, params, {k: jnp.asarray(v) for k, v in batch.items()}


def test_llm_is_causal(tiny):
    """Changing tokens after position t changes nothing at positions <= t."""
    cfg, model, params, batch = tiny
    llm = model.modules["llm"]
    head_def, _ = nnx.split(LMHeadLoss(cfg.llm, rngs=nnx.Rngs(0), dtype=jnp.float32), nnx.Param)

    @jax.jit
    def forward(params, tokens, images):
        image_tokens = model.encode(params, {"images": images})["image"]
        h = llm.apply_pre(params["llm"]["pre"], tokens, image=image_tokens)
        h = llm.apply_blocks(params["llm"]["blocks"], h)
        return h, nnx.merge(head_def, params["llm"]["post"]).logits(h)

    tokens = batch["tokens"]
    n_image = cfg.vision.num_tokens
    t = n_image + 8  # a text position after the image placeholders
    rng = np.random.default_rng(0)
    future = rng.integers(0, 256, size=(tokens.shape[0], tokens.shape[1] - t - 1))
    changed = tokens.at[:, t + 1 :].set(jnp.asarray(future, tokens.dtype))
    h_a, logits_a = forward(params, tokens, batch["images"])
    h_b, logits_b = forward(params, changed, batch["images"])
    np.testing.assert_array_equal(np.asarray(h_a[:, : t + 1]), np.asarray(h_b[:, : t + 1]))
    np.testing.assert_array_equal(
        np.asarray(logits_a[:, : t + 1]), np.asarray(logits_b[:, : t + 1])
    )
    # The change is visible from position t + 1 on.
    assert not np.allclose(np.asarray(h_a[:, t + 1 :]), np.asarray(h_b[:, t + 1 :]))


def test_bf16_model_lowers_to_cudnn_masks_without_bias(tiny, monkeypatch):
    """The bf16 model's program lowered for CUDA (cuDNN's probes stubbed, no GPU needed):
    the vision encoder's attention is cuDNN's unmasked kernel and the LLM's its causal
    one, forward and backward, and no attention reads a bias (``ScaleBias`` calls)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    cfg, _, _, batch = tiny
    model = MLLM(cfg, dtype=jnp.bfloat16)
    params = model.init(jax.random.key(1))
    llm = model.modules["llm"]

    def loss(params, tokens, images):
        image_tokens = model.encode(params, {"images": images})["image"]
        h = llm.apply_pre(params["llm"]["pre"], tokens, image=image_tokens)
        return jnp.sum(llm.apply_blocks(params["llm"]["blocks"], h).astype(jnp.float32))

    traced = jax.jit(jax.grad(loss)).trace(params, batch["tokens"], batch["images"])
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    calls = re.findall(r"custom_call @(__cudnn\$\w+)\([^\n]*?mask_type\\22: \\22(\w+)", text)
    assert sorted(calls) == [
        ("__cudnn$fmhaSoftmax", "CAUSAL"),
        ("__cudnn$fmhaSoftmax", "NO_MASK"),
        ("__cudnn$fmhaSoftmaxBackward", "CAUSAL"),
        ("__cudnn$fmhaSoftmaxBackward", "NO_MASK"),
    ]
