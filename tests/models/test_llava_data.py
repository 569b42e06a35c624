"""LLaVA data: templates and supervision, image preprocessing, mixtures, determinism and
resume, truncation, packing, balancing (no JAX)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from models.llava import BadSample, ImageProcessor, Loader, render
from models.llava.images import CLIP_MEAN, CLIP_STD
from models.llava.rows import Packer
from tests.models.llava_fixtures import IMAGE_TOKENS, make_data

TWO_TURNS = [
    {"from": "human", "value": "<image>\nWhat color is the shape?"},
    {"from": "gpt", "value": "green"},
    {"from": "human", "value": "And which shape is it?"},
    {"from": "gpt", "value": "a square"},
]


def _supervised_text(tok, ids, sup):
    return tok.tok.decode([int(i) for i, s in zip(ids, sup, strict=True) if s], False)


@pytest.mark.parametrize(
    "template, supervised",
    [
        ("vicuna_v1", "green</s> a square</s>"),
        ("plain", "green\na square\n"),
    ],
)
def test_templates_supervise_assistant_turns_only(template, supervised, tok):
    ids, sup = render(TWO_TURNS, tok, template, image_tokens=IMAGE_TOKENS, placeholder=3)
    assert _supervised_text(tok, ids, sup).replace(" \n", "\n") == supervised
    assert ids[0] == tok.bos_id and sup[0] == 0
    # <image> became the encoder's token count of placeholders, none supervised.
    assert (ids == 3).sum() == IMAGE_TOKENS and not sup[ids == 3].any()
    text = tok.tok.decode([int(i) for i in ids], False)
    if template == "vicuna_v1":
        assert "USER:" in text and "ASSISTANT:" in text and "And which shape" in text


def test_llama3_template_marks_turns(tok):
    ids, sup = render(TWO_TURNS, tok, "llama3", image_tokens=2, placeholder=3)
    got = _supervised_text(tok, ids, sup)
    assert got.startswith("green") and "a square" in got and "shape?" not in got


def test_clip_preprocessing_resize_crop_normalise(tmp_path):
    # 40 x 20: the shortest side (20) goes to 16, the long one to int(16 * 40 / 20) = 32,
    # then the centre 16 x 16 (columns 8..24): red on the left, blue on the right.
    im = np.zeros((20, 40, 3), np.uint8)
    im[:, :20] = (255, 0, 0)
    im[:, 20:] = (0, 0, 255)
    Image.fromarray(im).save(tmp_path / "a.png")
    x = ImageProcessor(size=16, crop=16)(str(tmp_path / "a.png"))
    assert x.shape == (16, 16, 3) and x.dtype == np.float32
    mean, std = np.asarray(CLIP_MEAN), np.asarray(CLIP_STD)
    np.testing.assert_allclose(x[0, 0], (np.array([1, 0, 0]) - mean) / std, rtol=1e-6)
    np.testing.assert_allclose(x[-1, -1], (np.array([0, 0, 1]) - mean) / std, rtol=1e-6)
    # pad: a square of the mean colour first; the top and bottom quarters are mean-grey.
    y = ImageProcessor(size=16, crop=16, pad=True)(str(tmp_path / "a.png"))
    grey = (np.array([int(255 * m) for m in CLIP_MEAN]) / 255 - mean) / std
    np.testing.assert_allclose(y[0, 8], grey, atol=1e-6)
    np.testing.assert_allclose(y[8, 0], (np.array([1, 0, 0]) - mean) / std, rtol=1e-5)


def test_mixture_weights_and_seeded_order(llava_dir, tok, tmp_path):
    small = tmp_path / "b.jsonl"
    records = json.load(open(llava_dir["train"]))[:10]
    small.write_text("\n".join(json.dumps(r) for r in records))
    data = make_data(llava_dir, tok, [(llava_dir["train"], 0.75), (str(small), 0.25)])
    counts = [0, 0]
    drawn = [data.draw(counts) for _ in range(100)]
    assert counts == [75, 25]
    again = make_data(llava_dir, tok, [(llava_dir["train"], 0.75), (str(small), 0.25)])
    assert drawn == [again.draw(c) for c in [[0, 0]] for _ in range(100)]
    other = make_data(llava_dir, tok, [(llava_dir["train"], 0.75), (str(small), 0.25)], seed=1)
    assert drawn != [other.draw(c) for c in [[0, 0]] for _ in range(100)]
    # Epochs: the 10-record file repeats as a new permutation of all ten.
    assert sorted([j for s, j in drawn if s == 1][:10]) == list(range(10))


def _take(loader, n):
    batches = [loader.next() for _ in range(n)]
    loader.close()
    return batches


@pytest.mark.parametrize("pack", [False, True])
def test_resumed_loader_continues_exactly(pack, llava_dir, tok):
    data = make_data(llava_dir, tok, pack=pack, seq_len=192)
    first = _take(Loader(data), 3)
    resumed = _take(Loader(data, state=first[0].state), 2)
    for a, b in zip(first[1:], resumed, strict=True):
        assert a.arrays.keys() == b.arrays.keys()
        for k in a.arrays:
            np.testing.assert_array_equal(a.arrays[k], b.arrays[k], err_msg=k)
        assert a.state == b.state


def test_rows_images_and_truncation(llava_dir, tok):
    b = _take(Loader(make_data(llava_dir, tok, seq_len=50, global_batch=32)), 1)[0]
    tokens, images = b.arrays["tokens"], b.arrays["images"]
    assert tokens.shape == (32, 50) and images.shape == (32, 2, 16, 16, 3)
    per_row = (np.abs(images).sum(axis=(2, 3, 4)) > 0).sum(axis=1)
    placeholders = (tokens == tok.image_id).sum(axis=1)
    np.testing.assert_array_equal(placeholders, per_row * IMAGE_TOKENS)  # images follow tags
    assert not images[per_row == 0].any()  # unused slots are zero
    # 50 tokens: one-image samples lose their tail (counted); two images do not fit whole: skipped.
    assert b.state["truncated"] > 0
    assert b.state["bad"].get("image_truncated", 0) > 0


def test_packing_keeps_every_supervised_token_and_cuts_padding(llava_dir, tok):
    plain, packed = (
        _take(Loader(make_data(llava_dir, tok, pack=p, seq_len=192, images_per_row=4)), 1)[0]
        for p in (False, True)
    )
    assert packed.metrics["padding_fraction"] < plain.metrics["padding_fraction"] / 2
    # The packed step holds whole samples: its segments each restart positions at 0 and
    # their supervised tokens are those of the same records rendered alone.
    seg, pos = packed.arrays["segment_ids"], packed.arrays["positions"]
    assert seg.max() > 1 and (pos[seg > 0][np.diff(seg, prepend=0)[seg > 0] != 0] == 0).all()
    assert packed.state["counts"][0] > plain.state["counts"][0]


def test_packer_first_fit_respects_tokens_and_image_slots():
    class S:
        def __init__(self, n, k):
            self.ids, self.supervised = np.arange(n, dtype=np.int32), np.ones(n, np.float32)
            self.images = [np.ones((2, 2, 3), np.float32)] * k

    p = Packer(2, capacity=10, slots=2, pack=True)
    assert p.add(S(6, 1)) and p.add(S(6, 2)) and p.add(S(4, 1))  # third joins row 0
    assert not p.add(S(2, 1))  # row 0 has no image slot left, row 1 none either
    arrays, loads = p.arrays(pad_id=0, shape=(2, 2, 3))
    np.testing.assert_array_equal(loads, [[9, 2], [6, 2]])
    np.testing.assert_array_equal(arrays["segment_ids"][0], [1] * 6 + [2] * 3)


def test_balancing_evens_tokens_over_dp_ranks(llava_dir, tok):
    kw = dict(seq_len=192, global_batch=32, bins=(2, 4, 2))
    off, on = (
        _take(Loader(make_data(llava_dir, tok, balance=b, **kw)), 1)[0] for b in (False, True)
    )
    assert on.metrics["token_imbalance"] < 1.1 <= off.metrics["token_imbalance"]
    assert on.metrics["image_imbalance"] <= off.metrics["image_imbalance"]
    # The same rows, reordered.
    assert sorted(map(tuple, on.arrays["tokens"])) == sorted(map(tuple, off.arrays["tokens"]))


def _has_image(images):
    return np.abs(images).reshape(*images.shape[:2], -1).sum(axis=2) > 0  # [B, K]


@pytest.mark.parametrize("pack", [False, True])
def test_image_rows_decode_only_those_rows(pack, llava_dir, tok):
    """A multi-process run's loader (``image_rows``): the same batches as decoding every
    image, but pixels only in the given rows, balanced order and packing included."""
    kw = dict(pack=pack, seq_len=192, global_batch=16, balance=True, bins=(2, 4, 2))
    whole = _take(Loader(make_data(llava_dir, tok, **kw)), 3)
    rows = [1, 2, 3, 8, 14]
    cases = {"all": range(16), "some": rows, "none": ()}
    for name, chosen in cases.items():
        got = _take(Loader(make_data(llava_dir, tok, **kw), image_rows=chosen), 3)
        for want, b in zip(whole, got, strict=True):
            assert b.state == want.state and set(b.arrays) == set(want.arrays), name
            for k, v in want.arrays.items():
                if k != "images":
                    np.testing.assert_array_equal(b.arrays[k], v, err_msg=f"{name} {k}")
            mine = np.isin(np.arange(16), list(chosen))
            np.testing.assert_array_equal(b.arrays["images"][mine], want.arrays["images"][mine])
            assert not b.arrays["images"][~mine].any(), name
            assert b.metrics["images_decoded"] == _has_image(want.arrays["images"])[mine].sum()
            assert want.metrics["images_decoded"] == want.metrics["images_per_step"]
            same = {k: v for k, v in b.metrics.items() if k != "images_decoded"}
            assert same == {k: v for k, v in want.metrics.items() if k != "images_decoded"}


def test_image_rows_check_headers_alike_and_stop_on_local_pixels(llava_dir, tok, tmp_path):
    """A file that is no image is skipped by every process alike (its header is read
    either way); one whose header reads but whose pixels do not decode can no longer be
    skipped alike, so the process that decodes it stops with one line."""
    real = json.load(open(llava_dir["train"]))
    one = [r for r in real if isinstance(r.get("image"), str)][:3]
    folder = tmp_path / "images"
    folder.mkdir()
    for r in one:
        (folder / r["image"]).write_bytes(open(f"{llava_dir['images']}/{r['image']}", "rb").read())
    (folder / "notpng.png").write_bytes(b"not a png at all")
    good = (folder / one[0]["image"]).read_bytes()
    (folder / "cut.png").write_bytes(good[: len(good) // 2])  # the header reads
    bad = [
        {**one[0], "id": "notpng", "image": "notpng.png"},
        {**one[1], "id": "cut", "image": "cut.png"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [*one, *bad]))
    kw = dict(shuffle=False, global_batch=4, skip_bad=True, image_folder=str(folder))
    # Rows 0-2 are the good records, row 3 the cut one (the other was skipped).
    for rows in ([0, 1, 2], []):
        b = _take(Loader(make_data(llava_dir, tok, [(str(path), 1.0)], **kw), image_rows=rows), 1)
        assert b[0].state["bad"] == {"undecodable_image": 1}, rows
        assert b[0].metrics["images_decoded"] == len(rows)
    loader = Loader(make_data(llava_dir, tok, [(str(path), 1.0)], **kw), image_rows=[3])
    with pytest.raises(BadSample) as e:
        loader.next()
    msg = str(e.value)
    assert e.value.reason == "undecodable_image" and "\n" not in msg
    assert f"{path} record 4 (id cut)" in msg and msg.endswith("fix or remove the file"), msg
    # Decoding every image as it loads (one process) skips the cut one too, as before.
    whole = _take(Loader(make_data(llava_dir, tok, [(str(path), 1.0)], **kw)), 1)[0]
    assert whole.state["bad"] == {"undecodable_image": 2}
