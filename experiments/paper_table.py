"""The paper's results, predicted by the planner: ``python -m experiments.paper_table``.

    python -m experiments.paper_table [--json out.json] [--plot out.png]

One row per reported result (H100 80GB). Each row runs the planner
(:func:`hetjax.plan.search.search`) for the best heterogeneous and the best homogeneous
plan and compares the predicted gain with the paper's. Settings the paper leaves open,
fixed once for every row (what a Megatron user runs at this scale):

- 256 H100 GPUs (32 nodes of 8), BF16, 4M tokens per step (``2**22 // seq_len`` samples);
- half of every sample is image tokens (1024 per 448 px image: 4 images at 8K, 32 at 64K,
  64 at 128K);
- Megatron's uneven pipeline splits allowed; every plan searched with the same space.

Where the paper gives a range (+12.1% to +21.6% for 1B/3B encoders with 14B-120B LLMs) its
top end goes to the pair with the largest encoder share (vit-1b + llm-14b) and its bottom
end to the smallest (vit-3b + llm-120b). The paper's TFLOPS/GPU and throughput gains are
the same ratio here (same GPUs, same batch). ``regime`` sweeps the encoder for a 120B LLM
and reports where non-colocated starts to beat colocated.
"""

from __future__ import annotations

import dataclasses

GPUS = 256
IMAGE_SHARE = 0.5  # image tokens per sample, as a share of the sequence
ROWS = (
    # regime, encoder, llm, seq_len, paper gain %, paper metric, paper mode
    ("colocated long context", "vit-3b", "llm-70b", 65536, 49.3, "TFLOPS/GPU", "colocated"),
    ("colocated long context", "vit-3b", "llm-70b", 131072, 49.3, "TFLOPS/GPU", "colocated"),
    ("colocated small encoder", "vit-1b", "llm-14b", 8192, 21.6, "throughput", "colocated"),
    ("colocated small encoder", "vit-3b", "llm-120b", 8192, 12.1, "throughput", "colocated"),
    ("non-colocated big encoder", "vit-12b", "llm-120b", 8192, 13.0, "throughput", "non-colocated"),
    ("non-colocated big encoder", "vit-6b", "llm-120b", 8192, 9.6, "TFLOPS/GPU", "non-colocated"),
)
SWEEP = ("vit-1b", "vit-3b", "vit-6b", "vit-12b")
REGIME_LLM = "llm-120b"  # the LLM of the regime sweep


@dataclasses.dataclass(frozen=True)
class TableConfig:
    json: str | None = None  # write rows + regime here
    plot: str | None = None  # PNG: predicted gain vs context length and vs encoder size
    gpu: str = "h100"  # hardware profile


