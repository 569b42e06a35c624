"""Distributed properties of the executor, beyond the values it computes.

- nothing compiles again after the first step (compile events during each stage
  program's calls, and JAX's compile log);
- one data-parallel reduction per parameter per step: the per-microbatch backward
  programs of a ``dp > 1, tp = 1`` stage contain no collective on a parameter-sized
  array, and the once-per-step ``reduce`` all-reduces exactly the stage's parameters;
- encoder offload parks encoder state in ``pinned_host`` during the LLM phase and
  changes no value;
- the three-phase order (all encoder forwards, the LLM pipeline, all encoder
  backwards), the placements of the other modes, and the profiled timeline.

One colocated run (vision ``dp=8``, LLM ``dp=4,pp=2``, two microbatches; no TP, so any
collective in a backward would be a data-parallel one) is shared by most tests.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

import hetjax
from hetjax import Layout
from hetjax.inspect import Collective, CompileCounter, collectives
from models.config import get_preset
from models.data import DataConfig, SyntheticLlava
from models.mllm import MLLM

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 16
MICROBATCHES = 2
STEPS = 3
PROGRAMS = ("fwd", "bwd", "update", "reduce", "zeros")
OPTIMIZER = hetjax.OptimizerConfig(total_steps=10, warmup_steps=2)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def layouts(**texts: str) -> dict[str, Layout]:
    return {name: Layout.parse(text, module=name) for name, text in texts.items()}


SHARED_LAYOUTS = layouts(vision="dp=8", llm="dp=4,pp=2")


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data = SyntheticLlava(DataConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(s, GLOBAL_BATCH) for s in range(STEPS)]
    return model, model.init(jax.random.key(0)), batches


def executor(tiny, lays, **kw) -> hetjax.Executor:
    model, params, _ = tiny
    kw.setdefault("microbatches", MICROBATCHES)
    return hetjax.Executor(
        model.train_graph(lays), params, devices=jax.devices(), optimizer=OPTIMIZER, **kw
    )


def abstract(tree):
    """Shapes, dtypes and (committed) shardings of a call's arguments, for ``.lower``."""

    def one(a):
        if not isinstance(a, jax.Array):
            return a
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding if a.committed else None)

    return jax.tree.map(one, tree)


class CompileLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.compiled: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            self.compiled.append(msg[:200])


@dataclasses.dataclass
class Run:
    ex: hetjax.Executor
    jitted: dict  # (stage key, program name) -> the StageProgram's own jitted function
    calls: Counter  # (stage key, program name) -> calls over all steps
    args: dict  # (stage key, program name) -> abstract arguments of its first call
    compiles: Counter  # (stage key, program name) -> compiles during its calls, so far
    losses: np.ndarray
    compiled_after_1: dict  # compiled(compiles, jitted) after step 1
    compiled_after_3: dict
    compiles_in_steps_2_3: list[str]


def compiled(compiles: Counter, jitted: dict) -> dict:
    """Compiles so far of every stage program, called or not."""
    return {call_id: compiles[call_id] for call_id in jitted}


@pytest.fixture(scope="module")
def run(tiny):
    """The shared colocated run: three steps, with counters of calls and compiles on
    every stage program (a program compiles on its first call with new arguments)."""
    _, _, batches = tiny
    ex = executor(tiny, SHARED_LAYOUTS, mode="colocated")
    jitted = {(k, n): getattr(p, n) for k, p in ex.programs.items() for n in PROGRAMS}
    calls, args, compiles = Counter(), {}, Counter()
    counter = CompileCounter().start()

    def counted(fn, call_id):
        def call(*a):
            calls[call_id] += 1
            args.setdefault(call_id, abstract(a))  # before the call donates its buffers
            before = counter.count
            out = fn(*a)
            compiles[call_id] += counter.count - before
            return out

        return call

    for call_id, fn in jitted.items():
        setattr(ex.programs[call_id[0]], call_id[1], counted(fn, call_id))
    losses = [jax.device_get(ex.step(batches[0])["loss"])]
    after_1 = compiled(compiles, jitted)
    log, jax_logger = CompileLog(), logging.getLogger("jax")
    jax_logger.addHandler(log)
    try:
        with jax.log_compiles(True):
            losses += [jax.device_get(ex.step(b)["loss"]) for b in batches[1:]]
    finally:
        jax_logger.removeHandler(log)
    yield Run(
        ex,
        jitted,
        calls,
        args,
        compiles,
        np.asarray(losses),
        after_1,
        compiled(compiles, jitted),
        log.compiled,
    )
    counter.stop()


