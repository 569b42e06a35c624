"""``python -m experiments.bench_comm --quick``, run in the test process: the JSON rows
(both modes, a dense and the MoE model) and the condition (the heterogeneous encoder moves
fewer collective bytes than a homogeneous one that inherits tp > 1 or cp > 1)."""

import pytest

from experiments.bench_comm import GLOBAL_BATCH, SCENARIOS
from hetjax import Layout
from models.config import get_preset
from tests.runtime.benchmarks import quick_rows

SCENARIOS_BY_NAME = {s.name: s for s in SCENARIOS}

KEYS = {
    "scenario",
    "mode",
    "module",
    "collective_bytes",
    "boundary_bytes",
    "peak_bytes_per_device",
    "step_time_s",
}
KINDS = {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return quick_rows("bench_comm", tmp_path_factory.mktemp("bench_comm"))


def encoder_bytes(rows, scenario, mode) -> int:
    (row,) = [
        r for r in rows if (r["scenario"], r["mode"], r["module"]) == (scenario, mode, "vision")
    ]
    return sum(row["collective_bytes"].values())


@pytest.mark.slow
def test_rows_have_the_keys(rows):
    assert {r["scenario"] for r in rows} == {"cp2", "moe"}  # dense cp and tp; MoE ep and tp
    assert {(r["mode"], r["module"]) for r in rows} == {
        (m, n) for m in ("heterogeneous", "homogeneous") for n in ("vision", "llm")
    }
    for row in rows:
        assert KEYS <= row.keys(), KEYS - row.keys()
        assert set(row["collective_bytes"]) == KINDS
        assert all(isinstance(v, int) and v >= 0 for v in row["collective_bytes"].values())
        assert row["peak_bytes_per_device"] > 0 and row["step_time_s"] > 0
        assert row["boundary_bytes"] >= 0


@pytest.mark.slow
def test_heterogeneous_encoder_moves_fewer_collective_bytes(rows):
    scenarios = {r["scenario"] for r in rows}
    assert scenarios
    for scenario in scenarios:
        (hom,) = [
            r
            for r in rows
            if (r["scenario"], r["mode"], r["module"]) == (scenario, "homogeneous", "vision")
        ]
        inherited = Layout.parse(hom["layout"])
        assert inherited.tp > 1 or inherited.cp > 1  # the quick scenarios all inherit
        assert encoder_bytes(rows, scenario, "heterogeneous") < encoder_bytes(
            rows, scenario, "homogeneous"
        )
        # The LLM's programs do not depend on the encoder's layout, except that with
        # cp > 1 the heterogeneous link routes each cp rank only its own image tokens, so
        # their gradient is not all-reduced over cp inside the LLM, nor the slot mask
        # gathered over cp to number the slots (the homogeneous LLM, per cp rank, gets
        # the tokens whole: hetjax.ops.token_routing.merge_whole_per_rank).
        llm = {
            r["mode"]: r["collective_bytes"]
            for r in rows
            if r["scenario"] == scenario and r["module"] == "llm"
        }
        if inherited.cp == 1:
            assert llm["heterogeneous"] == llm["homogeneous"]
        else:
            assert llm["heterogeneous"]["all-reduce"] < llm["homogeneous"]["all-reduce"]
            # the [B, L] boolean mask, whole on each of the LLM's devices, once per step
            seq_len = get_preset(SCENARIOS_BY_NAME[scenario].preset).seq_len
            mask = inherited.num_devices * GLOBAL_BATCH // inherited.dp * seq_len
            gathered = llm["homogeneous"]["all-gather"] - llm["heterogeneous"]["all-gather"]
            assert gathered == mask, (gathered, mask)
            for kind in KINDS - {"all-reduce", "all-gather"}:
                assert llm["heterogeneous"][kind] == llm["homogeneous"][kind], kind


@pytest.mark.slow
def test_only_the_heterogeneous_link_moves_bytes(rows):
    """The homogeneous encoder already produces the LLM's layout: its link is identity."""
    for r in rows:
        if r["module"] == "vision":
            assert (r["boundary_bytes"] > 0) == (r["mode"] == "heterogeneous"), r
