"""Joining a multi-process job: where the settings come from, and ``jax.distributed``.

:func:`initialize` wraps ``jax.distributed.initialize`` and finds its arguments in one
place, in this order: explicit arguments (the trainer's ``--coordinator``,
``--num-processes``, ``--process-id`` flags), the ``HETJAX_*`` variables that
``python -m hetjax.launch`` sets, a SLURM / Open MPI job that JAX detects by itself, or
else a plain single-process run. :func:`resolve` makes that decision without touching
JAX, so it can be tested and its errors are one line naming the fix. On CPU it selects
gloo collectives, which JAX does not default to in every version.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping
from typing import Any, Literal

from .process import record
from .watchdog import install_guard

ENV_COORDINATOR = "HETJAX_COORDINATOR"
ENV_NUM_PROCESSES = "HETJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "HETJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "HETJAX_LOCAL_DEVICES"


@dataclasses.dataclass(frozen=True)
class DistributedInfo:
    """Where this process stands in the job."""

    process_id: int  # this process's index, 0 .. num_processes - 1
    num_processes: int  # processes in the job; 1 for a single-process run
    coordinator: str | None  # HOST:PORT of process 0's service; None if single or detected
    local_device_count: int | None  # devices requested per process; None = all visible
    source: Literal["flags", "env", "cluster", "single"]  # where the settings came from

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1


_info: DistributedInfo | None = None


def resolve(
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> DistributedInfo:
    """Decides how this process joins the job, without touching JAX.

    Each setting comes from its argument if given, else from ``HETJAX_*`` variables; if
    none is set, a SLURM or Open MPI job with more than one task means JAX detects the
    rest, and otherwise the run is single-process.

    Raises:
        ValueError: a partial or invalid setting (one line naming the fix).
    """
    env = os.environ if environ is None else environ
    explicit = (coordinator, num_processes, process_id) != (None, None, None)
    coordinator = coordinator or env.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(env, ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(env, ENV_PROCESS_ID)
    if local_device_count is None:
        local_device_count = _env_int(env, ENV_LOCAL_DEVICES)
    if local_device_count is not None and local_device_count < 1:
        raise ValueError(f"local device count must be at least 1, got {local_device_count}")
    given = {
        "coordinator": coordinator,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    if all(v is None for v in given.values()):
        cluster = _cluster_env(env)
        if cluster is None:
            return DistributedInfo(0, 1, None, local_device_count, "single")
        return DistributedInfo(cluster[1], cluster[0], None, local_device_count, "cluster")
    missing = [flag for flag, v in given.items() if v is None]
    if missing:
        have = ", ".join(flag for flag, v in given.items() if v is not None)
        raise ValueError(
            f"{have} given but {' and '.join(missing)} missing: pass all three (or start "
            "the processes with python -m hetjax.launch)"
        )
    assert num_processes is not None and process_id is not None and coordinator is not None
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"process_id={process_id} with num_processes={num_processes}: the id must be "
            f"in 0..{num_processes - 1}"
        )
    if ":" not in coordinator:
        raise ValueError(
            f"coordinator={coordinator!r} must be HOST:PORT, e.g. coordinator='10.0.0.1:1234'"
        )
    source = "flags" if explicit else "env"
    return DistributedInfo(process_id, num_processes, coordinator, local_device_count, source)


def initialize(
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
    cpu: bool = False,
    heartbeat_timeout_s: int = 60,
    shutdown_timeout_s: int = 300,
) -> DistributedInfo:
    """Joins the multi-process job (if any); call first, before anything touches JAX.

    Args:
        coordinator: HOST:PORT of process 0's coordination service.
        num_processes: processes in the job.
        process_id: this process's index.
        local_device_count: devices per process: how many CPU devices to simulate
            (``jax_num_cpu_devices``); GPUs per process are chosen by the launcher
            (``CUDA_VISIBLE_DEVICES``) or by JAX's SLURM detection.
        cpu: run on CPU devices (sets ``jax_platforms=cpu``). Multi-process CPU runs,
            also ones the launcher marked with ``JAX_PLATFORMS=cpu``, use gloo collectives.
        heartbeat_timeout_s: JAX's own limit after which a silent process is declared
            dead and every process aborts (the backstop behind :func:`watch_peers`).
        shutdown_timeout_s: how long a finished process waits at exit for the others.

    In a multi-process run it also installs an excepthook: an uncaught exception is
    published to the other processes (see :func:`watch_peers`) and the process exits
    at once with status 1 instead of waiting ``shutdown_timeout_s`` at JAX's exit
    barrier for peers that are stuck in a collective it will never join.

    Returns:
        This process's place in the job; ``num_processes == 1`` means no
        ``jax.distributed`` service was started.

    Raises:
        ValueError: inconsistent settings (see :func:`resolve`).

    Example::

        info = hetjax.distributed.initialize(cpu=True)  # under python -m hetjax.launch
        hetjax.distributed.check_consistent("config", dataclasses.asdict(config))
        hetjax.distributed.watch_peers()
    """
    global _info
    if _info is not None:
        return _info
    info = resolve(
        coordinator=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        local_device_count=local_device_count,
    )
    import jax

    if cpu:
        jax.config.update("jax_platforms", "cpu")
    if info.local_device_count is not None:
        # Only the CPU backend reads it: harmless where the devices are GPUs.
        jax.config.update("jax_num_cpu_devices", info.local_device_count)
    if info.is_multiprocess:
        on_cpu = cpu or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
        if on_cpu or jax.config.jax_cpu_collectives_implementation is None:
            # Gloo is JAX's default only from some version on; without it cross-process
            # CPU programs fail.
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        kwargs: dict[str, Any] = {}
        if info.source != "cluster":
            kwargs.update(
                coordinator_address=info.coordinator,
                num_processes=info.num_processes,
                process_id=info.process_id,
            )
        accepted = inspect.signature(jax.distributed.initialize).parameters
        for name, value in (
            ("heartbeat_timeout_seconds", int(heartbeat_timeout_s)),
            ("shutdown_timeout_seconds", int(shutdown_timeout_s)),
        ):
            if name in accepted:
                kwargs[name] = value
        jax.distributed.initialize(**kwargs)
    _info = info
    record(info.process_id, info.num_processes)
    if info.is_multiprocess:
        install_guard()
    return info


def _env_int(env: Mapping[str, str], key: str) -> int | None:
    text = env.get(key, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not an integer") from None


def _cluster_env(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(num_processes, process_id) of a SLURM / Open MPI job that JAX detects itself."""
    # The same variables JAX's cluster detection requires; one task is a plain run.
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID")
    if all(k in env for k in (*slurm, "SLURM_LOCALID")):
        count, rank = int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"])
    elif "OMPI_MCA_orte_hnp_uri" in env and "OMPI_COMM_WORLD_SIZE" in env:
        count, rank = int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_RANK"])
    else:
        return None
    return (count, rank) if count > 1 else None
