"""Transfer plans as data: leaders, lanes, bytes, reverse plans and edge validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hetjax.boundary import (
    BoundaryError,
    EdgeSpec,
    Endpoint,
    make_plan,
    naive_device_put_bytes,
)
from hetjax.meshes import place_modules

SHAPE = (12, 6, 8)


def _edge(enc: str, llm: str, placement: str = "non-colocated", **dst) -> EdgeSpec:
    meshes = place_modules({"enc": enc, "llm": llm}, placement=placement)
    return EdgeSpec(Endpoint.source(meshes["enc"]), Endpoint.destination(meshes["llm"], **dst))


def test_transform_from_dp_degrees():
    assert _edge("dp=2", "dp=2,tp=2").transform == "dp_equal"
    assert _edge("dp=4", "dp=2,tp=2").transform == "fan_in"
    assert _edge("dp=1", "dp=2,tp=2").transform == "fan_out"
    assert _edge("dp=3", "dp=2,tp=2").transform == "non_dividing"
    # Experts share the data-parallel ranks: dp=4,ep=2 still has 4 batch slices.
    assert _edge("dp=4", "dp=4,ep=2").transform == "dp_equal"


def test_placement_from_device_sets():
    assert _edge("dp=2", "dp=2,tp=2").placement == "non-colocated"
    assert _edge("dp=8", "dp=2,tp=4", "colocated").placement == "colocated"


def test_non_colocated_leaders_and_lanes():
    # Fan-In 4 -> 2 onto dp=2,tp=2: devices 0-3 are the encoder, 4-7 the LLM.
    plan = make_plan(_edge("dp=4", "dp=2,tp=2"), SHAPE, jnp.float32)
    assert [(lane.devices, lane.leader) for lane in plan.lanes] == [((4, 5), 4), ((6, 7), 6)]
    assert [(c.src, c.dst, c.region[0]) for c in plan.copies] == [
        (0, 4, (0, 3)),
        (1, 4, (3, 6)),
        (2, 6, (6, 9)),
        (3, 6, (9, 12)),
    ]
    assert plan.local.kind == "broadcast" and plan.local.axes == ("tp",)
    assert plan.local.nbytes == plan.activation_bytes  # one extra copy per tp=2 lane
    assert plan.cross_island_bytes == plan.activation_bytes


def test_source_leader_is_last_replica_of_its_lane():
    # Source dp=1,tp=2 on devices 0,1: both hold everything; the last one sends.
    plan = make_plan(_edge("dp=1,tp=2", "dp=2,tp=2"), SHAPE, jnp.float32)
    assert {c.src for c in plan.copies} == {1}
    assert plan.cross_island_bytes == plan.activation_bytes


def test_reverse_plan_follows_the_same_leaders_backwards():
    plan = make_plan(_edge("dp=1,tp=2", "dp=2,tp=2"), SHAPE, jnp.float32)
    back = plan.reverse()
    assert back.edge == plan.edge.reversed()
    assert {c.src for c in back.copies} == {lane.leader for lane in plan.lanes}
    assert [lane.leader for lane in back.lanes] == [1]
    assert back.local.kind == "broadcast" and back.local.axes == ("tp",)
    assert back.cross_island_bytes == back.activation_bytes
    assert back.reverse() is plan  # plans are cached data


def test_cp_token_split_makes_dp_times_cp_lanes():
    plan = make_plan(_edge("dp=2", "dp=2,cp=2", shard_tokens=True), SHAPE, jnp.bfloat16)
    assert len(plan.lanes) == 4 and plan.local.kind == "none"
    assert plan.cross_island_bytes == plan.activation_bytes == 12 * 6 * 8 * 2


def test_colocated_plans():
    gather = make_plan(_edge("dp=8", "dp=2,tp=4", "colocated"), (16, 6, 8), jnp.float32)
    assert (gather.mode, gather.local.kind, gather.copies) == ("traced", "all_gather", ())
    # Each device keeps its 1/8 and receives the other 3/8 of its dp half.
    assert gather.local_collective_bytes == 8 * 3 * (2 * 6 * 8 * 4)
    same = make_plan(_edge("dp=2,cp=2,tp=2", "dp=2,tp=4", "colocated"), SHAPE, jnp.float32)
    assert (same.mode, same.local.kind, same.local_collective_bytes) == ("traced", "none", 0)
    narrow = make_plan(_edge("dp=2,tp=4", "dp=4,tp=2", "colocated"), SHAPE, jnp.float32)
    assert (narrow.local.kind, narrow.local_collective_bytes) == ("slice", 0)
    for plan in (gather, same, narrow):
        assert plan.cross_island_bytes == 0


def test_colocated_stage_destination_fetches_only_missing_blocks():
    # Encoder dp=8 on 8 devices -> LLM stage 0 (devices 0-3, dp=2,tp=2).
    edge = _edge("dp=8", "dp=2,tp=2,pp=2", "colocated")
    plan = make_plan(edge, (16, 6, 8), jnp.float32)
    assert plan.mode == "copies" and plan.cross_island_bytes == 0
    assert all(not c.cross_island for c in plan.copies)
    # Devices 0 and 1 already hold rows 0-2 and 2-4 of their half [0, 8): kept locally.
    assert [(c.src, c.region[0]) for c in plan.copies if c.nbytes == 0] == [
        (0, (0, 2)),
        (1, (2, 4)),
    ]
    naive = naive_device_put_bytes(edge.src.sharding, edge.dst.sharding, plan.shape, plan.dtype)
    assert plan.local_collective_bytes == naive


def test_naive_bytes_count_every_replica():
    edge = _edge("dp=2", "dp=2,tp=2")
    naive = naive_device_put_bytes(edge.src.sharding, edge.dst.sharding, SHAPE, np.float32)
    assert naive == 2 * 12 * 6 * 8 * 4  # every tp replica fetches its shard across islands


def test_summary_is_plain_data():
    summary = make_plan(_edge("dp=3", "dp=2,tp=2"), SHAPE, jnp.float32).summary()
    assert summary["transform"] == "non_dividing" and summary["copies"] == 4
    assert summary["cross_island_bytes"] == summary["activation_bytes"]


def test_partially_shared_devices_are_rejected():
    enc = place_modules({"enc": "dp=4"}, placement="non-colocated")["enc"]
    llm = place_modules({"llm": "dp=2,tp=2"}, jax.devices()[2:6], placement="colocated")["llm"]
    with pytest.raises(BoundaryError, match="enc->llm: the modules share 2 of"):
        EdgeSpec(Endpoint.source(enc), Endpoint.destination(llm))


def test_batch_not_divisible_names_the_edge_and_fix():
    edge = _edge("dp=3", "dp=2,tp=2")
    with pytest.raises(BoundaryError, match=r"enc stage 0 -> llm stage 0: batch 8 .* 3 slices"):
        make_plan(edge, (8, 6, 8), jnp.float32)
    with pytest.raises(BoundaryError, match="multiple of 3"):
        make_plan(edge, (8, 6, 8), jnp.float32)


def test_tokens_not_divisible_by_cp():
    edge = _edge("dp=2", "dp=2,cp=2", shard_tokens=True)
    with pytest.raises(BoundaryError, match=r"dim 1 5 is not divisible by the 2 slices"):
        make_plan(edge, (4, 5, 8), jnp.float32)


def test_spec_longer_than_activation():
    meshes = place_modules({"enc": "dp=2", "llm": "dp=2,cp=2"}, placement="non-colocated")
    dst = Endpoint.of(meshes["llm"], P("dp", "cp", None, None), stage=0)
    with pytest.raises(BoundaryError, match="has 4 entries but the activation has shape"):
        make_plan(EdgeSpec(Endpoint.source(meshes["enc"]), dst), (4, 6, 8), jnp.float32)
