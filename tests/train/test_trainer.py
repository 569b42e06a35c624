"""hetjax.train.Trainer over a user's own graph (``experiments/own_graph.py``): two
layouts alike, resume, SIGTERM, a planner's list of layouts, layout text resolved once."""

from __future__ import annotations

import dataclasses
import os
import signal

import jax
import numpy as np
import pytest

import hetjax
from experiments import own_graph
from hetjax.runtime import JsonlWriter
from hetjax.train import Every, Hook, LayoutChoice, Trainer, resolve_layouts
from tests.launch import rows


def test_the_example_trains_two_layouts_alike_through_a_resume():
    own_graph.main()  # asserts rtol 1e-5 between colocated and non-colocated + resumed


class _SigtermAt(Hook):
    """Sends this process SIGTERM right after step ``at`` is dispatched."""

    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def after_step(self, trainer, step, metrics):
        if step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _trainer(tmp_path, name: str, *hooks, **overrides) -> Trainer:
    config = own_graph.config("colocated", str(tmp_path / name), **overrides)
    data = own_graph.Batches(global_batch=16)
    return Trainer(config, own_graph.SensorLM(), data, devices=jax.devices()[:8], hooks=hooks)


def test_sigterm_saves_at_the_next_step_boundary_and_the_resumed_run_is_bit_exact(tmp_path):
    whole = own_graph.LossEvery(every=1)
    _trainer(tmp_path, "whole", whole).fit()

    first = own_graph.LossEvery(every=1)
    trainer = _trainer(tmp_path, "cut", first, _SigtermAt(1))
    history = trainer.fit()  # returns normally
    assert trainer.preempted_at == 2 and [m["step"] for m in history] == [0, 1]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is given back
    rest = own_graph.LossEvery(every=1)
    resumed = _trainer(tmp_path, "cut", rest)
    assert resumed.start == 2
    resumed.fit()
    assert {**first.losses, **rest.losses} == whole.losses  # bit-exact, not close


def test_hooks_run_every_n_steps_and_at_the_last(tmp_path):
    every = own_graph.LossEvery(every=4)
    _trainer(tmp_path, "every", every, checkpoint=hetjax.config.CheckpointConfig()).fit()
    assert sorted(every.losses) == [3, 5]  # steps 4 and 6 (1-based): every 4th and the last


def test_every_calls_a_process_0_observer_every_n_steps(tmp_path):
    path = tmp_path / "m.jsonl"
    no_ckpt = hetjax.config.CheckpointConfig()
    _trainer(tmp_path, "obs", Every(JsonlWriter(str(path)), 4), checkpoint=no_ckpt).fit()
    assert [row["step"] for row in rows(path)] == [3, 5]


def test_a_planners_list_takes_the_first_layouts_that_run(tmp_path):
    config = own_graph.config("colocated", str(tmp_path / "auto"))
    bad = LayoutChoice({"sensor": hetjax.Layout(dp=8), "lm": hetjax.Layout(dp=2, cp=2, pp=2)})
    good = LayoutChoice(
        {"sensor": hetjax.Layout(dp=8), "lm": hetjax.Layout(dp=4, pp=2)}, "colocated", None, 2
    )
    trainer = Trainer(
        config,
        own_graph.SensorLM(),
        own_graph.Batches(16),
        devices=jax.devices()[:8],
        layouts=[bad, good],
    )
    assert trainer.choice == good and "lm dp=4" in trainer.layout_text
    with pytest.raises(ValueError, match="this model has neither"):  # one choice: its error
        Trainer(
            config,
            own_graph.SensorLM(),
            own_graph.Batches(16),
            devices=jax.devices()[:8],
            layouts=bad,
        )


def test_layouts_resolve_once_with_the_sinks_for_modules_without_one():
    names = ["vision", "llm"]
    layouts = resolve_layouts({"llm": "dp=2,tp=2"}, names, num_devices=4, mode="colocated")
    assert layouts == {"vision": hetjax.Layout(dp=2, tp=2), "llm": hetjax.Layout(dp=2, tp=2)}
    given = {"vision": hetjax.Layout(dp=4), "llm": "dp=4"}  # objects and text mix
    assert resolve_layouts(given, names, num_devices=4, mode="colocated")["vision"].dp == 4
    with pytest.raises(ValueError, match=r"give the LLM's layout too"):
        resolve_layouts({"vision": "dp=4"}, names, num_devices=4, mode="colocated")
    with pytest.raises(ValueError, match=r"MODULE one of \['vision', 'llm'\]"):
        resolve_layouts({"nope": "dp=4"}, names, num_devices=4, mode="colocated")


def test_the_config_is_the_one_given(tmp_path):
    """Nothing in the trainer rewrites the config it was handed (one pass down)."""
    config = own_graph.config("colocated", str(tmp_path / "same"))
    frozen = dataclasses.replace(config)
    trainer = Trainer(
        config, own_graph.SensorLM(), own_graph.Batches(16), devices=jax.devices()[:8]
    )
    assert trainer.config is config and config == frozen
    np.testing.assert_equal(trainer.microbatches, config.parallel.microbatches)


def test_the_readme_shows_the_example_file():
    """Every line of the README's Trainer example is in ``experiments/own_graph.py``
    (a line ending in ``...  # note`` stands for a body left out)."""
    from tests.launch import ROOT

    section = (ROOT / "README.md").read_text().split("## Train your own graph", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    source = {line.strip() for line in (ROOT / "experiments" / "own_graph.py").open()}
    for line in block.splitlines():
        shown = line.split(" ...", 1)[0].strip()
        assert not shown or shown in source or shown + ":" in source, line


def test_bad_trainer_inputs_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^every=0 must be a positive integer$"):
        Every(JsonlWriter(str(tmp_path / "m.jsonl")), 0)
    with pytest.raises(ValueError, match=r"^every=-2 must be a positive integer$"):
        Hook(every=-2)
    config = own_graph.config("colocated", str(tmp_path / "none"))
    with pytest.raises(ValueError, match=r"none of the 0 candidate layouts runs"):
        Trainer(config, own_graph.SensorLM(), own_graph.Batches(16), layouts=[])
