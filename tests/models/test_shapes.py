"""Shapes of every part of the MLLM: embeddings, encoders, projectors, LLM pre/blocks/post.

Shape key: B batch, N modality tokens, L sequence, D width, V vocabulary.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.encoders import FrameEmbed, PatchEmbed
from models.llm import LMHeadLoss
from models.mllm import MLLM

B = 2


def _setup(preset):
    cfg = get_preset(preset)
    model = MLLM(cfg)
    params = model.init(jax.random.key(0))
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    return cfg, model, params, data.batch(0, B)


@pytest.fixture(scope="module")
def setup():
    """tiny-av: both encoders (its vision encoder and LLM are tiny's)."""
    return _setup("tiny-av")


@pytest.fixture(scope="module", params=["tiny", "tiny-av"])
def each_preset(request, setup):
    return setup if request.param == "tiny-av" else _setup(request.param)


def test_embed_modules_standalone():
    cfg = get_preset("tiny-av")
    v, a = cfg.vision, cfg.audio
    patch = PatchEmbed(v, rngs=nnx.Rngs(0), dtype=jnp.float32)
    images = jnp.ones((B, v.image_size, v.image_size, v.channels))
    chex.assert_shape(patch(images), (B, v.num_tokens, v.width))
    assert v.num_tokens == (v.image_size // v.patch) ** 2
    frames = FrameEmbed(a, rngs=nnx.Rngs(0), dtype=jnp.float32)
    clip = jnp.ones((B, a.frames, a.frame_dim))
    chex.assert_shape(frames(clip), (B, a.frames // a.frame_stack, a.width))


def test_patch_embed_orders_patches_row_major():
    """Token n is the patch at grid row n // (H/p), column n % (W/p)."""
    cfg = get_preset("tiny").vision
    embed = PatchEmbed(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    p, s, c = cfg.patch, cfg.image_size, cfg.channels
    rng = np.random.default_rng(0)
    images = rng.normal(size=(B, s, s, c)).astype(np.float32)
    tokens = np.asarray(embed(jnp.asarray(images)))
    kernel = np.asarray(embed.proj.kernel[...])
    pos = np.asarray(embed.pos[...])
    grid = s // p
    for n in (0, 1, grid, cfg.num_tokens - 1):
        r, col = divmod(n, grid)
        patch = images[:, r * p : (r + 1) * p, col * p : (col + 1) * p, :].reshape(B, -1)
        np.testing.assert_allclose(tokens[:, n], patch @ kernel + pos[n], rtol=1e-5, atol=1e-6)


def test_encoder_and_projector_shapes(setup):
    cfg, model, params, batch = setup
    for name, key, proj in (
        ("vision", "images", "projector"),
        ("audio", "audio", "audio_projector"),
    ):
        enc_cfg = cfg.encoders[name]
        enc = model.modules[name]
        x = jnp.asarray(batch[key])
        tokens_BxNxE = enc.apply_pre(params[name]["pre"], x)
        chex.assert_shape(tokens_BxNxE, (B, enc_cfg.num_tokens, enc_cfg.width))
        h = enc.apply_blocks(params[name]["blocks"], tokens_BxNxE)
        chex.assert_shape(h, (B, enc_cfg.num_tokens, enc_cfg.width))
        feats_BxNxE = enc(params[name], x)
        chex.assert_shape(feats_BxNxE, (B, enc_cfg.num_tokens, enc_cfg.width))
        chex.assert_tree_all_finite(feats_BxNxE)
        out_BxNxD = model.modules[proj](params[proj], feats_BxNxE)
        chex.assert_shape(out_BxNxD, (B, enc_cfg.num_tokens, cfg.llm.width))


def test_encode_shapes(each_preset):
    cfg, model, params, batch = each_preset
    out = model.encode(params, {k: jnp.asarray(v) for k, v in batch.items()})
    expected = {"image": cfg.vision} | ({"audio": cfg.audio} if cfg.audio else {})
    assert sorted(out) == sorted(expected)
    for modality, enc_cfg in expected.items():
        chex.assert_shape(out[modality], (B, enc_cfg.num_tokens, cfg.llm.width))
        assert out[modality].dtype == jnp.float32


def test_llm_part_shapes(setup):
    cfg, model, params, batch = setup
    llm = model.modules["llm"]
    L, D = cfg.seq_len, cfg.llm.width
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    h = llm.apply_pre(params["llm"]["pre"], batch["tokens"], **model.encode(params, batch))
    chex.assert_shape(h, (B, L, D))
    h = llm.apply_blocks(params["llm"]["blocks"], h)
    chex.assert_shape(h, (B, L, D))
    loss = llm.apply_post(params["llm"]["post"], h, batch["targets"], batch["loss_mask"])
    chex.assert_shape(loss, ())
    head_def, _ = nnx.split(LMHeadLoss(cfg.llm, rngs=nnx.Rngs(0), dtype=jnp.float32), nnx.Param)
    logits = nnx.merge(head_def, params["llm"]["post"]).logits(h)
    chex.assert_shape(logits, (B, L, cfg.llm.vocab))
    assert logits.dtype == jnp.float32
    # An untrained model predicts nearly uniformly: loss per token ~ log(V).
    per_token = float(loss) / float(batch["loss_mask"].sum())
    assert abs(per_token - np.log(cfg.llm.vocab)) < 0.5
