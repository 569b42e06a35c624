"""Train an LLaVA-style MLLM on synthetic data: ``python -m experiments.llava_train``.

With no flags: the ``tiny`` preset on 8 simulated CPU devices (or the visible GPUs) with
a heterogeneous colocated layout - the encoder data parallel over every device, the LLM
with ``pp=2, tp=2`` - for a run that finishes in well under two minutes on a laptop CPU.

The same command runs as one process of a multi-process job (JAX's multi-controller
runtime, one process per node or per GPU): under ``python -m hetjax.launch`` on one
machine, under SLURM (``srun ... python -m experiments.llava_train``), or started by hand
with ``--coordinator HOST:PORT --num-processes N --process-id I``. Every process builds
the same global batch and walks the same schedule; the processes refuse to start if
their settings differ, stop together when one fails, and only process 0 prints and
writes files.

This file is only what is the command line's own: flags (:mod:`experiments.flags`),
joining the job, the devices, ``--layout auto``. The run itself is the library's
:class:`hetjax.train.Trainer` over the LLaVA model (:mod:`models.llava.task`), or a
Qwen2.5-VL preset's (:mod:`models.qwen.task`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from experiments import flags, job
from experiments.cli import ConfigError, run_cli
from experiments.flags import errors_as_flags
from experiments.plan import StepTimeCheck
from hetjax.config import TrainConfig

PROG = "llava_train"


def parse_args(argv: Sequence[str]) -> TrainConfig:
    """The resolved config of a command line (``--print-config`` prints it and exits)."""
    return flags.parse_args(argv, prog=PROG, description=__doc__.splitlines()[0])


def main(config: TrainConfig) -> int:
    """Trains ``config`` (resolved and checked by the CLI or a caller); returns 0.

    Raises:
        ConfigError: one line naming the flag to fix (:func:`~experiments.flags.as_flags`).
    """
    multi, devices = job.join_job(config, PROG)
    import jax  # after the device count is fixed

    from hetjax import train
    from hetjax.runtime import NonFiniteError
    from models.llava.records import BadSample
    from models.llava.task import LlavaBatches, LlavaTask
    from models.qwen.task import QwenBatches, QwenTask, is_qwen

    if multi:
        job.check_consistent(config, devices)
    with job.stop_peers_on_error(multi, PROG), errors_as_flags():  # files may differ per process
        train.check_outputs(config.logging, lead=jax.process_index() == 0)
    # The settings agree, so a bad one fails alike on every process (a normal exit).
    with errors_as_flags():
        Task, Batches = (QwenTask, QwenBatches) if is_qwen(config) else (LlavaTask, LlavaBatches)
        task = Task(config)
        ests, layouts = _auto_layouts(config, task, devices) if _auto(config) else ([], None)
        check = StepTimeCheck(0.0)  # --layout auto: the chosen plan's time, set below
        hooks = [check] if ests else []
        trainer = train.Trainer(
            config, task, Batches(task), devices=devices, layouts=layouts, hooks=hooks
        )
    if ests and trainer.lead:
        est = ests[layouts.index(trainer.choice)]
        check.predicted_s = est.step_time_s
        print(
            f"--layout auto ({_profile(devices)} profile): {est.plan}; predicted "
            f"{est.tokens_per_s:.0f} tokens/s, {est.peak_memory_bytes / 2**20:.0f} MiB per device"
        )
    try:
        trainer.fit()
    except (NonFiniteError, BadSample) as e:  # a non-finite stop, a bad record
        raise ConfigError(str(e)) from None
    return 0


def _auto(config: TrainConfig) -> bool:
    return config.parallel.layouts == {"auto": "auto"}


def _auto_layouts(config: TrainConfig, task: Any, devices: Sequence[Any]) -> tuple[list, list]:
    """``--layout auto``: the planner's estimates for this model and these devices, best
    first, and their layouts (the trainer takes the first that the model and the devices
    accept)."""
    from experiments.plan import auto_plans, hetjax_workload, layout_choices

    act_bytes = 2 if config.model.dtype == "bfloat16" else 4
    work = hetjax_workload(config.data.global_batch, task.seq_len, act_bytes=act_bytes)
    p = config.parallel
    ests = auto_plans(
        task.config,
        len(devices),
        work,
        gpu=_profile(devices),
        zero1=p.zero1,
        sequence_parallel=p.sequence_parallel,
    )
    return ests, layout_choices(ests)


def _profile(devices: Sequence[Any]) -> str:
    """The planner's hardware profile of these devices."""
    kind = devices[0].device_kind.lower()
    return "cpu" if devices[0].platform == "cpu" else ("h200" if "h200" in kind else "h100")


if __name__ == "__main__":
    run_cli(lambda argv: main(parse_args(argv)), PROG)
