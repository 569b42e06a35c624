"""Model and hardware FLOPs of a training step, MFU and HFU.

Model FLOPs (MFU) follow the anchors' convention (MaxText's and PaLM's: 6 x parameters x
tokens for the blocks, causal attention at half the square), per part, from the part's
forward FLOPs ``F`` (the model's own count, e.g.
``models.config.MLLMConfig.forward_flops``: the LM head over the supervised tokens, an
encoder per sample at its real token count) and the part of ``F`` in attention's
weightless matmuls ``A`` (QK^T, PV):

- a trained part costs ``3 F`` (forward, activation gradient, weight gradient);
- a frozen part that a gradient passes through (something upstream trains)
  ``2 F + A``: its weight matmuls take an activation gradient only, its attention
  matmuls two (both operands are activations);
- a frozen part with nothing trainable upstream ``F``: it runs forward only.

Hardware FLOPs (HFU) count what runs: the same rule over what the kernels compute
(``forward_flops(..., executed=True)``: attention over the share of the square the kernel
computes, the head over the positions it is computed at), plus what the executor
recomputes, by the module's activation policy (``ModuleSpec.recompute``, see
:mod:`hetjax.runtime.vjp`): ``none`` nothing; ``selective`` the weightless matmuls of
attention (QK^T, PV: ``attention``) of every stage with a backward (element-wise work is
not counted); ``full`` every stage with a backward re-runs its forward inside it
(``jax.vjp`` on the stashed input), except the sink's last stage, whose forward only ever
runs inside its backward, and a frozen first part with nothing trainable upstream under a
trained one on the same stage (a frozen encoder under its trained projector): the
forward keeps its output and the backward starts there
(:meth:`~hetjax.runtime.graph.TrainGraph.stashes_frozen_output`). A module's block stack is
split into ``pp`` equal stages, so each stage holds ``1 / pp`` of its first part's
forward; further parts sit on the last stage. (``experiments.gpu_check`` counts HFU from
the compiled programs instead: :func:`hetjax.inspect.hlo.matmul_flops`.)

MFU (HFU) is model (hardware) FLOPs per second over the devices' peak: :data:`PEAK_TFLOPS`
knows common accelerators' dense BF16 peaks (by ``device_kind``); elsewhere give one.
"""

from __future__ import annotations

from collections.abc import Mapping

from hetjax.runtime.graph import TrainGraph

TRAINED, THROUGH, FORWARD = "trained", "frozen, gradient through", "frozen, forward only"
FACTORS = {TRAINED: 3, THROUGH: 2, FORWARD: 1}

# Dense BF16 TFLOP/s per device, matched as a prefix of the lower-cased device_kind.
PEAK_TFLOPS: dict[str, float] = {
    "nvidia h200": 989.4,
    "nvidia h100": 989.4,  # SXM; the PCIe part is lower, give --peak-tflops for it
    "nvidia gh200": 989.4,
    "nvidia a100": 312.0,
    "nvidia l40s": 362.05,
    "tpu v5p": 459.0,
    "tpu v5 lite": 197.0,
    "tpu v4": 275.0,
}


def peak_tflops(device_kind: str) -> float | None:
    """The table's dense BF16 peak of a device kind (``jax.Device.device_kind``), if known."""
    kind = device_kind.lower()
    return next((v for k, v in PEAK_TFLOPS.items() if kind.startswith(k)), None)


def part_roles(graph: TrainGraph) -> dict[str, str]:
    """Every part's role in the step: :data:`TRAINED`, :data:`THROUGH` or :data:`FORWARD`."""
    roles = {}
    for spec in graph.modules:
        upstream = any(graph.trains_upstream(l.src) for l in graph.links_into(spec.name))
        for name in spec.param_keys:
            if name not in spec.frozen:
                roles[name], upstream = TRAINED, True
            else:
                roles[name] = THROUGH if upstream else FORWARD
    return roles


def model_flops(
    graph: TrainGraph, forward: Mapping[str, float], attention: Mapping[str, float] = {}
) -> dict[str, float]:
    """Model FLOPs of one step per MODULE from each part's forward FLOPs and the part of
    them in attention's weightless matmuls (``attention``; missing: none), by the rule
    above."""
    roles = part_roles(graph)
    return {
        m.name: float(
            sum(
                FACTORS[roles[p]] * forward[p] + (roles[p] == THROUGH) * attention.get(p, 0.0)
                for p in m.param_keys
            )
        )
        for m in graph.modules
    }


def hardware_flops(
    graph: TrainGraph, forward: Mapping[str, float], attention: Mapping[str, float] = {}
) -> dict[str, float]:
    """The rule plus the forwards the backward recomputes, per module. ``forward``: what
    the kernels compute per part (e.g. ``forward_flops(..., executed=True)``);
    ``attention``: the part of it in weightless matmuls (``attention_flops(...,
    executed=True)``)."""
    out = model_flops(graph, forward, attention)
    for spec in graph.modules:
        pp = spec.layout.pp
        replayed = forward if spec.recompute == "full" else {}
        if spec.recompute == "selective":
            replayed = attention
        for stage in range(pp):
            if not graph.has_backward((spec.name, stage)):
                continue
            if spec.name == graph.sink and stage == pp - 1 and spec.recompute != "selective":
                continue  # its forward runs only inside its backward
            on_stage = replayed.get(spec.param_keys[0], 0.0) / pp
            if graph.stashes_frozen_output((spec.name, stage)):
                on_stage = 0.0  # the backward starts after the frozen first part
            if stage == pp - 1:
                on_stage += sum(replayed.get(p, 0.0) for p in spec.param_keys[1:])
            out[spec.name] += on_stage
    return out


def throughput_metrics(
    model: Mapping[str, float],
    hardware: Mapping[str, float],
    step_time_s: float,
    *,
    num_devices: int,
    module_devices: Mapping[str, int],
    peak: float | None,
) -> dict[str, float]:
    """One step's FLOP metrics from per-module model and hardware FLOPs.

    ``model_tflops_per_step`` (and ``/<module>``), ``hardware_tflops_per_step``,
    ``tflops_per_s`` (model FLOPs) and, with a ``peak`` (TFLOP/s per device), ``mfu`` and
    ``hfu`` over the ``num_devices`` of the run and ``mfu/<module>`` over the devices each
    module runs on (``module_devices``; colocated, all of them).
    """
    total = sum(model.values())
    out = {
        "model_tflops_per_step": total / 1e12,
        **{f"model_tflops_per_step/{m}": v / 1e12 for m, v in model.items()},
        "hardware_tflops_per_step": sum(hardware.values()) / 1e12,
        "tflops_per_s": total / 1e12 / step_time_s,
    }
    if peak:
        out["mfu"] = out["tflops_per_s"] / (peak * num_devices)
        out["hfu"] = out["hardware_tflops_per_step"] / step_time_s / (peak * num_devices)
        for m, v in model.items():
            out[f"mfu/{m}"] = v / 1e12 / step_time_s / (peak * module_devices[m])
    return out
