"""Checks of one config section that need more than a field's type and value rule
(:func:`hetjax.config.tree.check` calls them): the logging section's profile window and
plot path. Split from ``tree.py`` to keep that file to its dataclasses and the rules
table."""

from __future__ import annotations

import re
from typing import Any

from hetjax.config.fields import InvalidConfigError


def check_logging(cfg: Any) -> None:
    """The profiled steps lie in the run and come with their directory; plots are PNG.

    ``cfg`` is a :class:`hetjax.config.tree.TrainConfig` (not imported: ``tree`` imports
    this module)."""
    lg = cfg.logging
    if lg.plot is not None and not lg.plot.lower().endswith(".png"):
        raise InvalidConfigError(
            f"logging.plot={lg.plot!r} must be a .png path; give e.g. 'run.png'"
        )
    if (lg.profile_steps is None) != (lg.profile_dir is None):
        given, missing = (
            ("logging.profile_steps", "logging.profile_dir")
            if lg.profile_dir is None
            else ("logging.profile_dir", "logging.profile_steps")
        )
        raise InvalidConfigError(f"{given} needs {missing}; give both or neither")
    if lg.profile_steps is None:
        return
    last = (cfg.stop_after or cfg.steps) - 1
    if not re.fullmatch(r"\d+:\d+", lg.profile_steps):
        raise InvalidConfigError(
            f"profile_steps={lg.profile_steps!r} is not A:B; give two step numbers, e.g. "
            f"profile_steps='{min(2, last)}:{min(3, last)}'"
        )
    a, b = lg.profile_range
    if a > b:
        raise InvalidConfigError(
            f"profile_steps={lg.profile_steps!r} starts after it ends; give A <= B, e.g. "
            f"profile_steps='{b}:{a}'"
        )
    if b > last:
        raise InvalidConfigError(
            f"profile_steps={lg.profile_steps!r} is outside the run (metrics steps 0..{last}); "
            f"give steps within it, e.g. profile_steps='{min(a, last)}:{last}'"
        )
