"""Modality tokens land exactly on the placeholder positions, in order; text stays text."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import tokenizer
from models.config import LLMConfig
from models.llm import TokenEmbed, merge_modality_tokens

CFG = LLMConfig(vocab=320, width=16, depth=1, heads=2, kv_heads=1, mlp=32)


def _slots(rng, b, l, n):
    """Per sample, n distinct (scattered, not contiguous) positions out of l."""
    return [np.sort(rng.choice(l, size=n, replace=False)) for _ in range(b)]


def test_merge_places_tokens_in_order():
    rng = np.random.default_rng(0)
    b, l, n, d = 3, 20, 5, 4
    h = rng.normal(size=(b, l, d)).astype(np.float32)
    tokens = rng.normal(size=(b, n, d)).astype(np.float32)
    slots = _slots(rng, b, l, n)
    is_slot = np.zeros((b, l), bool)
    for i, s in enumerate(slots):
        is_slot[i, s] = True
    out = np.asarray(merge_modality_tokens(jnp.asarray(h), jnp.asarray(is_slot), tokens))
    for i in range(b):
        np.testing.assert_array_equal(out[i, slots[i]], tokens[i])
        np.testing.assert_array_equal(out[i, ~is_slot[i]], h[i, ~is_slot[i]])


def test_merge_casts_to_the_sequence_dtype():
    h = jnp.zeros((1, 3, 2), jnp.bfloat16)
    out = merge_modality_tokens(h, jnp.asarray([[False, True, False]]), jnp.ones((1, 1, 2)))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out[0, 1], np.float32), [1.0, 1.0])


@pytest.fixture(scope="module")
def embed():
    placeholders = {"image": tokenizer.IMAGE, "audio": tokenizer.AUDIO}
    return TokenEmbed(CFG, placeholders, rngs=nnx.Rngs(0), dtype=jnp.float32)


def test_token_embed_merges_image_and_audio(embed):
    rng = np.random.default_rng(1)
    b, l, n_img, n_aud = 2, 24, 4, 3
    tokens = rng.integers(0, 256, size=(b, l)).astype(np.int32)
    img_slots, aud_slots = [], []
    for i in range(b):
        pos = rng.permutation(l)  # images and audio interleaved at random positions
        img_slots.append(np.sort(pos[:n_img]))
        aud_slots.append(np.sort(pos[n_img : n_img + n_aud]))
        tokens[i, img_slots[i]] = tokenizer.IMAGE
        tokens[i, aud_slots[i]] = tokenizer.AUDIO
    image = rng.normal(size=(b, n_img, CFG.width)).astype(np.float32)
    audio = rng.normal(size=(b, n_aud, CFG.width)).astype(np.float32)
    out = np.asarray(embed(jnp.asarray(tokens), image=jnp.asarray(image), audio=audio))
    table = np.asarray(embed.table[...])
    for i in range(b):
        np.testing.assert_array_equal(out[i, img_slots[i]], image[i])
        np.testing.assert_array_equal(out[i, aud_slots[i]], audio[i])
        text = np.setdiff1d(np.arange(l), np.concatenate([img_slots[i], aud_slots[i]]))
        np.testing.assert_array_equal(out[i, text], table[tokens[i, text]])


def test_token_embed_without_modalities_is_a_lookup(embed):
    tokens = np.arange(10, dtype=np.int32)[None]
    out = np.asarray(embed(jnp.asarray(tokens)))
    np.testing.assert_array_equal(out[0], np.asarray(embed.table[...])[:10])


def test_token_embed_rejects_unknown_modality():
    text_only = TokenEmbed(CFG, {"image": tokenizer.IMAGE}, rngs=nnx.Rngs(0), dtype=jnp.float32)
    with pytest.raises(ValueError, match="audio"):
        text_only(jnp.zeros((1, 4), jnp.int32), audio=jnp.zeros((1, 1, CFG.width)))
