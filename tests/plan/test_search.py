"""The planner and its CLI: best plans, pruning speed, one-line errors."""

import contextlib
import dataclasses
import itertools
import json
import sys

import pytest

from hetjax.plan import ModulePlan, Workload, estimate, get_profile
from hetjax.plan.cost import homogeneous, llm_stages
from hetjax.plan.search import MICROBATCH_SIZES, llm_layouts, search
from models.config import get_preset, paper_preset

CFG = paper_preset("vit-3b", "llm-70b", 8192)


def test_search_returns_feasible_best_plans():
    r = search(CFG, 32, Workload(64, 8192, 4), "h100")
    assert r.best.fits and r.homogeneous.fits
    assert r.best.plan.heterogeneous and r.homogeneous.plan.mode == "homogeneous"
    assert r.best.simulated and r.homogeneous.simulated
    assert r.ranked[0] is r.best and all(
        a.step_time_s <= b.step_time_s for a, b in zip(r.ranked, r.ranked[1:], strict=False)
    )
    assert r.gain_pct == pytest.approx(100 * (r.best.tokens_per_s / r.homogeneous.tokens_per_s - 1))
    hom = r.homogeneous.plan
    assert (hom.vision.layout.dp, hom.vision.layout.tp) == (hom.llm.layout.dp, hom.llm.layout.tp)
    for e in r.ranked:
        assert e.plan.num_gpus == 32


def test_search_runnable_preset_on_simulated_devices():
    r = search(get_preset("tiny"), 8, Workload(8, 64, 1, act_bytes=4), "cpu")
    for e in (r.best, r.homogeneous):
        assert e.plan.llm.layout.num_devices <= 8
        assert 4 % e.plan.llm.layout.pp == 0  # executor needs even stages


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_gpus=0), "num_gpus=0 must be a positive int"),
        (dict(num_gpus=12), "not a multiple of the h100 node size 8.*use 8 or 16"),
        (dict(hw="a100"), "unknown GPU profile 'a100'"),
    ],
)
def test_bad_input_one_line(kwargs, match):
    args = dict(num_gpus=16, hw="h100") | kwargs
    with pytest.raises(ValueError, match=match) as err:
        search(CFG, args["num_gpus"], Workload(64, 8192, 4), args["hw"])
    assert "\n" not in str(err.value)


def test_too_big_says_how_far_over():
    big = paper_preset("vit-12b", "llm-120b", 8192)
    with pytest.raises(ValueError, match=r"fits no .* GiB over the 74.0 GiB limit") as err:
        search(big, 8, Workload(16, 8192, 4), "h100")
    assert "\n" not in str(err.value)


def test_cli_table_json_and_errors(tmp_path, capsys, monkeypatch):
    from experiments import plan as cli
    from experiments.cli import run_cli

    out = tmp_path / "p.json"
    argv = ["--encoder", "vit-1b", "--llm", "llm-14b", "--gpus", "16", "--global-batch", "32"]
    cli.main(cli.parse_args(argv + ["--json", str(out)]))
    printed = capsys.readouterr().out
    assert "predicted gain" in printed and "hom " in printed
    data = json.loads(out.read_text())
    assert data["best"]["mode"] in ("colocated", "non-colocated")
    assert data["homogeneous"]["peak_memory_gib"] <= data["homogeneous"]["memory_limit_gib"]
    assert data["baseline"] == "paper" and data["gain_pct"] >= data["gain_pct_best"]
    assert data["paper_baseline"]["mode"] == "homogeneous"
    assert cli.parse_args(argv + ["--baseline", "best"]).baseline == "best"
    monkeypatch.setattr(sys, "argv", ["plan", "--gpu", "tpu9"])
    with pytest.raises(SystemExit) as done:
        run_cli(cli.cli, "plan")
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.strip().count("\n") == 0
    assert "unknown GPU profile 'tpu9'" in err


def test_cli_plans_a_runnable_preset(capsys):
    from experiments import plan as cli

    out = cli.main(cli.parse_args(["--model", "tiny", "--gpus", "8", "--gpu", "cpu"]))
    assert out["seq_len"] == 64 and out["images_per_sample"] == 1
    assert out["best"]["mode"] in ("colocated", "non-colocated")


