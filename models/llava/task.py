"""The LLaVA MLLM as a :class:`hetjax.train.Trainer` model and batch source.

:class:`LlavaTask` is what the trainer's protocols ask for (module names, layout checks,
the training graph, parameters, FLOPs for MFU, checkpoint metadata) over a
:class:`models.mllm.MLLM` built from a run's ``model`` and ``data`` settings: a preset,
a Hugging Face LLaVA directory (``model.init_from``) or a preset with Hugging Face parts
(``model.init``), and synthetic data or LLaVA record files (``data.sources``).
:class:`LlavaBatches` hands the trainer one global batch per step, from the loader
position a resumed checkpoint stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from hetjax.config import TrainConfig
from hetjax.meshes import Layout
from hetjax.runtime import flops as flops_lib
from hetjax.runtime.graph import TrainGraph
from models.config import MLLMConfig, config_to_dict, get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM, check_llava


class LlavaTask:
    """The model of a run (:class:`~hetjax.train.protocols.TrainableModel`).

    Args:
        config: the run's settings (``model``, ``data``, ``seed``, ``parallel``).
        preset: the model instead of ``model.preset``'s (a benchmark's shrunk preset).
        params: the initial parameters instead of fresh or Hugging Face ones (benchmark
            rows that share one initialisation).

    Raises:
        ValueError: one line: an unknown preset, a tokenizer or record file that does not
            fit the model (the validation pass over every record file runs here).
    """

    def __init__(
        self, config: TrainConfig, *, preset: MLLMConfig | None = None, params: Any = None
    ):
        self.run_config = config
        self.given_params = params
        m = config.model
        preset = preset or model_config(m)
        fresh = not (m.init_from or "llm" in m.init)  # the LLM's vocabulary is ours to set
        if m.vocab_size is not None:
            preset = dataclasses.replace(
                preset, llm=dataclasses.replace(preset.llm, vocab=m.vocab_size)
            )
        self.seq_len = config.model.seq_len or preset.seq_len
        images_per_row, max_segments = 1, None
        from models.llava import run as llava_run
        from models.llava.rows import attention_segments

        if config.data.sources:
            self.dataset, preset = llava_run.build(
                config.data,
                preset,
                seq_len=self.seq_len,
                seed=config.seed,
                microbatches=config.parallel.microbatches,
                grow_vocab=fresh and m.vocab_size is None,
            )
            images_per_row = self.dataset.config.images_per_row
            loss_tokens = self.dataset.config.loss_tokens_per_row
            self.loss_budget = self.dataset.loss_budget
            samples = self.dataset.config.samples_per_row
            if samples is not None:  # packed rows: their segments bound the attention's
                max_segments = attention_segments(samples)
        else:
            images_per_row = config.data.synthetic_max_images
            data = SyntheticConfig.for_model(
                preset, seq_len=self.seq_len, seed=config.seed, max_images=images_per_row
            )
            self.dataset = SyntheticLlava(data)
            rows = config.data.global_batch // config.parallel.microbatches
            budget = config.data.max_loss_tokens_per_microbatch
            loss_tokens, source = llava_run.synthetic_loss_tokens(budget, data, rows)
            self.loss_budget = llava_run.budget_line(loss_tokens, rows, source)
        dtype = jnp.bfloat16 if config.model.dtype == "bfloat16" else jnp.float32
        # Packed rows (several samples each, at most max_segments runs of segment ids)
        # attend within their samples only; the LM head computes logits at a row's
        # (bounded) supervised positions only.
        self.mllm = MLLM(
            preset,
            dtype=dtype,
            images_per_row=images_per_row,
            packed=config.data.pack,
            loss_tokens_per_row=loss_tokens,
            max_segments=max_segments,
        )
        self.config: MLLMConfig = preset

    # -- the protocol ---------------------------------------------------------------------

    @property
    def module_names(self) -> list[str]:
        return self.mllm.module_names

    def validate_layouts(self, layouts: Mapping[str, Layout]) -> None:
        self.mllm.validate_layouts(layouts, seq_len=self.seq_len)

    def train_graph(
        self, layouts: Mapping[str, Layout], *, freeze: Collection[str] = ()
    ) -> TrainGraph:
        return self.mllm.train_graph(layouts, freeze=freeze)

    def init(self, key: jax.Array) -> Any:
        return self.mllm.init(key)

    def initial_params(self, key: jax.Array, *, lead: bool) -> Any:
        """The given parameters, fresh ones, or lazily read Hugging Face weights (each
        process then reads only what its devices hold when the trainer places them);
        process 0 (``lead``) prints what was read."""
        if self.given_params is not None:
            return self.given_params
        m = self.run_config.model
        if not (m.init_from or m.init):
            return self.mllm.init(key)
        from models import hf

        if m.init_from:
            params, report = hf.read_llava(self.mllm, m.init_from, lazy=True)
        else:
            params, report = hf.read_parts(self.mllm, m.init, key=key, lazy=True)
        if lead:
            for line in report.lines():
                print(line, flush=True)
        return params

    def loss_sum(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return self.mllm.loss_sum(params, batch)

    def logical_axes(self, frozen: Collection[str]) -> dict[str, Any]:
        return {n: m.logical_axes() for n, m in self.mllm.modules.items() if n not in frozen}

    def num_params(self) -> dict[str, int]:
        return self.mllm.num_params()

    def describe(self) -> str:
        counts = self.mllm.num_params()
        params = ", ".join(f"{k} {v:,}" for k, v in counts.items())
        return f"{self.config.name}: {sum(counts.values()):,} params ({params})"

    def summary(self) -> dict[str, Any]:
        """The image budget (LLaVA files), the loss budget and the samples per packed row,
        and where they came from (flag or data)."""
        images = {"image slots": self.dataset.image_budget} if self.run_config.data.sources else {}
        out = {**images, "loss tokens": self.loss_budget}
        if self.mllm.max_segments is not None:
            out["samples per row"] = self.dataset.samples_budget
        return out

    def metadata(self) -> dict[str, Any]:
        return {
            "preset": self.config.name,
            "params": self.mllm.num_params(),
            "config": config_to_dict(self.config),  # what experiments.export rebuilds
        }

    def flop_metrics(self, trainer: Any):
        """``(supervised tokens, step time) -> FLOP metrics`` of the run
        (:func:`hetjax.runtime.flops.throughput_metrics`): model FLOPs from the model's
        forward FLOPs per part by the rule there (3x trained, 2x + attention frozen with a
        gradient through, 1x forward only); hardware FLOPs count what the kernels compute
        (the whole causal square, the head over every position it runs at: the loss
        budget's, :meth:`models.mllm.MLLM.head_positions`) and the
        executor's backward recompute (the reference trainer recomputes nothing); MFU
        with the peak of ``parallel.peak_tflops`` or the device table."""
        devices, plan, graph = trainer.devices, trainer.plan, trainer.graph
        peak = self.run_config.parallel.peak_tflops or flops_lib.peak_tflops(devices[0].device_kind)
        n = len(devices)
        if plan is None:
            module_devices = {m.name: n for m in graph.modules}
        else:
            module_devices = {name: len(pos) for name, pos in plan.positions.items()}
        batch = self.run_config.data.global_batch
        # The head runs at its gathered positions: per cp block of the LLM's layout.
        cp = 1 if plan is None else next(m.layout.cp for m in graph.modules if m.name == "llm")
        head = batch * self.mllm.head_positions(self.seq_len, cp)

        def metrics(supervised: float, step_time_s: float) -> dict[str, float]:
            forward, attention, executed, executed_attention = self.step_flops(
                int(supervised), head
            )
            model = flops_lib.model_flops(graph, forward, attention)
            if plan is None:  # the reference trainer recomputes nothing
                hardware = flops_lib.model_flops(graph, executed, executed_attention)
            else:
                hardware = flops_lib.hardware_flops(graph, executed, executed_attention)
            return flops_lib.throughput_metrics(
                model,
                hardware,
                step_time_s,
                num_devices=n,
                module_devices=module_devices,
                peak=peak,
            )

        return metrics

    def step_flops(self, supervised: int, head_tokens: int) -> tuple[dict, dict, dict, dict]:
        """One step's forward FLOPs per part and the part of them in attention, as the
        anchors count them, then as the kernels compute them (the head over
        ``head_tokens``): :meth:`models.config.MLLMConfig.forward_flops` over every
        image slot."""
        cfg, per = self.config, {"images_per_sample": self.mllm.images_per_row}
        sizes = (self.run_config.data.global_batch, self.seq_len, supervised)
        return (
            cfg.forward_flops(*sizes, **per),
            cfg.attention_flops(*sizes[:2], **per),
            cfg.forward_flops(*sizes, executed=True, head_tokens=head_tokens, **per),
            cfg.attention_flops(*sizes[:2], executed=True, **per),
        )


class LlavaBatches:
    """The run's batches (:class:`~hetjax.train.protocols.BatchSource`): LLaVA record
    files from a resumed loader position, or synthetic (a function of seed and step). In
    a multi-process run each process decodes only the images its devices are fed."""

    def __init__(self, task: LlavaTask):
        self.task = task
        self.stream: Any = None

    def start(self, trainer: Any, state: Mapping[str, Any] | None) -> None:
        from hetjax.runtime.feed import local_rows
        from models.llava import run as llava_run

        cfg = self.task.run_config
        if not cfg.data.sources:
            self.stream = llava_run.SyntheticStream(
                self.task.dataset, cfg.data.global_batch, cfg.seed
            )
            return
        saved = state["state"] if state and state.get("kind") == "llava" else None
        if trainer.plan is None:  # the reference trainer: data parallel over every device
            dp = {"llm": len(trainer.devices)}
        else:
            dp = {m.name: m.layout.data_ranks for m in trainer.graph.modules}
        microbatches = trainer.microbatches
        bins = (microbatches, dp.get("vision", dp["llm"]), dp["llm"])
        image_rows = None  # one process, or the reference trainer: every image
        shape = self.task.dataset.images_shape
        if jax.process_count() > 1 and trainer.plan is not None and shape is not None:
            programs = trainer.engine.programs.values()
            image_rows = local_rows(programs, microbatches, {"images": shape})["images"]
        self.stream = llava_run.DataStream(self.task.dataset, bins, saved, image_rows=image_rows)

    def batch(self, step: int) -> dict[str, Any]:
        batch = self.stream.batch(step)  # a bad record: models.llava.BadSample (a ValueError)
        self.task.mllm.check_loss_budget(batch)
        self.task.mllm.check_segments(batch)
        return batch

    def step_metrics(self, step: int) -> dict[str, float]:
        return self.stream.step_metrics(step)

    def checkpoint(self) -> dict[str, Any]:
        return self.stream.checkpoint()

    def summary(self) -> str:
        return self.stream.summary() if self.stream else "-"

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def model_config(m: Any) -> MLLMConfig:
    """The model of ``model`` settings: a preset, a Hugging Face LLaVA's config.json, or
    a preset with parts from Hugging Face checkpoints (reads configs only, no weights)."""
    if m.init_from:
        from models import hf

        return check_llava(hf.llava_config_of(m.init_from))
    preset = check_llava(get_preset(m.preset))
    if m.init:
        from models import hf

        return hf.parts_config(m.init, preset)
    return preset
