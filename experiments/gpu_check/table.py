"""The printed summary of a :mod:`experiments.gpu_check` report (the JSON has it all)."""

from __future__ import annotations

from typing import Any


def pct(x: Any) -> str:
    return f"{x:6.1%}" if isinstance(x, (int, float)) else "     -"


def rate_line(name: str, r: Any) -> str:
    if not isinstance(r, dict) or "tflops_per_s" not in r:
        return f"{name:<28} {r}"
    return (
        f"{name:<28} {r['time_s'] * 1e3:9.2f} {r['tflops_per_s']:8.1f} {pct(r['mfu'])}"
        f" {pct(r['hfu'])} {pct(r['of_ceiling'])}"
    )


def print_table(report: dict) -> None:
    print(
        f"device: {report['device']} ({report['num_devices']}), peak {report['peak_tflops']},"
        f" measured matmul ceiling {report['ceiling_tflops']} TFLOP/s, XLA flags"
        f" {report['xla_recipe']}"
    )
    print(f"{'row':<28} {'ms':>9} {'TFLOP/s':>8} {'MFU':>6} {'HFU':>6} {'ceil%':>6}")
    rows: list[tuple[str, Any]] = []
    for key, row in (report.get("llm_blocks") or {}).items():
        rows.append((f"blocks {key}", row))
    v = report.get("variants")
    if isinstance(v, dict):
        rows += [(f"variant {k}", r) for k, r in v.items() if isinstance(r, dict)]
    loss = report.get("llm_loss_stage")
    if isinstance(loss, dict):
        rows.append(("llm loss stage", loss.get("none", loss)))
    vit = report.get("vit_stage")
    if isinstance(vit, dict):
        rows += [(f"vit stage {p}", vit.get(p, vit)) for p in ("full", "none")]
    if "llava_step" in report:
        rows.append(("llava step (executor)", report["llava_step"]))
    e = report.get("executor_vs_fused")
    if isinstance(e, dict) and "fused" in e:
        rows.append(("llava step (one jit)", e["fused"]))
    if "qwen_step" in report:
        rows.append(("qwen step (executor)", report["qwen_step"]))
    for name, r in rows:
        print(rate_line(name, r))
    q = report.get("qwen_step")
    if isinstance(q, dict) and "patches_per_s" in q:
        print(
            f"qwen step: {q['tokens_per_s']:.0f} tokens/s ({q['positions_per_s']:.0f} positions),"
            f" {q['patches_per_s']:.0f} patches/s; {q['shape']['reduced'] or 'full depth'}"
        )
    if isinstance(e, dict) and "executor_over_fused" in e:
        print(f"executor / one jit: {e['executor_over_fused']:.3f}")
    att = report.get("attention")
    if isinstance(att, dict):
        for name, r in att.items():
            if not isinstance(r, dict) or "plain_fwd_bwd_s" not in r:
                continue
            line = f"attention {name:<14} plain {r['plain_fwd_bwd_s'] * 1e3:8.2f} ms"
            if "fused_fwd_bwd_s" in r:
                line += (
                    f", fused {r['fused_fwd_bwd_s'] * 1e3:8.2f} ms; rel diff out"
                    f" {r['out_rel_diff']:.1e} dq {r['dq_rel_diff']:.1e}"
                    f" dk {r['dk_rel_diff']:.1e} dv {r['dv_rel_diff']:.1e}"
                )
            print(line)
    p = report.get("profile")
    if isinstance(p, dict) and "span_s" in p:
        parts = ", ".join(
            f"{c} {pct(p[f'{c}_share']).strip()}"
            for c in ("matmul", "attention", "other_fusions", "copy", "gaps")
        )
        print(f"profile of one step ({p['span_s'] * 1e3:.1f} ms): {parts}")
    for name in ("roofline", "reduce_scatter"):
        if (
            name in report
            and not isinstance(report[name], dict)
            or "error" in (report.get(name) or {})
        ):
            print(f"{name}: {report[name]}")
