"""Train your own graph: your Flax NNX encoder and LLM with :class:`hetjax.train.Trainer`.

``python -m experiments.own_graph`` trains a small two-module model (a "sensor" encoder
whose output every position of a language model sees) on two layouts of 8 simulated CPU
devices, stops the first run half way (``stop_after``), resumes it from its checkpoint,
and checks that both layouts give the same losses, the resumed steps included. A custom
hook records the loss every second step.

The model is any object with ``module_names``, ``validate_layouts``, ``train_graph`` and
``init`` (:class:`hetjax.train.TrainableModel`); the data any object with ``batch(step)``
(:class:`hetjax.train.BatchSource`). Everything else - layouts, the executor,
checkpoints, resume, progress, metrics files - is the trainer's.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import hetjax
from hetjax import config as hc
from hetjax.train import Hook, Trainer

WIDTH, VOCAB, SEQ, FEATURES, PATCHES = 32, 64, 16, 12, 4


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple) -> nnx.Param:
    return nnx.Param(0.1 * jax.random.normal(rngs.params(), shape), axes=axes)


class Patches(nnx.Module):  # sensor pre: [B, N, F] -> [B, N, D]
    def __init__(self, rngs: nnx.Rngs):
        self.w = _param(rngs, (FEATURES, WIDTH), (None, "embed"))

    def __call__(self, x_BxNxF):
        return x_BxNxF @ self.w[...]


class Mlp(nnx.Module):  # one block of either module (stacked and scanned by hetjax)
    def __init__(self, rngs: nnx.Rngs):
        self.up = _param(rngs, (WIDTH, 4 * WIDTH), ("embed", "mlp"))
        self.down = _param(rngs, (4 * WIDTH, WIDTH), ("mlp", "embed"))

    def __call__(self, h):
        return h + jax.nn.gelu(h @ self.up[...]) @ self.down[...]


class Embed(nnx.Module):  # lm pre: tokens [B, L] and the sensor's [B, N, D] -> [B, L, D]
    def __init__(self, rngs: nnx.Rngs):
        self.table = _param(rngs, (VOCAB, WIDTH), (None, "embed"))

    def __call__(self, tokens_BxL, sensor):  # `sensor`: the link's name
        return self.table[...][tokens_BxL] + sensor.mean(axis=1, keepdims=True)


class Head(nnx.Module):  # lm post: the SUM of the loss over supervised tokens
    def __init__(self, rngs: nnx.Rngs):
        self.w = _param(rngs, (WIDTH, VOCAB), ("embed", "vocab"))

    def __call__(self, h_BxLxD, targets_BxL, mask_BxL):
        logp = jax.nn.log_softmax(h_BxLxD @ self.w[...])
        nll = -jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * mask_BxL)


class SensorLM:
    """The model (:class:`hetjax.train.TrainableModel`): modules, layouts, graph, init."""

    module_names = ("sensor", "lm")  # the sink last
    seq_len = SEQ  # for throughput figures

    def __init__(self):
        self.sensor = hetjax.StagedModule("sensor", pre=Patches, block=Mlp, num_layers=2)
        self.lm = hetjax.StagedModule("lm", pre=Embed, block=Mlp, post=Head, num_layers=4)

    def validate_layouts(self, layouts):
        for name, layout in layouts.items():
            if layout.cp > 1 or layout.ep > 1:
                raise ValueError(f"{name}: {layout} has cp or ep; this model has neither")

    def train_graph(self, layouts, *, freeze=()):
        graph = hetjax.TrainGraph(
            modules=(
                hetjax.ModuleSpec(
                    "sensor", parts=(self.sensor,), layout=layouts["sensor"], inputs=("patches",)
                ),
                hetjax.ModuleSpec(
                    "lm",
                    parts=(self.lm,),
                    layout=layouts["lm"],
                    inputs=("tokens",),
                    loss_inputs=("targets", "loss_mask"),
                    seq_inputs=("tokens", "targets", "loss_mask"),
                ),
            ),
            links=(hetjax.Link("sensor", "lm", "sensor"),),
        )
        return graph.freeze(freeze) if freeze else graph

    def init(self, key):
        return {
            "sensor": self.sensor.init(jax.random.fold_in(key, 0)),
            "lm": self.lm.init(jax.random.fold_in(key, 1)),
        }


class Batches:
    """The data (:class:`hetjax.train.BatchSource`): a function of the step, so a resumed
    run continues where it stopped. The last token answers whether the sensor's sum is
    positive: only the encoder can tell."""

    def __init__(self, global_batch: int):
        self.global_batch = global_batch

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([0, step])
        b = self.global_batch
        patches = rng.normal(size=(b, PATCHES, FEATURES)).astype(np.float32)
        tokens = rng.integers(2, VOCAB, size=(b, SEQ + 1)).astype(np.int32)
        tokens[:, -1] = patches.sum(axis=(1, 2)) > 0
        mask = np.zeros((b, SEQ), np.float32)
        mask[:, -1] = 1.0  # only the answer is supervised
        return {
            "patches": patches,
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "loss_mask": mask,
        }


class LossEvery(Hook):
    """A custom hook: the loss at every ``every``-th step (and the last)."""

    def __init__(self, every: int):
        super().__init__(every)
        self.losses: dict[int, float] = {}

    def on_step(self, step, metrics):
        self.losses[step] = metrics["loss"]


LAYOUTS = {
    "colocated": {"sensor": "dp=8", "lm": "dp=2,tp=2,pp=2"},
    "non-colocated": {"sensor": "dp=4", "lm": "dp=1,tp=2,pp=2"},
}


def config(layout: str, checkpoint_dir: str, **overrides) -> hc.TrainConfig:
    """The run's settings: 6 steps of 16 samples in 2 microbatches, a checkpoint every 3."""
    islands = {"sensor": 4, "lm": 4} if layout == "non-colocated" else {}
    settings = dict(
        steps=6,
        data=hc.DataConfig(global_batch=16),
        parallel=hc.ParallelConfig(
            layouts=LAYOUTS[layout], placement=layout, islands=islands, microbatches=2
        ),
        optimizer=hc.OptimizerConfig(lr=1e-2),
        checkpoint=hc.CheckpointConfig(dir=checkpoint_dir, save_every=3),
    )
    return hc.TrainConfig(**{**settings, **overrides})


def train(layout: str, checkpoint_dir: str, **overrides) -> dict[int, float]:
    """Trains (or resumes) ``layout``; returns the custom hook's losses."""
    hook = LossEvery(every=1)
    trainer = Trainer(
        config(layout, checkpoint_dir, **overrides),
        SensorLM(),
        Batches(global_batch=16),
        devices=jax.devices()[:8],
        hooks=[hook],
    )
    trainer.fit()
    return hook.losses


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        whole = train("colocated", f"{tmp}/whole")
        first = train("non-colocated", f"{tmp}/split", stop_after=3)  # stops after step 3
        rest = train("non-colocated", f"{tmp}/split")  # resumes at step 3
    resumed = {**first, **rest}
    for step in whole:
        print(f"step {step}: colocated {whole[step]:.6f}  non-colocated {resumed[step]:.6f}")
    np.testing.assert_allclose(list(resumed.values()), list(whole.values()), rtol=1e-5)


if __name__ == "__main__":
    jax.config.update("jax_num_cpu_devices", 8)  # simulated devices when there is no GPU
    main()
