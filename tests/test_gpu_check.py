"""``experiments.gpu_check --smoke``, run once in-process on the test session's CPU
devices: every section's keys and value types (the full check needs a GPU; the smoke run
is the same code at tiny sizes); the variants' child process under an XLA flag recipe;
bad flags give one line; the profile's split of a trace."""

import contextlib
import io
import json
import warnings

import jax
import pytest

from experiments.cli import ConfigError
from experiments.gpu_check import SECTIONS, CheckConfig, main, parse_args
from tests import launch

NUMBER = (int, float)
RATES = ("time_s", "tflops_per_s", "mfu", "hfu", "of_ceiling", "model_tflops")


def test_bad_flags_are_one_line_errors():
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        parse_args(["--bogus"])
    with pytest.raises(ConfigError, match="peak-tflops"):
        parse_args(["--peak-tflops", "-3"])
    assert parse_args(["--sections", "roofline,attention"]).sections == ("roofline", "attention")
    assert parse_args(["--no-gpu-flags"]).xla_flags == "none"
    with pytest.raises(ConfigError, match=r"--sections: unknown \['bogus'\]; choose from"):
        main(CheckConfig(smoke=True, sections=("attention", "bogus")), devices=jax.devices())
    out = launch.run_main("experiments.gpu_check", "--bogus")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_section_past_the_budget_is_skipped(tmp_path):
    path = tmp_path / "out.json"
    config = CheckConfig(json=str(path), smoke=True, sections=("qwen_step",), budget_s=1e-9)
    with contextlib.redirect_stdout(io.StringIO()):
        main(config, devices=jax.devices())
    assert json.loads(path.read_text())["qwen_step"] == {"skipped": "time budget spent"}


def check_rates(row: dict, what) -> None:
    assert "error" not in row and "skipped" not in row, (what, row)
    for key in RATES:
        assert isinstance(row[key], NUMBER) and row[key] > 0, (what, key, row[key])


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """(the JSON file's report, the printed table) of one smoke run."""
    path = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        # SGD has no state to alias (the script filters this at import; pytest resets it)
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        main(CheckConfig(json=str(path), smoke=True, peak_tflops=1.0), devices=jax.devices())
    return json.loads(path.read_text()), out.getvalue()


def test_smoke_run_reports_every_section(smoke):
    report, table = smoke
    assert set(SECTIONS) <= set(report) and report["smoke"] is True
    assert report["platform"] == "cpu" and report["peak_tflops"] == 1.0
    assert report["ceiling_tflops"] > 0 and report["xla_recipe"] == "none"
    for stage, row in report["roofline"].items():
        if stage != "ceiling":
            assert 0 < row["stage_tflops_per_s"] and row["matmuls"], stage
    for row in report["llm_blocks"].values():
        check_rates(row, "llm_blocks")
    v = report["variants"]
    for key in ("scan_donate", "unrolled_donate", "scan_no_donate"):
        check_rates(v[key], key)
    assert (v["unrolled_donate"]["unroll"], v["scan_no_donate"]["donate"]) == (True, False)
    check_rates(report["llm_loss_stage"]["none"], "llm_loss_stage")
    for policy in ("full", "none"):
        check_rates(report["vit_stage"][policy], policy)
    loss = report["llm_loss_stage"]["none"]
    assert loss["recompiles_after_step_1"] == 0, loss["recompiled"]
    assert loss["grad_dtypes"]["bwd_accumulators"] == ["float32"]
    assert loss["inflight_guard"] == {"platform": "cpu", "enabled": True, "ok": True}
    check_rates(report["llava_step"], "llava_step")
    e = report["executor_vs_fused"]
    check_rates(e["fused"], "executor_vs_fused")
    assert e["executor_over_fused"] > 0
    p = report["profile"]
    assert p["kernels"] > 0 and 0 <= p["gaps_share"] <= 1 and p["top_kernels"]
    att = report["attention"]
    for name in (
        "causal",
        "causal_bias",
        "packed",
        "ring_block",
        "encoder",
        "causal_vmap2",
        "packed_vmap2",
    ):
        row = att[name]
        assert row["fused_kernel"] == "xla" and row["plain_fwd_bwd_s"] > 0, (name, row)
        # the fused call's XLA twin: within bf16 rounding of the plain path
        for key in ("out", "dq", "dk", "dv"):
            assert row[f"{key}_rel_diff"] < 2e-2, (name, key, row)
    assert att["allgather_block"]["fused_kernel"] is None
    rs = report["reduce_scatter"]
    # XLA:CPU has no reduce-scatter pass: the ZeRO-1 reduction is an all-reduce there.
    assert rs["checked"] is True and rs["zero1_reduction_kinds"]
    assert rs["zero1_reduce_scatter"] is False
    q = report["qwen_step"]
    check_rates(q, "qwen_step")
    assert q["shape"]["reduced"].startswith("LLM cut to 1 of 4 layers: training state")
    assert 0 < q["tokens_per_s"] < q["positions_per_s"] and q["patches_per_s"] > 0
    assert 0 < q["patch_fill"] <= 1 and set(q["mfu_by_module"]) == {"vision", "llm"}
    # the tower frozen runs forward only; CPUs and float32 take the plain attention
    assert "vision/fwd" in q["fused_attention_calls"] and q["programs"] >= 3
    assert not any(q["fused_attention_calls"].values())
    assert q["largest_program_bytes"] > 0 and q["device_peak_bytes"] is None
    assert "MFU" in table and "attention causal" in table and "profile of one step" in table
    assert "qwen step (executor)" in table and "patches/s; LLM cut to 1 of 4" in table


def test_the_variants_child_runs_under_another_flag_recipe():
    """What ``variants`` runs per XLA flag recipe: a child ``gpu_check`` (flags are read
    once per process) whose first ``llm_blocks`` row comes back with its flags."""
    from experiments.gpu_check import smoke_sizes
    from experiments.gpu_check.blocks import other_process
    from experiments.gpu_check.common import Run

    run = Run(smoke_sizes(), jax.devices(), 1.0, budget_s=300)
    row = other_process(run, "maxtext")
    check_rates({**row, "of_ceiling": 1.0, "mfu": 1.0, "hfu": 1.0}, "child")
    assert "--xla_gpu_enable_triton_gemm=false" in row["xla_flags"]


def test_profile_split_of_a_trace():
    from experiments.gpu_check.profile import split

    kernels = [
        ("sm90_xmma_gemm_bf16", 0.0, 10.0),
        ("cudnn_fmha_fwd", 12.0, 4.0),
        ("loop_fusion.3", 14.0, 4.0),  # overlaps the attention by 2
        ("memcpy_DtoD", 20.0, 2.0),
    ]
    got = split(kernels)
    assert got["span_s"] == pytest.approx(22e-6)
    assert got["matmul_s"] == pytest.approx(10e-6) and got["attention_s"] == pytest.approx(4e-6)
    assert got["other_fusions_s"] == pytest.approx(4e-6) and got["copy_s"] == pytest.approx(2e-6)
    assert got["gaps_s"] == pytest.approx(4e-6)  # 10-12 and 18-20
