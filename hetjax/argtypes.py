"""``argparse`` ``type=`` validators shared by the launcher and the experiment CLIs.

Each parses one flag value and raises ``argparse.ArgumentTypeError``, which argparse
turns into ``argument --flag: expected ..., got ...``, so a bad value is one line naming
the flag. They live in ``hetjax`` (not ``experiments``) because ``hetjax.launch`` needs
them and the core never imports the experiments.

Example::

    parser.add_argument("--steps", type=positive_int, default=10)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

_N = TypeVar("_N", int, float)


def _number(
    text: str, kind: type[_N], ok: Callable[[_N], bool], want: str, *, malformed: str = ""
) -> _N:
    """``kind(text)`` if ``ok``; else "expected ``want``" (``malformed`` if not a number)."""
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {malformed or want}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1, e.g. a step or process count."""
    return _number(text, int, lambda v: v >= 1, "a positive integer")


def positive_float(text: str) -> float:
    """A number > 0 (``nan`` is refused), e.g. a learning rate or a timeout."""
    return _number(text, float, lambda v: v > 0, "a positive number")


def non_negative_int(text: str) -> int:
    """An integer >= 0, e.g. a count that may be zero."""
    return _number(text, int, lambda v: v >= 0, "an integer >= 0")


def non_negative_float(text: str) -> float:
    """A number >= 0, e.g. a grace period in seconds."""
    # ``not v < 0`` rather than ``v >= 0``: lets ``nan`` through, as the launcher always did.
    return _number(text, float, lambda v: not v < 0, "a number >= 0", malformed="a number")
