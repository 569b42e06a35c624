"""The in-process runner of entry points (:func:`tests.launch.run_main`) and what it relies
on: :func:`experiments.cli.setup_devices` in a process where JAX already runs."""

import logging
import sys
import threading

import jax
import pytest

from experiments.cli import ConfigError, setup_devices
from tests import launch


def test_setup_devices_takes_the_first_devices_of_a_running_backend():
    devices = jax.devices()
    assert len(devices) == 8  # the suite's, fixed when the backend started
    assert setup_devices(2) == devices[:2]
    assert setup_devices(None) == devices
    with pytest.raises(ConfigError, match=r"--devices 16 but only 8 cpu devices .* 8 or fewer"):
        setup_devices(16)


def test_run_main_reports_a_one_line_error_and_puts_the_process_back():
    argv, handlers = sys.argv, logging.getLogger().handlers[:]
    hooks = sys.unraisablehook, threading.excepthook
    result = launch.run_main(launch.TRAIN, "--steps", "0", log_compiles=True)
    assert result == launch.Result(
        2,
        "",
        "llava_train: error: argument --steps: expected a positive integer, got 0 (see --help)\n",
    )
    assert sys.argv is argv and logging.getLogger().handlers == handlers
    assert (sys.unraisablehook, threading.excepthook) == hooks
    assert not jax.config.jax_log_compiles
