"""Qwen2.5-VL's data at native resolution: the processor equals transformers' bit for bit
(golden made with transformers 5.25: ``golden/make_qwen_processor_golden.py``), frames
are sampled as its video processor samples them, the ``qwen2_vl`` template's layout and
loss mask, a video folder's row, bad records in one line (or skipped and counted), and
a short training run on records made on the spot."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import numpy as np
import pytest

import hetjax.config as hc
from experiments import llava_train
from models.config import get_preset
from models.llava.records import BadSample
from models.qwen import demo, grids, loader, video
from models.qwen.data import patchify
from models.qwen.processor import QwenImageProcessor, smart_resize
from models.qwen.template import QwenTokens, render

GOLDEN = pathlib.Path(__file__).parent / "golden" / "qwen_processor"
TINY = get_preset("qwen2.5-vl-tiny")
PIXELS = dict(min_pixels=28 * 28 * 2, max_pixels=28 * 28 * 4)


@pytest.mark.parametrize(
    "name, max_pixels", [("a", 28 * 28 * 1280), ("b", 28 * 28 * 1280), ("c", 28 * 28 * 8)]
)
def test_processor_equals_transformers(name, max_pixels):
    """Rounded (45x67 -> 56x56), scaled up to min_pixels (20x90 -> 28x140) and down to
    max_pixels (150x97 greyscale -> 84x56): grids and float32 patches equal."""
    golden = np.load(GOLDEN / "golden.npz")
    proc = QwenImageProcessor(get_preset("qwen2.5-vl-7b").vision, 56 * 56, max_pixels)
    patches, grid = proc(str(GOLDEN / f"{name}.png"))
    assert [list(grid)] == golden[f"grid_{name}"].tolist()
    np.testing.assert_array_equal(patches, golden[f"pixel_values_{name}"])


def test_smart_resize_and_patch_order():
    """Hand-derived sizes; a patch row is (channel, frame, row, column) of one 14x14 patch,
    patches in 2x2 merge units in raster order (the processor's)."""
    assert smart_resize(45, 67) == (56, 56)
    assert smart_resize(20, 90) == (28, 140)  # 28x84 < 3136: sqrt(3136/1800) up, ceil
    assert smart_resize(1080, 1920) == (728, 1316)  # 1092x1932 > 1003520: floor after scale
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        smart_resize(10, 2010)
    v = TINY.vision
    h, w = 28, 56
    px = np.zeros((1, h, w, 3), np.float32)
    px[0] = np.arange(h)[:, None, None] * 1000 + np.arange(w)[None, :, None] + [0, 1e5, 2e5]
    patches, grid = patchify(v, px)
    assert grid == (1, 2, 4) and patches.shape == (8, 3 * 2 * 14 * 14)
    # merge unit (0, 0) holds patches (0,0) (0,1) (1,0) (1,1); unit (0, 1) starts at (0, 2)
    for k, (r, c) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2)]):
        x = patches[k].reshape(3, 2, 14, 14)
        assert x[0, 0, 0, 0] == r * 14 * 1000 + c * 14, k
        assert x[2, 1, 13, 13] == 2e5 + (r * 14 + 13) * 1000 + c * 14 + 13, k
        np.testing.assert_array_equal(x[:, 0], x[:, 1])  # an image fills both frames


def test_frames_sampled_as_transformers():
    cases = json.loads((GOLDEN / "frames.json").read_text())["cases"]
    args = [(10, 2.0, 2.0, 768), (30, 30.0, 2.0, 768), (25, 24.0, 3.0, 4), (7, 1.0, 2.0, 768)]
    for (total, src, fps, most), want in zip(args, cases, strict=True):
        s = video.sample_frames(total, src, fps, most)
        assert s.indices.tolist() == want["indices"]
        assert s.second_per_grid == 2 / want["sampled_fps"]
    with pytest.raises(ValueError, match="a video needs at least 2"):
        video.sample_frames(1, 2.0, 2.0, 768)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return demo.make(str(tmp_path_factory.mktemp("qwen_data")), train=24)


def _data(made, records, tmp_path, **data) -> loader.QwenData:
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    d = dict(sources={str(path): 1.0}, tokenizer=made["tokenizer"], image_folder=made["media"])
    d = {"global_batch": 2, "template": "qwen2_vl", "workers": 2, **PIXELS, **d, **data}
    cfg = hc.DataConfig(**d)
    out, _ = loader.build(cfg, TINY, seq_len=64, seed=0, microbatches=1, grow_vocab=True)
    return out


