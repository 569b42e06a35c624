"""Qwen2.5-VL as a :class:`hetjax.train.Trainer` model and batch source.

:class:`QwenTask` is :class:`models.llava.task.LlavaTask`'s counterpart for a
``qwen2.5-vl`` preset: the trainer's protocol over a :class:`~models.qwen.model.QwenVL`
built from a run's ``model`` and ``data`` settings, on synthetic dynamic-resolution data
(:mod:`models.qwen.data`) or LLaVA-format record files of images and videos
(:mod:`models.qwen.loader`). :class:`QwenBatches` hands out one global batch per step.

The static shapes are two budgets per microbatch, split evenly over its rows: patches
(``data.max_patches_per_microbatch``: the tower's row length; default the most a
synthetic sample has, or one of the first records) and supervised tokens
(``data.max_loss_tokens_per_microbatch``, as LLaVA's). ``model.init_from`` starts from a
Hugging Face ``Qwen2_5_VLForConditionalGeneration`` directory: the model from its
``config.json`` (vision placeholder ids included), the weights read lazily per process
(:func:`models.hf.qwen.read_qwen`). ``data.pack`` packs record files' samples several to
a row (:mod:`models.qwen.packing`); ``model.init`` (parts) is refused in one line.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import Layout, LayoutError
from hetjax.config import TrainConfig
from models import tokenizer
from models.config import PRESETS, MLLMConfig, get_preset
from models.llava import rows as rows_lib
from models.llava.rows import attention_segments
from models.llava.task import LlavaTask

from . import flops as qwen_flops
from . import loader as qwen_loader
from .config import QwenVisionConfig
from .data import QwenSyntheticConfig, SyntheticQwen
from .model import QwenVL


def is_qwen(config: TrainConfig) -> bool:
    """Whether the run's model is Qwen2.5-VL (the entry point picks the task): a Qwen
    preset, or ``model.init_from`` a directory whose ``config.json`` has a Qwen
    ``model_type`` (an unreadable one goes to LlavaTask, which says so in one line)."""
    m = config.model
    if m.init_from:
        return _model_type(m.init_from).startswith("qwen")
    preset = PRESETS.get(m.preset)  # an unknown name: LlavaTask says so in one line
    return preset is not None and isinstance(preset.vision, QwenVisionConfig)


def _model_type(path: str) -> str:
    try:
        return str(json.loads((pathlib.Path(path) / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def model_config(path: str) -> MLLMConfig:
    """The model of a Hugging Face Qwen2.5-VL directory (its ``config.json`` only).

    Raises:
        ValueError: one line: another Qwen family (Qwen2-VL, Qwen3-VL), or settings this
            model does not take.
    """
    from models.hf import qwen_config

    kind = _model_type(path)
    if kind != qwen_config.MODEL_TYPE:
        raise ValueError(
            f"model.init_from {path} is a {kind!r} checkpoint; Qwen2.5-VL training takes a "
            f"Qwen2_5_VLForConditionalGeneration directory (model_type "
            f"{qwen_config.MODEL_TYPE!r})"
        )
    return qwen_config.qwen_config_of(pathlib.Path(path))


class QwenTask(LlavaTask):
    """The model of a Qwen2.5-VL run (:class:`~hetjax.train.protocols.TrainableModel`):
    :class:`~models.llava.task.LlavaTask`'s members over a :class:`QwenVL` (``mllm``),
    its own set-up, summary and FLOPs.

    Args:
        config: the run's settings (``model``, ``data``, ``seed``, ``parallel``).
        preset: the model instead of ``model.preset``'s.

    Raises:
        ValueError: one line: settings this family does not train with yet, or budgets
            that do not fit the data.
    """

    def __init__(self, config: TrainConfig, *, preset: MLLMConfig | None = None):
        self.run_config, self.given_params = config, None
        m, d = config.model, config.data
        if m.init:
            raise ValueError(
                "model.init is not wired to Qwen2.5-VL training (its parts load together): "
                "give the whole Hugging Face directory as model.init_from, or drop model.init"
            )
        if config.parallel.layouts == {"auto": "auto"}:
            raise ValueError(
                "parallel.layouts=auto: the planner does not cost the Qwen2.5-VL tower yet; "
                "give each module's layout (vision and llm)"
            )
        preset = preset or (model_config(m.init_from) if m.init_from else get_preset(m.preset))
        if m.vocab_size is not None:
            llm = dataclasses.replace(preset.llm, vocab=m.vocab_size)
            preset = dataclasses.replace(preset, llm=llm)
        self.seq_len = m.seq_len or preset.seq_len
        from models.llava import run as llava_run

        rows = d.global_batch // config.parallel.microbatches
        given, max_segments, self.samples_budget = preset, None, ""
        if d.sources:  # record files (models.qwen.loader): the budgets come from them
            self.dataset, preset = qwen_loader.build(
                d,
                preset,
                seq_len=self.seq_len,
                seed=config.seed,
                microbatches=config.parallel.microbatches,
                grow_vocab=m.vocab_size is None and not m.init_from,
            )
            if m.init_from:
                check_tokenizer_ids(m.init_from, given, preset)
            self.patch_budget, self.loss_budget = (
                self.dataset.patch_budget,
                self.dataset.loss_budget,
            )
            loss_tokens = self.dataset.config.loss_tokens_per_row
            if d.pack:  # packed rows: their segments bound the attention's
                max_segments = attention_segments(self.dataset.config.samples_per_row)
                self.samples_budget = self.dataset.samples_budget
        else:
            if m.init_from:
                check_synthetic_ids(m.init_from, preset)
            data = QwenSyntheticConfig(
                preset.vision, self.seq_len, preset.image_token_id, 0, seed=config.seed
            )
            patches, source = patch_budget(d.max_patches_per_microbatch, data, rows)
            data = dataclasses.replace(data, patches_per_row=patches)
            self.patch_budget = llava_run.budget_line(patches, rows, source)
            self.dataset = SyntheticQwen(data)
            loss_tokens, source = llava_run.synthetic_loss_tokens(
                d.max_loss_tokens_per_microbatch, data, rows
            )
            self.loss_budget = llava_run.budget_line(loss_tokens, rows, source)
        self.config, self.rows = preset, rows
        self.patches_per_row = self.dataset.config.patches_per_row  # the tower's row length
        dtype = jnp.bfloat16 if m.dtype == "bfloat16" else jnp.float32
        self.mllm = QwenVL(
            preset,
            dtype,
            packed=d.pack,
            loss_tokens_per_row=loss_tokens,
            max_segments=max_segments,
        )
        # Real counts of each batch handed out, in step order, for flop_metrics (its
        # callback sees the supervised tokens only; the loop reports steps in order).
        self.counts: collections.deque = collections.deque()

    # -- the protocol: LlavaTask's over ``self.mllm``, but for these ----------------------

    def validate_layouts(self, layouts: Mapping[str, Layout]) -> None:
        """:meth:`QwenVL.validate_layouts`, and a tower with cp > 1 splits each row's
        patches (the patch budget per row) evenly over its cp ranks.

        Raises:
            LayoutError: one line naming the patch budget that splits.
        """
        self.mllm.validate_layouts(layouts, seq_len=self.seq_len)
        cp = layouts["vision"].cp if "vision" in layouts else 1
        if cp > 1 and self.patches_per_row % cp:
            unit = math.lcm(cp, self.config.vision.merge_unit)
            up = -(-self.patches_per_row // unit) * unit * self.rows
            raise LayoutError(
                f"vision: cp={cp} must divide a row's {self.patches_per_row} patches (the "
                f"tower splits each row over cp); use max_patches_per_microbatch={up}"
            )

    def initial_params(self, key: jax.Array, *, lead: bool) -> Any:
        """Fresh parameters, or ``model.init_from``'s weights read lazily (each process
        reads only what its devices hold when the trainer places them); process 0
        (``lead``) prints what was read."""
        m = self.run_config.model
        if not m.init_from:
            return self.mllm.init(key)
        from models.hf import LoadReport
        from models.hf.files import read_config
        from models.hf.qwen import read_qwen

        path = pathlib.Path(m.init_from)
        params, unused = read_qwen(self.mllm, path, read_config(path), lazy=True)
        if lead:
            report = LoadReport(dict.fromkeys(params, str(path)), {str(path): unused})
            for line in report.lines():
                print(line, flush=True)
        return params

    def summary(self) -> dict[str, Any]:
        """The patch, loss and (packed) samples budgets, and where they came from."""
        out = {"patches": self.patch_budget, "loss tokens": self.loss_budget}
        return {**out, "samples per row": self.samples_budget} if self.samples_budget else out

    def step_flops(self, supervised: int, head_tokens: int) -> tuple[dict, dict, dict, dict]:
        """As :meth:`LlavaTask.step_flops` (what :meth:`LlavaTask.flop_metrics` reads),
        with the tower counted per patch at the step's real counts: its patches, and the
        pairs within each window and frame its attention needs
        (:func:`models.qwen.flops.forward_flops`); executed, every patch of the budget
        and each row's whole square. The counts come from the batch source, in step
        order (the loop reports every step once, in order)."""
        counts = self.counts.popleft()
        sizes = (self.config, counts, self.run_config.data.global_batch, self.seq_len)
        return (
            qwen_flops.forward_flops(*sizes, supervised),
            qwen_flops.attention_flops(*sizes),
            qwen_flops.forward_flops(*sizes, supervised, executed=True, head_tokens=head_tokens),
            qwen_flops.attention_flops(*sizes, executed=True),
        )


class QwenBatches:
    """The run's batches (:class:`~hetjax.train.protocols.BatchSource`): synthetic (a
    function of seed and step), or record files from a loader position (:meth:`start`);
    each step's patch counts go to the metrics (``patches``: real ones, ``patch_fill``:
    their share of the budget), and synthetic batches' ``patch_imbalance`` and
    ``token_imbalance`` over the tower's and the LLM's data-parallel ranks, as the record
    loader gives them (:func:`models.llava.rows.metrics`)."""

    def __init__(self, task: QwenTask):
        from models.llava import run as llava_run

        self.task = task
        cfg = task.run_config
        self.stream = llava_run.SyntheticStream(task.dataset, cfg.data.global_batch, cfg.seed)
        self.metrics: dict[int, dict[str, float]] = {}
        self.bins: tuple[int, int, int] | None = None  # synthetic: for the imbalance metrics

    def start(self, trainer: Any, state: Mapping[str, Any] | None) -> None:
        """Record files: the loader from a checkpoint's position, balancing over the
        trainer's microbatches and each module's data-parallel ranks (synthetic: those
        ranks for the imbalance metrics)."""
        if trainer.plan is None:  # the reference trainer: data parallel over every device
            dp = {"llm": len(trainer.devices)}
        else:
            dp = {m.name: m.layout.data_ranks for m in trainer.graph.modules}
        bins = (trainer.microbatches, dp.get("vision", dp["llm"]), dp["llm"])
        if not self.task.run_config.data.sources:
            self.bins = bins
            return
        saved = state["state"] if state and state.get("kind") == "qwen" else None
        self.stream = qwen_loader.QwenStream(self.task.dataset, bins, saved)

    def batch(self, step: int) -> dict[str, Any]:
        batch = self.stream.batch(step)
        self.task.mllm.check_loss_budget(batch)
        counts = qwen_flops.vision_counts(batch)
        self.task.counts.append(counts)
        budget = batch["frame_ids"].size
        self.metrics[step] = {"patches": counts.patches, "patch_fill": counts.patches / budget}
        if self.bins is not None:
            tokens = (batch["tokens"] != tokenizer.PAD).sum(1)
            loads = np.stack([tokens, qwen_flops.row_patches(batch)], axis=1)
            m = rows_lib.metrics(loads, self.bins, self.task.seq_len)
            if "image_imbalance" in m:
                self.metrics[step]["patch_imbalance"] = m["image_imbalance"]
                self.metrics[step]["token_imbalance"] = m["token_imbalance"]
        return batch

    def step_metrics(self, step: int) -> dict[str, float]:
        return {**self.stream.step_metrics(step), **self.metrics.pop(step, {})}

    def checkpoint(self) -> dict[str, Any]:
        return self.stream.checkpoint()

    def summary(self) -> str:
        return self.stream.summary()

    def close(self) -> None:
        self.stream.close()


def patch_budget(budget: int | None, data: QwenSyntheticConfig, rows: int) -> tuple[int, str]:
    """The tower's row length (patches per row) and where it came from: the flag's share of
    a microbatch, or (default) the most patches a synthetic sample has.

    Raises:
        ValueError: the share does not split evenly, is not a whole number of merge
            units, or is below what a sample needs (one line, the fix).
    """
    from models.llava import run as llava_run

    need, unit = data.max_sample_patches(), data.vision.merge_unit
    if budget is None:
        return need, "the most a synthetic sample has (--max-patches-per-microbatch sets it)"
    per = llava_run.per_row("max_patches_per_microbatch", budget, rows)
    if per < need:
        raise ValueError(
            f"max_patches_per_microbatch={budget} is {per} patches per row of a {rows}-row "
            f"microbatch, but synthetic samples have up to {need}; use "
            f"max_patches_per_microbatch={need * rows}"
        )
    if per % unit:
        up = -(-per // unit) * unit * rows
        raise ValueError(
            f"max_patches_per_microbatch={budget} is {per} patches per row, not a multiple of "
            f"the {unit} patches the merger joins into one token; use "
            f"max_patches_per_microbatch={up}"
        )
    return per, "--max-patches-per-microbatch"


def check_synthetic_ids(path: str, config: MLLMConfig) -> None:
    """Synthetic data writes text with the byte tokenizer (ids up to its EOS): a
    checkpoint's vision token ids must lie above them and inside its vocabulary.

    Raises:
        ValueError: one line: give record files with the checkpoint's tokenizer instead.
    """
    v, vocab = config.vision, config.llm.vocab
    ids = {
        "image_token_id": config.image_token_id,
        "video_token_id": v.video_token_id,
        "vision_start_token_id": v.vision_start_token_id,
        "vision_end_token_id": v.vision_end_token_id,
    }
    bad = [f"{k}={i}" for k, i in ids.items() if not tokenizer.EOS < i < vocab]
    if bad:
        raise ValueError(
            f"model.init_from {path}: synthetic data needs the vision token ids between the "
            f"byte tokenizer's {tokenizer.EOS + 1} ids and the vocabulary's {vocab}, not "
            f"{', '.join(bad)}; give data.sources records with the checkpoint's tokenizer"
        )


def check_tokenizer_ids(path: str, checkpoint: MLLMConfig, data: MLLMConfig) -> None:
    """The tokenizer's vision token ids (``data``: what the loader set) must be those the
    checkpoint was trained with (its ``config.json``).

    Raises:
        ValueError: one line naming the first id that differs.
    """
    names = ("video_token_id", "vision_start_token_id", "vision_end_token_id")
    pairs = [("image_token_id", checkpoint.image_token_id, data.image_token_id)]
    pairs += [(n, getattr(checkpoint.vision, n), getattr(data.vision, n)) for n in names]
    for name, want, got in pairs:
        if want != got:
            raise ValueError(
                f"data.tokenizer gives {name}={got} but model.init_from {path}'s config.json "
                f"has {want}; use the checkpoint's own tokenizer"
            )
