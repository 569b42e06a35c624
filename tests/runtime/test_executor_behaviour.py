"""Distributed properties of the executor, beyond the values it computes.

- nothing compiles again after the first step (``jax.monitoring`` compile events
  during each stage program's call and anywhere, ``on_compile`` reports, and JAX's
  compile log);
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
import re
import time
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest

import hetjax
from hetjax import Layout
from hetjax.inspect import (
    BACKEND_COMPILE_EVENT,
    Collective,
    CompileCounter,
    Recorder,
    collectives,
)
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM
from tests import launch

GLOBAL_BATCH = 16
MICROBATCHES = 2
STEPS = 3
PROGRAMS = ("fwd", "bwd", "update", "reduce", "zeros")
OPTIMIZER = hetjax.AdamWConfig(total_steps=10, warmup_steps=2)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def layouts(**texts: str) -> dict[str, Layout]:
    return {name: Layout.parse(text, module=name) for name, text in texts.items()}


SHARED_LAYOUTS = layouts(vision="dp=8", llm="dp=4,pp=2")


@pytest.fixture(scope="module")
def tiny():
    cfg = get_preset("tiny")
    model = MLLM(cfg)
    data = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0))
    batches = [data.batch(s, GLOBAL_BATCH) for s in range(STEPS)]
    return model, model.init(jax.random.key(0)), batches


def executor(tiny, lays, *, observers=(), **plan) -> hetjax.Executor:
    """The executor of ``lays``, planned with ``plan`` (:func:`hetjax.plan_run`'s options)."""
    model, params, _ = tiny
    plan.setdefault("microbatches", MICROBATCHES)
    run = hetjax.plan_run(model.train_graph(lays), num_devices=len(jax.devices()), **plan)
    return hetjax.Executor(
        run, params, devices=jax.devices(), optimizer=OPTIMIZER, observers=observers
    )


class CompileLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.compiled: list[str] = []

    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Compiling "):
            self.compiled.append(msg[:200])


class CompileEvents:
    """Observer: the ``jax.monitoring`` backend compiles during each program call (an
    event inside a call's ``t0``..``t1``; compiles of transfers fall between calls)."""

    def __init__(self):
        self.at: list[float] = []  # perf_counter of each backend compile
        self.per_call: Counter = Counter()  # (stage key, program name) -> compiles so far

    def listen(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.at.append(time.perf_counter())

    def on_dispatch(self, event) -> None:
        if self.at:
            self.per_call[(event.stage, event.program)] += sum(
                event.t0 <= t <= event.t1 for t in self.at
            )
            self.at = [t for t in self.at if t > event.t1]


@dataclasses.dataclass
class Run:
    ex: hetjax.Executor
    rec: Recorder  # argument signatures compiled (on_compile) and calls, per program
    events: CompileEvents
    losses: np.ndarray
    compiled_after_1: dict  # compiled(ex, events) after step 1
    compiled_after_3: dict
    compiles_in_steps_2_3: int  # backend compiles of anything
    logged_in_steps_2_3: list[str]  # JAX's compile log


def compiled(ex: hetjax.Executor, events: CompileEvents) -> dict:
    """Backend compiles so far during the calls of every stage program, called or not."""
    return {(k, n): events.per_call[(k, n)] for k in ex.programs for n in PROGRAMS}


@pytest.fixture(scope="module")
def run(tiny):
    """The shared colocated run: three steps, watched by two observers (compiles and calls
    of every stage program; a program compiles on its first call with new arguments)."""
    _, _, batches = tiny
    rec, events = Recorder(), CompileEvents()
    jax.monitoring.register_event_duration_secs_listener(events.listen)
    ex = executor(tiny, SHARED_LAYOUTS, mode="colocated", observers=[rec, events])
    losses = [jax.device_get(ex.step(batches[0])["loss"])]
    after_1 = compiled(ex, events)
    log, jax_logger = CompileLog(), logging.getLogger("jax")
    jax_logger.addHandler(log)
    try:
        with jax.log_compiles(True), CompileCounter() as counter:
            losses += [jax.device_get(ex.step(b)["loss"]) for b in batches[1:]]
    finally:
        jax_logger.removeHandler(log)
    yield Run(
        ex,
        rec,
        events,
        np.asarray(losses),
        after_1,
        compiled(ex, events),
        counter.count,
        log.compiled,
    )
    jax.monitoring.unregister_event_duration_listener(events.listen)


# -- (a) compilation ------------------------------------------------------------------


def test_no_recompilation_after_first_step(run):
    assert run.compiled_after_3 == run.compiled_after_1
    # Every program that step 1 needs was compiled exactly once (the sink's last stage
    # forwards inside its backward, so its fwd is never called).
    sink_last = ("llm", SHARED_LAYOUTS["llm"].pp - 1)
    for (key, name), count in run.compiled_after_1.items():
        expected = 0 if (key, name) == (sink_last, "fwd") else 1
        assert count == expected, (key, name, count)
        # ... for one argument signature, the one the observers were shown
        assert run.rec.compiles[(key, name)] == expected, (key, name)
    # Nothing else either: no transfer, reshard or scalar op compiled in steps 2-3.
    assert run.compiles_in_steps_2_3 == 0
    assert run.logged_in_steps_2_3 == []
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
    return run.rec.compiled[(key, name)].as_text()


def test_backward_and_reduce_are_called_per_microbatch_and_per_step(run):
    for key in run.ex.programs:
        assert run.rec.calls[(key, "bwd")] == STEPS * MICROBATCHES, key
        assert run.rec.calls[(key, "reduce")] == STEPS, key


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
    plan = hetjax.plan_run(
        model.train_graph(lays), num_devices=len(jax.devices()), mode="colocated", microbatches=4
    )
    ex = hetjax.Executor(
        plan, model.init(jax.random.key(0)), devices=jax.devices(), optimizer=OPTIMIZER
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
    assert compiled(run.ex, run.events) == run.compiled_after_1  # profiling: none
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
    result = launch.run_main(launch.TRAIN, *flags, "--timeline", str(png))
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
