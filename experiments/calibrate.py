"""Calibrate the CPU profile's matmul curve: ``python -m experiments.calibrate``.

    python -m experiments.calibrate [--devices 8] [--tokens 2048] [--json out.json]

Times one jitted program per width ``w``: a ``[tokens, w] @ [w, w]`` matmul per device,
batch-sharded over all simulated devices at once (they share the host's cores, as in
training), median of 5 runs after a warm-up; per device FLOPs ``2 tokens w^2``. Fits
``R w / (w + k)`` (:func:`hetjax.plan.calibrate.fit_matmul`) and prints the fit, each
point, and the profile line to put in ``hetjax/plan/hardware.py``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

WIDTHS = (8, 16, 32, 64, 128, 256, 512)


@dataclasses.dataclass(frozen=True)
class CalibrateConfig:
    devices: int = 8  # simulated CPU devices
    tokens: int = 2048  # rows per device
    json: str | None = None  # write the points and the fit


def measure(tokens: int, devices: list) -> list[tuple[float, float, float]]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.asarray(devices), ("d",))
    out = []
    for w in WIDTHS:
        x = jax.device_put(jnp.ones((len(devices), tokens, w)), NamedSharding(mesh, P("d")))
        y = jax.device_put(jnp.ones((len(devices), w, w)), NamedSharding(mesh, P("d")))
        f = jax.jit(lambda a, b: jnp.einsum("dtw,dwv->dtv", a, b))
        jax.block_until_ready(f(x, y))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(f(x, y))
            times.append(time.perf_counter() - t0)
        out.append((float(w), 2.0 * tokens * w * w, statistics.median(times)))
    return out


def main(config: CalibrateConfig) -> dict:
    from experiments.cli import setup_devices

    devices = setup_devices(config.devices)
    from hetjax.plan.calibrate import fit_matmul

    points = measure(config.tokens, devices)
    fit = fit_matmul(points)
    for w, f, t in points:
        pred = f * (w + fit.knee) / (fit.tflops * 1e12 * w)
        print(
            f"width {int(w):4d}: {f / t / 1e9:8.2f} GFLOP/s per device measured, "
            f"{f / pred / 1e9:8.2f} fitted"
        )
    print(
        f"fit: R = {fit.tflops * 1e3:.2f} GFLOP/s per device, knee k = {fit.knee:.1f}, "
        f"worst point {fit.max_rel_error:.1%} off"
    )
    out = {
        "points": points,
        "tflops": fit.tflops,
        "knee": fit.knee,
        "max_rel_error": fit.max_rel_error,
        "devices": config.devices,
    }
    from experiments.cli import write_json

    write_json(config.json, out)
    return out


def parse_args(argv: list[str]) -> CalibrateConfig:
    from experiments.cli import OneLineParser, positive_int

    p = OneLineParser(prog="calibrate", description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=positive_int, default=8, help="simulated CPU devices")
    p.add_argument("--tokens", type=positive_int, default=2048, help="rows per device")
    p.add_argument("--json", default=None, help="write the points and the fit")
    return CalibrateConfig(**vars(p.parse_args(argv)))


if __name__ == "__main__":
    from experiments.cli import run_cli
    from experiments.plan import one_line

    run_cli(one_line(main, parse_args), "calibrate")
