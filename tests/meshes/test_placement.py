"""Placement: device order, colocated, island and homogeneous meshes, stage submeshes,
errors; island sizes (the run planner's ``islands``) become positions the same way."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from hetjax.meshes import (
    MESH_AXES,
    STAGE_AXES,
    Layout,
    LayoutError,
    island_positions,
    module_positions,
    place_modules,
)


def _ids(mesh) -> np.ndarray:
    return np.vectorize(lambda d: d.id)(mesh.devices)


def test_megatron_device_order_tp_innermost_pp_outermost():
    mm = place_modules({"llm": "dp=2,tp=2,pp=2"}, placement="colocated")["llm"]
    assert mm.mesh.axis_names == MESH_AXES
    assert mm.mesh.axis_types == (AxisType.Auto,) * 6
    ids = _ids(mm.mesh)
    assert ids.shape == (2, 2, 1, 1, 1, 2)
    assert ids[0, 0, 0, 0, 0].tolist() == [0, 1]  # a tp group is neighbouring devices
    assert ids[0, :, 0, 0, 0, 0].tolist() == [0, 2]  # then dp
    assert ids[:, 0, 0, 0, 0, 0].tolist() == [0, 4]  # pp outermost: stage 1 is devices 4-7
    stage1 = mm.stage_mesh(1)
    assert stage1.axis_names == STAGE_AXES and _ids(stage1).ravel().tolist() == [4, 5, 6, 7]
    assert mm.stage_mesh(-1) is stage1  # cached, and -1 is the last stage
    assert [d.id for d in mm.stage_devices(0)] == [0, 1, 2, 3]


def test_cp_and_ep_sit_between_tp_and_dp():
    mm = place_modules({"moe": "dp=4,ep=2,cp=2"}, placement="colocated")["moe"]
    ids = _ids(mm.mesh)[0, :, 0]  # (dp // ep, ep, cp, tp); fsdp = 1
    assert ids.shape == (2, 2, 2, 1)
    assert ids[0, 0, :, 0].tolist() == [0, 1]  # cp neighbours
    assert ids[0, :, 0, 0].tolist() == [0, 2]  # then ep
    assert ids[:, 0, 0, 0].tolist() == [0, 4]  # then dp


def test_fsdp_sits_between_ep_and_dp():
    mm = place_modules({"llm": "dp=2,fsdp=2,tp=2"}, placement="colocated")["llm"]
    ids = _ids(mm.mesh)[0, :, :, 0, 0]  # (dp, fsdp, tp)
    assert ids[0, :, 0].tolist() == [0, 2]  # fsdp after tp
    assert ids[:, 0, 0].tolist() == [0, 4]  # then dp


def test_colocated_modules_share_one_flat_device_order():
    meshes = place_modules({"vit": "dp=8", "llm": "dp=2,tp=4"}, placement="colocated")
    vit, llm = meshes["vit"], meshes["llm"]
    assert vit.devices == llm.devices == tuple(jax.devices())
    assert list(vit.mesh.devices.flat) == list(llm.mesh.devices.flat)
    assert vit.layout == Layout(dp=8)


def test_islands_are_disjoint_and_consecutive_by_default():
    meshes = place_modules({"vit": "dp=2", "llm": "dp=2,tp=2"}, placement="non-colocated")
    assert meshes["vit"].positions == (0, 1)
    assert meshes["llm"].positions == (2, 3, 4, 5)
    assert [d.id for d in meshes["llm"].mesh.devices.flat] == [2, 3, 4, 5]


def test_islands_at_given_offsets_or_positions():
    meshes = place_modules(
        {"vit": "dp=3", "llm": "tp=2,pp=2"},
        placement="non-colocated",
        islands={"vit": 5, "llm": [0, 1, 2, 3]},
    )
    assert meshes["vit"].positions == (5, 6, 7)
    assert [d.id for d in meshes["llm"].stage_devices(1)] == [2, 3]


def test_homogeneous_puts_the_other_modules_on_the_sinks_first_stage():
    meshes = place_modules(
        {"vit": "dp=2,tp=2", "llm": "dp=2,tp=2,pp=2"}, placement="homogeneous", sink="llm"
    )
    assert meshes["llm"].positions == tuple(range(8))
    assert meshes["vit"].positions == (0, 1, 2, 3)
    assert meshes["vit"].devices == meshes["llm"].stage_devices(0)


def test_island_sizes_place_like_island_positions():
    layouts = {"vit": Layout.parse("dp=2"), "llm": Layout.parse("dp=2,tp=2")}
    sizes = island_positions({"llm": 4, "vit": 2}, layouts, 8)  # assigned in this order
    assert sizes == {"llm": (0, 1, 2, 3), "vit": (4, 5)}
    assert module_positions(layouts, 8, placement="non-colocated", islands=sizes) == sizes


def test_explicit_device_list_is_the_canonical_order():
    devices = jax.devices()[::-1][:4]
    mm = place_modules({"llm": "dp=2,tp=2"}, devices, placement="colocated")["llm"]
    assert [d.id for d in mm.mesh.devices.flat] == [7, 6, 5, 4]


@pytest.mark.parametrize(
    "layouts, kwargs, match",
    [
        (
            {"vit": "dp=4", "llm": "dp=2,tp=2"},
            dict(placement="non-colocated", islands={"vit": 0, "llm": 2}),
            r"llm: island overlaps vit's island at device positions \[2, 3\]; give disjoint",
        ),
        (
            {"vit": "dp=4", "llm": "dp=2,tp=4"},
            dict(placement="non-colocated"),
            r"llm: island at positions 4..11 exceeds the 8 devices",
        ),
        (
            {"vit": "dp=2", "llm": "dp=2"},
            dict(placement="non-colocated", islands={"vit": 0}),
            r"islands name modules \['vit'\] but layouts name \['llm', 'vit'\]",
        ),
        (
            {"vit": "dp=2", "llm": "dp=2,tp=2"},
            dict(placement="non-colocated", islands={"vit": [0, 1, 2], "llm": 4}),
            r"vit: dp\*tp\*cp\*pp = 2\*1\*1\*1 = 2 but the module has 3 devices",
        ),
        (
            {"vit": "dp=8", "llm": "dp=2,tp=2"},
            dict(placement="colocated"),
            r"llm: dp\*tp\*cp\*pp = 2\*2\*1\*1 = 4 but the module has 8 devices; choose",
        ),
        (
            {"vit": "dp=8"},
            dict(placement="colocated", islands={"vit": 0}),
            r"colocated modules share all devices; drop islands=",
        ),
        ({"vit": "dp=8"}, dict(placement="mixed"), r"placement='mixed' is unknown"),
        (
            {"vit": "dp=4", "llm": "dp=4,pp=2"},
            dict(placement="homogeneous"),
            r"homogeneous placement needs sink= naming one of \['llm', 'vit'\], not None",
        ),
        (
            {"vit": "dp=8", "llm": "dp=4,pp=2"},
            dict(placement="homogeneous", sink="llm"),
            r"vit: dp\*tp\*cp\*pp = 8\*1\*1\*1 = 8 but the module has 4 devices",
        ),
        ({"moe": "dp=2,ep=4"}, dict(placement="colocated"), r"moe: Layout\(.*\): ep=4 must"),
        (
            {"vit": "dp=2", "llm": "dp=2"},
            dict(placement="non-colocated", islands={"vit": [0, 0], "llm": 2}),
            r"vit: island \(0, 0\) repeats a device",
        ),
    ],
)
def test_placement_errors(layouts, kwargs, match):
    with pytest.raises(LayoutError, match=match):
        place_modules(layouts, **kwargs)


def test_missing_stage_is_an_error():
    mm = place_modules({"llm": "dp=4,pp=2"}, placement="colocated")["llm"]
    with pytest.raises(LayoutError, match=r"llm: pipeline stage 2 does not exist with pp=2"):
        mm.stage_mesh(2)
