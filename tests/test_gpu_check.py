"""``experiments.gpu_check --smoke``, run once in-process on the test session's CPU
devices: every section's keys and value types; bad flags give one line. The full check
needs a GPU; the smoke run is the same code at tiny sizes (one executor for both stages)."""

import contextlib
import io
import json
import warnings

import jax
import pytest

from experiments.cli import ConfigError
from experiments.gpu_check import CheckConfig, main, parse_args
from tests import launch

NUMBER = (int, float)


def test_bad_flags_are_one_line_errors():
    with pytest.raises(ConfigError, match="unrecognized arguments: --bogus"):
        parse_args(["--bogus"])
    with pytest.raises(ConfigError, match="peak-tflops"):
        parse_args(["--peak-tflops", "-3"])
    assert parse_args(["--sections", "llm_stage,attention"]).sections == ("llm_stage", "attention")
    with pytest.raises(ConfigError, match=r"--sections: unknown \['bogus'\]; choose from"):
        main(CheckConfig(smoke=True, sections=("attention", "bogus")), devices=jax.devices())
    out = launch.run_main("experiments.gpu_check", "--bogus")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr


def check_stage(sec: dict) -> None:
    assert sec["module"] in ("llm", "vision")
    for policy in ("full", "none"):
        row = sec[policy]
        assert "error" not in row, (policy, row)
        for key in ("stage_time_s", "tflops_per_s", "mfu", "hfu", "model_tflops"):
            assert isinstance(row[key], NUMBER) and row[key] > 0, (policy, key, row[key])
        assert row["recompiles_after_step_1"] == 0, row["recompiled"]


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
    assert report["smoke"] is True and report["num_devices"] >= 4
    assert report["platform"] == "cpu" and report["peak_tflops"] == 1.0
    check_stage(report["llm_stage"])
    check_stage(report["vit_stage"])
    dtypes = report["llm_stage"]["full"]["grad_dtypes"]
    assert dtypes["bwd_accumulators"] == ["float32"]
    guard = report["llm_stage"]["full"]["inflight_guard"]
    assert guard == {"platform": "cpu", "enabled": True, "ok": True}
    rs = report["reduce_scatter"]
    assert rs["checked"] is True
    # XLA:CPU has no reduce-scatter pass: the ZeRO-1 reduction is an all-reduce there.
    assert rs["zero1_reduction_kinds"] and rs["zero1_reduce_scatter"] is False
    assert isinstance(rs["sp_reduce_scatter"], bool)
    att = report["attention"]
    for key in ("ring_fwd_bwd_s", "allgather_fwd_bwd_s", "ring_over_allgather"):
        assert isinstance(att[key], float) and att[key] > 0
    assert att["fused"] == {"checked": False, "why": "not taken here (cpu, bfloat16)"}
    assert "MFU" in table and "attention cp=1" in table
