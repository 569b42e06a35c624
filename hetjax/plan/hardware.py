"""Hardware profiles as data: peak FLOP/s, memory, links and node size of one accelerator.

The cost model (:mod:`hetjax.plan.cost`) reads only these numbers, so a new machine is a
new :class:`HardwareProfile`, not new code. Bandwidths are per GPU and per direction:
NVLink inside a node, the GPU's own InfiniBand NIC (8 x 400 Gb/s per node = 50 GB/s per
GPU) across nodes.

Efficiency is one saturating curve for every matmul: ``peak x matmul_efficiency x
n / (n + matmul_knee)``, where ``n`` is the smallest per-GPU dimension of the layer's
matmuls (the width a TP shard leaves). It is what makes a small encoder pay for the
LLM's TP: its shards get thin, and thin matmuls run far below peak.

The time model (:mod:`hetjax.plan.stage`) adds what is not a weight matmul, each priced by
one constant here: a fixed host cost per program call and per transfer
(``dispatch_us``: hetjax's executor dispatches one jitted program per stage op),
the fixed cost of a block's kernels on each device (``launch_us``), element-wise work by
the bytes it moves (``hbm_tbps x memory_efficiency``), attention by
its kernel (a fused kernel at ``fused_attention_efficiency`` of peak; plain attention as
thin matmuls over ``head_dim`` plus ``score_passes`` passes over its score matrix), a
block's element-wise bytes times ``elementwise_scale``, ``weight_passes`` over a trained
stage's block weights per backward, and an MoE layer's dispatch buffers at
``moe_buffer_passes`` plus ``moe_launch_us`` per block pass (on the GPU profiles 1, 0, 0
and 0: the bytes alone, as before these were fitted on CPU), and ``fsdp_call_us`` per
fsdp collective the engine chains on CPU (0 on GPU).
``shared_compute`` marks devices that share one pool of cores (JAX's simulated CPU
devices): a step is then the sum of every device's work, not a pipeline makespan.

Profiles are data: :func:`load_profile` reads one written by ``python -m
experiments.calibrate`` (``hetjax/plan/profiles/*.json``, which say what they were
fitted on); :func:`get_profile` prefers such a file to the built-in constants below.
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator model and the machine it sits in."""

    name: str  # short name for --gpu
    peak_tflops: float  # dense BF16 (CPU: float32) TFLOP/s per device
    hbm_gib: float  # device memory, GiB
    hbm_tbps: float  # device memory bandwidth, TB/s
    nvlink_gbps: float  # GB/s per direction per device inside a node
    ib_gbps: float  # GB/s per direction per device across nodes
    gpus_per_node: int  # devices sharing one NVLink domain
    matmul_efficiency: float  # fraction of peak a large matmul reaches
    matmul_knee: float  # per-device matmul width at which efficiency halves
    comm_efficiency: float = 0.8  # fraction of link bandwidth a large collective reaches
    latency_us: float = 10.0  # fixed cost per collective call, microseconds
    reserved_gib: float = 6.0  # memory the runtime, NCCL buffers and fragmentation take
    dispatch_us: float = 20.0  # host cost of one program call or transfer, microseconds
    launch_us: float = 0.0  # fixed cost of one block's kernels per pass per device, us
    memory_efficiency: float = 0.8  # fraction of hbm_tbps element-wise kernels reach
    fused_attention_efficiency: float = 0.0  # fused attention kernel, fraction of peak (0: none)
    # plain attention: passes over its score matrix per forward (the backward twice),
    # priced as memory traffic; 4 counts the bytes (written, softmax read and write, read
    # by PV), a calibrated value also the softmax's arithmetic (exp) and its masking
    score_passes: float = 4.0
    # a block's element-wise work (norms, residual adds, activation: elementwise_elements)
    # costs this many times its bytes at the memory rate; 1 counts the bytes, a
    # calibrated value also the transcendental ops (rsqrt, exp, sin/cos) and copies
    elementwise_scale: float = 1.0
    # passes over an MoE layer's [E, C, D] dispatch buffers per forward (the backward
    # twice) at the memory rate: filling, scattering into and gathering from them
    moe_buffer_passes: float = 0.0
    moe_launch_us: float = 0.0  # an MoE layer's routing kernels: fixed cost per pass, us
    # passes over a trained stage's block weights per backward at the memory rate: its
    # weight gradients written and moved (0: only the optimizer's passes, as on GPU)
    weight_passes: float = 0.0
    # one fsdp collective as hetjax's engine issues it on XLA:CPU (each array's gather
    # chained behind the last, the layer's compute behind all: hetjax.runtime.fsdp),
    # beyond latency_us; fitted on CPU, 0 on GPU (no chain there)
    fsdp_call_us: float = 0.0
    shared_compute: bool = False  # devices share the host's cores (simulated CPU devices)

    @property
    def memory_bytes(self) -> float:
        """Bytes a plan may use per device (``hbm_gib - reserved_gib``)."""
        return (self.hbm_gib - self.reserved_gib) * 2**30

    def matmul_tflops(self, width: float) -> float:
        """Achieved TFLOP/s of matmuls whose smallest per-device dimension is ``width``."""
        return self.peak_tflops * self.matmul_efficiency * width / (width + self.matmul_knee)

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds of element-wise work that reads and writes ``nbytes`` on one device."""
        return nbytes / (self.hbm_tbps * self.memory_efficiency * 1e12)

    def fused_attention(self, act_bytes: int) -> bool:
        """Whether attention runs as a fused kernel (hetjax takes cuDNN's for BF16 on GPU)."""
        return self.fused_attention_efficiency > 0 and act_bytes == 2

    def link_gbps(self, crosses_nodes: bool) -> float:
        """Achieved GB/s of a collective inside a node or across nodes."""
        return (self.ib_gbps if crosses_nodes else self.nvlink_gbps) * self.comm_efficiency


# H100 SXM 80GB: 989.4 dense BF16 TFLOP/s, 3.35 TB/s HBM3, NVLink 4 (450 GB/s per
# direction), 8 x 400 Gb/s InfiniBand per node.
H100 = HardwareProfile(
    name="h100",
    peak_tflops=989.4,
    hbm_gib=80.0,
    hbm_tbps=3.35,
    nvlink_gbps=450.0,
    ib_gbps=50.0,
    gpus_per_node=8,
    matmul_efficiency=0.70,
    matmul_knee=96.0,
)
# H200 SXM 141GB: the H100's compute and links, more and faster HBM3e.
H200 = dataclasses.replace(H100, name="h200", hbm_gib=141.0, hbm_tbps=4.8)
# This machine's CPU as JAX's host platform, per simulated device (8 share 2 cores and
# 23 GiB): the matmul curve fitted by `python -m experiments.calibrate` (R = 7.6 GFLOP/s
# per device, knee 101, on a loaded machine; the worst point was 90% off the fit, so
# treat CPU predictions as rough). Links: in-process copies.
CPU = HardwareProfile(
    name="cpu",
    peak_tflops=0.0076,
    hbm_gib=2.5,
    hbm_tbps=0.005,
    nvlink_gbps=2.0,
    ib_gbps=2.0,
    gpus_per_node=8,
    matmul_efficiency=1.0,
    matmul_knee=101.0,
    comm_efficiency=1.0,
    latency_us=50.0,
    reserved_gib=0.0,
    memory_efficiency=1.0,
    shared_compute=True,
)

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")


def load_profile(path: str) -> HardwareProfile:
    """The profile in a JSON file (``{"profile": {field: value}, "fitted_on": {...}}``, as
    ``python -m experiments.calibrate`` writes it).

    Raises:
        ValueError: a field the profile does not have (the file is from another version).
    """
    with open(path) as f:
        fields = json.load(f)["profile"]
    known = {f.name for f in dataclasses.fields(HardwareProfile)}
    if unknown := sorted(set(fields) - known):
        raise ValueError(f"{path}: unknown profile fields {unknown}; recalibrate the profile")
    return HardwareProfile(**fields)


def save_profile(hw: HardwareProfile, path: str, fitted_on: dict) -> None:
    """Writes ``hw`` and what it was fitted on (machine, date, versions, points) to ``path``."""
    with open(path, "w") as f:
        json.dump({"profile": dataclasses.asdict(hw), "fitted_on": fitted_on}, f, indent=1)
        f.write("\n")


def _fitted(hw: HardwareProfile) -> HardwareProfile:
    """``hw`` as its calibrated file says (``profiles/<name>.json``), else as built in."""
    path = os.path.join(PROFILE_DIR, f"{hw.name}.json")
    return load_profile(path) if os.path.exists(path) else hw


PROFILES: dict[str, HardwareProfile] = {p.name: _fitted(p) for p in (H100, H200, CPU)}


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """The profile called ``name`` (a profile is returned as is).

    Raises:
        ValueError: unknown name; the message lists the known ones.
    """
    if isinstance(name, HardwareProfile):
        return name
    key = name.lower().strip()
    if key not in PROFILES:
        raise ValueError(f"unknown GPU profile {name!r}: choose one of {', '.join(PROFILES)}")
    return PROFILES[key]
