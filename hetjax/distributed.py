"""Multi-process start-up, a launch-consistency check and a fault watchdog.

A multi-process JAX job is N copies of one program that must agree on everything
(layouts, seeds, model, steps) and issue the same collectives in the same order. Three
things go wrong in practice, and this module handles each:

- **Start-up.** :func:`initialize` wraps ``jax.distributed.initialize`` and finds its
  arguments in one place: explicit arguments (the trainer's ``--coordinator``,
  ``--num-processes``, ``--process-id`` flags), else the ``HETJAX_*`` variables that
  ``python -m hetjax.launch`` sets, else a SLURM / Open MPI job that JAX detects by
  itself, else a plain single-process run. On CPU it selects gloo collectives.
- **Mismatched launches.** :func:`check_consistent` exchanges a config between all
  processes (two tiny all-gathers through the public ``multihost_utils``) and refuses a
  run whose processes were started with different settings, in one line on every process.
- **A dead peer.** Without help, the survivors of a crash wait in a collective until
  JAX's heartbeat timeout aborts them with a C++ stack trace. :func:`watch_peers` starts a
  daemon thread that publishes a heartbeat in JAX's coordination key-value store and
  watches everyone else's; an uncaught exception is published too. A process whose peer
  raised stops within about a second; one whose peer vanished (killed, out of memory)
  stops once that peer's heartbeat is ``timeout_s`` old; both print one line naming the
  peer and exit with :data:`PEER_FAILED_EXIT_CODE`.

The watchdog (like ``multihost_utils`` itself) reaches the coordination client through
``jax._src.distributed.global_state.client``: JAX 0.10-0.12 has no public key-value API.
If that attribute disappears, :func:`watch_peers` logs a warning and leaves failure
detection to JAX's own heartbeat (``heartbeat_timeout_s`` of :func:`initialize`).
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn

logger = logging.getLogger(__name__)

ENV_COORDINATOR = "HETJAX_COORDINATOR"
ENV_NUM_PROCESSES = "HETJAX_NUM_PROCESSES"
ENV_PROCESS_ID = "HETJAX_PROCESS_ID"
ENV_LOCAL_DEVICES = "HETJAX_LOCAL_DEVICES"

#: Exit status of a process that the watchdog stopped because another process failed
#: (EX_TEMPFAIL): the launcher uses it to tell the cause of a failure from its echoes.
PEER_FAILED_EXIT_CODE = 75

_KEY_PREFIX = "hetjax/"
_KEY_FAILED = "hetjax/failed"  # "PROCESS\tREASON" of the first failure; set once
_KEY_HEARTBEAT = "hetjax/heartbeat/"  # + process id: a counter that advances while alive
_KEY_DONE = "hetjax/done/"  # + process id: finished cleanly, stop watching it


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
        "--coordinator": coordinator,
        "--num-processes": num_processes,
        "--process-id": process_id,
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
            f"--process-id {process_id} with --num-processes {num_processes}: the id must be "
            f"in 0..{num_processes - 1}"
        )
    if ":" not in coordinator:
        raise ValueError(f"--coordinator {coordinator!r} must be HOST:PORT, e.g. 10.0.0.1:1234")
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
        local_device_count: devices per process; on CPU, how many to simulate.
        cpu: run on CPU devices (sets ``jax_platforms=cpu``). CPU runs, also ones the
            launcher marked with ``JAX_PLATFORMS=cpu``, get gloo collectives.
        heartbeat_timeout_s: JAX's own limit after which a silent process is declared
            dead and every process aborts (the backstop behind :func:`watch_peers`).
        shutdown_timeout_s: how long a finished process waits at exit for the others.

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

    on_cpu = cpu or os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    if cpu:
        jax.config.update("jax_platforms", "cpu")
    if on_cpu and info.local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", info.local_device_count)
    if info.is_multiprocess:
        if on_cpu:
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
    return info


def check_consistent(name: str, payload: Mapping[str, Any]) -> None:
    """Refuses a run whose processes were launched with different settings.

    Every process must call it at the same point (it runs two small all-gathers). Values
    are compared by their JSON form (``repr`` for other objects); long values by hash.

    Args:
        name: what is compared, for the message (e.g. ``"training config"``).
        payload: the settings every process must share: layouts, seeds, model, steps.

    Raises:
        ValueError: on every process, one line naming the differing keys and processes.
    """
    import jax

    if jax.process_count() == 1:
        return
    import numpy as np
    from jax.experimental import multihost_utils

    mine = _canonical(payload)
    blob = np.frombuffer(json.dumps(mine, sort_keys=True).encode(), dtype=np.uint8)
    sizes = multihost_utils.process_allgather(np.array([blob.size], np.int32))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: blob.size] = blob
    rows = multihost_utils.process_allgather(padded)
    payloads = [
        json.loads(bytes(row[: int(size)]).decode())
        for row, size in zip(rows, sizes.reshape(-1), strict=True)
    ]
    message = _mismatch(name, payloads)
    if message is not None:
        raise ValueError(message)


def watch_peers(timeout_s: float = 30.0, *, interval_s: float = 1.0) -> None:
    """Stops this process soon after another process of the job fails or vanishes.

    Starts a daemon thread that every ``interval_s`` advances this process's heartbeat
    in the coordination service and reads the others'. It ends this process (one line
    on stderr, exit status :data:`PEER_FAILED_EXIT_CODE`) when another process published
    a failure - an uncaught exception, seen within ``interval_s`` - or when a peer's
    heartbeat has not advanced for ``timeout_s`` (killed, out of memory, machine lost).
    It also installs an excepthook that publishes this process's own uncaught exception
    and then exits without waiting at JAX's shutdown barrier for peers that will not
    come. Peers that finished cleanly are no longer watched. Call once, after
    :func:`initialize`; a no-op in a single-process run. A hang in which every process
    stays alive (e.g. collectives issued in different orders) is not detected.

    Keep ``timeout_s`` below ``heartbeat_timeout_s`` of :func:`initialize`, so the clear
    line comes before JAX's abort.
    """
    if _watchdog is not None or not _is_multiprocess():
        return
    client = _kv_client()
    if client is None:
        logger.warning(
            "hetjax.distributed.watch_peers: this JAX has no coordination client at "
            "jax._src.distributed.global_state.client; relying on JAX's heartbeat timeout"
        )
        return
    _start_watchdog(client, _process_id(), float(timeout_s), float(interval_s))


def fail(reason: str, *, exit_code: int = 1) -> NoReturn:
    """Tells the other processes that this one failed, prints ``reason``, exits now.

    For an error that is handled rather than raised (e.g. a one-line config error that
    ends with ``sys.exit``): peers stop at once instead of waiting in a collective, and
    this process does not wait at JAX's shutdown barrier.
    """
    print(f"hetjax: process {_process_id()}: {reason}", file=sys.stderr)
    if _watchdog is not None:
        _watchdog.publish_failure(reason)
    _exit_now(exit_code, linger=_watchdog is not None and _process_id() == 0)


# --- settings --------------------------------------------------------------------------


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


def _is_multiprocess() -> bool:
    if _info is not None:
        return _info.is_multiprocess
    import jax

    return jax.process_count() > 1


def _process_id() -> int:
    if _info is not None:
        return _info.process_id
    import jax

    return jax.process_index()


# --- consistency check -----------------------------------------------------------------

_LONG = 120  # characters; longer values are compared (and shown) by hash


def _canonical(payload: Mapping[str, Any]) -> dict[str, str]:
    out = {}
    for key, value in payload.items():
        text = json.dumps(value, sort_keys=True, default=repr)
        if len(text) > _LONG:
            digest = hashlib.sha256(text.encode()).hexdigest()[:12]
            text = f"{text[:40]}...(sha256 {digest})"
        out[str(key)] = text
    return out


def _mismatch(name: str, payloads: list[dict[str, str]]) -> str | None:
    """One line naming what differs from process 0, or None if all agree."""
    ref = payloads[0]
    parts = []
    for pid, other in enumerate(payloads[1:], start=1):
        keys = sorted(k for k in ref.keys() | other.keys() if ref.get(k) != other.get(k))
        if not keys:
            continue
        shown = ", ".join(
            f"{k}={other.get(k, '<missing>')} (process 0: {ref.get(k, '<missing>')})"
            for k in keys[:3]
        )
        more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
        parts.append(f"process {pid} has {shown}{more}")
    if not parts:
        return None
    if len(parts) > 3:
        parts = [*parts[:3], f"{len(parts) - 3} more processes differ"]
    return (
        f"{name} differs between processes: {'; '.join(parts)}; launch every process with "
        "the same flags"
    )


# --- watchdog --------------------------------------------------------------------------


def _kv_client() -> Any:
    try:
        from jax._src import distributed as jax_distributed
    except ImportError:
        return None
    client = getattr(getattr(jax_distributed, "global_state", None), "client", None)
    needed = ("key_value_set", "key_value_dir_get")
    return client if client is not None and all(hasattr(client, m) for m in needed) else None


def _exit_now(code: int, *, linger: bool = False) -> NoReturn:
    """Flushes what can be flushed and ends the process without JAX's exit barrier."""
    if linger:
        # Process 0 hosts the coordination service: stay until peers could read the news.
        time.sleep(2.0 * (_watchdog.interval_s if _watchdog else 1.0))
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not block the exit
            pass
    logging.shutdown()
    os._exit(code)


