"""``experiments.llava_train`` with one process SIGKILLing itself mid-training.

``HETJAX_TEST_KILL_AT=PROCESS:STEP`` (set by the test, inherited through the launcher)
makes process PROCESS print ``killing itself at TIME`` and SIGKILL itself just before it
dispatches step STEP, while the others go on into that step's collectives. The trainer
itself has no such switch, and the host loop's hooks run on process 0 only: this module
wraps :func:`hetjax.run_training` (the public loop the trainer calls) and then runs the
trainer's own command line unchanged, as ``python -m experiments.llava_train`` would
(``runpy``; nothing here imports the entry point).
"""

from __future__ import annotations

import os
import runpy
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before jax loads, as the trainer does

import hetjax  # noqa: E402 - after the log level; imports jax but starts no backend

ENV_KILL_AT = "HETJAX_TEST_KILL_AT"
TRAINER = "experiments.llava_train"


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
    runpy.run_module(TRAINER, run_name="__main__", alter_sys=True)
