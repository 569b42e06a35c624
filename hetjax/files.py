"""Checks on where a run will write, made before it trains (not at the first write)."""

from __future__ import annotations

import os
from pathlib import Path


def ensure_writable_dir(directory: str | os.PathLike) -> None:
    """Creates ``directory`` (and its parents) and writes a probe file into it.

    A probe, not ``os.access``: it also fails for root on a read-only file system, and
    for a path below a plain file.

    Raises:
        OSError: the directory cannot be created or written.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".hetjax-write-probe-{os.getpid()}"
    probe.write_bytes(b"")
    probe.unlink()