def workload(seq_len: int):
    from experiments.plan import default_batch
    from hetjax.plan import Workload
    from models.config import PAPER_ENCODERS

    images = max(1, int(seq_len * IMAGE_SHARE) // PAPER_ENCODERS["vit-1b"].num_tokens)
    return Workload(default_batch(seq_len), seq_len, images)


def plan_pair(encoder: str, llm: str, seq_len: int, gpu: str):
    from hetjax.plan.search import search
    from models.config import paper_preset

    cfg = paper_preset(encoder, llm, seq_len)
    return search(cfg, GPUS, workload(seq_len), gpu, even_stages=False)


def row(spec: tuple, gpu: str) -> dict:
    regime, enc, llm, seq, paper, metric, mode = spec
    r = plan_pair(enc, llm, seq, gpu)
    return {
        "regime": regime,
        "encoder": enc,
        "llm": llm,
        "seq_len": seq,
        "gpus": GPUS,
        "global_batch": workload(seq).global_batch,
        "images_per_sample": workload(seq).images_per_sample,
        "paper_metric": metric,
        "paper_gain_pct": paper,
        "predicted_gain_pct": round(r.gain_pct, 2),
        "paper_mode": mode,
        "chosen_mode": r.best.plan.mode,
        "chosen_plan": str(r.best.plan),
        "homogeneous_plan": str(r.homogeneous.plan),
        "by_mode_tokens_per_s": {k: e.tokens_per_s for k, e in r.by_mode.items()},
        "search_seconds": round(r.seconds, 2),
    }


def regime(gpu: str) -> dict:
    """Colocated vs non-colocated for a 120B LLM at 8K, by encoder size."""
    sweep = []
    for enc in SWEEP:
        r = plan_pair(enc, REGIME_LLM, 8192, gpu)
        hom = r.homogeneous.tokens_per_s
        gains = {
            m: 100 * (r.by_mode[m].tokens_per_s / hom - 1) if m in r.by_mode else None
            for m in ("colocated", "non-colocated")
        }
        sweep.append({"encoder": enc, **{f"{m}_gain_pct": g for m, g in gains.items()}})
    wins = [
        s["encoder"]
        for s in sweep
        if (s["non-colocated_gain_pct"] or -1e9) > (s["colocated_gain_pct"] or -1e9)
    ]
    return {"sweep": sweep, "non_colocated_wins_from": wins[0] if wins else None}


def context_sweep(gpu: str) -> list[dict]:
    """Predicted gain vs context length for vit-3b + llm-70b (the long-context rows)."""
    out = []
    for seq in (8192, 16384, 32768, 65536, 131072):
        out.append({"seq_len": seq, "gain_pct": plan_pair("vit-3b", "llm-70b", seq, gpu).gain_pct})
    return out


def print_table(rows: list[dict], reg: dict) -> None:
    print(
        f"{'regime':<26} {'encoder':<8} {'llm':<9} {'seq':>7} {'paper %':>8} {'pred %':>7}"
        f" {'paper mode':<14} {'chosen mode':<14}"
    )
    for r in rows:
        print(
            f"{r['regime']:<26} {r['encoder']:<8} {r['llm']:<9} {r['seq_len']:>7}"
            f" {r['paper_gain_pct']:>8.1f} {r['predicted_gain_pct']:>7.1f}"
            f" {r['paper_mode']:<14} {r['chosen_mode']:<14}"
        )
    for s in reg["sweep"]:
        c, n = s["colocated_gain_pct"], s["non-colocated_gain_pct"]
        print(
            f"  {REGIME_LLM} + {s['encoder']}: colocated {c:+.1f}%  non-colocated "
            + (f"{n:+.1f}%" if n is not None else "no plan fits")
        )
    print(
        f"regime boundary: non-colocated wins from {reg['non_colocated_wins_from']} "
        "(paper: between 3B and 6B)"
    )
    print(
        f"settings: {GPUS} GPUs, 4M tokens per step, {IMAGE_SHARE:.0%} image tokens per sample,"
        " uneven pipeline splits allowed"
    )


def plot(path: str, rows: list[dict], reg: dict, ctx: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot([c["seq_len"] for c in ctx], [c["gain_pct"] for c in ctx], "o-", label="predicted")
    pts = [r for r in rows if r["regime"] == "colocated long context"]
    a.plot(
        [r["seq_len"] for r in pts],
        [r["paper_gain_pct"] for r in pts],
        "r*",
        ms=12,
        label="paper (up to)",
    )
    a.set_xscale("log", base=2)
    a.set(
        xlabel="context length (tokens)",
        ylabel="gain over homogeneous (%)",
        title="vit-3b + llm-70b, 256 H100",
    )
    a.legend()
    x = range(len(reg["sweep"]))
    for key, style in (("colocated_gain_pct", "o-"), ("non-colocated_gain_pct", "s-")):
        b.plot(
            x,
            [s[key] if s[key] is not None else float("nan") for s in reg["sweep"]],
            style,
            label=key.replace("_gain_pct", " (predicted)"),
        )
    names = [s["encoder"] for s in reg["sweep"]]
    for r in rows:
        if r["llm"] == REGIME_LLM and r["encoder"] in names:
            b.plot(names.index(r["encoder"]), r["paper_gain_pct"], "r*", ms=12)
    b.set_xticks(list(x), names)
    b.set(
        xlabel="encoder", ylabel="gain over homogeneous (%)", title=f"{REGIME_LLM}, 8K (red: paper)"
    )
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(config: TableConfig) -> dict:
    rows = [row(spec, config.gpu) for spec in ROWS]
    reg = regime(config.gpu)
    print_table(rows, reg)
    out = {
        "rows": rows,
        "regime": reg,
        "settings": {
            "gpus": GPUS,
            "tokens_per_step": 2**22,
            "image_share": IMAGE_SHARE,
            "gpu": config.gpu,
            "uneven_pipeline_stages": True,
        },
    }
    if config.plot:
        ctx = context_sweep(config.gpu)
        out["context_sweep"] = ctx
        plot(config.plot, rows, reg, ctx)
        print(f"plot: {config.plot}")
    from experiments.cli import write_json

    write_json(config.json, out)
    return out


def parse_args(argv: list[str]) -> TableConfig:
    from experiments.cli import OneLineParser

    p = OneLineParser(prog="paper_table", description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None, help="write the rows as JSON")
    p.add_argument("--plot", default=None, help="write the gain plot as PNG")
    p.add_argument("--gpu", default="h100", help="hardware profile")
    return TableConfig(**vars(p.parse_args(argv)))


def cli(argv: list[str]) -> int:
    """The command line: a bad setting gets one line."""
    from experiments.plan import one_line

    return one_line(main, parse_args)(argv)


if __name__ == "__main__":
    from experiments.cli import run_cli

    run_cli(cli, "paper_table")
