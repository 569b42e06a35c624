"""Model configurations and presets (plain frozen dataclasses, no JAX).

Presets:
    tiny      - tests; every head / kv-head / MLP / layer count divisible by 4 (TP, PP <= 4).
    small     - tens of millions of parameters, still trains on a laptop CPU.
    tiny-av   - tiny with an image AND an audio encoder feeding the LLM.
    tiny-moe  - tiny with a mixture-of-experts LLM (8 experts, top-2, dropless).
    tiny-moe-enc - tiny with a mixture-of-experts vision encoder.
    llava-1.5-7b, llava-1.5-13b - LLaVA-1.5: CLIP ViT-L/14-336 (576 image tokens, the
        layers up to ``vision_feature_layer=-2``) + Vicuna-7B / 13B, exact GELU projector.
    llava-1.5-tiny - the same architecture, depth- and width-reduced to run on a CPU.
    qwen2.5-vl-3b, qwen2.5-vl-7b - Qwen2.5-VL (Hugging Face's config values): a 32-layer
        dynamic-resolution vision tower with window attention (:mod:`models.qwen`) + Qwen2.5
        3B (its tied LM head untied) / 7B with 3D rotary positions.
    qwen2.5-vl-tiny - the same architecture, depth- and width-reduced to run on a CPU.
Shape-only presets at the paper's scale (``vit-1b`` ... ``llm-120b``) carry parameter
counts and FLOPs per token for planning; they are never instantiated on CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from models.qwen.config import QwenVisionConfig


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts FFN: ``num_experts`` SwiGLU experts of the block's MLP width."""

    num_experts: int  # experts per MoE layer (split over the module's ep ranks)
    top_k: int = 2  # experts per token (1 or 2)
    capacity_factor: float | None = None  # slots per expert vs an even split; None: dropless
    aux_weight: float = 0.01  # load-balancing loss weight (per-sample loss, summed)

    def num_params(self, width: int, mlp: int) -> int:
        return width * self.num_experts + 3 * self.num_experts * width * mlp


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    """A pre-norm transformer encoder over patches (image) or stacked frames (audio).

    ``kind``:
        vit - hetjax's own ViT: patch embedding, GELU (tanh) MLP, final LayerNorm.
        clip - Hugging Face ``CLIPVisionModel`` as LLaVA uses it: class token, pre-layernorm,
            quick-GELU MLP, biased attention; ``depth`` counts the layers up to LLaVA's
            ``vision_feature_layer`` and the class token is dropped before the projector.
        siglip - ``SiglipVisionModel``: biased patch embedding, no class token, tanh-GELU
            MLP, biased attention; ``depth`` layers, no final norm (LLaVA reads a hidden
            state, which precedes SigLIP's ``post_layernorm``).
        audio - stacked frames.
    """

    kind: Literal["vit", "clip", "siglip", "audio"]
    width: int  # model width D
    depth: int  # number of blocks
    heads: int  # attention heads (head dim = width // heads)
    mlp: int  # MLP hidden width
    image_size: int = 16  # vit: square image side in pixels
    patch: int = 4  # vit: square patch side in pixels
    channels: int = 3  # vit: colour channels
    frames: int = 32  # audio: input frames per clip
    frame_dim: int = 16  # audio: features per frame
    frame_stack: int = 2  # audio: consecutive frames merged into one token
    moe: MoEConfig | None = None  # mixture-of-experts MLP (SwiGLU experts) instead of GELU
    norm_eps: float = 1e-6  # LayerNorm epsilon (CLIP: 1e-5)

    @property
    def is_image(self) -> bool:
        return self.kind != "audio"

    @property
    def hf(self) -> bool:
        """A Hugging Face architecture (biases everywhere, HF activations)."""
        return self.kind in ("clip", "siglip")

    @property
    def act(self) -> str:
        """MLP activation, by its Hugging Face name."""
        return "quick_gelu" if self.kind == "clip" else "gelu_pytorch_tanh"

    @property
    def num_tokens(self) -> int:
        """Tokens per sample at the encoder output (what the projector maps)."""
        if self.is_image:
            return (self.image_size // self.patch) ** 2
        return self.frames // self.frame_stack

    @property
    def block_tokens(self) -> int:
        """Tokens per sample inside the blocks (CLIP adds its class token)."""
        return self.num_tokens + (self.kind == "clip")

    @property
    def token_in_dim(self) -> int:
        """Input features per token before the embedding matmul."""
        if self.is_image:
            return self.patch * self.patch * self.channels
        return self.frame_dim * self.frame_stack

    def num_params(self) -> int:
        d, f = self.width, self.mlp
        biases = self.hf * (4 * d + d)  # qkv + out, MLP down
        mlp = self.moe.num_params(d, f) if self.moe else 2 * d * f + f  # (+up bias)
        block = 4 * d * d + mlp + 4 * d + biases  # qkv+out, MLP, 2 LayerNorms
        embed = self.token_in_dim * d + (self.kind != "clip") * d + self.block_tokens * d
        extra = {"clip": 3 * d, "siglip": 0}.get(self.kind, 2 * d)  # cls + pre-LN / final LN
        return embed + self.depth * block + extra

    def forward_flops_per_sample(self) -> int:
        """Forward FLOPs of one sample (an image, a clip) at its real token counts: the
        blocks over :attr:`block_tokens` (CLIP's class token included), 2 x their matmul
        weights (MoE: the ``top_k`` experts a token visits, and the router) plus
        bidirectional attention over the whole ``block_tokens`` square (QK^T and PV); the
        patch (frame) embedding over :attr:`num_tokens`."""
        d, f, n = self.width, self.mlp, self.block_tokens
        mlp = self.moe.top_k * 3 * d * f + d * self.moe.num_experts if self.moe else 2 * d * f
        blocks = n * self.depth * (2 * (4 * d * d + mlp) + 2 * 2 * n * d)
        return blocks + self.num_tokens * 2 * self.token_in_dim * d

    def attention_flops_per_sample(self) -> int:
        """The part of :meth:`forward_flops_per_sample` in QK^T and PV (weightless)."""
        return self.depth * 2 * 2 * self.block_tokens**2 * self.width


@dataclasses.dataclass(frozen=True)
class LLMConfig:
    """A Llama-style decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, untied head."""

    vocab: int
    width: int
    depth: int
    heads: int
    kv_heads: int
    mlp: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    moe: MoEConfig | None = None  # mixture-of-experts FFN instead of the dense SwiGLU
    tie_embeddings: bool = False  # LM head = embedding table (not supported for training)

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    def num_params(self) -> int:
        d, k = self.width, self.head_dim
        attn = d * self.heads * k * 2 + d * self.kv_heads * k * 2
        mlp = self.moe.num_params(d, self.mlp) if self.moe else 3 * d * self.mlp
        block = attn + mlp + 2 * d
        return 2 * self.vocab * d + self.depth * block + d

    def forward_flops(
        self,
        tokens: int,
        seq_len: int,
        supervised: int,
        *,
        executed: bool = False,
        head_tokens: int | None = None,
        attention_square: float = 1.0,
    ) -> int:
        """Forward FLOPs of ``tokens`` tokens in sequences of ``seq_len``: 2 x the blocks'
        matmul weights per token (MoE: the ``top_k`` experts a token visits, and the
        router), causal attention at half the ``seq_len`` square (QK^T and PV), the output
        head over the ``supervised`` tokens (the anchors' convention, MaxText's and
        PaLM's: the work the step needs).

        ``executed``: what the kernels compute instead, for hardware FLOPs: attention over
        ``attention_square`` of the square (1: the plain path and masked fused kernels;
        0.5: a causal kernel that skips masked tiles), the head over ``head_tokens``
        (None: every token; a loss head that gathers supervised positions up to a static
        capacity: that capacity)."""
        d, k = self.width, self.head_dim
        mlp = 3 * d * self.mlp
        if self.moe:
            mlp = self.moe.top_k * mlp + d * self.moe.num_experts
        body = self.depth * (d * self.heads * k * 2 + d * self.kv_heads * k * 2 + mlp)
        attention = self.depth * 2 * self.heads * k * seq_len  # causal: 2 matmuls / 2
        if executed:
            attention = int(2 * attention * attention_square)
            supervised = tokens if head_tokens is None else head_tokens
        return tokens * (2 * body + attention) + supervised * 2 * self.vocab * d

    def flops_per_token(self, seq_len: int) -> int:
        """Forward+backward FLOPs per token at ``seq_len`` (causal attention halves QK/PV)."""
        d, k = self.width, self.head_dim
        matmul = (
            self.depth * (d * self.heads * k * 2 + d * self.kv_heads * k * 2 + 3 * d * self.mlp)
            + self.vocab * d
        )
        attention = self.depth * 2 * self.heads * k * seq_len  # causal: 2 matmuls / 2
        return 6 * matmul + 3 * attention


@dataclasses.dataclass(frozen=True)
class MLLMConfig:
    """An LLaVA-style model: optional vision and audio encoders + projectors, and an LLM."""

    name: str
    llm: LLMConfig
    vision: EncoderConfig | QwenVisionConfig | None = None
    audio: EncoderConfig | None = None
    seq_len: int = 64  # default training sequence length
    shape_only: bool = False  # paper-scale preset: counts only, never instantiated
    projector_act: str = "gelu_pytorch_tanh"  # HF name; LLaVA-1.5 uses exact "gelu"
    image_token_id: int | None = None  # image placeholder id (None: the byte tokenizer's)

    @property
    def encoders(self) -> dict[str, EncoderConfig]:
        return {k: v for k, v in (("vision", self.vision), ("audio", self.audio)) if v}

    def num_params(self) -> dict[str, int]:
        """Parameter count per module (encoder, its projector, llm) and in total."""
        counts: dict[str, int] = {}
        for name, enc in self.encoders.items():
            counts[name] = enc.num_params()
            proj = "projector" if name == "vision" else f"{name}_projector"
            d = self.llm.width
            counts[proj] = enc.width * d + d + d * d + d
        counts["llm"] = self.llm.num_params()
        counts["total"] = sum(counts.values())
        return counts

    def forward_flops(
        self,
        batch: int,
        seq_len: int,
        supervised: int,
        *,
        executed: bool = False,
        images_per_sample: int = 1,
        head_tokens: int | None = None,
        attention_square: float = 1.0,
    ) -> dict[str, int]:
        """Forward FLOPs per part (encoders, projectors, ``llm``) of a batch of ``batch``
        samples of ``seq_len`` tokens, ``supervised`` of them under the loss (the rule of
        :func:`hetjax.runtime.flops.model_flops` turns them into training FLOPs);
        ``executed``, ``head_tokens``, ``attention_square``: what the LLM's kernels compute
        (:meth:`LLMConfig.forward_flops`); ``images_per_sample``: the image slots the
        vision encoder runs per sample. Encoders count per sample at their real token
        counts (:meth:`EncoderConfig.forward_flops_per_sample`), executed or not."""
        out: dict[str, int] = {}
        d = self.llm.width
        for name, enc in self.encoders.items():
            samples = batch * (images_per_sample if name == "vision" else 1)
            out[name] = samples * enc.forward_flops_per_sample()
            proj = "projector" if name == "vision" else f"{name}_projector"
            # two matmuls over the encoder's output tokens (CLIP's class token dropped)
            out[proj] = samples * enc.num_tokens * 2 * (enc.width * d + d * d)
        out["llm"] = self.llm.forward_flops(
            batch * seq_len,
            seq_len,
            supervised,
            executed=executed,
            head_tokens=head_tokens,
            attention_square=attention_square,
        )
        return out

    def attention_flops(
        self,
        batch: int,
        seq_len: int,
        *,
        executed: bool = False,
        images_per_sample: int = 1,
        attention_square: float = 1.0,
    ) -> dict:
        """The parts' forward FLOPs in weightless matmuls (attention's QK^T and PV; included
        in :meth:`forward_flops`): their backward always takes two activation gradients.
        The LLM's causal square counts half, or ``attention_square`` of it ``executed``."""
        out = {}
        for name, enc in self.encoders.items():
            samples = batch * (images_per_sample if name == "vision" else 1)
            out[name] = samples * enc.attention_flops_per_sample()
        c = self.llm
        share = attention_square if executed else 0.5
        out["llm"] = int(batch * seq_len * c.depth * 4 * c.heads * c.head_dim * seq_len * share)
        return out


# Byte-level tokenizer: 256 bytes + PAD, BOS, EOS, IMAGE, AUDIO, padded to a multiple of 64.
TOKENIZER_VOCAB = 320

_TINY_LLM = LLMConfig(vocab=TOKENIZER_VOCAB, width=64, depth=4, heads=8, kv_heads=4, mlp=128)
_TINY_VIT = EncoderConfig(kind="vit", width=32, depth=4, heads=4, mlp=64)
_TINY_AUDIO = EncoderConfig(kind="audio", width=32, depth=4, heads=4, mlp=64)

_TINY_MOE = MoEConfig(num_experts=8, top_k=2, capacity_factor=None)


def _clip(width, depth, heads, mlp, image_size, patch) -> EncoderConfig:
    return EncoderConfig(
        kind="clip",
        width=width,
        depth=depth,
        heads=heads,
        mlp=mlp,
        image_size=image_size,
        patch=patch,
        norm_eps=1e-5,
    )


# CLIP ViT-L/14-336 has 24 layers; LLaVA-1.5 reads hidden state -2, the output of layer 23.
_CLIP_L_336 = _clip(1024, 23, 16, 4096, 336, 14)
_VICUNA = dict(vocab=32064, rope_theta=10000.0, norm_eps=1e-5)
_LLAVA = dict(projector_act="gelu", image_token_id=32000, seq_len=2048)

PRESETS: dict[str, MLLMConfig] = {
    "tiny-moe": MLLMConfig(
        "tiny-moe", llm=dataclasses.replace(_TINY_LLM, moe=_TINY_MOE), vision=_TINY_VIT
    ),
    "tiny-moe-enc": MLLMConfig(
        "tiny-moe-enc", llm=_TINY_LLM, vision=dataclasses.replace(_TINY_VIT, moe=_TINY_MOE)
    ),
    "tiny": MLLMConfig("tiny", llm=_TINY_LLM, vision=_TINY_VIT, seq_len=64),
    "tiny-av": MLLMConfig(
        "tiny-av", llm=_TINY_LLM, vision=_TINY_VIT, audio=_TINY_AUDIO, seq_len=96
    ),
    "small": MLLMConfig(
        "small",
        llm=LLMConfig(vocab=TOKENIZER_VOCAB, width=512, depth=8, heads=8, kv_heads=4, mlp=1536),
        vision=EncoderConfig(
            kind="vit", width=384, depth=8, heads=8, mlp=1536, image_size=32, patch=4
        ),
        seq_len=128,
    ),
    "llava-1.5-7b": MLLMConfig(
        "llava-1.5-7b",
        llm=LLMConfig(width=4096, depth=32, heads=32, kv_heads=32, mlp=11008, **_VICUNA),
        vision=_CLIP_L_336,
        **_LLAVA,
    ),
    "llava-1.5-13b": MLLMConfig(
        "llava-1.5-13b",
        llm=LLMConfig(width=5120, depth=40, heads=40, kv_heads=40, mlp=13824, **_VICUNA),
        vision=_CLIP_L_336,
        **_LLAVA,
    ),
    "llava-1.5-tiny": MLLMConfig(
        "llava-1.5-tiny",
        llm=_TINY_LLM,
        vision=_clip(32, 4, 4, 64, 16, 4),
        projector_act="gelu",
        seq_len=64,
    ),
}


def _qwen(
    name: str, llm: LLMConfig, vision: QwenVisionConfig, seq_len: int, image_token_id: int
) -> MLLMConfig:
    return MLLMConfig(
        name,
        llm=llm,
        vision=dataclasses.replace(vision, out_width=llm.width),
        seq_len=seq_len,
        image_token_id=image_token_id,
    )


_QWEN_VIT = QwenVisionConfig()  # the same tower in every Qwen2.5-VL size
_QWEN = dict(rope_theta=1000000.0, norm_eps=1e-6)
PRESETS.update(
    {
        "qwen2.5-vl-3b": _qwen(
            "qwen2.5-vl-3b",
            LLMConfig(vocab=151936, width=2048, depth=36, heads=16, kv_heads=2, mlp=11008, **_QWEN),
            _QWEN_VIT,
            4096,
            151655,
        ),
        "qwen2.5-vl-7b": _qwen(
            "qwen2.5-vl-7b",
            LLMConfig(vocab=152064, width=3584, depth=28, heads=28, kv_heads=4, mlp=18944, **_QWEN),
            _QWEN_VIT,
            4096,
            151655,
        ),
        # Windows of 2x2 merged units (56 px), full attention every 2nd layer; mRoPE over
        # 16-dim heads; video/vision-start/end ids after the byte tokenizer's specials.
        "qwen2.5-vl-tiny": _qwen(
            "qwen2.5-vl-tiny",
            LLMConfig(
                vocab=TOKENIZER_VOCAB, width=128, depth=4, heads=8, kv_heads=4, mlp=256, **_QWEN
            ),
            QwenVisionConfig(
                width=32,
                depth=4,
                heads=4,
                mlp=64,
                window=56,
                full_attention=(1, 3),
                mrope_section=(2, 3, 3),
                video_token_id=261,
                vision_start_token_id=262,
                vision_end_token_id=263,
            ),
            128,
            259,  # the byte tokenizer's image placeholder
        ),
    }
)


def _paper_vit(name: str, width: int, depth: int, heads: int, mlp: int) -> EncoderConfig:
    # 448px images with 14px patches: 1024 tokens per image, as in the paper's ViT family.
    return EncoderConfig(
        kind="vit", width=width, depth=depth, heads=heads, mlp=mlp, image_size=448, patch=14
    )


def _paper_llm(width: int, depth: int, heads: int, kv_heads: int, mlp: int) -> LLMConfig:
    return LLMConfig(
        vocab=128256, width=width, depth=depth, heads=heads, kv_heads=kv_heads, mlp=mlp
    )


# Shape-only presets of the paper's scale (encoders 1B-12B, LLMs 14B-120B).
PAPER_ENCODERS: dict[str, EncoderConfig] = {
    "vit-1b": _paper_vit("vit-1b", 1536, 32, 16, 6144),
    "vit-3b": _paper_vit("vit-3b", 2560, 36, 20, 10240),
    "vit-6b": _paper_vit("vit-6b", 3200, 48, 25, 12800),
    "vit-12b": _paper_vit("vit-12b", 4096, 56, 32, 16384),
}
PAPER_LLMS: dict[str, LLMConfig] = {
    "llm-14b": _paper_llm(5120, 40, 40, 8, 17920),
    "llm-70b": _paper_llm(8192, 80, 64, 8, 28672),
    "llm-120b": _paper_llm(10240, 88, 80, 8, 36864),
}


def paper_preset(encoder: str, llm: str, seq_len: int = 8192) -> MLLMConfig:
    """A shape-only MLLM of the paper's scale, e.g. ``paper_preset("vit-6b", "llm-120b")``."""
    return MLLMConfig(
        f"{encoder}+{llm}",
        llm=PAPER_LLMS[llm],
        vision=PAPER_ENCODERS[encoder],
        seq_len=seq_len,
        shape_only=True,
    )


def get_preset(name: str) -> MLLMConfig:
    """Returns a runnable preset; raises ValueError naming the valid ones."""
    if name not in PRESETS:
        raise ValueError(
            f"unknown model preset {name!r}: choose one of {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[name]


def config_to_dict(cfg: MLLMConfig) -> dict:
    """The config as plain data (JSON), e.g. for a checkpoint's metadata."""
    return dataclasses.asdict(cfg)


def config_from_dict(d: dict) -> MLLMConfig:
    """Inverse of :func:`config_to_dict`."""

    def moe(x):
        return None if x is None else MoEConfig(**x)

    def encoder(x):
        if x is not None and x.get("kind") == "qwen2_5_vl":
            return QwenVisionConfig(**x)
        return None if x is None else EncoderConfig(**{**x, "moe": moe(x.get("moe"))})

    llm = LLMConfig(**{**d["llm"], "moe": moe(d["llm"].get("moe"))})
    return MLLMConfig(
        **{**d, "llm": llm, "vision": encoder(d.get("vision")), "audio": encoder(d.get("audio"))}
    )