def _turns(*values):
    return [{"from": w, "value": v} for w, v in zip(["human", "gpt"] * 4, values, strict=False)]


def test_template_layout_and_loss_mask(made, tmp_path):
    """System, user with an image's and a video's start/pads/end in place, assistant; only
    the reply, its <|im_end|> and the newline after it are supervised."""
    data = _data(made, [{"id": "x", "conversations": _turns("hi", "ok")}], tmp_path)
    tok, t = data.tokenizer, QwenTokens.of(data.tokenizer)
    conv = _turns("<image>\nWhat?<video>", "red", "And?", "blue")
    ids, sup = render(conv, tok, t, [2, 3])
    enc = lambda s: tok.encode(s)[0]  # noqa: E731
    head = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
    want = [*enc(head + "<|vision_start|>"), *[t.image_pad] * 2]
    want += [*enc("<|vision_end|>\nWhat?<|vision_start|>"), *[t.video_pad] * 3]
    want += enc("<|vision_end|><|im_end|>\n<|im_start|>assistant\n")
    reply1 = enc("red<|im_end|>\n")
    want += reply1 + enc("<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>assistant\n")
    reply2 = enc("blue<|im_end|>\n")
    want += reply2
    assert ids.tolist() == want
    mask = np.zeros(len(want))
    a = len(want) - len(reply2) - len(enc("<|im_start|>user\nAnd?<|im_end|>\n<|im_start|>"))
    a -= len(enc("assistant\n")) + len(reply1)
    mask[a : a + len(reply1)] = 1
    mask[len(want) - len(reply2) :] = 1
    np.testing.assert_array_equal(sup, mask)
    assert t.im_end in ids[sup == 1] and t.image_pad not in ids[sup == 1]


def test_video_folder_record(made, tmp_path):
    """A folder of 6 frames at 3 fps sampled at 2 fps: frames 0, 1, 3, 4 (two temporal
    patches, one second each); the row's patches are the processor's, the video's pads
    become the model's placeholder, and its temporal mRoPE positions step by
    tokens_per_second x 1 s."""
    from PIL import Image

    folder = pathlib.Path(made["media"]) / "clip6"
    folder.mkdir(exist_ok=True)
    for f in range(6):
        Image.new("RGB", (50, 40), (40 * f, 100, 200 - 30 * f)).save(folder / f"{f:03d}.png")
    rec = {"id": "v", "video": "clip6", "fps": 3, "conversations": _turns("<video>\nWhere?", "up")}
    data = _data(made, [rec], tmp_path)
    sample = data.load(0, 0)
    proc = data.processor
    patches, grid = proc.frames([str(folder / f"{f:03d}.png") for f in (0, 1, 3, 4)])
    assert grid == (2, 2, 4)  # 40x50 -> 28x56 at max_pixels 3136
    row = data.row(sample)
    np.testing.assert_array_equal(row["patches"][: len(patches)], patches)
    assert (row["frame_ids"][: len(patches)] == np.repeat([0, 1], 8)).all()
    t = data.tokens
    video_at = np.flatnonzero(np.isin(sample.ids, t.video_pad))
    assert len(video_at) == 4 and (row["tokens"][video_at] == data.config.placeholder).all()
    pos = row["mrope_positions"][video_at]
    step = int(TINY.vision.tokens_per_second * 1.0)
    assert pos[:, 0].tolist() == [pos[0, 0]] * 2 + [pos[0, 0] + step] * 2
    types = grids.token_types(sample.ids, t.image_pad, t.video_pad)
    want = grids.rope_positions(TINY.vision, types, [grid], [1.0])
    np.testing.assert_array_equal(row["mrope_positions"][: len(sample.ids)], want.T)


