"""Refusing a launch whose processes were started with different settings.

Processes that disagree on a layout, a seed or the step count do not fail cleanly: they
compute different things or issue different collectives and hang. :func:`check_consistent`
exchanges a canonical text form of a config between all processes (two tiny all-gathers
through the public ``multihost_utils``) and raises one line, on every process, naming
the keys and processes that differ. Values are compared as text rather than pickled so
that equal dataclasses and sets compare equal whatever each process's hash seed is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any


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


_LONG = 120  # characters; longer values are compared (and shown) by hash


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, set | frozenset):  # repr order depends on the per-process hash seed
        return sorted(repr(v) for v in value)
    return repr(value)


def _canonical(payload: Mapping[str, Any]) -> dict[str, str]:
    """Key -> canonical text of its value: equal values give equal text in every process."""
    out = {}
    for key, value in payload.items():
        try:
            text = json.dumps(value, sort_keys=True, default=_jsonable)
        except (TypeError, ValueError):  # e.g. a dict with tuple keys
            text = repr(value)
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
