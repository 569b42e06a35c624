"""Section ``profile``: one ``jax.profiler`` trace of the LLaVA executor step, its device
time split into matmuls, attention, other fusions, copies and gaps (time in the step's
span with no kernel running)."""

from __future__ import annotations

import glob
import gzip
import json
import re
import tempfile
from typing import Any

from experiments.gpu_check.common import Run

# Kernel name -> category, first match wins (cuDNN's and cuBLAS's kernel names, XLA's
# Triton gemm fusions, CUTLASS / nvjet gemms; on XLA:CPU its thunks' names).
CATEGORIES = (
    ("attention", re.compile(r"fmha|flash|cudnn|sdpa|attention", re.I)),
    (
        "matmul",
        re.compile(r"gemm|cublas|matmul|nvjet|xmma|cutlass|sm\d+_.*mma|\bdot|ynn_fusion", re.I),
    ),
    ("copy", re.compile(r"memcpy|memset|copy|dynamic.update.slice|transpose", re.I)),
)


def category(name: str) -> str:
    return next((c for c, pattern in CATEGORIES if pattern.search(name)), "other_fusions")


def kernel_events(trace: dict) -> list[tuple[str, float, float]]:
    """``(name, start us, duration us)`` of the trace's device kernels: events of the
    processes named ``/device:GPU:...``; with none (XLA:CPU), the compiled programs'
    thunks on the CPU client's threads."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    procs = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    gpu = {pid for pid, name in procs.items() if name.startswith("/device:GPU")}

    def device(e: dict) -> bool:
        if gpu:
            return e["pid"] in gpu
        thread = threads.get((e["pid"], e.get("tid")), "")
        name = e["name"]
        return "PjRtCpuClient" in thread and not name.startswith(("end: ", "Thunk", "Threadpool"))

    return [
        (e["name"], float(e["ts"]), float(e.get("dur", 0)))
        for e in events
        if e.get("ph") == "X" and device(e)
    ]


def split(kernels: list[tuple[str, float, float]]) -> dict[str, Any]:
    """Busy time per category and the gaps, in seconds and as shares of the span from the
    first kernel's start to the last one's end. Overlapping kernels (several streams)
    count in full per category; ``gaps`` is the span minus the union of kernel time."""
    if not kernels:
        return {"kernels": 0}
    busy: dict[str, float] = {}
    for name, _, dur in kernels:
        busy[category(name)] = busy.get(category(name), 0.0) + dur
    spans = sorted((ts, ts + dur) for _, ts, dur in kernels)
    start, end = spans[0][0], max(e for _, e in spans)
    covered, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            covered, cur_s, cur_e = covered + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    covered += cur_e - cur_s
    total = end - start
    out = {"kernels": len(kernels), "span_s": total / 1e6}
    for c in ("matmul", "attention", "other_fusions", "copy"):
        out[f"{c}_s"] = busy.get(c, 0.0) / 1e6
        out[f"{c}_share"] = busy.get(c, 0.0) / total if total else None
    out["gaps_s"] = (total - covered) / 1e6
    out["gaps_share"] = (total - covered) / total if total else None
    top: dict[str, float] = {}
    for name, _, dur in kernels:
        top[name] = top.get(name, 0.0) + dur
    out["top_kernels"] = [[n, d / 1e6] for n, d in sorted(top.items(), key=lambda x: -x[1])[:12]]
    return out


def profile_section(run: Run) -> dict:
    """Traces one (already compiled) step of the ``llava_step`` trainer."""
    import jax

    from experiments.gpu_check.stages import llava_trainer

    tr = llava_trainer(run, reference=False)
    ex = tr.engine
    jax.block_until_ready((ex.step(tr.data.batch(0)), ex.state))  # compiled (or reused)
    batch = tr.data.batch(1)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            jax.block_until_ready((ex.step(batch), ex.state))
        paths = glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True)
        if not paths:
            return {"error": "the profiler wrote no perfetto trace"}
        with gzip.open(paths[0]) as f:
            trace = json.load(f)
    return {"platform": run.devices[0].platform, **split(kernel_events(trace))}
