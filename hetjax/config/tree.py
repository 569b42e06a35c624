"""The training configuration: one frozen dataclass tree, checked when it is built.

A run is described by :class:`TrainConfig` and its sections (model, data, parallel,
optimizer, checkpoint, distributed, logging). Every field carries a one-line doc in its
metadata (:func:`hetjax.config.fields.doc`): the CLI's help and the comments of
:func:`hetjax.config.dump` are read from there, so a setting is described once.

Unlike a bag of flags that each consumer re-checks, the whole tree is checked once, in
``TrainConfig.__post_init__``: the type of every field and what the config alone can
decide (positive counts, known placements and schedules, islands only with non-colocated
placement). What needs the model or the devices (layouts against heads and layers,
islands against device counts) is :func:`hetjax.runtime.plan_run`'s job, still before any
parameter exists. Errors are one line naming the field by its dotted path with a Python
literal (``parallel.microbatches=0``), which a CLI translates into its flag names.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

from hetjax.config.checks import check_logging
from hetjax.config.fields import InvalidConfigError, Leaf, describe, doc, matches, walk
from hetjax.recompute import Recompute


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What is trained: a preset of ``models/config.py`` and its compute settings."""

    preset: str = doc(
        "tiny", "model preset: tiny, tiny-av, tiny-moe, tiny-moe-enc, small, llava-1.5-tiny, ..."
    )
    init_from: str | None = doc(
        None,
        "Hugging Face LLaVA checkpoint directory to start from (the model comes from its "
        "config.json: no preset)",
    )
    init: dict[str, str] = doc(
        {},
        "module -> Hugging Face checkpoint directory to start it from (vision: CLIP or "
        "SigLIP, llm: Llama); the other modules keep the preset, freshly initialised",
    )
    seq_len: int | None = doc(None, "text + media tokens per sample (None: the preset's)")
    vocab_size: int | None = doc(
        None,
        "the LLM's vocabulary when it starts fresh (None: the preset's, grown to "
        "data.tokenizer's size when that is larger)",
    )
    dtype: Literal["float32", "bfloat16"] = doc(
        "float32", "compute dtype: float32 or bfloat16 (parameters stay float32)"
    )
    freeze: str = doc(
        "", "modules or parts not trained, comma-separated (vision = the encoder alone)"
    )

    @property
    def frozen(self) -> tuple[str, ...]:
        """The names in :attr:`freeze`."""
        return tuple(n.strip() for n in self.freeze.split(",") if n.strip())


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What each step reads (the data seed is the top-level ``seed``)."""

    global_batch: int = doc(32, "samples per step, over all devices and microbatches")
    sources: dict[str, float] = doc(
        {}, "LLaVA JSON / JSONL files -> mixture weight (empty: synthetic data)"
    )
    image_folder: str | None = doc(None, "directory that relative image paths are under")
    tokenizer: str | None = doc(
        None, "Hugging Face tokenizer.json, or a directory with it and tokenizer_config.json"
    )
    template: Literal["plain", "vicuna_v1", "llama3", "qwen2_vl"] = doc(
        "vicuna_v1",
        "chat template: plain (pretraining), vicuna_v1 (LLaVA-1.5), llama3, qwen2_vl",
    )
    image_aspect: Literal["crop", "pad"] = doc(
        "crop", "crop: CLIP's shortest-side resize and centre crop; pad: square with the mean first"
    )
    max_images_per_microbatch: int | None = doc(
        None,
        "image slots per microbatch, split evenly over its rows (None: the most per record; "
        "packed, derived from the data)",
    )
    max_loss_tokens_per_microbatch: int | None = doc(
        None,
        "supervised tokens the LM head computes per microbatch, split evenly over its rows "
        "(None: derived from the data)",
    )
    max_samples_per_row: int | None = doc(
        None, "samples one packed row holds at most (None: derived from the data)"
    )
    max_patches_per_microbatch: int | None = doc(
        None,
        "vision patches per microbatch (Qwen2.5-VL), split evenly over its rows: the tower's "
        "row length (None: derived from the data)",
    )
    min_pixels: int = doc(56 * 56, "Qwen2.5-VL: fewest pixels of an image or frame after resizing")
    max_pixels: int = doc(
        28 * 28 * 1280, "Qwen2.5-VL: most pixels of an image or frame after resizing"
    )
    video_fps: float = doc(2.0, "Qwen2.5-VL: video frames sampled per second")
    max_frames: int = doc(768, "Qwen2.5-VL: most frames sampled from one video (whole pairs)")
    pack: bool = doc(False, "pack several samples into each seq_len row")
    balance: bool = doc(False, "order each step's rows so dp ranks get even tokens and images")
    synthetic_max_images: int = doc(
        1, "synthetic data: image slots per sample; above 1 a sample has 0 to this many images"
    )
    skip_bad_samples: bool = doc(False, "skip and count bad records instead of stopping")
    workers: int = doc(4, "data-loading threads (reading, tokenizing, image decoding)")
    prefetch: int = doc(2, "batches prepared ahead of the step that needs them")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How the graph is laid out on the devices and scheduled."""

    layouts: dict[str, str] = doc(
        {},
        "module -> layout, e.g. {llm: 'dp=2,tp=2,pp=2'}; a module without one gets the "
        "LLM's; empty: the trainer's defaults",
    )
    placement: Literal["colocated", "non-colocated"] = doc(
        "colocated",
        "colocated (same devices, three-phase schedule) or non-colocated (islands, "
        "graph-aware 1F1B)",
    )
    islands: dict[str, int] = doc(
        {}, "non-colocated: module -> device count of its island, assigned in order"
    )
    homogeneous: bool = doc(
        False, "baseline: encoders inherit the LLM's layout on its first pipeline stage"
    )
    schedule: Literal["1f1b", "gpipe"] = doc(
        "1f1b", "pipeline order of the pipelined part: 1f1b or gpipe (colocated: three-phase)"
    )
    microbatches: int = doc(4, "pipeline microbatches per global batch")
    offload_encoder: bool = doc(
        False, "colocated: encoder params/optimizer state in host memory in the LLM phase"
    )
    rebalance: str = doc(
        "", "encoders whose images are dealt evenly over their dp ranks each step, e.g. vision"
    )
    recompute: dict[str, Recompute] = doc(
        {},
        "module -> activation policy: none (keep the backward's residuals), selective "
        "(keep matmul outputs, recompute the rest) or full (replay the forward); key '*': "
        "every module not named; empty: none everywhere",
    )
    zero1: bool = doc(False, "shard optimizer state over each module's data-parallel ranks")
    sequence_parallel: bool = doc(
        False, "with tp > 1: activations between TP regions sharded on sequence"
    )
    reference: bool = doc(False, "train with the plain data-parallel reference trainer instead")
    peak_tflops: float | None = doc(
        None, "per-device peak TFLOP/s for mfu (None: the device table's, if it knows it)"
    )
    devices: int | None = doc(
        None,
        "simulated CPU devices when there is no GPU (None: 8; on GPU: all visible); in a "
        "multi-process run, devices PER PROCESS",
    )

    @property
    def rebalanced(self) -> tuple[str, ...]:
        """The names in :attr:`rebalance`."""
        return tuple(n.strip() for n in self.rebalance.split(",") if n.strip())

    @property
    def mode(self) -> Literal["colocated", "non-colocated", "homogeneous"]:
        """The executor's mode: the homogeneous baseline, else the placement."""
        return "homogeneous" if self.homogeneous else self.placement


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up and cosine decay to 10% of the peak."""

    lr: float = doc(3e-3, "peak learning rate")
    warmup_steps: int | None = doc(None, "warm-up steps (None: 10% of the run, at least 1)")
    weight_decay: float = doc(0.01, "AdamW decay on matrices (not biases / norms)")
    clip_norm: float = doc(1.0, "global gradient-norm clip (<= 0: off)")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Where and how often the run's state is saved; a run resumes from the latest."""

    dir: str | None = doc(None, "checkpoint directory: resume from its latest checkpoint")
    save_every: int | None = doc(None, "save every N steps (None: only at the end)")
    keep: int = doc(3, "the most recent complete checkpoints kept")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """A multi-process job started by hand (not needed under hetjax.launch or SLURM)."""

    coordinator: str | None = doc(None, "HOST:PORT of process 0")
    num_processes: int | None = doc(None, "number of processes of the job")
    process_id: int | None = doc(None, "this process's index, 0 .. num_processes-1")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """What process 0 writes besides the progress output."""

    metrics: str | None = doc(None, "JSON Lines path for per-step metrics")
    timeline: str | None = doc(None, "PNG path: profile the last step, draw its Gantt chart")
    tensorboard: str | None = doc(None, "directory for TensorBoard event files of every metric")
    profile_steps: str | None = doc(
        None, "'A:B': trace metrics steps A to B (0-based, inclusive) with jax.profiler"
    )
    profile_dir: str | None = doc(None, "directory of the jax.profiler trace (each process's own)")
    plot: str | None = doc(None, "PNG path: loss, tokens/s and grad norms per module at the end")

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """``profile_steps`` as ``(A, B)`` (checked by :func:`check`), or None."""
        if self.profile_steps is None:
            return None
        a, b = self.profile_steps.split(":")
        return int(a), int(b)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on; ``--print-config`` writes it out."""

    steps: int = doc(200, "optimiser steps of the whole run (a resumed run counts from 0)")
    stop_after: int | None = doc(
        None, "end cleanly after this step (with a checkpoint); the schedule stays `steps`"
    )
    skip_nonfinite_steps: int = doc(
        0, "skip updates whose loss or gradient is NaN/inf; stop after N in a row (0: stop)"
    )
    seed: int = doc(0, "initialisation and data seed; same seed -> identical losses")
    model: ModelConfig = doc(ModelConfig(), "what is trained")
    data: DataConfig = doc(DataConfig(), "what each step reads")
    parallel: ParallelConfig = doc(ParallelConfig(), "layouts, placement and schedule")
    optimizer: OptimizerConfig = doc(OptimizerConfig(), "AdamW and its schedule")
    checkpoint: CheckpointConfig = doc(CheckpointConfig(), "saved state")
    distributed: DistributedConfig = doc(DistributedConfig(), "a hand-started job")
    logging: LoggingConfig = doc(LoggingConfig(), "files process 0 writes")

    def __post_init__(self):
        check(self)


# Value rules: dotted path -> (holds for the value, what it must be). None always passes
# where the field's type allows it.
_RULES: dict[str, tuple[typing.Callable[[Any], bool], str]] = {
    "steps": (lambda v: v >= 1, "a positive integer"),
    "stop_after": (lambda v: v >= 1, "a positive integer"),
    "skip_nonfinite_steps": (lambda v: v >= 0, "an integer >= 0"),
    "checkpoint.save_every": (lambda v: v >= 1, "a positive integer"),
    "checkpoint.keep": (lambda v: v >= 1, "a positive integer"),
    "seed": (lambda v: v >= 0, "a non-negative integer (it seeds numpy's generator)"),
    "model.seq_len": (lambda v: v >= 1, "a positive integer"),
    "model.vocab_size": (lambda v: v >= 1, "a positive integer"),
    "data.global_batch": (lambda v: v >= 1, "a positive integer"),
    "data.sources": (lambda v: all(w > 0 for w in v.values()), "positive mixture weights"),
    "data.max_images_per_microbatch": (lambda v: v >= 1, "a positive integer"),
    "data.max_loss_tokens_per_microbatch": (lambda v: v >= 1, "a positive integer"),
    "data.max_samples_per_row": (lambda v: v >= 1, "a positive integer"),
    "data.max_patches_per_microbatch": (lambda v: v >= 1, "a positive integer"),
    "data.min_pixels": (lambda v: v >= 1, "a positive integer"),
    "data.max_pixels": (lambda v: v >= 1, "a positive integer"),
    "data.video_fps": (lambda v: v > 0, "a positive number"),
    "data.max_frames": (lambda v: v >= 2, "an integer >= 2 (one temporal patch)"),
    "data.workers": (lambda v: v >= 1, "a positive integer"),
    "data.prefetch": (lambda v: v >= 1, "a positive integer"),
    "data.synthetic_max_images": (lambda v: v >= 1, "a positive integer"),
    "parallel.microbatches": (lambda v: v >= 1, "a positive integer"),
    "parallel.devices": (lambda v: v >= 1, "a positive integer"),
    "parallel.peak_tflops": (lambda v: v > 0, "a positive number"),
    "parallel.islands": (lambda v: all(n >= 1 for n in v.values()), "positive device counts"),
    "parallel.layouts": (lambda v: all(k and t for k, t in v.items()), "non-empty texts"),
    "optimizer.lr": (lambda v: v > 0, "a positive number"),
    "optimizer.warmup_steps": (lambda v: v >= 0, "an integer >= 0"),
    "distributed.num_processes": (lambda v: v >= 1, "a positive integer"),
    "distributed.process_id": (lambda v: v >= 0, "an integer >= 0"),
}
# Options of the heterogeneous executor that the reference trainer does not have.
_NOT_FOR_REFERENCE = (
    "logging.timeline",
    "parallel.zero1",
    "parallel.sequence_parallel",
    "parallel.offload_encoder",
    "parallel.recompute",
    "parallel.rebalance",
)


def check(cfg: TrainConfig) -> None:
    """Checks every field's type and what the config alone can decide.

    Raises:
        InvalidConfigError: one line naming the field, e.g. ``parallel.microbatches=0
            must be a positive integer``.
    """
    for path, value, hint in walk(cfg):
        if not matches(value, hint):
            raise InvalidConfigError(f"{path}={value!r} is not {describe(hint)}")
        rule = _RULES.get(path)
        if rule is not None and value is not None and not rule[0](value):
            raise InvalidConfigError(f"{path}={value!r} must be {rule[1]}")
    if cfg.stop_after is not None and cfg.stop_after > cfg.steps:
        raise InvalidConfigError(
            f"stop_after={cfg.stop_after} is past the run's steps={cfg.steps}; give a step "
            f"of the run (1..{cfg.steps})"
        )
    m = cfg.model
    if m.init_from and (m.init or m.preset != "tiny"):
        other = "model.init" if m.init else f"model.preset={m.preset!r}"
        raise InvalidConfigError(
            f"model.init_from takes the whole model from its config.json; drop {other}"
        )
    if set(m.init) - {"vision", "llm"}:
        bad = sorted(set(m.init) - {"vision", "llm"})[0]
        raise InvalidConfigError(
            f"model.init names {bad!r}: only 'vision' (CLIP/SigLIP) and 'llm' (Llama) start "
            "from Hugging Face checkpoints"
        )
    if m.vocab_size is not None and (m.init_from or "llm" in m.init):
        where = "model.init_from" if m.init_from else "model.init's llm"
        raise InvalidConfigError(
            f"model.vocab_size={m.vocab_size} is for a fresh LLM; the vocabulary comes from "
            f"{where}: drop model.vocab_size"
        )
    if cfg.checkpoint.save_every is not None and not cfg.checkpoint.dir:
        raise InvalidConfigError(
            "checkpoint.save_every needs checkpoint.dir; give the directory to save into"
        )
    check_logging(cfg)
    _check_data(cfg.data)
    p = cfg.parallel
    if p.homogeneous and p.placement != "colocated":
        raise InvalidConfigError(
            "parallel.homogeneous puts the encoders on the LLM's first stage, so it takes no "
            f"parallel.placement={p.placement!r}; drop one of them"
        )
    if p.islands and p.placement != "non-colocated":
        raise InvalidConfigError(
            "parallel.islands is only for parallel.placement='non-colocated'; drop "
            "parallel.islands or set parallel.placement='non-colocated'"
        )
    if p.reference:
        for path in _NOT_FOR_REFERENCE:
            section, name = path.split(".")
            if getattr(getattr(cfg, section), name):
                raise InvalidConfigError(
                    f"{path} is a heterogeneous-executor option; drop parallel.reference"
                )


def _check_data(d: DataConfig) -> None:
    """LLaVA settings come with LLaVA files, and the files with a tokenizer."""
    if d.sources and d.tokenizer is None:
        raise InvalidConfigError("data.sources needs data.tokenizer (a tokenizer.json)")
    if d.max_samples_per_row is not None and not d.pack:
        raise InvalidConfigError("data.max_samples_per_row bounds packed rows; give data.pack")
    if d.sources and d.synthetic_max_images != 1:
        raise InvalidConfigError("data.synthetic_max_images is for synthetic data; drop it")
    if not d.sources:
        names = ("tokenizer", "image_folder", "pack", "max_images_per_microbatch")
        given = [f for f in names if getattr(d, f) not in (None, False)]
        if given:
            raise InvalidConfigError(
                f"data.{given[0]} is for LLaVA files; give data.sources too (synthetic data "
                "takes none)"
            )


def sections() -> dict[str, type]:
    """Section name -> its dataclass, in :class:`TrainConfig` order."""
    hints = typing.get_type_hints(TrainConfig)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(TrainConfig)
        if dataclasses.is_dataclass(hints[f.name])
    }


def leaves(cls: type = TrainConfig, prefix: str = "") -> dict[str, Leaf]:
    """Dotted path -> :class:`Leaf` of every setting, in declaration order."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    out: dict[str, Leaf] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(leaves(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = Leaf(hints[f.name], getattr(defaults, f.name), f.metadata["doc"])
    return out
