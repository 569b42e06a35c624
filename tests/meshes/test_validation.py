"""Shape validation: batch vs dp x microbatches, sizes vs tp / pp / ep / cp."""

from __future__ import annotations

import pytest

from hetjax.meshes import Layout, LayoutError, validate_batch, validate_divisible

LLM = Layout.parse("dp=2,tp=4,cp=2,pp=2,ep=2")


def test_valid_shapes_pass():
    validate_batch("llm", LLM, global_batch=16, microbatches=4)
    validate_divisible(
        "llm", LLM, heads=8, kv_heads=4, mlp=128, vocab=256, layers=4, experts=8, seq=64
    )


def test_batch_not_divisible_by_dp_times_microbatches():
    with pytest.raises(
        LayoutError,
        match=r"^llm: global batch 12 is not divisible by dp\*microbatches = 2\*4 = 8; use a"
        r" batch that is a multiple of 8 \(e.g. 8 or 16\)",
    ):
        validate_batch("llm", LLM, global_batch=12, microbatches=4)


def test_microbatches_must_be_positive():
    with pytest.raises(LayoutError, match="llm: microbatches=0 must be >= 1"):
        validate_batch("llm", LLM, global_batch=12, microbatches=0)


@pytest.mark.parametrize(
    "size, match",
    [
        (dict(heads=6), r"llm: heads=6 is not divisible by tp=4 \(attention heads .*\); use tp"),
        (dict(kv_heads=2), r"llm: kv_heads=2 is not divisible by tp=4 .* use tp in \[1, 2\]"),
        (dict(mlp=130), r"llm: mlp=130 is not divisible by tp=4"),
        (dict(vocab=1001), r"llm: vocab=1001 is not divisible by tp=4"),
        (dict(layers=3), r"llm: layers=3 is not divisible by pp=2 \(layers are split evenly"),
        (dict(experts=3), r"llm: experts=3 is not divisible by ep=2"),
        (dict(seq=63), r"llm: seq=63 is not divisible by cp=2"),
    ],
)
def test_indivisible_sizes_name_module_numbers_and_fix(size, match):
    with pytest.raises(LayoutError, match=match) as info:
        validate_divisible("llm", LLM, **size)
    assert "\n" not in str(info.value)
