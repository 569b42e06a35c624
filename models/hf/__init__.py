"""Hugging Face weights in and out: LLaVA (CLIP or SigLIP + Llama) and its parts, and
Qwen2.5-VL (:mod:`~models.hf.qwen`: ``load``, ``save`` and ``logits`` take it too).

    >>> model, params = hf.load("llava-1.5-7b-hf")            # LlavaForConditionalGeneration
    >>> dirs = {"vision": "clip-vit-large-patch14-336", "llm": "vicuna-7b-v1.5"}
    >>> model = MLLM(hf.parts_config(dirs, get_preset("llava-1.5-7b")))
    >>> params, report = hf.read_parts(model, dirs, key=jax.random.key(0))  # new projector
    >>> logits = hf.logits(model, params, input_ids, pixel_values)
    >>> hf.save(model, params, "out-hf")                     # from_pretrained loads it

By concern:

- :mod:`~models.hf.configs` - ``config.json`` <-> :class:`~models.config.MLLMConfig`;
- :mod:`~models.hf.files` - a checkpoint directory's safetensors and key names;
- :mod:`~models.hf.rules` - which HF tensors make each hetjax parameter, both directions;
- :mod:`~models.hf.lazy` - :class:`LazyTensor`, parameters that read only their slices;
- :mod:`~models.hf.reading` - :func:`load`, :func:`read_llava`, :func:`read_parts`;
- :mod:`~models.hf.writing` - :func:`save`;
- :mod:`~models.hf.inference` - :func:`logits` on one device, to compare with HF;
- :mod:`~models.hf.qwen_config`, :mod:`~models.hf.qwen`, :mod:`~models.hf.qwen_inference` -
  the same for ``Qwen2_5_VLForConditionalGeneration``.
"""

from .configs import llava_config as llava_config
from .configs import llava_config_of as llava_config_of
from .configs import llm_config as llm_config
from .configs import parts_config as parts_config
from .configs import vision_config as vision_config
from .errors import HFError as HFError
from .inference import logits as logits
from .lazy import LazyTensor as LazyTensor
from .reading import LoadReport as LoadReport
from .reading import load as load
from .reading import read_llava as read_llava
from .reading import read_parts as read_parts
from .writing import save as save

__all__ = [
    "HFError",
    "LazyTensor",
    "LoadReport",
    "llava_config",
    "llava_config_of",
    "llm_config",
    "load",
    "logits",
    "parts_config",
    "read_llava",
    "read_parts",
    "save",
    "vision_config",
]
