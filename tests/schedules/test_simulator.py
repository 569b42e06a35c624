"""Timeline simulator: closed-form makespans and bubbles, colocation, and the PNG chart."""

import itertools
import struct
import zlib

import numpy as np
import pytest

from hetjax.schedules import (
    ModuleGraph,
    gpipe,
    graph_one_f_one_b,
    one_f_one_b,
    simulate,
    three_phase,
)
from hetjax.schedules.gantt import action_colour
from hetjax.schedules.png import PNG_SIGNATURE, encode_png, read_png_size

PM = list(itertools.product(range(1, 7), range(1, 13)))


@pytest.mark.parametrize(("num_stages", "num_mb"), PM)
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_unit_durations_match_closed_form(make, num_stages, num_mb):
    timeline = simulate(make(num_stages, num_mb), {"F": 1, "B": 1})
    assert timeline.makespan == 2 * (num_mb + num_stages - 1)
    expected = (num_stages - 1) / (num_mb + num_stages - 1)
    assert timeline.bubble == pytest.approx([expected] * num_stages, abs=1e-12)


@pytest.mark.parametrize(("num_stages", "num_mb"), [(4, 8), (4, 2), (6, 12), (3, 3)])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_backward_twice_forward(make, num_stages, num_mb):
    timeline = simulate(make(num_stages, num_mb), {"F": 1.0, "B": 2.0})
    assert timeline.makespan == 3 * (num_mb + num_stages - 1)
    assert all(timeline.busy(s) == 3 * num_mb for s in range(num_stages))


def test_recv_cost_adds_per_hop():
    timeline = simulate(gpipe(4, 1), {"F": 1, "B": 1, "RECV_F": 0.5, "RECV_B": 0.25})
    assert timeline.makespan == pytest.approx(8 + 3 * 0.5 + 3 * 0.25)


def test_duration_lookup_precedence_and_callable():
    sched = one_f_one_b(2, 2, module="llm")
    table = {("F", 1): 3.0, ("F", "llm"): 2.0, "F": 100.0, "B": 1.0}
    rows = simulate(sched, table).items
    assert {t.duration for t in rows[0] if t.action.kind == "F"} == {2.0}
    assert {t.duration for t in rows[1] if t.action.kind == "F"} == {3.0}
    by_fn = simulate(sched, lambda a: 1.0 if a.is_compute else 0.0)
    assert by_fn.makespan == 2 * (2 + 2 - 1)


@pytest.mark.parametrize(
    ("durations", "match"), [({"F": 1}, "no duration for B"), ({"F": 1, "B": -1}, ">= 0")]
)
def test_bad_durations(durations, match):
    with pytest.raises(ValueError, match=match):
        simulate(gpipe(2, 2), durations)


def test_timing_respects_every_dependency():
    graph = ModuleGraph({"vision": 2, "audio": 1, "llm": 2}, [("vision", "llm"), ("audio", "llm")])
    timeline = simulate(graph_one_f_one_b(graph, 6), {"F": 1, "B": 2, "SEND_F": 0.1})
    send_end = {}
    for t in timeline.in_start_order():
        if t.action.is_send:
            send_end[t.action.transfer_key()] = t.end
        if t.action.is_recv:
            assert t.start >= send_end[t.action.transfer_key()]
    starts = [t.start for t in timeline.in_start_order()]
    assert starts == sorted(starts)
    for row in timeline.items:
        assert all(a.end <= b.start for a, b in zip(row, row[1:], strict=False))


def test_sink_alignment_saves_memory_without_slowing_down():
    graph = ModuleGraph({"vision": 2, "audio": 1, "llm": 2}, [("vision", "llm"), ("audio", "llm")])
    source = graph_one_f_one_b(graph, 8, align="source")
    sink = graph_one_f_one_b(graph, 8, align="sink")
    assert sum(sink.max_live) < sum(source.max_live)
    durations = {"F": 1, "B": 2}
    assert simulate(sink, durations).makespan == simulate(source, durations).makespan


@pytest.mark.parametrize(("llm_pp", "num_mb"), [(1, 1), (2, 4), (4, 8), (4, 2)])
def test_three_phase_phases_and_colocation(llm_pp, num_mb):
    durations = {
        "F": 1.0,
        "B": 2.0,
        ("F", "vision"): 0.5,
        ("B", "vision"): 1.0,
        ("F", "audio"): 0.25,
    }
    durations[("B", "audio")] = 0.5
    timeline = simulate(three_phase(["vision", "audio"], llm_pp, num_mb), durations)
    enc_f, llm_phase = 0.75 * num_mb, 3.0 * (num_mb + llm_pp - 1)
    assert timeline.phase_ends == pytest.approx(
        (enc_f, enc_f + llm_phase, enc_f + llm_phase + 1.5 * num_mb)
    )
    busy = sorted(
        (t.start, t.end, t.action.stage)
        for row in timeline.items[:2]  # encoders share every device: never overlap anything
        for t in row
        if t.duration > 0
    )
    others = [(t.start, t.end) for row in timeline.items for t in row if t.duration > 0]
    for start, end, stage in busy:
        overlapping = [(s, e) for s, e in others if s < end and start < e]
        assert overlapping == [(start, end)], stage
    assert timeline.schedule.finalize == "together"


def test_png_is_valid(tmp_path):
    timeline = simulate(three_phase(["vision"], 3, 6), {"F": 1, "B": 2})
    path = timeline.to_png(tmp_path / "chart.png", width=640, row_height=20)
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    height = 2 * 6 + 4 * (20 + 1) + 1
    assert read_png_size(data) == (640, height)
    pixels = _decode_rgb(data)
    assert pixels.shape == (height, 640, 3)
    colours = {tuple(p) for p in pixels.reshape(-1, 3)}
    assert (255, 255, 255) in colours
    assert action_colour("F", 0) in colours and action_colour("B", 3) in colours


def test_chrome_trace_has_every_action_at_its_simulated_time(tmp_path):
    import json

    timeline = simulate(three_phase(["vision"], 2, 3), {"F": 1, "B": 2, "SEND_F": 0.5})
    path = timeline.to_chrome_trace(tmp_path / "t.trace.json")
    events = json.loads(path.read_text())["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert tracks == {0: "vision s0", 1: "llm s0", 2: "llm s1"}
    slices = [e for e in events if e["ph"] == "X"]
    timed = [t for row in timeline.items for t in row]
    assert len(slices) == len(timed)
    assert sorted((e["tid"], e["ts"], e["dur"]) for e in slices) == sorted(
        (t.action.stage, t.start * 1e6, t.duration * 1e6) for t in timed
    )
    assert any(e["name"] == "F mb2" and e["tid"] == 2 for e in slices)
    assert any(e["name"].startswith("SEND_F mb0 -> ") for e in slices)
    ends = [e["ts"] for e in events if e["ph"] == "i"]
    assert ends == [end * 1e6 for end in timeline.phase_ends]


def test_encode_png_round_trip():
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(5, 7, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_decode_rgb(encode_png(pixels)), pixels)
    with pytest.raises(ValueError, match="uint8"):
        encode_png(np.zeros((2, 2), np.uint8))


def _decode_rgb(data: bytes) -> np.ndarray:
    """Decode our own PNGs (8-bit RGB, filter 0), checking every chunk's CRC."""
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
            assert body[8:] == bytes([8, 2, 0, 0, 0])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert kind == b"IEND"
    width, height = size
    raw = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(height, 1 + 3 * width)
    assert (raw[:, 0] == 0).all()
    return raw[:, 1:].reshape(height, width, 3)