def test_paper_baseline_is_the_llms_own_layout_inherited():
    """The paper's baseline: at the least CP with which the model (the LLM, the encoder
    inherited) trains without full recompute (cp=1 at 8K here), the LLM's fastest layout
    by itself (ZeRO-1), the encoder taking its dp, tp, cp and savers on the first stage;
    gains over either baseline."""
    work, hw = Workload(64, 8192, 4), get_profile("h100")
    r = search(CFG, 32, work, hw)
    stock = r.baseline("paper")
    assert stock is r.stock and r.baseline("best") is r.homogeneous and stock.fits
    enc, llm = stock.plan.vision, stock.plan.llm
    assert stock.plan.mode == "homogeneous" and enc.zero1 and llm.zero1
    assert enc.layout == dataclasses.replace(llm.layout, pp=1, ep=1)
    assert enc.recompute == llm.recompute
    assert llm.layout.cp == 1  # 8K fits without CP: a Megatron user runs none
    assert stock.step_time_s >= r.homogeneous.step_time_s  # the best is no slower

    def alone(mp: ModulePlan, m: int) -> tuple[float, bool]:
        st = llm_stages(CFG, homogeneous(mp, m), work, hw)
        per = [s.forward_s + s.backward_s + 2 * s.recv_s for s in st]
        step = sum(per) + (m - 1) * max(per) + max(s.reduce_s + s.optimizer_s for s in st)
        return step, max(s.memory.total for s in st) <= hw.memory_bytes

    # Every LLM layout of the same cp faster by itself (or as fast with less pp or tp: a
    # tie keeps data parallelism) leaves no room for the encoder, or cannot run it.
    chosen, _ = alone(llm, stock.plan.microbatches)
    degrees = (llm.layout.pp, llm.layout.tp)
    for lay in llm_layouts(CFG, 32, work, hw):
        for mbs, rc in itertools.product(MICROBATCH_SIZES, ("none", "selective", "full")):
            if work.global_batch % (lay.dp * mbs) or lay.cp != llm.layout.cp:
                continue
            mp, m = ModulePlan(lay, rc, zero1=True), work.global_batch // (lay.dp * mbs)
            t, fits = alone(mp, m)
            tie = abs(t / chosen - 1) < 1e-6 and (lay.pp, lay.tp) < degrees
            if fits and (t < chosen * (1 - 1e-6) or tie):
                plan = homogeneous(mp, m, recompute=rc, zero1=True)
                with contextlib.suppress(ValueError):  # check_plan: it cannot run
                    assert not estimate(CFG, plan, work, hw, simulate=False).fits
    assert r.gain("paper") == pytest.approx(100 * (r.best.tokens_per_s / stock.tokens_per_s - 1))
    assert r.gain("best") == r.gain_pct and r.gain("paper") >= r.gain("best")
    with pytest.raises(ValueError, match="unknown baseline 'megatron'; use one of paper, best"):
        r.gain("megatron")


def test_paper_baseline_takes_cp_only_where_activations_need_it():
    """_stock: the least CP with which the model (the LLM, the encoder inherited on its
    first stage) fits without full recompute, then the fastest LLM layout at that CP that
    fits with the encoder; with equally fast layouts, the least pp, then tp."""
    from hetjax.meshes.layout import Layout
    from hetjax.plan.search import _stock

    def cand(t, cp, rc="none", pp=1, tp=1):
        lay = Layout(dp=32 // (cp * pp * tp), tp=tp, cp=cp, pp=pp)
        return (t, 2, ModulePlan(lay, rc, zero1=True), [])

    def price(roomy=lambda mp: True):  # the stock plan's LLM where it "fits"
        return lambda plan, stages, simulate=False: plan.llm if roomy(plan.llm) else None

    fast_cp = [cand(1.0, 4), cand(1.5, 2), cand(2.0, 1), cand(1.8, 1, pp=2)]
    assert _stock(fast_cp, price()).layout == Layout(dp=16, pp=2)  # the fastest at cp=1
    # cp=1 fits only with full recompute (long context): the least cp that fits without.
    long = [cand(1.0, 4), cand(1.5, 2), cand(3.0, 1, "full"), cand(1.2, 2, "selective")]
    assert str(_stock(long, price())) == "dp=16,cp=2,zero1,recompute=selective"
    # No cp=2 layout leaves room for the encoder: the next cp.
    assert _stock(long, price(lambda mp: mp.layout.cp != 2)).layout.cp == 4
    # The LLM fits at cp=1 by itself, not with the encoder: more cp, not full recompute.
    crowded = [cand(1.0, 1), cand(2.0, 1, "full"), cand(1.5, 2)]
    roomy = lambda mp: mp.layout.cp > 1 or mp.recompute == "full"  # noqa: E731
    assert _stock(crowded, price(roomy)).layout.cp == 2
    # Nothing fits without full recompute: the least cp with it.
    assert (
        str(_stock(long, price(lambda mp: mp.recompute == "full"))) == "dp=32,zero1,recompute=full"
    )
    tie = [cand(1.0, 1, pp=4), cand(1.0000001, 1, tp=2, pp=2), cand(1.0, 1, tp=4)]
    assert _stock(tie, price()).layout == Layout(dp=8, tp=4)
    assert _stock(long, price(lambda mp: False)) is None


@pytest.mark.parametrize("seq, cp", [(65536, 4), (131072, 16)])
def test_paper_baseline_takes_cp_at_long_context(seq, cp):
    """The paper's long-context rows: a 70B LLM with a 3B encoder on 256 GPUs trains
    without full recompute from cp=4 on at 64K (cp=16 at 128K, where the encoder's 64
    images per sample leave no room at cp=8): the stock layout's cp, the encoder's too."""
    work = Workload(2**22 // seq, seq, seq // 2048)
    cfg = paper_preset("vit-3b", "llm-70b", seq)
    r = search(cfg, 256, work, "h100", modes=("colocated",), even_stages=False, fsdp=False)
    assert r.stock.plan.llm.layout.cp == r.stock.plan.vision.layout.cp == cp
    assert r.stock.plan.llm.recompute != "full"
