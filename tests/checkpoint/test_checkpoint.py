"""Logical checkpoints: exact resume, resume into other layouts, and bad checkpoints.

One uninterrupted 8-step run of ``tiny`` (colocated ``vision:dp=8 / llm:dp=2,tp=2,pp=2``)
is the reference; a second run saves at step 4 and every restore below continues it for
steps 5-8: in the same layout bit for bit, in other layouts (non-colocated islands with
another tp/pp on 6 devices; a cp=2 LLM with ZeRO-1; fsdp in both modules, whose
parameters and moments are then split over fsdp) and in the single-device reference
trainer at rtol 1e-5 (the float reordering of a different layout).
"""

from __future__ import annotations

import functools
import json
import shutil

import jax
import numpy as np
import pytest

import hetjax
from hetjax import Layout
from hetjax.checkpoint import Checkpointer, CheckpointError, logical
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

STEPS, SAVED = 8, 4
OPTIMIZER = hetjax.AdamWConfig(total_steps=STEPS, warmup_steps=2)
SAVED_LAYOUT = {"vision": "dp=8", "llm": "dp=2,tp=2,pp=2"}


def plan(model, layouts, *, n=8, **kwargs):
    parsed = {k: Layout.parse(v) for k, v in layouts.items()}
    return hetjax.plan_run(model.train_graph(parsed), num_devices=n, microbatches=2, **kwargs)


@functools.cache
def setup(preset="tiny"):
    cfg = get_preset(preset)
    model = MLLM(cfg)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(s, 16) for s in range(STEPS)]
    return model, model.init(jax.random.key(0)), batches


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(uninterrupted losses, a directory holding the step-4 checkpoint)."""
    model, params, batches = setup()
    whole = hetjax.Executor(
        plan(model, SAVED_LAYOUT), params, devices=jax.devices(), optimizer=OPTIMIZER
    )
    losses = [whole.step(b)["loss"] for b in batches]
    first = hetjax.Executor(
        plan(model, SAVED_LAYOUT), params, devices=jax.devices(), optimizer=OPTIMIZER
    )
    for b in batches[:SAVED]:
        first.step(b)
    directory = tmp_path_factory.mktemp("ckpt")
    ckpt = Checkpointer(directory)
    ckpt.save(SAVED, first, metadata={"model": {"preset": "tiny"}})
    ckpt.close()
    return losses, directory


def continue_from(directory, trainer) -> list[float]:
    meta = hetjax.checkpoint.restore(directory, trainer)
    assert meta["step"] == SAVED and meta["model"] == {"preset": "tiny"}
    _, _, batches = setup()
    return [float(trainer.step(b)["loss"]) for b in batches[SAVED:]]


def test_same_layout_resumes_bit_for_bit(saved):
    losses, directory = saved
    model, _, _ = setup()
    ex = hetjax.Executor(plan(model, SAVED_LAYOUT), devices=jax.devices(), optimizer=OPTIMIZER)
    assert ex.state is None  # nothing initialised: the restore provides every array
    assert continue_from(directory, ex) == losses[SAVED:]
    assert ex.state.step == STEPS


@pytest.mark.parametrize(
    ("layouts", "kwargs", "options", "n"),
    [
        (
            {"vision": "dp=2", "llm": "dp=1,tp=2,pp=2"},
            {"mode": "non-colocated", "islands": {"vision": 2, "llm": 4}},
            {},
            6,
        ),
        ({"vision": "dp=8", "llm": "dp=2,cp=2,tp=2"}, {}, {"zero1": True}, 8),
        ({"vision": "dp=4,tp=2", "llm": "dp=4,pp=2"}, {"mode": "homogeneous"}, {}, 8),
        ({"vision": "dp=2,fsdp=4", "llm": "fsdp=2,tp=2,pp=2"}, {}, {}, 8),
    ],
    ids=["noncolocated-6dev-tp2pp2", "cp2-zero1", "homogeneous-dp4pp2", "fsdp"],
)
def test_resumes_into_another_layout(saved, layouts, kwargs, options, n):
    losses, directory = saved
    model, _, _ = setup()
    ex = hetjax.Executor(
        plan(model, layouts, n=n, **kwargs),
        devices=jax.devices()[:n],
        optimizer=OPTIMIZER,
        options=hetjax.ParallelOptions(**options),
    )
    np.testing.assert_allclose(continue_from(directory, ex), losses[SAVED:], rtol=1e-5)


def test_resumes_into_the_single_device_reference(saved):
    losses, directory = saved
    model, params, _ = setup()
    axes = {name: m.logical_axes() for name, m in model.modules.items()}
    tx = hetjax.make_optimizer(OPTIMIZER, logical_axes=axes)
    ref = hetjax.ReferenceTrainer(model.loss_sum, params, tx, devices=jax.devices()[:1])
    np.testing.assert_allclose(continue_from(directory, ref), losses[SAVED:], rtol=1e-5)


def test_the_reference_saves_what_an_executor_restores(saved, tmp_path):
    losses, _ = saved
    model, params, batches = setup()
    axes = {name: m.logical_axes() for name, m in model.modules.items()}
    tx = hetjax.make_optimizer(OPTIMIZER, logical_axes=axes)
    ref = hetjax.ReferenceTrainer(model.loss_sum, params, tx, devices=jax.devices()[:1])
    for b in batches[:SAVED]:
        ref.step(b)
    hetjax.checkpoint.save(tmp_path, ref, SAVED, metadata={"model": {"preset": "tiny"}})
    ex = hetjax.Executor(plan(model, SAVED_LAYOUT), devices=jax.devices(), optimizer=OPTIMIZER)
    np.testing.assert_allclose(continue_from(tmp_path, ex), losses[SAVED:], rtol=1e-5)


def test_keeps_the_most_recent_and_ignores_an_unfinished_save(saved, tmp_path):
    """A kill during a save leaves orbax's temporary directory: never loaded."""
    losses, directory = saved
    ckpt_dir = tmp_path / "run"
    shutil.copytree(directory, ckpt_dir)
    partial = ckpt_dir / f"{SAVED + 2}.orbax-checkpoint-tmp-1234"
    shutil.copytree(ckpt_dir / str(SAVED), partial)
    (partial / "commit_success.txt").unlink(missing_ok=True)
    assert Checkpointer(ckpt_dir).latest_step() == SAVED
    model, _, _ = setup()
    ex = hetjax.Executor(plan(model, SAVED_LAYOUT), devices=jax.devices(), optimizer=OPTIMIZER)
    assert continue_from(ckpt_dir, ex) == losses[SAVED:]