def _write_video(path: pathlib.Path, codec: str, frames: int = 7, rate: int = 3) -> None:
    """A 64x48 clip at ``rate`` fps whose frame ``f`` is red ``30 f`` over a green left half."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for f in range(frames):
            x = np.zeros((48, 64, 3), np.uint8)
            x[..., 0], x[:, :32, 1] = 30 * f, 200
            container.mux(stream.encode(av.VideoFrame.from_ndarray(x, format="rgb24")))
        container.mux(stream.encode())


@pytest.mark.parametrize("codec, name", [("mpeg4", "clip.mp4"), ("libvpx", "clip.webm")])
def test_video_file_record(made, tmp_path, codec, name):
    """A 7-frame 3 fps file sampled at 2 fps takes frames 0, 1, 3, 5 (transformers'
    sample_frames); the row's patches are those frames decoded straight with PyAV and
    processed. WebM stores no frame count: the frames are counted by decoding."""
    import av

    media = tmp_path / "media"
    media.mkdir()
    _write_video(media / name, codec)
    rec = {"id": "f", "video": name, "conversations": _turns("<video>\nWhat?", "red")}
    data = _data({**made, "media": str(media)}, [rec], tmp_path)
    clip = video.open_clip(str(media / name), None, 2.0, 768)
    assert clip.sampled.indices.tolist() == [0, 1, 3, 5] and clip.size == (48, 64)
    assert clip.sampled.second_per_grid == 2 / (4 / 7 * 3)
    with av.open(str(media / name)) as c:
        direct = [f.to_image() for i, f in enumerate(c.decode(video=0)) if i in (0, 1, 3, 5)]
    patches, grid = data.processor.images(direct)
    assert grid == (2, 4, 4)  # 48x64 -> 56x56
    row = data.row(data.load(0, 0))
    np.testing.assert_array_equal(row["patches"][: len(patches)], patches)
    assert (row["frame_ids"][: len(patches)] == np.repeat([0, 1], 16)).all()
    assert (row["frame_ids"][len(patches) :] == -1).all()


def test_demo_video_files_are_its_folders(made, tmp_path):
    """``demo --video-files`` writes the same records with MPEG-4 files for the folders;
    each file samples the frames its folder does (same indices, same grid)."""
    files = demo.make(str(tmp_path / "files"), train=24, video_files=True)
    recs = json.loads(pathlib.Path(files["train"]).read_text())
    folders = json.loads(pathlib.Path(made["train"]).read_text())
    videos = [(r, f) for r, f in zip(recs, folders, strict=True) if "video" in r]
    assert videos and all(r["video"] == f"{f['video']}.mp4" for r, f in videos)
    for r, f in videos:
        clip = video.open_clip(str(pathlib.Path(files["media"]) / r["video"]), None, 2.0, 768)
        want = video.open_clip(str(pathlib.Path(made["media"]) / f["video"]), None, 2.0, 768)
        assert clip.sampled.indices.tolist() == want.sampled.indices.tolist()
        assert clip.sampled.second_per_grid == want.sampled.second_per_grid
        assert len(clip.frames()) == len(clip.sampled.indices)


def test_bad_video_files_are_one_line(made, tmp_path, monkeypatch):
    """A file FFmpeg does not read, or one frame: one line naming the record (skipped and
    counted with skip_bad); no PyAV: one line naming the extra to install."""
    media = tmp_path / "media"
    media.mkdir()
    (media / "junk.mp4").write_bytes(b"not a video")
    _write_video(media / "one.mp4", "mpeg4", frames=1)
    recs = [
        {"id": name, "video": f"{name}.mp4", "conversations": _turns("<video>", "x")}
        for name in ("junk", "one")
    ]
    recs.append({"id": "g", "conversations": _turns("two?", "two")})
    data = _data({**made, "media": str(media)}, recs, tmp_path, skip_bad_samples=True)
    with pytest.raises(BadSample, match=r"record 0 \(id junk\): video .*junk.mp4 does not "):
        data.load(0, 0)
    with pytest.raises(BadSample, match=r"record 1 \(id one\): .*1 frame\(s\): a video needs"):
        data.load(0, 1)
    stream = loader.QwenStream(data, (1, 1, 1))
    try:
        stream.batch(0)
        assert re.fullmatch(r"undecodable video \d+", stream.summary())
    finally:
        stream.close()
    monkeypatch.setitem(sys.modules, "av", None)
    no_av = r"^video files are decoded with PyAV, which is not installed: pip install 'hetjax"
    with pytest.raises(video.NoDecoder, match=no_av):
        data.load(0, 1)
    with pytest.raises(video.NoDecoder, match=no_av):  # the check, before training
        _data({**made, "media": str(media)}, recs, tmp_path, skip_bad_samples=True)


def test_bad_records_are_one_line_or_skipped(made, tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "junk.png").write_bytes(b"not an image")
    (tmp_path / "media" / "empty").mkdir()
    good = {"id": "g", "conversations": _turns("two?", "two")}
    recs = [
        {"id": "junk", "image": "junk.png", "conversations": _turns("<image>", "x")},
        {"id": "gone", "image": "gone.png", "conversations": _turns("<image>", "x")},
        {"id": "empty", "video": "empty", "conversations": _turns("<video>", "x")},
        {"id": "tags", "video": "empty", "conversations": _turns("no tag", "x")},
        good,
        good,
    ]
    made = {**made, "media": str(tmp_path / "media")}
    with pytest.raises(BadSample, match=r"records.json record 1 \(id gone\): image file .*gone"):
        _data(made, recs, tmp_path)
    data = _data(made, [recs[0], recs[2], good], tmp_path)
    with pytest.raises(BadSample, match=r"record 0 \(id junk\): image .*junk.png does not decode"):
        data.load(0, 0)
    with pytest.raises(
        BadSample, match=r"record 1 \(id empty\): video .*empty does not decode: no"
    ):
        data.load(0, 1)
    data = _data(made, recs, tmp_path, skip_bad_samples=True)
    stream = loader.QwenStream(data, (1, 1, 1))
    try:
        stream.batch(0)
        assert stream.summary() == (
            "<image>/<video> tags != images/videos 1, missing image file 1, undecodable image 1, "
            "undecodable video 1"
        )
    finally:
        stream.close()


def test_data_whose_every_record_is_skipped_stops_in_one_line(made, tmp_path):
    """With ``skip_bad`` and nothing good left, the loader stops (it drew forever)."""
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "junk.png").write_bytes(b"not an image")
    junk = {"id": "junk", "image": "junk.png", "conversations": _turns("<image>", "x")}
    made = {**made, "media": str(tmp_path / "media")}
    stream = loader.QwenStream(_data(made, [junk], tmp_path, skip_bad_samples=True), (1, 1, 1))
    try:
        with pytest.raises(ValueError, match=r"^every record was skipped \(\d+ undecodable"):
            stream.batch(0)
    finally:
        stream.close()


def test_trains_on_records(made, tmp_path):
    """``llava_train --model qwen2.5-vl-tiny --data ... --template qwen2_vl`` trains two
    steps on images of several sizes, two-image records, videos and text only."""
    metrics = tmp_path / "m.jsonl"
    argv = ["--model", "qwen2.5-vl-tiny", "--data", made["train"], "--image-folder"]
    argv += [made["media"], "--tokenizer", made["tokenizer"], "--template", "qwen2_vl"]
    argv += ["--steps", "2", "--global-batch", "8", "--microbatches", "1", "--seq-len", "64"]
    argv += ["--min-pixels", str(PIXELS["min_pixels"]), "--max-pixels", str(PIXELS["max_pixels"])]
    argv += ["--metrics", str(metrics), "--layout", "vision:dp=8", "--layout", "llm:dp=4,tp=2"]
    assert llava_train.main(llava_train.parse_args(argv)) == 0
    rows = [json.loads(r) for r in metrics.read_text().splitlines()]
    assert len(rows) == 2 and all(np.isfinite(r["loss"]) for r in rows)
    assert all(0 < r["patches"] == r["patches_per_step"] for r in rows)
    assert all(r["patch_fill"] < 1 for r in rows)


def test_settings_are_one_line(made, tmp_path):
    rec = [{"id": "x", "conversations": _turns("hi", "ok")}]
    with pytest.raises(ValueError, match=r"^template='vicuna_v1': Qwen2.5-VL records take"):
        loader.build(hc.DataConfig(), TINY, seq_len=8, seed=0, microbatches=1, grow_vocab=True)
    with pytest.raises(ValueError, match=r"^min_pixels=5000 and max_pixels=3136: give 0 <"):
        QwenImageProcessor(TINY.vision, 5000, 3136)
    with pytest.raises(ValueError, match=r"is 3 patches per row, not a multiple of the 4"):
        _data(made, rec, tmp_path, max_patches_per_microbatch=6)


def test_stream_resumes_and_balances(made, tmp_path):
    """A stream opened at a batch's position hands out what the first stream hands out
    next; with balance the rows are ordered by tokens and patches (imbalance metrics);
    a record whose truncation would cut its video is skipped and counted."""
    recs = json.loads(pathlib.Path(made["train"]).read_text())
    video = next(r for r in recs if "video" in r)
    long = {**video, "id": "long", "conversations": _turns("x " * 60 + "<video>", "y")}
    data = _data(made, [long, *recs[:12]], tmp_path, global_batch=4, balance=True)
    first = loader.QwenStream(data, (1, 2, 2))
    try:
        first.batch(0)
        state = first.checkpoint()["state"]
        a1 = first.batch(1)
        metrics = first.step_metrics(1)
    finally:
        first.close()
    assert {"patches_per_step", "patch_imbalance", "token_imbalance"} <= set(metrics)
    again = loader.QwenStream(data, (1, 2, 2), state)
    try:
        b1 = again.batch(1)
        assert again.summary() == "truncation would cut an image or video 1"
    finally:
        again.close()
    for k in a1:
        np.testing.assert_array_equal(a1[k], b1[k])
