"""The HLO collective parser on small programs compiled for the 8 CPU devices.

Each program is a jitted ``shard_map`` (or a GSPMD reduction) on a ``2 x 4`` mesh with
axes ``x, y``; every device holds a ``[4, 4]`` float32 block (64 bytes) of an
``[8, 16]`` array unless said otherwise.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hetjax.inspect import (
    KINDS,
    Collective,
    bytes_by_kind,
    collectives,
    dp_all_reduce_shapes,
    replica_groups,
    varied_axes,
)

BLOCK = 4 * 4 * 4  # bytes of one device's [4, 4] float32 block
ROWS_Y = ((0, 1, 2, 3), (4, 5, 6, 7))  # groups along y
COLS_X = ((0, 4), (1, 5), (2, 6), (3, 7))  # groups along x


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))


def compiled_collectives(mesh, f, in_spec, out_spec, x=None) -> list[Collective]:
    x = np.ones((8, 16), np.float32) if x is None else x
    fn = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=False))
    return collectives(fn.lower(x).compile().as_text(), mesh.size)


def only(items: list[Collective]) -> Collective:
    assert len(items) == 1, [c.line for c in items]
    return items[0]


def test_all_reduce(mesh):
    c = only(compiled_collectives(mesh, lambda a: lax.psum(a, "y"), P("x", "y"), P("x")))
    assert (c.kind, c.nbytes, c.shapes, c.groups, c.executions) == (
        "all-reduce",
        BLOCK,
        ((4, 4),),
        ROWS_Y,
        1,
    )
    assert varied_axes(c, mesh) == {"y"}
    assert "all-reduce(" in c.line
    assert c.dtypes == ("f32",)
    assert bytes_by_kind([c]) == {**dict.fromkeys(KINDS, 0), "all-reduce": BLOCK}


def test_all_gather_counts_its_result(mesh):
    def f(a):
        return lax.all_gather(a, "y", tiled=True)

    c = only(compiled_collectives(mesh, f, P("x", "y"), P("x")))
    assert (c.kind, c.nbytes, c.shapes, c.groups) == ("all-gather", 4 * BLOCK, ((16, 4),), ROWS_Y)
    assert varied_axes(c, mesh) == {"y"}


def test_reduce_scatter_counts_its_operand(mesh):
    def f(a):  # [4, 16] per device, scattered over y along dimension 1
        return lax.psum_scatter(a, "y", scatter_dimension=1, tiled=True)

    c = only(compiled_collectives(mesh, f, P("x"), P("x", "y")))
    assert (c.kind, c.shapes, c.groups) == ("reduce-scatter", ((4, 4),), ROWS_Y)
    assert c.nbytes == 4 * BLOCK  # the [4, 16] operand, not the [4, 4] result


def test_collective_permute_groups_are_its_pairs(mesh):
    ring = [(i, (i + 1) % 4) for i in range(4)]
    spec = P("x", "y")
    c = only(compiled_collectives(mesh, lambda a: lax.ppermute(a, "y", ring), spec, spec))
    assert (c.kind, c.nbytes, c.shapes) == ("collective-permute", BLOCK, ((4, 4),))
    assert set(c.groups) == {(s + 4 * r, t + 4 * r) for r in range(2) for s, t in ring}
    assert varied_axes(c, mesh) == {"y"}


def test_all_to_all(mesh):
    def f(a):  # [4, 16] per device: split dimension 1 over y, concatenate on it
        return lax.all_to_all(a, "y", 1, 1, tiled=True)

    c = only(compiled_collectives(mesh, f, P("x"), P("x")))
    assert (c.kind, c.nbytes, c.groups) == ("all-to-all", 4 * BLOCK, ROWS_Y)
    assert varied_axes(c, mesh) == {"y"}


def test_collective_in_fori_loop_counts_the_trip_count(mesh):
    def f(a):
        return lax.fori_loop(0, 5, lambda i, c: lax.psum(c, "x") * 0.5, a)

    c = only(compiled_collectives(mesh, f, P("x", "y"), P("x", "y")))
    assert (c.kind, c.groups, c.executions) == ("all-reduce", COLS_X, 5)
    assert varied_axes(c, mesh) == {"x"}
    assert bytes_by_kind([c])["all-reduce"] == 5 * BLOCK


def test_collectives_in_nested_scans_multiply_trip_counts(mesh):
    def f(a):
        def outer(c, _):
            inner = lax.scan(lambda c, _: (lax.psum(c, "y") * 0.5, None), c, None, length=5)
            return inner[0], None

        before = lax.psum(a, "x")  # outside the loops: once
        return lax.scan(outer, before, None, length=3)[0]

    items = compiled_collectives(mesh, f, P("x", "y"), P("x", "y"))
    assert sorted((c.executions, varied_axes(c, mesh) == {"y"}) for c in items) == [
        (1, False),
        (15, True),
    ]


def test_gspmd_reduction_spells_groups_as_mesh_axes(mesh):
    x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("x", "y")))
    f = jax.jit(lambda a: a.sum(0), out_shardings=NamedSharding(mesh, P(None)))
    hlo = f.lower(x).compile().as_text()
    (c,) = [c for c in collectives(hlo, mesh.size) if c.kind == "all-reduce"]
    assert c.groups == COLS_X and varied_axes(c, mesh) == {"x"}


@pytest.mark.parametrize(
    ("attr", "groups"),
    [
        ("replica_groups={{0,1},{2,3}}", ((0, 1), (2, 3))),
        ("replica_groups={}", ((0, 1, 2, 3),)),
        ("replica_groups=[2,2]<=[4]", ((0, 1), (2, 3))),
        ("replica_groups=[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
        ("replica_groups=mesh['a'=2,'b'=2] {'a'}", ((0, 2), (1, 3))),
        ("replica_groups=mesh[a=2,b=2]{b}", ((0, 1), (2, 3))),
        ("replica_groups=mesh[a=2,b=2], device_ids=(3,2,1,0) {b}", ((3, 2), (1, 0))),
        ("replica_groups=mesh[a=2,b=2], device_ids=([2,2]T(1,0)) {b}", ((0, 2), (1, 3))),
    ],
)
def test_replica_groups_reads_every_spelling(attr, groups):
    line = f"%ar = f32[4]{{0}} all-reduce(%p), channel_id=1, {attr}, to_apply=%add"
    assert replica_groups(line, 4) == groups


def test_replica_groups_refuses_a_line_without_groups():
    with pytest.raises(ValueError, match="cannot parse the replica groups"):
        replica_groups("%ar = f32[4]{0} all-reduce(%p), to_apply=%add", 4)


def test_dp_all_reduce_shapes_keeps_only_reductions_across_replicas():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("dp", "tp"))

    def f(a, b):  # a: [4, 4] per device, reduced over dp; b: [4, 2], reduced over tp
        return lax.psum(a, "dp"), lax.psum(b, "tp")

    fn = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(P("dp", "tp"), P("dp", "tp")),
            out_specs=(P(None, "tp"), P("dp")),
            check_vma=False,
        )
    )
    args = (np.ones((8, 16), np.float32), np.ones((8, 8), np.float32))
    hlo = fn.lower(*args).compile().as_text()
    assert dp_all_reduce_shapes(hlo, mesh) == Counter({(4, 4): 1})
    assert dp_all_reduce_shapes(hlo, mesh, replica_axes=("tp",)) == Counter({(4, 2): 1})


def test_dot_output_dtypes():
    from hetjax.inspect.hlo import dot_output_dtypes

    def f(a, b):
        wide = jnp.dot(a, b, preferred_element_type=jnp.float32)
        return wide, jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))

    a = jnp.ones((4, 8), jnp.bfloat16)
    found = dot_output_dtypes(jax.jit(f).lower(a, a.T).compile().as_text())
    assert set(found) == {"f32"} and sum(found.values()) >= 1


def test_matmul_flops_counts_the_dots_of_a_cpu_program():
    from hetjax.inspect.hlo import matmul_flops
    from tests.inspect.golden.make_gpu_hlo import MATMUL_FLOPS, program

    fn, args = program()
    assert matmul_flops(fn.lower(*args).compile().as_text()) == MATMUL_FLOPS


@pytest.mark.parametrize("codegen", ["cublas", "triton"])
def test_matmul_flops_counts_xla_gpu_matmuls(codegen):
    """The same program compiled by XLA:GPU (committed golden files, made on an H200 by
    ``golden/make_gpu_hlo.py``): its dots are cuBLASLt custom calls (``cublas``, Triton
    gemms off) or dots inside Triton gemm fusions (``triton``, XLA's default), in
    scanned while bodies; either way the count must be the hand count."""
    from pathlib import Path

    from hetjax.inspect.hlo import dot_output_dtypes, matmul_flops
    from tests.inspect.golden.make_gpu_hlo import MATMUL_FLOPS

    text = (Path(__file__).parent / "golden" / f"gpu_matmuls_{codegen}.hlo").read_text()
    assert ("__cublas$" in text) == (codegen == "cublas")
    assert ("__triton_nested_gemm_fusion" in text) == (codegen == "triton")
    assert matmul_flops(text) == MATMUL_FLOPS
    found = dot_output_dtypes(text)
    assert sum(found.values()) == 6  # forward loop body 1, backward loop body 2, einsum 3
    if codegen == "cublas":
        assert set(found) == {"bf16"}
