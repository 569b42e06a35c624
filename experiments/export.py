"""Export a training checkpoint as a Hugging Face LLaVA or Qwen2.5-VL directory.

    python -m experiments.export --checkpoint DIR --out HF_DIR [--step S]

Reads only the parameters of the checkpoint (latest step unless ``--step``) onto one host
device, rebuilds the model from the config the checkpoint records, and writes
``config.json`` + ``model.safetensors`` that ``LlavaForConditionalGeneration.from_pretrained``
(a Qwen2.5-VL run's: ``Qwen2_5_VLForConditionalGeneration``, the released checkpoints'
key names) loads (see ``models/hf``). Any layout the run used exports alike: checkpoints
are layout-free.
"""

from __future__ import annotations

import os

from experiments.cli import ConfigError, OneLineParser, non_negative_int, run_cli

PROG = "python -m experiments.export"


def main(argv: list[str]) -> int:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a --checkpoint-dir")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="directory to write")
    p.add_argument("--step", type=non_negative_int, help="checkpoint step (default: latest)")
    args = p.parse_args(argv)
    if os.path.exists(args.out) and os.listdir(args.out):
        raise ConfigError(f"--out {args.out} is not empty; give a new or empty directory")

    import jax

    from hetjax.checkpoint import Checkpointer, CheckpointError
    from models import hf
    from models.config import config_from_dict, get_preset
    from models.mllm import MLLM
    from models.qwen import QwenVisionConfig, QwenVL

    try:
        ckpt = Checkpointer(args.checkpoint)
        meta = ckpt.metadata(args.step)
        model_meta = meta.get("model", {})
        if "config" in model_meta:
            config = config_from_dict(model_meta["config"])
        else:  # checkpoints written before the model config was recorded
            config = get_preset(model_meta.get("preset", "tiny"))
        qwen = isinstance(config.vision, QwenVisionConfig)  # Qwen2.5-VL: its own model
        model = QwenVL(config) if qwen else MLLM(config)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        like = {
            name: jax.tree.map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device),
                module.abstract_params(),
            )
            for name, module in model.modules.items()
        }
        params = jax.device_get(ckpt.restore_params(like, step=args.step))
        ckpt.close()
        hf.save(model, params, args.out)
    except (CheckpointError, hf.HFError) as e:
        raise ConfigError(str(e)) from None
    print(f"exported step {meta['step']} of {args.checkpoint} to {args.out}")
    return 0


if __name__ == "__main__":
    run_cli(main, PROG)