def test_another_model_names_the_first_mismatched_leaf(saved):
    _, directory = saved
    model, _, _ = setup("tiny-av")
    layouts = {"vision": "dp=8", "audio": "dp=8", "llm": "dp=2,tp=2,pp=2"}
    ex = hetjax.Executor(plan(model, layouts), devices=jax.devices(), optimizer=OPTIMIZER)
    with pytest.raises(
        CheckpointError, match=r"of another model: (it has no |its )?parameter \S+ "
    ) as e:
        hetjax.checkpoint.restore(directory, ex)
    assert "\n" not in str(e.value)


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="not a hetjax checkpoint directory"):
        Checkpointer(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "hello"  # untouched


def test_a_damaged_checkpoint_is_one_line_and_untouched(saved, tmp_path):
    _, directory = saved
    ckpt_dir = tmp_path / "run"
    shutil.copytree(directory, ckpt_dir)
    data = sorted((ckpt_dir / str(SAVED) / "state").rglob("*"))
    biggest = max((p for p in data if p.is_file()), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])  # truncated
    before = sorted(p.name for p in ckpt_dir.rglob("*"))
    model, _, _ = setup()
    ex = hetjax.Executor(plan(model, SAVED_LAYOUT), devices=jax.devices(), optimizer=OPTIMIZER)
    with pytest.raises(CheckpointError, match=r"damaged or incomplete") as e:
        hetjax.checkpoint.restore(ckpt_dir, ex)
    assert "\n" not in str(e.value)
    assert sorted(p.name for p in ckpt_dir.rglob("*")) == before


def test_an_unwritable_directory_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(CheckpointError, match="not writable"):
        Checkpointer(blocker / "ckpt")


def test_metadata_holds_the_shapes_and_what_the_caller_gave(saved):
    _, directory = saved
    meta = Checkpointer(directory).metadata()
    assert meta["step"] == SAVED and meta["model"] == {"preset": "tiny"}
    assert meta["shapes"]["llm/blocks/qkv/kernel"][0] == get_preset("tiny").llm.depth
    json.dumps(meta)


def test_frozen_parts_checkpoint_and_resume_elsewhere(tmp_path):
    """With the vision encoder frozen (its first stage forward only, no optimizer state),
    a checkpoint holds the trained parts' optimizer state only and resumes into another
    layout and into the reference trainer with the same freeze."""
    model, params, batches = setup()
    freeze = ("vision",)

    def executor(layouts, n, **kwargs):
        parsed = {k: Layout.parse(v) for k, v in layouts.items()}
        graph = model.train_graph(parsed, freeze=freeze)
        p = hetjax.plan_run(graph, num_devices=n, microbatches=2, **kwargs)
        return hetjax.Executor(p, devices=jax.devices()[:n], optimizer=OPTIMIZER, params=params)

    first = executor(
        {"vision": "dp=2,pp=2", "llm": "dp=2,pp=2"},
        8,
        mode="non-colocated",
        islands={"vision": 4, "llm": 4},
    )
    for b in batches[:SAVED]:
        first.step(b)
    hetjax.checkpoint.save(tmp_path, first, SAVED, metadata={"model": {"preset": "tiny"}})
    losses = [float(first.step(b)["loss"]) for b in batches[SAVED:]]
    opt = logical.executor_logical(first)["opt_state"]
    moments = jax.tree.leaves(opt, is_leaf=lambda x: isinstance(x, dict) and "llm" in x)
    moments = [m for m in moments if isinstance(m, dict)]  # Adam's mu and nu
    assert len(moments) == 2 and all(set(m) == {"projector", "llm"} for m in moments)

    other = executor(SAVED_LAYOUT, 8)
    np.testing.assert_allclose(continue_from(tmp_path, other), losses, rtol=1e-5)
    axes = {n: m.logical_axes() for n, m in model.modules.items() if n not in freeze}
    tx = hetjax.make_optimizer(OPTIMIZER, logical_axes=axes)
    ref = hetjax.ReferenceTrainer(
        model.loss_sum, params, tx, devices=jax.devices()[:1], frozen=freeze
    )
    np.testing.assert_allclose(continue_from(tmp_path, ref), losses, rtol=1e-5)
    jax.tree.map(  # the frozen encoder never moved
        np.testing.assert_array_equal,
        jax.device_get(ref.params["vision"]),
        jax.device_get(params["vision"]),
    )
