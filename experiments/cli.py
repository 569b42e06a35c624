"""Command-line plumbing shared by the experiment entry points.

``argparse`` prints a usage block and exits 2 on a bad flag; users asked for one line
that names the fix, so :class:`OneLineParser` raises :class:`ConfigError` instead and
:func:`run_cli` prints it as a single line with a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn


class ConfigError(ValueError):
    """A user's flag or configuration is invalid; the message names the fix."""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def setup_devices(requested: int | None, *, default_cpu: int = 8) -> list:
    """Returns the devices to train on; simulates ``requested`` CPU devices if no GPU.

    Must run before anything touches a JAX backend.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import jax

    jax.config.update("jax_num_cpu_devices", requested or default_cpu)
    devices = jax.devices()
    if devices[0].platform == "cpu":
        return devices[: requested or default_cpu]
    if requested is not None and requested > len(devices):
        raise ConfigError(
            f"--devices {requested} but only {len(devices)} {devices[0].platform} devices are "
            f"visible; use --devices {len(devices)} or fewer"
        )
    return devices[: requested or len(devices)]


def run_cli(main: Callable[[list[str]], int], prog: str) -> NoReturn:
    """Runs ``main(argv)`` and turns :class:`ConfigError` / ``ValueError`` into one line."""
    try:
        code = main(sys.argv[1:])
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
