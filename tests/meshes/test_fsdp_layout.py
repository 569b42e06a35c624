"""The ``fsdp`` degree: parsing, device counts, batch and width checks, the flag path."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from experiments import flags
from hetjax.meshes import (
    Layout,
    LayoutError,
    gathered_spec,
    logical_to_sharding,
    logical_to_spec,
    place_modules,
    validate_batch,
)
from hetjax.train.layouts import resolve_layouts
from models.config import get_preset
from models.mllm import MLLM


def test_fsdp_adds_devices_and_data_ranks_and_round_trips():
    layout = Layout.parse("fsdp=4,tp=2")
    assert layout == Layout(fsdp=4, tp=2)
    assert layout.num_devices == 8 and layout.devices_per_stage == 8
    assert layout.data_ranks == 4  # the batch splits over dp x fsdp
    assert layout.mesh_shape == (1, 1, 4, 1, 1, 2)  # (pp, dp // ep, fsdp, ep, cp, tp)
    assert Layout.parse(str(layout)) == layout
    assert str(Layout(dp=2)) == "dp=2,tp=1,cp=1,pp=1,ep=1"  # printed only where set


def test_fsdp_shards_the_model_width_and_is_gathered_without_it():
    spec = logical_to_spec(("layers", "embed", "mlp"), stage_mesh=True)
    assert spec == P(None, "fsdp", "tp")
    assert gathered_spec(spec) == P(None, None, "tp")
    assert gathered_spec(P(("dp", "fsdp", "ep"), "cp")) == P(("dp", "ep"), "cp")


def test_fsdp_ranks_sit_next_to_each_other_as_data_ranks():
    mesh = place_modules({"llm": "dp=2,fsdp=2,tp=2"}, placement="colocated")["llm"].mesh
    assert dict(mesh.shape) == dict(pp=1, dp=2, fsdp=2, ep=1, cp=1, tp=2)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: Layout.parse("fsdp=0", module="llm"), r"^llm: Layout: fsdp=0 must be a positive"),
        (
            lambda: place_modules({"llm": "fsdp=4,tp=2"}, jax_devices(4), placement="colocated"),
            r"^llm: dp\*fsdp\*tp\*cp\*pp = 1\*4\*2\*1\*1 = 8 but the module has 4 devices;"
            r" choose degrees whose product is 4",
        ),
        (
            lambda: validate_batch("vision", Layout(dp=2, fsdp=4), 12, 1),
            r"^vision: global batch 12 is not divisible by dp\*fsdp\*microbatches = 2\*4\*1 ="
            r" 8; use a batch that is a multiple of 8 \(e.g. 8 or 16\) or change dp/fsdp/",
        ),
        (
            lambda: tiny_graph("fsdp=3"),
            r"^llm: fsdp=3 does not divide the model width 64 of parameter"
            r" \['llm'\]\['blocks'\]\['attn_norm'\]\['scale'\] \(4, 64\) \(its 'embed' dim is"
            r" split over fsdp\); use fsdp in \[1, 2\] or a width that is a multiple of 3$",
        ),
    ],
    ids=["positive", "devices", "batch", "width"],
)
def test_bad_fsdp_is_one_line_naming_the_fix(call, match):
    with pytest.raises(LayoutError) as info:
        call()
    assert re.search(match, str(info.value)), str(info.value)
    assert "\n" not in str(info.value)


def test_layout_flag_takes_fsdp():
    cfg = flags.parse_args(
        ["--layout", "vision:dp=2,fsdp=4", "--layout", "llm:fsdp=4,tp=2"], prog="llava_train"
    )
    layouts = resolve_layouts(
        cfg.parallel.layouts, ["vision", "llm"], num_devices=8, mode="colocated"
    )
    assert layouts == {"vision": Layout(dp=2, fsdp=4), "llm": Layout(fsdp=4, tp=2)}


def jax_devices(n: int):
    return jax.devices()[:n]


def tiny_graph(llm: str):
    model = MLLM(get_preset("tiny"))  # LLM width 64
    return model.train_graph({"vision": Layout(dp=8), "llm": Layout.parse(llm)})


def test_a_mesh_without_fsdp_reads_as_fsdp_1():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))
    assert logical_to_sharding(("embed", "mlp"), mesh).spec == P(None, "tp")