# -- (a) compilation ------------------------------------------------------------------


def test_no_recompilation_after_first_step(run):
    assert run.compiled_after_3 == run.compiled_after_1
    # Every program that step 1 needs was compiled exactly once (the sink's last stage
    # forwards inside its backward, so its fwd is never called).
    sink_last = ("llm", SHARED_LAYOUTS["llm"].pp - 1)
    for (key, name), count in run.compiled_after_1.items():
        expected = 0 if (key, name) == (sink_last, "fwd") else 1
        assert count == expected, (key, name, count)
    # Nothing else either: no transfer, reshard or scalar op compiled in steps 2-3.
    assert run.compiles_in_steps_2_3 == []
    assert np.all(np.isfinite(run.losses)) and len(set(run.losses.tolist())) == STEPS


# -- (b) one data-parallel reduction per parameter per step ---------------------------


def elements(c: Collective) -> list[int]:
    """Element count of each array ``c`` produces; a scalar counts 0 (the summed loss)."""
    return [math.prod(shape) if shape else 0 for shape in c.shapes]


def compiled_collectives(run: Run, key, name: str) -> list[tuple[str, list[int]]]:
    """``(kind, elements(c))`` of every collective of a stage program's compiled HLO."""
    mesh = run.ex.programs[key].mesh
    return [(c.kind, elements(c)) for c in collectives(compiled_text(run, key, name), mesh.size)]


def compiled_text(run: Run, key, name: str) -> str:
    return run.jitted[(key, name)].lower(*run.args[(key, name)]).compile().as_text()


def test_backward_and_reduce_are_called_per_microbatch_and_per_step(run):
    for key in run.ex.programs:
        assert run.calls[(key, "bwd")] == STEPS * MICROBATCHES, key
        assert run.calls[(key, "reduce")] == STEPS, key


@pytest.mark.parametrize("key", [("vision", 0), ("llm", 0), ("llm", 1)], ids=str)
def test_one_dp_reduction_per_parameter_per_step(run, key):
    prog = run.ex.programs[key]
    assert prog.spec.layout.dp > 1 and prog.spec.layout.tp == 1
    # Backward (one per microbatch): gradients stay per replica - no collective moves a
    # parameter-sized array (only the sink's scalar loss may be summed over replicas).
    moved = [(op, sizes) for op, sizes in compiled_collectives(run, key, "bwd") if any(sizes)]
    assert moved == [], moved
    # Reduce (once per step): all-reduces every parameter element exactly once.
    ops = compiled_collectives(run, key, "reduce")
    assert {op for op, sizes in ops if any(sizes)} == {"all-reduce"}, ops
    reduced = sum(n for _, sizes in ops for n in sizes)
    assert reduced == sum(a.size for a in jax.tree.leaves(run.ex.params[key]))


# -- (c) encoder offload --------------------------------------------------------------


def test_offload_parks_encoders_on_host_without_changing_values(tiny, run):
    _, _, batches = tiny
    ex = executor(tiny, SHARED_LAYOUTS, mode="colocated", offload_encoders=True)
    with pytest.raises(ValueError, match="profile"):  # nothing profiled yet
        ex.timeline()
    losses = [jax.device_get(ex.step(batches[0])["loss"])]
    assert ex.memory_log == [(1, "pinned_host"), (2, "device")]
    losses += [jax.device_get(ex.step(b)["loss"]) for b in batches[1:]]
    assert ex.memory_log == [(1, "pinned_host"), (2, "device")] * STEPS
    np.testing.assert_array_equal(np.asarray(losses), run.losses)  # bitwise
    for key in ex.programs:
        if key[0] == "vision":  # back on device for the next step's encoder phase
            leaves = jax.tree.leaves((ex.params[key], ex.opt_state[key]))
            assert {a.sharding.memory_kind for a in leaves} == {"device"}
    assert run.ex.memory_log == []  # off unless asked for


# -- (d) schedule order and placements ------------------------------------------------


def op_positions(ex: hetjax.Executor, kind: str, encoder: bool) -> list[int]:
    sink = ex.graph.sink
    return [
        i for i, op in enumerate(ex.ops) if op.kind == kind and (op.stage[0] != sink) == encoder
    ]


