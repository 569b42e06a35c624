"""The FLOP rule (3x trained, 2x frozen with a gradient through, 1x forward only), the
backward's recompute on top of it, and MFU: counted from graphs, nothing compiles."""

from __future__ import annotations

import pytest

from hetjax import Layout
from hetjax.runtime import flops
from models.config import get_preset
from models.mllm import MLLM

FORWARD = {"vision": 100.0, "projector": 10.0, "llm": 1000.0}


def graph(freeze, vision="dp=2,pp=2", llm="dp=2,pp=2", recompute="full"):
    model = MLLM(get_preset("tiny"))
    layouts = {"vision": Layout.parse(vision), "llm": Layout.parse(llm)}
    return model.train_graph(layouts, freeze=freeze).with_recompute({"*": recompute})


@pytest.mark.parametrize(
    ("freeze", "roles", "model"),
    [
        ((), "TTT", {"vision": 330, "llm": 3000}),
        (("vision",), "FTT", {"vision": 130, "llm": 3000}),
        (("vision", "llm"), "FTH", {"vision": 130, "llm": 2000}),
        (("vision", "projector"), "FFT", {"vision": 110, "llm": 3000}),
        (("projector", "llm"), "THH", {"vision": 320, "llm": 2000}),
    ],
)
def test_model_flops_follow_the_rule(freeze, roles, model):
    g = graph(freeze)
    letter = {flops.TRAINED: "T", flops.THROUGH: "H", flops.FORWARD: "F"}
    got = flops.part_roles(g)
    assert "".join(letter[got[p]] for p in ("vision", "projector", "llm")) == roles
    assert flops.model_flops(g, FORWARD) == model


def test_hardware_flops_add_the_recomputed_forwards():
    # vision pp=2: stage 0 forward only (frozen); stage 1 keeps its frozen blocks' output,
    # so its backward recomputes the projector only (10); llm pp=2: stage 0 recomputes
    # 1000/2, the sink's last stage nothing.
    g = graph(("vision",))
    assert g.stashes_frozen_output(("vision", 1)) and not g.stashes_frozen_output(("llm", 1))
    assert flops.hardware_flops(g, FORWARD) == {"vision": 130 + 10, "llm": 3000 + 500}
    # Vision trained, projector frozen: nothing is stashed after the encoder.
    g = graph(("projector",))
    assert not g.stashes_frozen_output(("vision", 1))
    assert flops.hardware_flops(g, FORWARD)["vision"] == 320 + 50 + 60
    full = flops.hardware_flops(graph(()), FORWARD)
    assert full == {"vision": 330 + 110, "llm": 3000 + 500}


def test_hardware_flops_by_recompute_policy():
    # none replays nothing; selective the attention core of every stage with a backward
    # (the sink's last stage too: its checkpoint policy recomputes inside its one program).
    assert flops.hardware_flops(graph((), recompute="none"), FORWARD) == flops.model_flops(
        graph(()), FORWARD
    )
    attention = {"vision": 20.0, "llm": 200.0}
    got = flops.hardware_flops(graph((), recompute="selective"), FORWARD, attention)
    assert got == {"vision": 330 + 20, "llm": 3000 + 200}


def test_peak_table_and_mfu():
    assert flops.peak_tflops("NVIDIA H200") == 989.4
    assert flops.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert flops.peak_tflops("cpu") is None
    model, hardware = {"vision": 2e12, "llm": 6e12}, {"vision": 3e12, "llm": 8e12}
    out = flops.throughput_metrics(
        model, hardware, 2.0, num_devices=8, module_devices={"vision": 4, "llm": 4}, peak=1.0
    )
    assert out["model_tflops_per_step"] == 8 and out["hardware_tflops_per_step"] == 11
    assert out["tflops_per_s"] == 4 and out["mfu"] == 0.5
    assert (out["mfu/vision"], out["mfu/llm"]) == (0.25, 0.75)
    assert "mfu" not in flops.throughput_metrics(
        model, hardware, 2.0, num_devices=8, module_devices={"vision": 4, "llm": 4}, peak=None
    )


def test_forward_flops_count_supervised_tokens_for_the_head():
    cfg = get_preset("tiny")
    a, b = cfg.forward_flops(8, 64, supervised=10), cfg.forward_flops(8, 64, supervised=20)
    assert a["vision"] == b["vision"] and a["projector"] == b["projector"]
    assert b["llm"] - a["llm"] == 10 * 2 * cfg.llm.vocab * cfg.llm.width
    assert 3 * cfg.vision.forward_flops_per_token() == cfg.vision.flops_per_token()
