"""Benchmark the boundary communicators against a naive ``jax.device_put``.

    python -m experiments.bench_boundary --json out.json

For every case of the boundary test matrix ({colocated, non-colocated} x {DP-Equal,
Fan-In, Fan-Out, non-dividing DP} x {destination tp > 1, cp > 1, a pipeline-stage
submesh}) it reports the activation bytes, the bytes the plan moves across islands and
inside the destination, the bytes a plain ``jax.device_put`` to the destination sharding
fetches from other devices, and the median wall time per transfer of both on this
machine (8 simulated CPU devices unless more are present).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# (placement, transform, variant, encoder layout, LLM layout, LLM tokens over cp);
# mirrors tests/boundary/cases.py.
CASES = (
    ("non-colocated", "dp_equal", "tp", "dp=2", "dp=2,tp=2", False),
    ("non-colocated", "dp_equal", "cp", "dp=2", "dp=2,cp=2", True),
    ("non-colocated", "dp_equal", "stage", "dp=2,pp=2", "dp=2,pp=2", False),
    ("non-colocated", "fan_in", "tp", "dp=4", "dp=2,tp=2", False),
    ("non-colocated", "fan_in", "cp", "dp=4", "dp=2,cp=2", False),
    ("non-colocated", "fan_in", "stage", "dp=4", "dp=2,pp=2", False),
    ("non-colocated", "fan_out", "tp", "dp=1,tp=2", "dp=2,tp=2", False),
    ("non-colocated", "fan_out", "cp", "dp=1", "dp=2,cp=2", True),
    ("non-colocated", "fan_out", "stage", "dp=1,pp=2", "dp=2,pp=2", False),
    ("non-colocated", "non_dividing", "tp", "dp=3", "dp=2,tp=2", False),
    ("non-colocated", "non_dividing", "cp", "dp=3", "dp=2,cp=2", True),
    ("non-colocated", "non_dividing", "stage", "dp=3", "dp=2,pp=2", False),
    ("colocated", "dp_equal", "tp", "dp=2,cp=2,tp=2", "dp=2,tp=4", False),
    ("colocated", "dp_equal", "cp", "dp=2,tp=4", "dp=2,cp=2,tp=2", True),
    ("colocated", "dp_equal", "stage", "dp=2,tp=2", "dp=2,pp=2", False),
    ("colocated", "fan_in", "tp", "dp=8", "dp=2,tp=4", False),
    ("colocated", "fan_in", "cp", "dp=8", "dp=2,cp=2,tp=2", True),
    ("colocated", "fan_in", "stage", "dp=8", "dp=2,tp=2,pp=2", False),
    ("colocated", "fan_out", "tp", "dp=2,tp=4", "dp=4,tp=2", False),
    ("colocated", "fan_out", "cp", "dp=2,tp=4", "dp=4,cp=2", False),
    ("colocated", "fan_out", "stage", "dp=2,tp=4", "dp=4,pp=2", False),
    ("colocated", "non_dividing", "tp", "dp=3,tp=2", "dp=2,tp=3", False),
    ("colocated", "non_dividing", "cp", "dp=3,tp=2", "dp=2,cp=3", True),
    ("colocated", "non_dividing", "stage", "dp=2,tp=3", "dp=3,pp=2", False),
)


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What to measure."""

    json: str | None = None  # where to write the results (a JSON list); None: print only
    batch: int = 24  # B; divisible by every dp in CASES (1, 2, 3, 4, 8)
    tokens: int = 96  # N; divisible by every cp in CASES (2, 3)
    width: int = 256  # D
    dtype: str = "float32"  # activation dtype
    repeats: int = 20  # timed transfers per case (median reported)


def _median_time(fn, x, repeats: int) -> float:
    jax.block_until_ready(fn(x))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(case: tuple, config: BenchConfig) -> dict:
    """Measures one case; returns one JSON row."""
    import jax.numpy as jnp

    from hetjax.boundary import Boundary, EdgeSpec, Endpoint, naive_device_put_bytes
    from hetjax.meshes import Layout, place_modules

    placement, transform, variant, enc, llm, shard_tokens = case
    layouts = {"enc": enc, "llm": llm}
    if placement == "colocated":
        devices = jax.devices()[: Layout.parse(enc).num_devices]
        meshes = place_modules(layouts, devices, placement="colocated")
    else:
        meshes = place_modules(layouts, placement="non-colocated")
    edge = EdgeSpec(
        Endpoint.source(meshes["enc"]),
        Endpoint.destination(meshes["llm"], shard_tokens=shard_tokens),
    )
    assert (edge.placement, edge.transform) == (placement, transform)
    shape = (config.batch, config.tokens, config.width)
    x = jax.device_put(jnp.ones(shape, config.dtype), edge.src.sharding)
    bnd = Boundary(edge)
    plan = bnd.plan(shape, config.dtype)
    dst = edge.dst.sharding
    return dict(
        case=f"{placement}-{transform}-{variant}",
        placement=placement,
        transform=transform,
        activation_bytes=plan.activation_bytes,
        cross_island_bytes=plan.cross_island_bytes,
        local_collective_bytes=plan.local_collective_bytes,
        naive_cross_island_bytes=naive_device_put_bytes(
            edge.src.sharding, dst, shape, config.dtype
        ),
        time_s=_median_time(bnd, x, config.repeats),
        naive_time_s=_median_time(lambda a: jax.device_put(a, dst), x, config.repeats),
    )


def check(rows: list[dict]) -> list[str]:
    """The issue's "done when" conditions; returns the violations."""
    bad = []
    for row in rows:
        want = row["activation_bytes"] if row["placement"] == "non-colocated" else 0
        if row["cross_island_bytes"] != want:
            bad.append(f"{row['case']}: cross_island_bytes {row['cross_island_bytes']} != {want}")
        if row["cross_island_bytes"] > row["naive_cross_island_bytes"]:
            bad.append(f"{row['case']}: cross_island_bytes above naive")
    return bad


def main(config: BenchConfig) -> list[dict]:
    """Runs every case, prints a table, writes JSON, and fails on a violated condition."""
    rows = [run_case(case, config) for case in CASES]
    header = f"{'case':34s} {'act B':>8s} {'cross B':>8s} {'local B':>8s} {'naive B':>8s}"
    print(header + f" {'time ms':>8s} {'naive ms':>8s}")
    for r in rows:
        print(
            f"{r['case']:34s} {r['activation_bytes']:8d} {r['cross_island_bytes']:8d}"
            f" {r['local_collective_bytes']:8d} {r['naive_cross_island_bytes']:8d}"
            f" {1e3 * r['time_s']:8.3f} {1e3 * r['naive_time_s']:8.3f}"
        )
    from experiments.cli import write_json

    write_json(config.json, rows)
    bad = check(rows)
    if bad:
        raise SystemExit("done-when conditions violated:\n" + "\n".join(bad))
    return rows


def parse_args() -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(BenchConfig):
        kind = int if field.type == "int" else str
        parser.add_argument(f"--{field.name}", type=kind, default=field.default)
    return BenchConfig(**vars(parser.parse_args()))


if __name__ == "__main__":
    config = parse_args()
    if jax.config.jax_platforms == "cpu":
        jax.config.update("jax_num_cpu_devices", max(8, jax.config.jax_num_cpu_devices))
    main(config)
