"""End-to-end observability: ONE tiny 5-step ``llava_train`` run with every output on.

``--metrics``, ``--tensorboard``, ``--profile-steps 2:3 --profile-dir``, ``--plot`` and
``--timeline`` are given together (one run for the whole module, in the test process:
:func:`tests.launch.run_main`); each test checks one output against the JSONL or the
run's own facts. The run's stdout and stderr are not terminals (captured, as pipes
would be), so the progress output must be plain lines.
"""

import gzip
import json
import re
import struct

import pytest

from tests import launch
from tests.launch import check_ok as _check_ok

STEPS = 5
ARGS = ["--steps", str(STEPS), "--devices", "2", "--global-batch", "8"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("obs")
    out = {
        "metrics": tmp / "m.jsonl",
        "tensorboard": tmp / "tb",
        "profile": tmp / "prof",
        "plot": tmp / "curves.png",
        "timeline": tmp / "gantt.png",
    }
    args = [*ARGS, "--metrics", str(out["metrics"]), "--tensorboard", str(out["tensorboard"])]
    args += ["--profile-steps", "2:3", "--profile-dir", str(out["profile"])]
    args += ["--plot", str(out["plot"]), "--timeline", str(out["timeline"])]
    result = launch.run_main(launch.TRAIN, *args)
    _check_ok(result)
    rows = [json.loads(line) for line in out["metrics"].read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(STEPS))
    return result, rows, out


def test_tensorboard_scalars_are_the_jsonl_metrics(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, rows, out = run
    events = EventAccumulator(str(out["tensorboard"]))
    events.Reload()
    keys = set(rows[0]) - {"step"}
    assert keys <= set(events.Tags()["scalars"]), keys - set(events.Tags()["scalars"])
    for key in ("loss", "grad_norm/vision", "grad_norm/llm", "tokens_per_s"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == list(range(STEPS))
        # Event files hold float32: the JSONL's float64 values, rounded once.
        expected = [struct.unpack("f", struct.pack("f", r[key]))[0] for r in rows]
        assert [s.value for s in scalars] == expected, key


def test_profile_traces_steps_2_to_3_with_named_stage_programs(run):
    _, _, out = run
    runs = list((out["profile"] / "plugins" / "profile").iterdir())
    assert len(runs) == 1  # one trace, one process
    assert list(runs[0].glob("*.xplane.pb")), list(runs[0].iterdir())
    (trace,) = runs[0].glob("*.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    programs = {m for n in names for m in re.findall(r"jit_(\w+_s\d+_\w+)", n)}
    assert {"vision_s0_fwd", "vision_s0_bwd", "llm_s0_bwd", "llm_s0_update"} <= programs
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert steps == [2, 3]  # exactly the traced steps


def test_plot_is_a_png(run):
    from matplotlib.image import imread

    _, _, out = run
    assert out["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = imread(out["plot"]).shape
    assert width > 2 * height > 300  # three panels side by side


def test_timeline_trace_json_has_a_track_per_stage(run):
    _, _, out = run
    trace = out["timeline"].with_suffix(".trace.json")
    assert out["timeline"].exists() and trace.exists()
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == {"vision s0", "llm s0"}
    kinds = {e["cat"] for e in events if e["ph"] == "X"}
    assert {"F", "B"} <= kinds


def test_output_to_a_pipe_is_plain_lines(run):
    result, rows, out = run
    for text in (result.stdout, result.stderr):
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", text), repr(text[-500:])
    lines = [l for l in result.stderr.splitlines() if l.startswith("step ")]
    assert [l.split()[1] for l in lines] == ["1/5", "5/5"], result.stderr
    assert all(" tok/s  eta " in l for l in lines)
    assert f"loss {rows[-1]['loss']:.4f}" in lines[-1]
    assert "hetjax run summary" in result.stdout
    assert f"tensorboard: {out['tensorboard']}" in result.stdout
