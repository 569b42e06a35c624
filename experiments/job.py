"""Joining a multi-process training job from a :class:`hetjax.config.TrainConfig`.

What every entry point that trains does before it builds anything: join the job (JAX's
multi-controller runtime; nothing to join for one process), watch the peers, pick the
devices, check that every process has the same settings, and make a one-line error on
one process stop the others at once. Errors are :class:`~experiments.cli.ConfigError`
lines naming flags.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

from experiments.cli import ConfigError, accelerator_installed, setup_devices
from experiments.flags import errors_as_flags
from hetjax.config import TrainConfig

# Settings that are this process's own, so they may differ between processes: the
# coordinator's address as each process reaches it, its index, and the files that only
# process 0 writes.
PER_PROCESS = (
    *("distributed.coordinator", "distributed.process_id", "logging.metrics"),
    *("logging.timeline", "logging.tensorboard", "logging.profile_dir", "logging.plot"),
)


def join_job(config: TrainConfig, prog: str) -> tuple[bool, list]:
    """Joins the multi-process job (if any) and picks the devices."""
    # Before anything touches JAX: XLA reads it when it loads, and a multi-process run
    # must join its job before any backend exists.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from hetjax import distributed

    d = config.distributed
    with errors_as_flags():
        info = distributed.initialize(
            coordinator=d.coordinator,
            num_processes=d.num_processes,
            process_id=d.process_id,
            local_device_count=config.parallel.devices,
            cpu=not accelerator_installed(),
        )
    if info.is_multiprocess:
        # First: from here on, a process that stops takes the others with it.
        distributed.watch_peers()
    with stop_peers_on_error(info.is_multiprocess, prog):  # GPU counts may differ between machines
        devices = setup_devices(config.parallel.devices, multiprocess=info.is_multiprocess)
    return info.is_multiprocess, devices


def check_consistent(config: TrainConfig, devices: Sequence[Any]) -> None:
    """Every process of the job has the same :func:`shared_settings` (raised on every
    process alike, so every process reports it and exits normally).

    Raises:
        ConfigError: one line naming the first setting that differs and the processes.
    """
    from hetjax import distributed

    try:
        distributed.check_consistent("training config", shared_settings(config, devices))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def shared_settings(config: TrainConfig, devices: Sequence[Any]) -> dict[str, Any]:
    """What every process of a job must agree on: the config (dotted keys) minus
    :data:`PER_PROCESS`, plus the devices and JAX version each process found."""
    import jax

    import hetjax.config as hc

    flat = hc.flatten(hc.to_dict(config))
    shared = {k: v for k, v in flat.items() if k not in PER_PROCESS}
    shared["global devices"] = f"{len(devices)} x {devices[0].platform}"
    shared["jax"] = jax.__version__
    return shared


@contextlib.contextmanager
def stop_peers_on_error(multiprocess: bool, prog: str) -> Iterator[None]:
    """A :class:`ConfigError` raised inside may hit only some processes (another machine's
    GPUs or files differ): in a multi-process run it stops the others too, at once,
    instead of leaving them to wait in a collective for this one."""
    try:
        yield
    except ConfigError as e:
        if multiprocess:
            from hetjax import distributed

            distributed.fail(f"{prog}: error: {e}", exit_code=2)
        raise
