"""Stopping every process of a job soon after one of them fails or vanishes.

Without help, the survivors of a crash wait in a collective until JAX's heartbeat
timeout aborts them with a C++ stack trace, and a process that raised waits at JAX's
exit barrier for them. :func:`initialize` calls :func:`install_guard`, whose excepthook
publishes an uncaught exception in JAX's coordination key-value store and exits at once;
:func:`watch_peers` starts a daemon thread that publishes a heartbeat there and watches
everyone else's (and, on the same machine, their OS processes). A process whose peer
raised, or whose peer on the same machine vanished (killed, out of memory), stops within
about a second; one whose peer on another machine vanished stops once that peer's
heartbeat is ``timeout_s`` old. It prints one line naming the peer and exits with
:data:`PEER_FAILED_EXIT_CODE`.

The watchdog (like ``multihost_utils`` itself) reaches the coordination client through
``jax._src.distributed.global_state.client``: JAX 0.10-0.12 has no public key-value API.
If that attribute disappears, :func:`watch_peers` logs a warning and leaves failure
detection to JAX's own heartbeat (``heartbeat_timeout_s`` of :func:`initialize`).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from .process import where

logger = logging.getLogger(__name__)

#: Exit status of a process that the watchdog stopped because another process failed
#: (EX_TEMPFAIL): the launcher uses it to tell the cause of a failure from its echoes.
PEER_FAILED_EXIT_CODE = 75

_KEY_PREFIX = "hetjax/"
_KEY_FAILED = "hetjax/failed"  # "PROCESS\tREASON" of the first failure; set once
_KEY_HEARTBEAT = "hetjax/heartbeat/"  # + process id: a counter that advances while alive
_KEY_DONE = "hetjax/done/"  # + process id: finished cleanly, stop watching it
_KEY_PROC = "hetjax/proc/"  # + process id: "HOST\tOS_PID\tSTART_TIME" of that process


def watch_peers(timeout_s: float = 30.0, *, interval_s: float = 1.0) -> None:
    """Stops this process soon after another process of the job fails or vanishes.

    Starts a daemon thread that every ``interval_s`` advances this process's heartbeat
    in the coordination service and reads the others'. It ends this process (one line
    on stderr, exit status :data:`PEER_FAILED_EXIT_CODE`) when another process published
    a failure (an uncaught exception or :func:`fail`; seen within ``interval_s``), when
    a peer on this machine has vanished (killed, out of memory: its OS process is gone,
    seen within ``interval_s``), or when a peer's heartbeat has not advanced for
    ``timeout_s`` (a vanished peer on another machine, a machine lost). Peers that
    finished cleanly are no longer watched. Call once, after
    :func:`initialize`; a no-op in a single-process run. Not detected: a hang in which
    every process stays alive (e.g. collectives issued in different orders).

    Keep ``timeout_s`` below ``heartbeat_timeout_s`` of :func:`initialize`, so the clear
    line comes before JAX's own abort.
    """
    guard = _guard or install_guard()
    if guard is None or guard.thread is not None:
        return
    guard.timeout_s, guard.interval_s = float(timeout_s), float(interval_s)
    try:  # A key-value API that changed must not later pass for a lost coordinator.
        guard.find_local_peers(where()[1])
        guard.beat()
    except Exception as e:  # noqa: BLE001
        logger.warning("hetjax.distributed.watch_peers disabled: %s: %s", type(e).__name__, e)
        return
    guard.thread = threading.Thread(target=guard.watch, name="hetjax-watch-peers", daemon=True)
    guard.thread.start()


def fail(reason: str, *, exit_code: int = 1) -> NoReturn:
    """Tells the other processes that this one failed, prints ``reason``, exits now.

    For an error that is handled rather than raised (e.g. a one-line config error that
    ends in ``sys.exit``): watching peers stop at once instead of waiting in a
    collective, and this process does not wait at JAX's shutdown barrier for them.
    """
    print(f"hetjax: process {where()[0]}: {reason}", file=sys.stderr)
    if _guard is not None:
        _guard.publish(_guard.me, reason)
        _guard.stopping.set()  # we are the failure: do not report peers that stop for it
    _exit_now(exit_code)


def _kv_client() -> Any:
    try:
        from jax._src import distributed as jax_distributed
    except ImportError:
        return None
    client = getattr(getattr(jax_distributed, "global_state", None), "client", None)
    needed = ("key_value_set", "key_value_dir_get")
    return client if client is not None and all(hasattr(client, m) for m in needed) else None


def _exit_now(code: int) -> NoReturn:
    """Flushes what can be flushed and ends the process without JAX's exit barrier."""
    if _guard is not None and _guard.me == 0 and _guard.thread is not None:
        # Process 0 hosts the coordination service, and JAX aborts every other process
        # once it is gone: stay until their watchdogs have read why.
        time.sleep(2.0 * _guard.interval_s)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not block the exit
            pass
    logging.shutdown()
    os._exit(code)


