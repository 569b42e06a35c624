"""The FLOP rule (3x trained, 2x + attention frozen with a gradient through, 1x forward
only), the backward's recompute on top of it, and MFU/HFU: counted from graphs; the
models' forward FLOPs against hand formulas (MaxText's convention) and the compiled
program's matmuls."""

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


def test_frozen_with_a_gradient_through_adds_its_attention():
    # A frozen part's weight matmuls take one activation gradient, its QK^T / PV two.
    g = graph(("projector", "llm"))
    attention = {"vision": 20.0, "projector": 0.0, "llm": 200.0}
    assert flops.model_flops(g, FORWARD, attention) == {"vision": 320, "llm": 2000 + 200}
    got = flops.hardware_flops(g.with_recompute({"*": "none"}), FORWARD, attention)
    assert got == {"vision": 320, "llm": 2200}


def test_llm_forward_flops_match_maxtexts_formula():
    """MaxText's per-device training FLOPs for a dense decoder (``6 x (ffn + qkv +
    projection) x layers + 6 x embedding`` and ``3 x causal attention``), here with the
    head over the supervised tokens, against the tiny LLM's real parameters."""
    from models.llm import make_llm

    cfg = get_preset("tiny").llm
    b, l, sup = 3, 64, 50
    d, h, g, k, f, v = cfg.width, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.vocab
    ffn, qkv, proj = 2 * b * l * f * d * 3, 2 * b * l * d * (h + 2 * g) * k, 2 * b * l * d * h * k
    causal_attention = 4 * b * l * l * h * k / 2
    layer = jax_free_blocks(make_llm(cfg, {"image": 1}))
    assert layer == d * (h + 2 * g) * k + h * k * d + 3 * d * f  # the model's own weights
    training = (ffn + qkv + proj) * cfg.depth * 3 + 3 * 2 * sup * d * v
    training += 3 * causal_attention * cfg.depth
    assert 3 * cfg.forward_flops(b * l, l, sup) == training
    # Executed: the whole square (plain path), or half (a causal kernel); the head over a
    # capacity of 20 positions per row.
    whole = cfg.forward_flops(b * l, l, sup, executed=True, head_tokens=b * 20)
    assert whole == training / 3 + causal_attention * cfg.depth + 2 * d * v * (b * 20 - sup)
    half = cfg.forward_flops(b * l, l, sup, executed=True, attention_square=0.5)
    assert half == training / 3 + 2 * d * v * (b * l - sup)
    mllm = get_preset("tiny")
    attention = mllm.attention_flops(b, l)["llm"]
    assert attention == causal_attention * cfg.depth
    assert mllm.attention_flops(b, l, executed=True)["llm"] == 2 * attention


def jax_free_blocks(module) -> int:
    """Matmul weights of one block of a staged module: its stacked kernels (rank >= 3:
    layers x in x out; biases and norm scales are rank 2)."""
    import jax

    leaves = jax.tree.leaves(module.abstract_params()["blocks"])
    return sum(x.size for x in leaves if len(x.shape) >= 3) // module.num_layers


@pytest.mark.parametrize("preset", ["tiny", "llava-1.5-tiny"])
def test_encoder_flops_count_each_patch_and_the_class_token(preset):
    """Per sample: the blocks over every token they see (CLIP: the patches and its class
    token), bidirectional attention over that whole square, the patch embedding over the
    patches; the projector over the patches (the class token is dropped)."""
    from models.encoders import make_encoder

    cfg = get_preset(preset)
    enc, d_llm = cfg.vision, cfg.llm.width
    n, p = enc.block_tokens, enc.num_tokens
    assert n == p + (enc.kind == "clip")
    module = make_encoder("vision", enc)
    embed = enc.token_in_dim * enc.width
    attention = enc.depth * 4 * n * n * enc.width
    per_sample = 2 * n * enc.depth * jax_free_blocks(module) + attention + 2 * p * embed
    got = cfg.forward_flops(5, 64, 10, images_per_sample=2)
    assert got["vision"] == 10 * per_sample
    assert got["projector"] == 10 * p * 2 * (enc.width * d_llm + d_llm * d_llm)
    assert cfg.attention_flops(5, 64, images_per_sample=2)["vision"] == 10 * attention
    executed = cfg.forward_flops(5, 64, 10, images_per_sample=2, executed=True)
    assert {k: executed[k] for k in ("vision", "projector")} == {
        k: got[k] for k in ("vision", "projector")
    }  # no masked or skipped work in an encoder


def test_compiled_matmuls_are_the_executed_count():
    """HFU's count from the compiled program (:func:`hetjax.inspect.hlo.matmul_flops`) is
    the executed forward's 3x on the plain path (CPU, float32): every weight matmul three
    times, the whole attention square's QK^T / PV three times (forward, two gradients)."""
    import jax
    import jax.numpy as jnp

    from hetjax.inspect.hlo import matmul_flops
    from models.llm import make_llm

    cfg = get_preset("tiny").llm
    llm = make_llm(cfg, {"image": 1})
    blocks = llm.init(jax.random.key(0))["blocks"]
    b, l = 2, 16
    x = jax.random.normal(jax.random.key(1), (b, l, cfg.width))

    def loss(blocks, x):
        return jnp.sum(llm.apply_blocks(blocks, x) ** 2)

    text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(blocks, x).compile().as_text()
    executed = cfg.forward_flops(b * l, l, 0, executed=True, head_tokens=0)
    assert matmul_flops(text) == 3 * executed


def fmha_line(target: str, out: str, scores: str, mask: str) -> str:
    """An XLA:GPU HLO line of a cuDNN fused-attention call, as jax builds its config."""
    config = (
        '{"operation_queue_id":"0","cudnn_fmha_backend_config":{"algorithm":{"algo_id":"0",'
        '"math_type":"TENSOR_OP_MATH","tuning_knobs":{"17":"1","24":"0"},"is_cudnn_frontend":'
        'true,"workspace_size":"0"},"fmha_scale":0.125,"intermediate_tensor_shape":{'
        f'"element_type":"BF16","dimensions":[{scores}],"tuple_shapes":[],"layout":{{'
        '"minor_to_major":["3","2","1","0"]}},"is_flash_attention":true,'
        f'"mask_type":"{mask}"}}}}'
    )
    return (
        f"  %custom-call.7 = ({out}, f32[2,8,256]{{2,1,0}}, u8[0]{{0}}) custom-call("
        f"bf16[2,256,8,64]{{3,2,1,0}} %q, bf16[2,256,8,64]{{3,2,1,0}} %k), "
        f'custom_call_target="{target}", backend_config={config}'
    )


def test_fused_attention_calls_count_the_square_they_compute():
    from hetjax.inspect.hlo import fused_attention_flops

    out, scores = "bf16[2,256,8,64]{3,2,1,0}", '"2","8","256","256"'
    square = 2 * 8 * 256 * 256 * 64
    causal = fmha_line("__cudnn$fmhaSoftmax", out, scores, "CAUSAL")
    assert fused_attention_flops(causal) == 2 * 2 * square / 2
    biased = fmha_line("__cudnn$fmhaScaleBiasSoftmaxBackward", out, scores, "NO_MASK")
    assert fused_attention_flops(biased) == 5 * 2 * square
    padded = fmha_line("__cudnn$fmhaSoftmaxBackward", out, scores.replace(" ", ""), "PADDING")
    assert fused_attention_flops(padded.replace('":', '": ')) == 5 * 2 * square
    assert fused_attention_flops("  %d = f32[2,2]{1,0} dot(%a, %b)") is None
