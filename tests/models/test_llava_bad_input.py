"""Every bad input stops with one line naming the file, the record and the problem; with
``skip_bad`` it is skipped and counted per reason instead (nothing dropped silently)."""

from __future__ import annotations

import json
import os

import pytest

from models.llava import REASONS, BadSample, HFTokenizer, Loader, summary_counts
from tests.models.llava_fixtures import make_data

GOOD = {
    "id": "ok",
    "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yes"}],
}


def _img(value="<image>\nWhat color?"):
    return [{"from": "human", "value": value}, {"from": "gpt", "value": "red"}]


def _bad_records(images):
    """(reason, record) for every record-level problem; ``images`` holds train images."""
    real = sorted(os.listdir(images))[0]
    with open(os.path.join(images, "broken.png"), "wb") as f:
        f.write(b"not a png at all")
    return [
        ("no_conversations", {"id": "noconv", "image": real}),
        ("unknown_role", {"id": "role", "conversations": [{"from": "robot", "value": "x"}]}),
        ("image_count", {"id": "count", "image": [real, real], "conversations": _img()}),
        ("missing_image", {"id": "missing", "image": "nope.png", "conversations": _img()}),
        ("image_outside_folder", {"id": "escape", "image": "../x.png", "conversations": _img()}),
        ("undecodable_image", {"id": "broken", "image": "broken.png", "conversations": _img()}),
    ]


RECORD_REASONS = (
    "no_conversations",
    "unknown_role",
    "image_count",
    "missing_image",
    "image_outside_folder",
    "undecodable_image",
)


@pytest.mark.parametrize("reason", RECORD_REASONS)
def test_each_bad_record_is_one_line_naming_file_record_and_id(reason, llava_dir, tok, tmp_path):
    record = dict(_bad_records(llava_dir["images"]))[reason]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (GOOD, GOOD, record)))
    with pytest.raises(BadSample) as e:
        data = make_data(llava_dir, tok, [(str(path), 1.0)], shuffle=False, global_batch=4)
        Loader(data).next()  # an undecodable image shows only when decoded
    msg = str(e.value)
    assert e.value.reason == reason and "\n" not in msg
    assert f"{path} record 2 (id {record['id']})" in msg, msg


def test_malformed_json_names_file_record_and_line(llava_dir, tok, tmp_path):
    listed = tmp_path / "d.json"
    listed.write_text(json.dumps([GOOD, GOOD], indent=1)[:-2] + ',\n {"id": oops}\n]')
    with pytest.raises(BadSample, match=rf"^{listed} record 2 \(line \d+\): Expecting value"):
        make_data(llava_dir, tok, [(str(listed), 1.0)])
    lines = tmp_path / "d.jsonl"
    lines.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(BadSample, match=rf"^{lines} record 1 \(line 2\): "):
        make_data(llava_dir, tok, [(str(lines), 1.0)])


def test_tokenizer_that_does_not_load(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{broken")
    with pytest.raises(ValueError, match=rf"^tokenizer {bad} does not load: ") as e:
        HFTokenizer(str(tmp_path))
    assert "\n" not in str(e.value)


def test_skip_bad_samples_counts_every_reason(llava_dir, tok, tmp_path):
    bad = _bad_records(llava_dir["images"])
    path = tmp_path / "d.jsonl"
    good = json.load(open(llava_dir["train"]))[:20]
    rows = [json.dumps(r) for r in good] + [json.dumps(r) for _, r in bad] + ["{not json"]
    path.write_text("\n".join(rows))
    data = make_data(llava_dir, tok, [(str(path), 1.0)], skip_bad=True, shuffle=False)
    assert len(data.files[0]) == 21  # 20 good + the undecodable one (found when decoded)
    loader = Loader(data)
    for _ in range(4):  # past the undecodable record
        loader.next()
    loader.close()
    counts = summary_counts(loader.state)
    expected = {r for r, _ in bad} | {"malformed_json"}
    assert {REASONS[r] for r in expected} <= set(counts)
    assert all(counts[REASONS[r]] == 1 for r in expected), counts


def test_data_whose_every_record_is_skipped_stops_in_one_line(llava_dir, tok, tmp_path):
    """With ``skip_bad`` and nothing good left, the loader stops (it looped forever)."""
    with open(os.path.join(llava_dir["images"], "broken.png"), "wb") as f:
        f.write(b"not a png at all")
    broken = {"id": "broken", "image": "broken.png", "conversations": _img()}
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps({**broken, "id": f"b{i}"}) for i in range(3)))
    data = make_data(llava_dir, tok, [(str(path), 1.0)], skip_bad=True, global_batch=4)
    loader = Loader(data)
    with pytest.raises(ValueError, match=r"^every record was skipped \(\d+ ") as e:
        loader.next()
    assert "\n" not in str(e.value)