class _Guard:
    """This process's link to the others: failure reports, heartbeats, the watch loop."""

    def __init__(self, client: Any, me: int):
        self.client = client
        self.me = me
        self.failed = False  # this process failed: skip JAX's exit barrier
        self.exit_code = 1
        self.stopping = threading.Event()
        self.previous_hook: Callable[..., Any] = sys.excepthook
        self.thread: threading.Thread | None = None
        self.timeout_s = 30.0
        self.interval_s = 1.0
        self.beats = 0
        self.host = _host_id()
        self.local: dict[str, tuple[int, str]] = {}  # peer -> (OS pid, start) on this host

    def register(self) -> None:
        """Publishes this process's OS identity, so peers on this host can check on it."""
        start = _proc_start(os.getpid()) or ""
        value = f"{self.host}\t{os.getpid()}\t{start}"
        self.client.key_value_set(f"{_KEY_PROC}{self.me}", value, allow_overwrite=True)

    def find_local_peers(self, count: int, wait_s: float = 10.0) -> None:
        """Notes the peers whose OS process this one can see (same host, same PID space).

        Runs while every peer is alive (they registered right after initialize), so a
        peer in another PID namespace or on another machine is never mistaken for a
        dead one later.
        """
        deadline = time.monotonic() + wait_s
        while True:
            entries = dict(self.client.key_value_dir_get(_KEY_PROC))
            if len(entries) >= count or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for key, value in entries.items():
            peer = key[len(_KEY_PROC) :]
            host, pid, start = value.split("\t")
            if peer != str(self.me) and host == self.host and start:
                if _proc_start(int(pid)) == start:
                    self.local[peer] = (int(pid), start)

    def dead_local_peer(self, entries: Mapping[str, str]) -> tuple[str, int] | None:
        """A peer on this machine whose OS process has ended (checked through /proc)."""
        for peer, (pid, start) in self.local.items():
            if f"{_KEY_DONE}{peer}" not in entries and _proc_start(pid) != start:
                return peer, pid
        return None

    def publish(self, process: int, reason: str) -> None:
        if process == self.me:
            self.failed = True
        line = " ".join(reason.split())[:300]
        try:  # No overwrite: the first failure wins and names the cause.
            self.client.key_value_set(_KEY_FAILED, f"{process}\t{line}")
        except Exception:  # noqa: BLE001 - already set, or the service is gone
            pass

    def entries(self) -> dict[str, str]:
        return dict(self.client.key_value_dir_get(_KEY_PREFIX))

    def first_failure(self) -> tuple[int, str] | None:
        try:
            return _parse_failure(self.entries())
        except Exception:  # noqa: BLE001
            return None

    def beat(self) -> None:
        self.beats += 1
        key = f"{_KEY_HEARTBEAT}{self.me}"
        self.client.key_value_set(key, str(self.beats), allow_overwrite=True)

    def excepthook(self, kind, value, tb) -> None:
        try:
            entries = self.entries()
        except Exception:  # noqa: BLE001
            entries = {}
        first = _parse_failure(entries)
        dead = self.dead_local_peer(entries) if first is None else None
        if dead is not None:  # e.g. a collective broken because that peer was killed
            self.publish(int(dead[0]), f"died (OS process {dead[1]} ended)")
        elif first is None or first[0] == self.me:
            self.publish(self.me, f"{kind.__name__}: {value}")
        self.failed = True
        self.previous_hook(kind, value, tb)
        first = self.first_failure()
        if first is not None and first[0] != self.me:
            # Most likely a collective broken by that peer: report it as the cause.
            print(f"hetjax: process {first[0]} failed first ({first[1]})", file=sys.stderr)
            self.exit_code = PEER_FAILED_EXIT_CODE

    def at_exit(self) -> None:
        self.stopping.set()
        if self.failed:
            _exit_now(self.exit_code)
        try:
            self.client.key_value_set(f"{_KEY_DONE}{self.me}", "1", allow_overwrite=True)
        except Exception:  # noqa: BLE001
            pass

    def watch(self) -> None:
        seen: dict[str, tuple[str, float]] = {}  # heartbeat key -> (value, when it changed)
        lost_since: float | None = None
        while not self.stopping.wait(self.interval_s):
            if _kv_client() is not self.client:  # jax.distributed.shutdown() ran here
                return
            now = time.monotonic()
            try:
                self.beat()
                entries = self.entries()
            except Exception as e:  # noqa: BLE001
                if _kv_client() is not self.client:
                    return
                lost_since = lost_since or now
                if now - lost_since >= min(self.timeout_s, 2 * self.interval_s):
                    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                    self.stop(f"lost the coordination service on process 0 ({first[:200]})")
                continue
            lost_since = None
            failure = _parse_failure(entries)
            if failure is not None and failure[0] != self.me:
                self.stop(f"process {failure[0]} failed ({failure[1]})")
            dead = self.dead_local_peer(entries)
            if dead is not None and f"{_KEY_DONE}{dead[0]}" not in self.entries():
                reason = f"died (OS process {dead[1]} ended)"
                self.publish(int(dead[0]), reason)
                self.stop(f"process {dead[0]} {reason}")
            for key, value in entries.items():
                peer = key[len(_KEY_HEARTBEAT) :]
                if not key.startswith(_KEY_HEARTBEAT) or peer == str(self.me):
                    continue
                if f"{_KEY_DONE}{peer}" in entries:
                    continue
                last = seen.get(key)
                if last is None or last[0] != value:
                    seen[key] = (value, now)
                elif now - last[1] > self.timeout_s:
                    reason = f"died or hung: no heartbeat for {now - last[1]:.0f} s"
                    self.publish(int(peer), reason)
                    self.stop(f"process {peer} {reason}")

    def stop(self, what: str) -> None:
        if self.stopping.is_set():  # this process is exiting normally meanwhile
            return
        print(f"hetjax: {what}; stopping process {self.me}", file=sys.stderr)
        _exit_now(PEER_FAILED_EXIT_CODE)


