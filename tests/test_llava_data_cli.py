"""``python -m experiments.llava_train --data ...`` end to end on a small LLaVA-format set
(Pillow images, a trained BPE tokenizer, text-only, multi-image and multi-turn records,
plus a file of bad records), packed (``--pack``): the loss falls, ``--skip-bad-samples``
counts every reason in the run summary, the data metrics are logged, and a run stopped
and resumed from its checkpoint sees exactly the batches an uninterrupted run would
(recomputed here, in process, from the same resolved config). Bad input without the flag
stops with one line before anything compiles. The runs run in the test process
(:func:`tests.launch.run_main`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from experiments import flags
from models.config import get_preset
from models.llava import REASONS
from models.llava import run as llava_run
from tests import launch

GOOD = {
    "id": "g",
    "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}],
}
BAD = [
    {"id": "role", "conversations": [{"from": "robot", "value": "x"}]},
    {"id": "noconv"},
    {"id": "count", "conversations": [{"from": "human", "value": "<image>"}]},
]


def _train(*args: str) -> launch.Result:
    return launch.run_main(launch.TRAIN, *args)


@pytest.fixture(scope="module")
def argv(llava_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    bad = tmp / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in [GOOD, *BAD, GOOD]) + "\n{oops\n")
    return [
        *("--data", f"{llava_dir['train']}:0.8", "--data", f"{bad}:0.2"),
        *("--image-folder", llava_dir["images"], "--tokenizer", llava_dir["tokenizer"]),
        *("--seq-len", "96", "--global-batch", "16", "--microbatches", "2", "--steps", "8"),
        *("--reference", "--pack", "--balance", "--skip-bad-samples", "--lr", "3e-3"),
        *("--checkpoint-dir", str(tmp / "ckpt"), "--metrics", str(tmp / "m.jsonl")),
    ]


def test_train_stop_resume_sees_the_same_batches_and_counts_skips(argv):
    first = _train(*argv, "--stop-after", "4")
    assert first.returncode == 0, first.stderr[-2000:]
    second = _train(*argv)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 4" in second.stdout
    rows = {}
    for line in Path(argv[argv.index("--metrics") + 1]).read_text().splitlines():
        row = json.loads(line)
        rows[row["step"]] = row  # the resumed run's row wins
    assert sorted(rows) == list(range(8))
    losses = [rows[s]["loss"] for s in range(8)]
    assert np.mean(losses[-2:]) < losses[0] - 0.5, losses

    # The batches an uninterrupted run reads, from the same resolved config.
    config = flags.parse_args(argv, prog="t")
    data, _ = llava_run.build(config.data, get_preset("tiny"), seq_len=96, seed=0, microbatches=2)
    stream = llava_run.DataStream(data, (2, 8, 8))
    for step in range(8):
        batch = stream.batch(step)
        want = stream.step_metrics(step)
        got = rows[step]
        assert got["supervised_tokens"] == batch["loss_mask"].sum(), step
        for key in ("tokens_per_step", "padding_fraction", "token_imbalance", "image_imbalance"):
            assert got[key] == pytest.approx(want[key], rel=1e-12), (step, key)
    stream.close()

    # The summary names every skipped reason with its count (the index pass's and the
    # loader's), read from the state the checkpoint carried over.
    summary = second.stdout[second.stdout.index("== hetjax run summary") :]
    data_line = next(line for line in summary.splitlines() if line.strip().startswith("data"))
    for reason in ("unknown_role", "no_conversations", "image_count", "malformed_json"):
        assert f"{REASONS[reason]} 1" in data_line, data_line
    # ... and the image slots with where they came from: --pack without the flag, so
    # derived from the data, as build() derived them here.
    slots = next(line for line in summary.splitlines() if line.strip().startswith("image slots"))
    assert slots.split("image slots", 1)[1].strip() == data.image_budget, slots
    assert "derived from the data (--pack)" in slots, slots


def test_bad_input_stops_before_training_with_one_line(argv, tmp_path):
    given = dict(zip(argv[::2], argv[1::2], strict=False))
    bad = [a for a in argv if a.endswith(":0.2")][0].rsplit(":", 1)[0]
    run = _train("--data", bad, "--tokenizer", given["--tokenizer"])
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"llava_train: error: {bad} record 1 (id role): turn 0 is from 'robot'; known roles: "
        "['assistant', 'gpt', 'human', 'system', 'user']"
    ]
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{")
    run = _train("--data", bad, "--tokenizer", str(broken))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1
    assert f"tokenizer {broken} does not load" in run.stderr
