"""``experiments.llava_train`` that prints, on every process, how many images it decoded.

The trainer's data metrics (``images_decoded``: by this process, for the step's rows) go
only into process 0's metrics file; this module wraps :func:`hetjax.run_training` (the
public loop the trainer calls), and after the run each process prints the per-step
counts of the history the loop returns, as ``images decoded [..] of [..]`` (decoded, and
the images in the step's rows). The trainer's command line then runs unchanged
(``runpy``, as ``python -m experiments.llava_train`` would).
"""

from __future__ import annotations

import json
import os
import runpy

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before jax loads, as the trainer does

import hetjax  # noqa: E402 - after the log level; imports jax but starts no backend

TRAINER = "experiments.llava_train"


def _printing_decodes(run_training):
    def wrapped(step_fn, steps, **kwargs):
        history = run_training(step_fn, steps, **kwargs)
        decoded = [int(h["images_decoded"]) for h in history]
        images = [int(h["images_per_step"]) for h in history]
        print(f"images decoded {json.dumps(decoded)} of {json.dumps(images)}", flush=True)
        return history

    return wrapped


if __name__ == "__main__":
    hetjax.run_training = _printing_decodes(hetjax.run_training)
    runpy.run_module(TRAINER, run_name="__main__", alter_sys=True)
