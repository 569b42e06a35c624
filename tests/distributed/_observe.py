"""One process of the observer test: ``python -m tests.distributed._observe [--devices N]``.

Trains one step of the ``tiny`` preset, colocated: vision ``dp=4`` over all four devices,
the LLM ``dp=2,pp=2`` (stage 0 on devices 0-1, stage 1 on 2-3), watched by an
:class:`hetjax.Observer` that counts the program calls it is told of. Prints one line,
``observed {json}``: the process, the stages with a device of its own, and the calls
per ``module/stage/program``. Run alone (``--devices 4``) or as 2 processes x 2 devices
under ``python -m hetjax.launch``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

PREFIX = "observed "


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--devices", type=int, default=None)
    args = p.parse_args(argv)
    from experiments.cli import setup_devices
    from hetjax import distributed

    info = distributed.initialize(local_device_count=args.devices, cpu=True)
    devices = setup_devices(args.devices, multiprocess=info.is_multiprocess)
    import jax

    import hetjax
    from models.config import get_preset
    from models.data import SyntheticConfig, SyntheticLlava
    from models.mllm import MLLM

    class Calls(hetjax.Observer):
        def __init__(self):
            self.counts: Counter[str] = Counter()

        def on_dispatch(self, event) -> None:
            self.counts[f"{event.stage[0]}/{event.stage[1]}/{event.program}"] += 1

    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    layouts = {"vision": hetjax.Layout.parse("dp=4"), "llm": hetjax.Layout.parse("dp=2,pp=2")}
    calls = Calls()
    ex = hetjax.Executor(
        hetjax.plan_run(model.train_graph(layouts), num_devices=len(devices), microbatches=2),
        model.init(jax.random.key(0)),
        devices=devices,
        observers=[calls],
    )
    metrics = ex.step(data.batch(0, 8))
    result = {
        "process": jax.process_index(),
        "local": sorted(f"{k[0]}/{k[1]}" for k, prog in ex.programs.items() if prog.local),
        "calls": dict(sorted(calls.counts.items())),
        "loss": float(metrics["loss"]),
    }
    print(PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
