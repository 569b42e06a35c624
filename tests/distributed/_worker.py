"""One process of the launcher tests: ``python -m tests.distributed._worker [flags]``.

Joins the job through :func:`hetjax.distributed.initialize` (the ``HETJAX_*`` variables
that ``python -m hetjax.launch`` or the test sets), checks that it sees every process and
device, refuses a mismatched launch, then runs ``--steps`` jitted sums over a mesh of
ALL devices (a cross-process all-reduce over gloo) and prints each result. ``--fail``
makes one process raise, SIGKILL or SIGSTOP itself before its collective at ``--fail-step``, while
the others are already waiting in that collective.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from hetjax import distributed


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mismatch", action="store_true", help="process 1 uses seed + 1")
    p.add_argument("--fail", choices=("none", "raise", "kill", "stop"), default="none")
    p.add_argument("--fail-process", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=1)
    p.add_argument("--watchdog", type=float, default=0.0, help="watch_peers timeout; 0: off")
    p.add_argument("--heartbeat", type=int, default=60, help="JAX's heartbeat timeout")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    info = distributed.initialize(cpu=True, heartbeat_timeout_s=args.heartbeat)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    me, n, k = info.process_id, info.num_processes, info.local_device_count
    assert jax.process_index() == me and jax.process_count() == n, (jax.process_index(), n)
    assert len(jax.devices()) == n * k and jax.local_device_count() == k, jax.devices()
    seed = args.seed + (1 if args.mismatch and me == 1 else 0)
    distributed.check_consistent("worker config", {"seed": seed, "steps": args.steps})
    if args.watchdog > 0:
        distributed.watch_peers(args.watchdog, interval_s=0.5)
    print(f"process {me} of {n} sees {len(jax.devices())} devices", flush=True)

    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharded = NamedSharding(mesh, PartitionSpec("d"))
    total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    for step in range(args.steps):
        if args.fail != "none" and me == args.fail_process and step == args.fail_step:
            print(f"failing at {time.time():.3f}", flush=True)
            if args.fail in ("kill", "stop"):  # stop: alive but silent, a hung machine
                os.kill(os.getpid(), signal.SIGKILL if args.fail == "kill" else signal.SIGSTOP)
            raise RuntimeError(f"injected failure at step {step}")
        # Device d holds d + step: every process must see the same global sum.
        values = np.arange(n * k, dtype=np.float32) + step
        x = jax.make_array_from_callback(values.shape, sharded, values.__getitem__)
        print(f"step {step} sum {float(total(x).addressable_data(0)):.1f}", flush=True)


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:  # a refused launch: one line, like the trainers' run_cli
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
