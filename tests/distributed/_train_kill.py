"""``experiments.llava_train`` with one process SIGKILLing itself mid-training.

``HETJAX_TEST_KILL_AT=PROCESS:STEP`` (set by the test, inherited through the launcher)
makes process PROCESS print ``killing itself at TIME`` and SIGKILL itself just before it
dispatches step STEP, while the others go on into that step's collectives. The trainer
itself has no such switch: this module wraps :func:`hetjax.run_training` and then runs
the trainer's own command line unchanged.
"""

from __future__ import annotations

import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before jax loads, as the trainer does

import hetjax  # noqa: E402 - after the log level; imports jax but starts no backend
from experiments import llava_train  # noqa: E402
from experiments.cli import run_cli  # noqa: E402

ENV_KILL_AT = "HETJAX_TEST_KILL_AT"


def _with_kill(run_training, process: int, at_step: int):
    def wrapped(step_fn, steps, **kwargs):
        import jax

        def step(i: int):
            if i == at_step and jax.process_index() == process:
                print(f"killing itself at {time.time():.3f}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return step_fn(i)

        return run_training(step, steps, **kwargs)

    return wrapped


if __name__ == "__main__":
    process, _, at_step = os.environ[ENV_KILL_AT].partition(":")
    hetjax.run_training = _with_kill(hetjax.run_training, int(process), int(at_step))
    run_cli(lambda argv: llava_train.main(llava_train.parse_args(argv)), llava_train.PROG)
