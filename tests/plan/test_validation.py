"""The cost model against what the compiled programs really do (counts, not times).

For each layout below, one executor of a runnable preset trains one step on the 8
simulated CPU devices while a :class:`hetjax.inspect.Recorder` keeps every stage
program's compiled HLO and how often the step called it. Per stage:

- FLOPs: the compiled forward program's matmul FLOPs (:func:`hetjax.inspect.hlo.matmul_flops`,
  per device, times the stage's devices) equal the cost model's forward FLOPs of one
  microbatch (``StageCost.flops``, with ``full_attention``: XLA's attention computes the
  masked half), and the backward program's are twice that under the activation
  policy ``none`` (the forward keeps the ``jax.vjp`` residuals; the sink's last stage,
  whose forward runs inside its backward, three times), within 10%;
- collective bytes per step, by kind: the sum over the step's program calls of the HLO's
  collectives (:func:`hetjax.inspect.hlo.collectives`, loop trip counts included) equals
  the model's per-pass bytes composed with the same calls (forward program: one forward
  pass; backward program: one backward pass, plus the forward on the sink's last stage;
  reduce program: the DP reduction),
  within 10% for every kind that carries more than 1% of the stage's bytes.

Twelve module layouts over six executors (TP, CP, PP, EP, ZeRO-1; colocated,
non-colocated, homogeneous); the first runs by default, the others are ``slow``.
"""

from __future__ import annotations

import jax
import pytest

import hetjax
from hetjax import Layout
from hetjax.inspect import Recorder
from hetjax.inspect.hlo import bytes_by_kind, collectives, matmul_flops
from hetjax.plan import ModulePlan, Plan, Workload, estimate
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

BATCH, M = 16, 2
TOLERANCE = 0.10
CASES = {
    "colocated_tp_pp": ("tiny", "colocated", "dp=8", "dp=2,tp=2,pp=2", False),
    "noncolocated_pp_zero1": ("tiny", "non-colocated", "dp=2,pp=2", "dp=2,tp=2", True),
    # the dense LLM runs per cp rank (tp = 2 and 1), its gradients reduced over dp x cp
    # once per step; the compiled backward's FLOPs match the cost model's (no replica of
    # dp left unpartitioned inside the per-rank region)
    "colocated_cp": ("tiny", "colocated", "dp=4,tp=2", "dp=2,cp=2,tp=2", False),
    "colocated_cp_pp": ("tiny", "colocated", "dp=8", "dp=2,cp=2,pp=2", False),
    "homogeneous_tp": ("tiny", "homogeneous", None, "dp=4,tp=2", False),
    "noncolocated_ep": ("tiny-moe", "non-colocated", "dp=4", "dp=4,ep=4", False),
}
SLOW = {name: [pytest.mark.slow] for name in list(CASES)[1:]}


def measure(name: str) -> tuple[dict, dict]:
    """(compiled, modelled) per stage key: forward/backward FLOPs, bytes per step by kind."""
    preset, mode, vision, llm, zero1 = CASES[name]
    cfg = get_preset(preset)
    model = MLLM(cfg)
    batch = SyntheticLlava(SyntheticConfig.for_model(cfg, seq_len=cfg.seq_len, seed=0)).batch(
        0, BATCH
    )
    lay_l = Layout.parse(llm)
    lay_v = Layout.parse(vision) if vision else Layout(dp=lay_l.dp, tp=lay_l.tp, cp=lay_l.cp)
    rec = Recorder()
    plan = hetjax.plan_run(
        model.train_graph({"vision": lay_v, "llm": lay_l}).with_recompute({"*": "none"}),
        num_devices=len(jax.devices()),
        mode=mode,
        islands={"vision": lay_v.num_devices, "llm": lay_l.num_devices}
        if mode == "non-colocated"
        else None,
        microbatches=M,
    )
    ex = hetjax.Executor(
        plan,
        model.init(jax.random.key(0)),
        devices=jax.devices(),
        optimizer=hetjax.AdamWConfig(total_steps=2),
        options=hetjax.ParallelOptions(zero1=zero1),
        observers=[rec],
    )
    jax.block_until_ready(ex.step(batch))
    opts = dict(zero1=zero1, sequence_parallel=False)  # the executor's options above
    plan = Plan(mode, ModulePlan(lay_v, **opts), ModulePlan(lay_l, **opts), M)
    work = Workload(
        BATCH,
        cfg.seq_len,
        1,
        act_bytes=4,
        full_attention=True,  # XLA's attention computes the masked half
        fused_columns=False,  # one reduction per column-parallel weight (2: fused qkv, gate|up)
        replica_grads_per_microbatch=True,  # the engine's: see hetjax.plan.stage
    )
    est = estimate(cfg, plan, work, "cpu")
    compiled: dict = {}
    modelled: dict = {}
    for st in est.stages:
        key = (st.module, st.index)
        size = ex.programs[key].mesh.size
        got = {"fwd": 0.0, "bwd": 0.0, "bytes": dict.fromkeys(bytes_by_kind([]), 0.0)}
        # Policy ``none``: a backward replays no forward, except on the sink's
        # last stage, whose forward runs inside its backward.
        fused = (key, "fwd") not in rec.compiled
        want = {
            "fwd": st.flops,
            "bwd": (3 if fused else 2) * st.flops,
            "bytes": dict.fromkeys(got["bytes"], 0.0),
        }
        for (k, kind), prog in rec.compiled.items():
            if k != key:
                continue
            hlo, calls = prog.as_text(), rec.calls[(k, kind)]
            if kind in ("fwd", "bwd"):
                got[kind] = matmul_flops(hlo) * size
            moved = [c for c in collectives(hlo, size) if max(map(len, c.groups)) > 1]
            for c, b in bytes_by_kind(moved).items():
                got["bytes"][c] += calls * b
            bwd = [st.forward_comm, st.backward_comm] if fused else [st.backward_comm]
            passes = {"fwd": [st.forward_comm], "bwd": bwd}
            for part in passes.get(kind, [st.step_comm] if kind == "reduce" else []):
                for c, b in part.items():
                    c = "all-reduce" if c == "reduce-scatter" else c  # XLA:CPU's unfused form
                    want["bytes"][c] += calls * b
        if fused:
            got["fwd"] = want["fwd"] = 0.0  # the sink's last stage: forward inside backward
        compiled[key], modelled[key] = got, want
    return compiled, modelled


@pytest.mark.parametrize("name", [pytest.param(n, marks=SLOW.get(n, [])) for n in CASES])
def test_flops_and_collective_bytes_match_compiled_programs(name):
    compiled, modelled = measure(name)
    for key, got in compiled.items():
        want = modelled[key]
        for kind in ("fwd", "bwd"):
            assert got[kind] == pytest.approx(want[kind], rel=TOLERANCE), (key, kind)
        total = sum(got["bytes"].values()) + sum(want["bytes"].values())
        for c in got["bytes"]:
            g, w = got["bytes"][c], want["bytes"][c]
            if max(g, w) > 0.01 * total:
                assert g == pytest.approx(w, rel=TOLERANCE), (key, c, g, w)
