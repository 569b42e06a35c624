"""Layout parsing and its own checks."""

from __future__ import annotations

import pytest

from hetjax.meshes import Layout, LayoutError


def test_parse_fills_missing_degrees_with_one():
    layout = Layout.parse("dp=2,tp=2,pp=2")
    assert layout == Layout(dp=2, tp=2, cp=1, pp=2, ep=1)
    assert layout.num_devices == 8 and layout.devices_per_stage == 4


def test_parse_ignores_spaces_and_order_and_round_trips():
    layout = Layout.parse(" tp=4 , cp=2,dp=4, ep=2 ")
    assert layout == Layout(dp=4, tp=4, cp=2, ep=2)
    assert Layout.parse(str(layout)) == layout
    assert Layout.parse("") == Layout()


def test_mesh_shapes_group_experts_inside_dp():
    layout = Layout.parse("dp=4,ep=2,cp=2,tp=2,pp=3")
    assert layout.mesh_shape == (3, 2, 1, 2, 2, 2)  # (pp, dp // ep, fsdp, ep, cp, tp)
    assert layout.stage_shape == (2, 1, 2, 2, 2)
    assert layout.num_devices == 4 * 2 * 2 * 3  # ep adds no devices


@pytest.mark.parametrize(
    "text, match",
    [
        ("dp=2,xp=2", r"llm: cannot parse 'xp=2' .* keys from dp, fsdp, tp, cp, pp, ep"),
        ("dp2", r"llm: cannot parse 'dp2'"),
        ("dp=2,dp=4", r"llm: degree dp given twice .* keep one"),
        ("tp=two", r"llm: tp='two' .* is not an int; e.g. tp=2"),
        ("tp=0", r"llm: Layout: tp=0 must be a positive int"),
        ("dp=3,ep=2", r"llm: Layout\(dp=3,.*ep=2\): ep=2 must divide dp=3 .* divisor of 3"),
    ],
)
def test_parse_errors_name_the_module_and_the_fix(text, match):
    with pytest.raises(LayoutError, match=match):
        Layout.parse(text, module="llm")


def test_layout_error_is_a_value_error_on_one_line():
    with pytest.raises(ValueError) as info:
        Layout(dp=6, ep=4)
    assert "\n" not in str(info.value)