def check_three_phase(ex: hetjax.Executor) -> None:
    enc_f, llm_f = op_positions(ex, "F", True), op_positions(ex, "F", False)
    enc_b, llm_b = op_positions(ex, "B", True), op_positions(ex, "B", False)
    encoders = [m.name for m in ex.graph.modules if m.name != ex.graph.sink]
    assert len(enc_f) == len(enc_b) == len(encoders) * ex.microbatches
    assert max(enc_f) < min(llm_f), "an encoder forward runs after the LLM started"
    assert max(llm_b) < min(enc_b), "an encoder backward runs before the LLM finished"
    for op in ex.ops:  # phases: 0 encoder forward, 1 LLM pipeline, 2 encoder backward
        if op.stage[0] == ex.graph.sink:
            assert op.phase == 1, op
        elif op.kind in ("F", "SEND_F"):
            assert op.phase == 0, op
        else:
            assert op.phase == 2, op


def test_three_phase_order(run):
    check_three_phase(run.ex)


def test_three_phase_order_with_two_encoders():
    cfg = get_preset("tiny-av")
    model = MLLM(cfg)
    lays = layouts(vision="dp=4,tp=2", audio="dp=8", llm="dp=2,tp=2,pp=2")
    ex = hetjax.Executor(
        model.train_graph(lays),
        model.init(jax.random.key(0)),
        devices=jax.devices(),
        mode="colocated",
        microbatches=4,
        optimizer=OPTIMIZER,
    )
    check_three_phase(ex)


def test_non_colocated_islands_and_overlap(tiny):
    lays = layouts(vision="dp=4", llm="dp=2,pp=2")
    ex = executor(tiny, lays, mode="non-colocated", islands={"vision": 4, "llm": 4}, microbatches=4)
    devices = jax.devices()
    assert ex.meshes["vision"].devices == tuple(devices[:4])  # islands in the given order
    assert ex.meshes["llm"].devices == tuple(devices[4:])
    # Graph-aware 1F1B: the encoder island keeps working while the LLM pipeline runs.
    assert max(op_positions(ex, "F", True)) > min(op_positions(ex, "F", False))


def test_homogeneous_encoder_inherits_llm_first_stage(tiny):
    ex = executor(tiny, layouts(vision="dp=8", llm="dp=2,tp=2,pp=2"), mode="homogeneous")
    assert ex.graph.module("vision").layout == Layout(dp=2, tp=2)
    assert ex.meshes["vision"].devices == ex.meshes["llm"].stage_devices(0)
    assert ex.links[("vision", "llm")].identity  # nothing to move between them
    # The encoder runs inside the LLM's first pipeline stage: F right before LLM stage 0.
    for i, op in enumerate(ex.ops):
        if op.kind == "F" and op.stage == ("llm", 0):
            assert ex.ops[i - 2].kind == "F" and ex.ops[i - 2].stage == ("vision", 0)
            assert ex.ops[i - 2].microbatch == op.microbatch


# -- (e, f) profiling and the timeline ------------------------------------------------


def test_profiled_step_draws_timeline(run, tiny, tmp_path):
    _, _, batches = tiny
    metrics = run.ex.step(batches[0], profile=True)
    assert np.isfinite(jax.device_get(metrics["loss"]))
    assert compiled(run.compiles, run.jitted) == run.compiled_after_1  # profiling: none
    for kind, key in [("F", ("vision", 0)), ("F", ("llm", 0)), ("B", ("llm", 1))]:
        assert len(run.ex.op_times[(kind, key)]) == MICROBATCHES
    timeline = run.ex.timeline()
    path = Path(timeline.to_png(tmp_path / "t.png"))
    assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 100
    assert len(timeline.bubble) == len(run.ex.schedule.stages) == 3
    assert all(0.0 <= b <= 1.0 for b in timeline.bubble), timeline.bubble
    assert timeline.makespan > 0


@pytest.mark.slow
def test_cli_timeline_writes_png(tmp_path):
    png = tmp_path / "timeline.png"
    flags = ["--steps", "2", "--global-batch", "16", "--microbatches", "2"]
    result = subprocess.run(
        [sys.executable, "-m", "experiments.llava_train", *flags, "--timeline", str(png)],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    m = re.search(
        r"timeline: .*timeline\.png \(simulated bubble per stage: ([^)]*)\)", result.stdout
    )
    assert m, result.stdout[-3000:]
    bubbles = [float(b) for b in m[1].split(",")]
    # Default layouts: vision dp=8 (one stage) and the LLM with pp=2 -> three stages.
    assert len(bubbles) == 3 and all(0.0 <= b <= 1.0 for b in bubbles), bubbles