def _host_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _proc_start(pid: int) -> str | None:
    """Start time of a live (not zombie) process from Linux /proc; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if len(fields) < 20 or fields[0] in ("Z", "X") else fields[19]


def _parse_failure(entries: Mapping[str, str]) -> tuple[int, str] | None:
    value = entries.get(_KEY_FAILED)
    if value is None:
        return None
    process, _, reason = value.partition("\t")
    return int(process), reason


_guard: _Guard | None = None


def install_guard() -> _Guard | None:
    """Publishes this process's uncaught exceptions; exits without the shutdown wait."""
    global _guard
    me, count = where()
    if _guard is not None or count == 1:
        return _guard
    client = _kv_client()
    if client is None:
        logger.warning(
            "hetjax.distributed: this JAX has no coordination client at "
            "jax._src.distributed.global_state.client; relying on JAX's heartbeat timeout"
        )
        return None
    guard = _Guard(client, me)
    try:
        guard.register()
    except Exception as e:  # noqa: BLE001 - e.g. a changed key-value API
        logger.warning("hetjax.distributed: no failure reporting: %s: %s", type(e).__name__, e)
        return None
    _guard = guard
    sys.excepthook = _guard.excepthook
    # Registered after JAX's own exit handler, so it runs first (atexit is LIFO).
    atexit.register(_guard.at_exit)
    return _guard