class _Watchdog:
    def __init__(self, client: Any, me: int, timeout_s: float, interval_s: float):
        self.client = client
        self.me = me
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.stop = threading.Event()
        self.failed = False  # this process failed: skip JAX's exit barrier
        self.exit_code = 1
        self.previous_hook: Callable[..., Any] = sys.excepthook
        self.thread = threading.Thread(target=self.run, name="hetjax-watch-peers", daemon=True)

    def publish_failure(self, reason: str) -> None:
        self.failed = True
        self._publish(self.me, reason)

    def _publish(self, process: int, reason: str) -> None:
        line = " ".join(reason.split())[:300]
        try:  # No overwrite: the first failure wins and names the cause.
            self.client.key_value_set(_KEY_FAILED, f"{process}\t{line}")
        except Exception:  # noqa: BLE001 - already set, or the service is gone
            pass

    def first_failure(self) -> tuple[int, str] | None:
        try:
            entries = dict(self.client.key_value_dir_get(_KEY_PREFIX))
        except Exception:  # noqa: BLE001
            return None
        return _parse_failure(entries)

    def excepthook(self, kind, value, tb) -> None:
        first = self.first_failure()
        if first is None or first[0] == self.me:
            self.publish_failure(f"{kind.__name__}: {value}")
        self.failed = True
        self.previous_hook(kind, value, tb)
        first = self.first_failure()
        if first is not None and first[0] != self.me:
            # Most likely a collective broken by that peer: report it as the cause.
            print(f"hetjax: process {first[0]} failed first ({first[1]})", file=sys.stderr)
            self.exit_code = PEER_FAILED_EXIT_CODE

    def at_exit(self) -> None:
        self.stop.set()
        if self.failed:
            _exit_now(self.exit_code, linger=self.me == 0)
        try:
            self.client.key_value_set(f"{_KEY_DONE}{self.me}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001
            pass

    def run(self) -> None:
        seen: dict[str, tuple[str, float]] = {}  # heartbeat key -> (value, when it changed)
        lost_since: float | None = None
        beat = 0
        while not self.stop.wait(self.interval_s):
            beat += 1
            now = time.monotonic()
            try:
                self.client.key_value_set(
                    f"{_KEY_HEARTBEAT}{self.me}", str(beat), allow_overwrite=True
                )
                entries = dict(self.client.key_value_dir_get(_KEY_PREFIX))
            except Exception as e:  # noqa: BLE001
                if self.stop.is_set():
                    return
                lost_since = lost_since or now
                if now - lost_since > min(self.timeout_s, 3 * self.interval_s):
                    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e)
                    self._stop(f"lost the coordination service on process 0 ({first})")
                continue
            lost_since = None
            failure = _parse_failure(entries)
            if failure is not None and failure[0] != self.me:
                self._stop(f"process {failure[0]} failed ({failure[1]})")
            for key, value in entries.items():
                if not key.startswith(_KEY_HEARTBEAT) or key == f"{_KEY_HEARTBEAT}{self.me}":
                    continue
                peer = key[len(_KEY_HEARTBEAT) :]
                if f"{_KEY_DONE}{peer}" in entries:
                    continue
                last = seen.get(key)
                if last is None or last[0] != value:
                    seen[key] = (value, now)
                elif now - last[1] > self.timeout_s:
                    reason = f"died or hung: no heartbeat for {now - last[1]:.0f} s"
                    self._publish(int(peer), reason)
                    self._stop(f"process {peer} {reason}")

    def _stop(self, what: str) -> NoReturn:
        if self.stop.is_set():  # exiting normally meanwhile
            sys.exit(0)
        print(f"hetjax: {what}; stopping process {self.me}", file=sys.stderr)
        _exit_now(PEER_FAILED_EXIT_CODE)


def _parse_failure(entries: Mapping[str, str]) -> tuple[int, str] | None:
    value = entries.get(_KEY_FAILED)
    if value is None:
        return None
    process, _, reason = value.partition("\t")
    return int(process), reason


_watchdog: _Watchdog | None = None


def _start_watchdog(client: Any, me: int, timeout_s: float, interval_s: float) -> None:
    global _watchdog
    dog = _Watchdog(client, me, timeout_s, interval_s)
    client.key_value_set(f"{_KEY_HEARTBEAT}{me}", "0", allow_overwrite=True)
    sys.excepthook = dog.excepthook
    # Registered after JAX's own exit handler, so it runs first (atexit is LIFO).
    atexit.register(dog.at_exit)
    _watchdog = dog
    dog.thread.start()
