"""The composed LLaVA-style MLLM: encoders + projectors feeding a Llama-style LLM.

Modules are :class:`hetjax.StagedModule` objects keyed by name: ``vision`` and its
``projector``; ``audio`` and its ``audio_projector``; ``llm``. Parameters are a dict
with the same keys, so per-module metrics (gradient and parameter norms) and
per-module layouts address the same names.

The loss contract: :meth:`MLLM.loss_sum` returns the SUM of next-token cross-entropy over
supervised tokens of whatever (micro)batch it is given; dividing by the supervised-token
count of the GLOBAL batch gives the same loss for any split of the batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hetjax import Layout, LayoutError, Link, ModuleSpec, Params, StagedModule, TrainGraph
from hetjax.meshes import validate_divisible
from hetjax.runtime.graph import frozen_parts
from models import tokenizer
from models.config import MLLMConfig
from models.encoders import make_encoder, make_projector
from models.llm import make_llm

# modality name in the data / LLM placeholders -> (encoder module, projector module, batch key)
MODALITIES = {
    "image": ("vision", "projector", "images"),
    "audio": ("audio", "audio_projector", "audio"),
}
# Packed rows' extra batch keys ``[B, L]`` (``models.llava.rows``), read by every LLM block.
PACKED_KEYS = ("segment_ids", "positions")


def check_llava(config: MLLMConfig) -> MLLMConfig:
    """``config``, if it is an LLaVA-style model, which :class:`MLLM` (and so LLaVA's task)
    builds; a one-line error for Qwen2.5-VL (:mod:`models.qwen`: the trainer takes its
    presets and Hugging Face directories through :class:`models.qwen.task.QwenTask`)."""
    if config.vision is not None and config.vision.kind == "qwen2_5_vl":
        raise ValueError(
            f"model {config.name!r} (Qwen2.5-VL) is not an LLaVA model: train a qwen2.5-vl "
            "preset (model.preset) or its Hugging Face directory (model.init_from), or build "
            "it with models.qwen.QwenVL"
        )
    return config


class MLLM:
    """An LLaVA-style model built from a :class:`models.config.MLLMConfig`.

    Args:
        config: the model preset.
        dtype: compute dtype (``jnp.float32`` or ``jnp.bfloat16``); parameters stay float32.
        images_per_row: image slots per sample (row); above 1 the batch's ``images`` are
            ``[B, K, H, W, C]`` and row ``b``'s ``k``-th placeholder run takes image ``k``.
            Parameters do not depend on it.
        packed: rows hold several samples: batches carry ``segment_ids`` and
            ``positions`` (:data:`PACKED_KEYS`), and the LLM attends within a sample only,
            with RoPE positions restarting per sample. Parameters do not depend on it.
        loss_tokens_per_row: the most supervised tokens a row has (a bound the data
            guarantees: :func:`models.llava.run.loss_budget`); the LM head then computes
            logits at that many positions per row instead of all ``L``
            (:class:`models.llm.LMHeadLoss`). ``None``: every position. Parameters do not
            depend on it; :meth:`check_loss_budget` checks a batch against it.
        max_segments: packed: the most runs of equal segment ids any row has (its
            samples and its trailing padding, :func:`models.llava.rows.attention_segments`;
            a bound the data guarantees). With it, bf16 attention on a GPU runs cuDNN's
            packed layout (each sample causal on its own, no bias); without, the packed
            mask is an additive bias over the whole square. Parameters and the float32
            maths do not depend on it; :meth:`check_segments` checks a batch against it.
    """

    def __init__(
        self,
        config: MLLMConfig,
        dtype: Any = jnp.float32,
        images_per_row: int = 1,
        *,
        packed: bool = False,
        loss_tokens_per_row: int | None = None,
        max_segments: int | None = None,
    ):
        if config.shape_only:
            raise ValueError(f"preset {config.name!r} is shape-only (planning); not runnable")
        check_llava(config)
        if max_segments is not None and not packed:
            raise ValueError("MLLM: max_segments bounds packed rows; pass packed=True")
        self.config = config
        self.images_per_row = images_per_row
        self.packed = packed
        self.loss_tokens_per_row = loss_tokens_per_row
        self.max_segments = max_segments
        self.modules: dict[str, StagedModule] = {}
        placeholders = {}
        for modality, (enc_name, proj_name, _) in MODALITIES.items():
            enc = config.encoders.get(enc_name)
            if enc is None:
                continue
            self.modules[enc_name] = make_encoder(enc_name, enc, dtype)
            self.modules[proj_name] = make_projector(
                proj_name,
                enc.width,
                config.llm.width,
                dtype,
                act=config.projector_act,
                skip=enc.block_tokens - enc.num_tokens,
                images_per_row=images_per_row if modality == "image" else 1,
            )
            placeholders[modality] = self.placeholder(modality)
        self.modules["llm"] = make_llm(
            config.llm,
            placeholders,
            dtype,
            loss_capacity=loss_tokens_per_row,
            max_segments=max_segments,
        )

    def placeholder(self, modality: str) -> int:
        """The token id that marks ``modality``'s positions in the sequence."""
        if modality == "image" and self.config.image_token_id is not None:
            return self.config.image_token_id
        return tokenizer.PLACEHOLDERS[modality]

    @property
    def modalities(self) -> list[str]:
        return [m for m, (enc, _, _) in MODALITIES.items() if enc in self.modules]

    def init(self, key: jax.Array) -> Params:
        """Parameters per module; module ``i`` (in a fixed order) uses ``fold_in(key, i)``."""
        order = ["vision", "projector", "audio", "audio_projector", "llm"]
        return {
            name: self.modules[name].init(jax.random.fold_in(key, order.index(name)))
            for name in self.modules
        }

    def num_params(self) -> dict[str, int]:
        return {name: m.num_params() for name, m in self.modules.items()}

    def encode(self, params: Params, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Projected modality tokens ``[B, N, D_llm]`` per modality."""
        out = {}
        for modality in self.modalities:
            enc_name, proj_name, key = MODALITIES[modality]
            feats_BxNxE = self.modules[enc_name](params[enc_name], batch[key])
            out[modality] = self.modules[proj_name](params[proj_name], feats_BxNxE)
        return out

    def loss_sum(self, params: Params, batch: dict[str, jax.Array]) -> jax.Array:
        """Summed cross-entropy over the supervised tokens of ``batch``."""
        llm = self.modules["llm"]
        h = llm.apply_pre(params["llm"]["pre"], batch["tokens"], **self.encode(params, batch))
        h = llm.apply_blocks(params["llm"]["blocks"], h, **self.block_inputs(batch))
        return llm.apply_post(params["llm"]["post"], h, batch["targets"], batch["loss_mask"])

    def check_loss_budget(self, batch: Mapping[str, Any]) -> None:
        """Host-side: no row of ``batch`` has more supervised tokens than the head computes
        (``loss_tokens_per_row``), which the device could only flag with a NaN loss.

        Raises:
            ValueError: one line naming the row, its count and the budget that fits.
        """
        cap = self.loss_tokens_per_row
        if cap is None:
            return
        counts = np.count_nonzero(np.asarray(batch["loss_mask"]), axis=1)
        row = int(np.argmax(counts))
        if counts[row] > cap:
            raise ValueError(
                f"row {row} of the batch has {counts[row]} supervised tokens but the LM head "
                f"computes {cap} per row; raise data.max_loss_tokens_per_microbatch to at "
                f"least {counts[row]} x the rows of a microbatch"
            )

    def check_segments(self, batch: Mapping[str, Any]) -> None:
        """Host-side: no packed row of ``batch`` has more runs of equal segment ids than
        the attention is built for (``max_segments``). The fused kernel would merge a
        row's last runs into one, its samples attending across each other, silently.

        Raises:
            ValueError: one line naming the row, its count and the setting that fits.
        """
        if self.max_segments is None:
            return
        seg_BxL = np.asarray(batch["segment_ids"])
        runs = 1 + np.count_nonzero(seg_BxL[:, 1:] != seg_BxL[:, :-1], axis=1)
        row = int(np.argmax(runs))
        if runs[row] > self.max_segments:
            raise ValueError(
                f"row {row} of the batch has {runs[row]} segments (samples, and the trailing "
                f"padding) but the attention takes {self.max_segments} "
                f"(data.max_samples_per_row={self.max_segments - 1}, and the padding); raise "
                f"data.max_samples_per_row to at least {runs[row] - 1}"
            )

    def head_positions(self, seq_len: int, cp: int = 1) -> int:
        """Positions per row the LM head computes logits at (what executed FLOPs count):
        every one, or with a loss budget the budget per stored block of the row (a cp
        rank's block under context parallelism: :class:`models.llm.LMHeadLoss`)."""
        cap, block = self.loss_tokens_per_row, seq_len // cp
        return seq_len if cap is None or cap >= block else cap * cp

    def block_inputs(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """The batch keys every LLM block reads: :data:`PACKED_KEYS` when packed.

        Raises:
            ValueError: a packed model's batch lacks them, or an unpacked one's has them
                (its attention would cross the samples of a row).
        """
        given = [k for k in PACKED_KEYS if k in batch]
        if self.packed and len(given) < len(PACKED_KEYS):
            raise ValueError(
                f"a packed model's batches need {list(PACKED_KEYS)}; got {sorted(batch)}"
            )
        if not self.packed and given:
            raise ValueError(
                f"the batch has {given} (packed rows) but the model is not packed; build "
                "it with MLLM(..., packed=True)"
            )
        return {k: batch[k] for k in PACKED_KEYS} if self.packed else {}

    def module_parts(self) -> dict[str, tuple[str, ...]]:
        """Module name -> its part names (an encoder and its projector; the LLM)."""
        out = {}
        for modality in self.modalities:
            enc_name, proj_name, _ = MODALITIES[modality]
            out[enc_name] = (enc_name, proj_name)
        return {**out, "llm": ("llm",)}

    def frozen_parts(self, names: Collection[str]) -> frozenset[str]:
        """The parts that ``freeze`` names select (:func:`hetjax.runtime.frozen_parts`)."""
        return frozen_parts(names, self.module_parts())

    def train_graph(
        self, layouts: Mapping[str, Layout], freeze: Collection[str] = ()
    ) -> TrainGraph:
        """The model as a heterogeneous training graph: one module per encoder (with its
        projector) and the LLM, each with its layout; encoders link into the LLM.

        Args:
            layouts: layout per module name (``vision``, ``audio``, ``llm``); every module
                must have one (the trainer gives modules without one the LLM's).
            freeze: modules or parts not trained (``vision`` is the encoder alone; LLaVA
                stage 1 freezes ``vision, llm``, stage 2 ``vision``).
        """
        modules, links = [], []
        for modality in self.modalities:
            enc_name, proj_name, key = MODALITIES[modality]
            modules.append(
                ModuleSpec(
                    enc_name,
                    parts=(self.modules[enc_name], self.modules[proj_name]),
                    layout=layouts[enc_name],
                    inputs=(key,),
                    input_slots=self.images_per_row if modality == "image" else 1,
                )
            )
            links.append(Link(enc_name, "llm", modality))
        packed = PACKED_KEYS if self.packed else ()
        modules.append(
            ModuleSpec(
                "llm",
                parts=(self.modules["llm"],),
                layout=layouts["llm"],
                inputs=("tokens",),
                loss_inputs=("targets", "loss_mask"),
                block_inputs=packed,
                seq_inputs=("tokens", "targets", "loss_mask", *packed),
                token_slots=tuple(
                    (link.name, "tokens", self.placeholder(link.name)) for link in links
                ),
            )
        )
        graph = TrainGraph(tuple(modules), tuple(links))
        return graph.freeze(freeze) if freeze else graph

    @property
    def module_names(self) -> list[str]:
        """Layout / island names: the encoders present, then ``llm``."""
        return [MODALITIES[m][0] for m in self.modalities] + ["llm"]

    def validate_layouts(
        self, layouts: Mapping[str, Layout], *, seq_len: int | None = None
    ) -> None:
        """Heads, kv heads, MLP width, vocabulary and layers divisible by tp / pp; the
        sequence by ``2 * cp`` (load-balanced context parallelism)."""
        for name, layout in layouts.items():
            if name == "llm":
                c = self.config.llm
                validate_divisible(
                    name,
                    layout,
                    heads=c.heads,
                    kv_heads=c.kv_heads,
                    layers=c.depth,
                    mlp=c.mlp,
                    vocab=c.vocab,
                )
                if seq_len is not None and layout.cp > 1 and seq_len % (2 * layout.cp):
                    raise LayoutError(
                        f"llm: model.seq_len={seq_len} must be divisible by 2*cp = "
                        f"{2 * layout.cp} (each context-parallel rank holds two mirrored "
                        "chunks); use model.seq_len="
                        f"{-(-seq_len // (2 * layout.cp)) * 2 * layout.cp}"
                    )
            else:
                c = self.config.encoders[name]
                validate_divisible(
                    name,
                    layout,
                    heads=c.heads,
                    layers=c.depth,
                    mlp=c.mlp,
                    experts=c.moe.num_experts if c.moe else None,
                    seq=c.block_tokens,  # an encoder with cp > 1 splits its tokens over cp
                )
