"""Synthetic LLaVA data: determinism, supervision mask, answers grounded in the media."""

import numpy as np
import pytest

from models import tokenizer
from models.config import get_preset
from models.data import COLORS, PITCHES, POSITIONS, SyntheticConfig, SyntheticLlava


def _dataset(preset="tiny", seed=0, seq_len=None):
    cfg = get_preset(preset)
    return SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=seq_len or cfg.seq_len, seed=seed))


def _assert_batches_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("preset", ["tiny", "tiny-av"])
def test_batch_keys_shapes_dtypes(preset):
    cfg = get_preset(preset)
    batch = _dataset(preset).batch(0, 3)
    L = cfg.seq_len
    expected = {"tokens": ((3, L), np.int32), "targets": ((3, L), np.int32)}
    expected["loss_mask"] = ((3, L), np.float32)
    v = cfg.vision
    expected["images"] = ((3, v.image_size, v.image_size, v.channels), np.float32)
    if cfg.audio:
        expected["audio"] = ((3, cfg.audio.frames, cfg.audio.frame_dim), np.float32)
    assert {k: (x.shape, x.dtype) for k, x in batch.items()} == expected
    # Every sample has exactly N placeholders per modality (merge_modality_tokens needs it).
    assert np.all((batch["tokens"] == tokenizer.IMAGE).sum(1) == v.num_tokens)
    if cfg.audio:
        assert np.all((batch["tokens"] == tokenizer.AUDIO).sum(1) == cfg.audio.num_tokens)
    # targets are tokens shifted by one.
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["tokens"][:, 1:])
    assert np.all(batch["tokens"][:, 0] == tokenizer.BOS)


def test_same_seed_same_batches():
    a, b = _dataset(seed=7), _dataset(seed=7)
    for step in (0, 3):
        _assert_batches_equal(a.batch(step, 4), b.batch(step, 4))


def test_different_seed_different_batches():
    a, b = _dataset(seed=0).batch(0, 4), _dataset(seed=1).batch(0, 4)
    assert not np.array_equal(a["images"], b["images"])
    assert not np.array_equal(a["tokens"], b["tokens"])


def test_sample_independent_of_batching():
    ds = _dataset("tiny-av", seed=3)
    big = ds.batch(0, 8)  # samples 0..7
    small = ds.batch(1, 4)  # samples 4..7
    for i in range(4):
        one = ds.sample(4 + i)
        for k in big:
            np.testing.assert_array_equal(big[k][4 + i], one[k], err_msg=k)
            np.testing.assert_array_equal(small[k][i], one[k], err_msg=k)


def _answer_and_question(tokens, targets, mask):
    """(decoded supervised targets, question text) of one sample."""
    sup = np.flatnonzero(mask)
    assert sup.size > 0
    assert np.array_equal(sup, np.arange(sup[0], sup[-1] + 1)), "supervision is contiguous"
    answer_ids = targets[sup]
    assert answer_ids[-1] == tokenizer.EOS
    assert tokenizer.EOS not in answer_ids[:-1] and np.all(answer_ids[:-1] < 256)
    prompt = tokenizer.decode(tokens[1 : sup[0] + 1].tolist())
    return tokenizer.decode(answer_ids[:-1].tolist()), prompt


def test_loss_mask_is_answer_bytes_plus_eos():
    ds = _dataset("tiny-av")
    for i in range(40):
        s = ds.sample(i)
        answer, prompt = _answer_and_question(s["tokens"], s["targets"], s["loss_mask"])
        sup = np.flatnonzero(s["loss_mask"])
        # Everything before the answer is prompt; after the EOS only padding, unsupervised.
        assert prompt.endswith("\n") and prompt.startswith("<image>")
        assert len(tokenizer.encode(answer)) == sup.size - 1
        assert np.all(s["targets"][sup[-1] + 1 :] == tokenizer.PAD)
        assert set(np.unique(s["loss_mask"])) <= {0.0, 1.0}


def _image_content(image):
    """(colour name, position) read off the pixels: the brightest quadrant's mean colour."""
    s = image.shape[0]
    h = s // 2
    quads = [image[r * h : (r + 1) * h, c * h : (c + 1) * h] for r in (0, 1) for c in (0, 1)]
    q = int(np.argmax([quad.sum() for quad in quads]))
    quad = quads[q]
    bright = quad[quad.sum(-1) > 1.0]  # pixels of the square (noise has std 0.1)
    rgb = bright.mean(0)
    color = min(COLORS, key=lambda c: np.sum((np.asarray(COLORS[c]) - rgb) ** 2))
    return color, POSITIONS[q]


def _audio_pitch(clip):
    centre = float(np.argmax(clip.mean(0)))
    width = clip.shape[1] / len(PITCHES)
    return PITCHES[int(centre // width)]


@pytest.mark.parametrize("preset", ["tiny", "tiny-av"])
def test_answers_match_media_content(preset):
    ds = _dataset(preset, seed=11)
    batch = ds.batch(0, 64)
    seen_questions = set()
    for i in range(64):
        answer, prompt = _answer_and_question(
            batch["tokens"][i], batch["targets"][i], batch["loss_mask"][i]
        )
        question = prompt.split("\n")[-2]
        seen_questions.add(question)
        color, position = _image_content(batch["images"][i])
        expected = {
            "What color?": color,
            "Where is it?": position,
            "Describe.": f"{color}, {position}",
        }
        if preset == "tiny-av":
            pitch = _audio_pitch(batch["audio"][i])
            expected |= {"What pitch?": pitch, "Describe all.": f"{color}, {position}, {pitch}"}
        assert answer == expected[question], (i, question)
    assert len(seen_questions) == (5 if preset == "tiny-av" else 3)


@pytest.mark.parametrize("preset", ["tiny", "tiny-av"])
def test_seq_len_too_short_names_the_needed_length(preset):
    cfg = get_preset(preset)
    need = SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0).max_sample_tokens()
    # The longest real sample (BOS ... EOS) fits exactly at seq_len = need - 1.
    ds = _dataset(preset, seq_len=need - 1)
    longest = max(int(np.flatnonzero(ds.sample(i)["loss_mask"])[-1]) + 2 for i in range(200))
    assert longest <= need
    with pytest.raises(ValueError, match=f"seq_len={need - 1} or more"):
        _dataset(preset, seq_len=need - 2)
    with pytest.raises(ValueError, match=f"seq_len=8 is too short: samples need up to {need}"):
        SyntheticConfig.for_model(cfg, seq_len=8, seed=0).validate()


@pytest.mark.parametrize(
    "text", ["", "hello world", "What color?\n", "caf\u00e9 \u00fcber \u65e5\u672c \U0001f600"]
)
def test_tokenizer_round_trip(text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_tags_and_specials():
    ids = tokenizer.encode("<image><audio>hi", tokens_per_tag={"image": 3, "audio": 2})
    assert ids == [tokenizer.IMAGE] * 3 + [tokenizer.AUDIO] * 2 + [ord("h"), ord("i")]
    assert tokenizer.decode(ids) == "<image>" * 3 + "<audio>" * 2 + "hi"
    assert tokenizer.decode([tokenizer.BOS, ord("a"), tokenizer.EOS, tokenizer.PAD]) == "a"
    with pytest.raises(ValueError, match="no audio encoder"):
        tokenizer.encode("<audio>", tokens_per_tag={"image": 1})
    specials = [tokenizer.PAD, tokenizer.BOS, tokenizer.EOS, tokenizer.IMAGE, tokenizer.AUDIO]
    assert len(set(specials)) == 5 and all(
        256 <= s < get_preset("tiny").llm.vocab for s in specials
    )
