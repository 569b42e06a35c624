"""The planner: the fastest plan that fits, heterogeneous and homogeneous.

Searched: the mode (colocated; non-colocated with every whole-node island split),
per-module dp/tp/cp/pp (ep for MoE), the LLM's fsdp share of its data ranks, the
microbatch size (so M), recompute and ZeRO-1.
Enumerating the product is millions of plans at 256 GPUs, so the search prunes with the
constraints and with the cost model's structure instead:

- degrees must divide what they split (TP the key/value heads and at most a node; PP the
  layers, unless uneven stages are allowed; CP the sequence in 2 x cp zigzag chunks; DP
  the microbatch's samples);
- the LLM's stages depend only on its own layout and M (not on the encoder's), so each
  LLM candidate on ``n`` GPUs is priced once and kept only on the Pareto front of
  (standalone 1F1B time, memory) per ``(n, M)``; encoder candidates likewise;
- pairs are ranked by the closed-form makespan; the best few per mode are re-timed with
  the schedule simulator, which decides.

fsdp is searched by default for the LLM; the encoder takes the LLM's share alone, where
colocated (so that the homogeneous plan's encoder layout stays among the colocated
ones). The cost model prices it (state / fsdp per device; per microbatch a gather of the
weights for the forward, one for the backward and a reduce-scatter of the gradients,
only what exceeds the compute exposed), so it wins where it should: where memory rules
out faster layouts, and where the gathers hide behind compute but tp's per-layer
all-reduces or the once-per-step gradient reduction would not. An fsdp layout re-splits
the data ranks of a plain one, so the Pareto front keeps both and the plain plan is
never lost. The encoder's own shares are not searched: its state is a small share of the
job's (1-12B beside a 14-120B LLM), ZeRO-1 over its ranks already splits its optimizer
state (12 of its 16 bytes per parameter), and every share would multiply the pairs
priced (each encoder layout meets every LLM candidate) where the LLM's add one pass over
its own candidates.

Two homogeneous baselines (:data:`Baseline`), since gains depend on what they are against:
``best``, the fastest plan in which the encoder inherits the LLM's layout (the strongest
homogeneous baseline a search finds), and ``paper``, the stock one the paper measures
against: a Megatron user picks the LLM's layout (CP only as far as activations need it
to fit without full recompute, then the LLM's fastest by itself, with the distributed
optimizer, ZeRO-1 over DP, no fsdp; see :func:`_stock`), and the encoder inherits it,
savers included, on the LLM's first stage, repeating its work on every CP rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, Literal

from hetjax.meshes.layout import Layout
from hetjax.recompute import RECOMPUTE_POLICIES

from .cost import Estimate, Plan, Workload, assemble, check_plan, llm_stages, vision_stages
from .hardware import HardwareProfile, get_profile
from .stage import ModulePlan

MICROBATCH_SIZES = (1, 2, 4)  # samples per data lane per microbatch
MAX_PP, MAX_CP = 16, 32
FRONT = 6  # candidates kept per module, GPU count and M
SIMULATED = 4  # best closed-form plans per mode re-timed with the simulator
Baseline = Literal["paper", "best"]  # the homogeneous plan a gain is measured against
BASELINES: tuple[Baseline, ...] = ("paper", "best")


@dataclasses.dataclass(frozen=True)
class SearchResult:
    """The planner's answer."""

    best: Estimate  # the best heterogeneous plan (colocated or non-colocated)
    homogeneous: Estimate  # the best homogeneous plan (encoder inherits the LLM's layout)
    stock: Estimate | None  # the paper's baseline (the LLM's own layout, inherited)
    ranked: tuple[Estimate, ...]  # simulated heterogeneous plans, best first
    by_mode: dict[str, Estimate]  # the best plan of each mode that has one
    candidates: int  # plans priced
    seconds: float  # wall time of the search

    @property
    def gain_pct(self) -> float:
        """Throughput of ``best`` over ``homogeneous``, in percent."""
        return self.gain("best")

    def baseline(self, kind: Baseline) -> Estimate:
        """The homogeneous plan called ``kind`` (see the module doc)."""
        if kind not in BASELINES:
            raise ValueError(f"unknown baseline {kind!r}; use one of {', '.join(BASELINES)}")
        if kind == "best":
            return self.homogeneous
        if self.stock is None:
            raise ValueError(
                "no paper baseline: no layout chosen for the LLM alone leaves room for the "
                "encoder on its first stage; compare with baseline 'best'"
            )
        return self.stock

    def gain(self, kind: Baseline, mode: str | None = None) -> float:
        """Throughput of ``best`` (or of the best plan of ``mode``) over the baseline
        ``kind``, in percent."""
        est = self.best if mode is None else self.by_mode[mode]
        return 100.0 * (est.tokens_per_s / self.baseline(kind).tokens_per_s - 1.0)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _powers(limit: int) -> list[int]:
    return [2**i for i in range(limit.bit_length()) if 2**i <= limit]


def llm_layouts(
    cfg: Any, n: int, work: Workload, hw: HardwareProfile, *, even: bool = True, fsdp: bool = True
) -> list[Layout]:
    """The LLM's valid layouts on ``n`` GPUs (``even``: pp divides the layers; ``fsdp``:
    also every power-of-two fsdp share of the data ranks that divides the width)."""
    llm, out = cfg.llm, []
    for tp in _divisors(llm.kv_heads, hw.gpus_per_node):
        for cp in _powers(MAX_CP):
            if work.seq_len % (2 * cp) or n % (tp * cp):
                continue
            for pp in _divisors(llm.depth, MAX_PP) if even else range(1, MAX_PP + 1):
                if n % (tp * cp * pp):
                    continue
                ranks = n // (tp * cp * pp)
                shares = [f for f in _powers(ranks) if ranks % f == 0 and llm.width % f == 0]
                for f in shares if fsdp else [1]:
                    dp = ranks // f
                    eps = [1] if not llm.moe else _divisors(dp, llm.moe.num_experts)
                    out += [
                        Layout(dp=dp, fsdp=f, tp=tp, cp=cp, pp=pp, ep=ep)
                        for ep in eps
                        if not (llm.moe and llm.moe.num_experts % ep)
                    ]
    return out


def vision_layouts(
    cfg: Any, n: int, hw: HardwareProfile, *, pipelined: bool, fsdp: int = 1
) -> list[Layout]:
    """The encoder's layouts on ``n`` GPUs (cp=1: an image is not split; pp only when
    non-colocated); with ``fsdp`` > 1 each again with that fsdp share of its data ranks,
    where it divides them and the width."""
    out = []
    for tp in _powers(hw.gpus_per_node):
        for pp in _divisors(cfg.vision.depth, 4) if pipelined else [1]:
            if n % (tp * pp) == 0:
                out.append(Layout(dp=n // (tp * pp), tp=tp, pp=pp))
    if fsdp > 1 and cfg.vision.width % fsdp == 0:
        out += [
            dataclasses.replace(lay, dp=lay.dp // fsdp, fsdp=fsdp)
            for lay in out
            if lay.dp % fsdp == 0
        ]
    return out


# The ModulePlan options tried per module by default: recompute x ZeRO-1.
SAVERS: tuple[dict, ...] = tuple(
    dict(recompute=r, zero1=z) for r in RECOMPUTE_POLICIES for z in (False, True)
)


def _front(items: list[tuple[float, float, Any]]) -> list[Any]:
    """Pareto front on (time, memory), at most FRONT of the fastest."""
    out, best_mem = [], float("inf")
    for _t, mem, item in sorted(items, key=lambda x: (x[0], x[1])):
        if mem < best_mem:
            out.append(item)
            best_mem = mem
    return out[:FRONT]


def search(
    cfg: Any,
    num_gpus: int,
    work: Workload,
    hw: HardwareProfile | str,
    *,
    modes: tuple[str, ...] = ("colocated", "non-colocated"),
    even_stages: bool = True,
    savers: Sequence[dict] = SAVERS,
    keep: int = SIMULATED,
    fsdp: bool = True,
) -> SearchResult:
    """The best heterogeneous plan in ``modes`` and the best homogeneous plan.

    Args:
        cfg: The model (``models.config.MLLMConfig``-shaped; one vision encoder).
        num_gpus: GPUs of the job.
        work: Global batch and sequence length.
        hw: A profile or its name (``h100``, ``h200``, ``cpu``).
        modes: Heterogeneous modes to search.
        even_stages: The LLM's pp divides its layers (as hetjax's executor needs); False
            allows Megatron's uneven splits, priced at the largest stage.
        savers: The :class:`ModulePlan` options tried per module (recompute, zero1,
            sequence_parallel), e.g. ``[dict(zero1=True)]`` to fix ZeRO-1 on.
        keep: Best closed-form plans per mode re-timed with the simulator (and ranked).
        fsdp: Also search the LLM's fsdp degrees (:func:`llm_layouts`; see the module
            doc); False: dp only, as before fsdp was searched.

    Returns:
        The :class:`SearchResult`.

    Raises:
        ValueError: one line: an unknown profile, ``num_gpus`` below 1 or (above one
            node) not a multiple of the node size, or no plan of either kind fits the
            memory (with how far over the leanest plan is).
    """
    hw = get_profile(hw)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ValueError(f"num_gpus={num_gpus!r} must be a positive int (GPUs of the job)")
    node = hw.gpus_per_node
    if num_gpus > node and num_gpus % node:
        lo, hi = num_gpus // node * node, (num_gpus // node + 1) * node
        raise ValueError(
            f"num_gpus={num_gpus} is not a multiple of the {hw.name} node size {node}: islands "
            f"and TP groups need whole nodes; use {lo} or {hi}"
        )
    t0 = time.perf_counter()
    count = [0]
    lean: list[Estimate] = []  # the leanest plan seen, for the error message

    llm_cache: dict = {}
    alone: list[tuple[float, int, ModulePlan, list]] = []  # the LLM by itself on every GPU

    def llm_front(n: int) -> dict[int, list[tuple[ModulePlan, list]]]:
        """Per M, the LLM's Pareto-front plans on ``n`` GPUs with their stages."""
        if n in llm_cache:
            return llm_cache[n]
        items: dict[int, list] = defaultdict(list)
        for lay, mbs, saver in itertools.product(
            llm_layouts(cfg, n, work, hw, even=even_stages, fsdp=fsdp), MICROBATCH_SIZES, savers
        ):
            if work.global_batch % (lay.data_ranks * mbs):
                continue
            m = work.global_batch // (lay.data_ranks * mbs)
            mp = ModulePlan(lay, **saver)
            probe = Plan("homogeneous", ModulePlan(Layout(dp=lay.data_ranks)), mp, m)
            stages = llm_stages(cfg, probe, work, hw)
            count[0] += 1
            per = [s.forward_s + s.backward_s + 2 * s.recv_s for s in stages]
            chain = sum(per) + (m - 1) * max(per)
            mem = max(s.memory.total for s in stages)
            items[m].append((chain, mem, (mp, stages)))
            if n == num_gpus and mem <= hw.memory_bytes:
                step = chain + max(s.reduce_s + s.optimizer_s for s in stages)
                alone.append((step, m, mp, stages))
        llm_cache[n] = {m: _front(v) for m, v in items.items()}
        return llm_cache[n]

    vis_cache: dict = {}

    def price(plan: Plan, llm: list, *, simulate: bool = False) -> Estimate | None:
        try:
            check_plan(cfg, plan, work)
        except ValueError:
            return None
        count[0] += 1
        # The encoder's stages see the LLM only through its pp (the schedule's warm-up).
        key = (plan.mode, plan.vision, plan.microbatches, plan.llm.layout.pp)
        if key not in vis_cache:
            vis_cache[key] = vision_stages(cfg, plan, work, hw)
        est = assemble(cfg, plan, work, hw, vis_cache[key], llm, simulate=simulate)
        if not lean or est.peak_memory_bytes < lean[0].peak_memory_bytes:
            lean[:] = [est]
        return est if est.fits else None

    found: dict[str, list[Estimate]] = defaultdict(list)
    for m, front in llm_front(num_gpus).items():
        for mp, stages in front:
            for saver in savers:
                base = dataclasses.replace(mp.layout, pp=1, ep=1)
                plan = Plan("homogeneous", ModulePlan(base, **saver), mp, m)
                if est := price(plan, stages):
                    found["homogeneous"].append(est)
            if "colocated" in modes:
                # With the LLM's fsdp share too: the homogeneous plan's encoder is one.
                shared = vision_layouts(cfg, num_gpus, hw, pipelined=False, fsdp=mp.layout.fsdp)
                for lay, saver in itertools.product(shared, savers):
                    plan = Plan("colocated", ModulePlan(lay, **saver), mp, m)
                    if est := price(plan, stages):
                        found["colocated"].append(est)
    if "non-colocated" in modes and num_gpus > 1:
        step = node if num_gpus > node else 1
        for n_vis in range(step, num_gpus, step):
            fronts = llm_front(num_gpus - n_vis)
            for lay, saver in itertools.product(
                vision_layouts(cfg, n_vis, hw, pipelined=True), savers
            ):
                for m, front in fronts.items():
                    for mp, stages in front:
                        plan = Plan("non-colocated", ModulePlan(lay, **saver), mp, m)
                        if est := price(plan, stages):
                            found["non-colocated"].append(est)
    by_mode = {}
    for mode, ests in found.items():
        best = sorted(ests, key=lambda e: e.step_time_s)[:keep]
        timed = [
            price(e.plan, list(e.stages[e.plan.vision.layout.pp :]), simulate=True) for e in best
        ]
        by_mode[mode] = sorted([e for e in timed if e], key=lambda e: e.step_time_s)
    hetero = sorted(
        (e for mode in modes for e in by_mode.get(mode, [])), key=lambda e: e.step_time_s
    )
    if not hetero or not by_mode.get("homogeneous"):
        _no_fit(cfg, num_gpus, hw, lean, "heterogeneous" if not hetero else "homogeneous")
    stock = _stock(alone, price)
    if stock and stock.step_time_s < by_mode["homogeneous"][0].step_time_s:
        by_mode["homogeneous"].insert(0, stock)  # the best baseline is never the slower
    return SearchResult(
        best=hetero[0],
        homogeneous=by_mode["homogeneous"][0],
        stock=stock,
        ranked=tuple(hetero),
        by_mode={k: v[0] for k, v in by_mode.items() if v},
        candidates=count[0],
        seconds=time.perf_counter() - t0,
    )


def _stock(alone: list, price: Any) -> Estimate | None:
    """The paper's baseline: the layout a Megatron user picks for the LLM, which the
    encoder inherits, its savers included, on the first stage. Without fsdp (Megatron's
    stock shards the state by its distributed optimizer alone, ZeRO-1), at the least CP
    degree with which the model trains without full recompute (where none does, with
    it): Megatron's guide takes CP where long sequences' activations run out of memory,
    instead of full recompute (~30% overhead), and defaults context_parallel_size to 1
    (NVIDIA/Megatron-LM docs/source/api-guide/context_parallel.rst, "Context parallelism
    benefits" and "Enabling context parallelism"). At that CP, the LLM's layouts by
    their own step time, the fastest first, the first that fits with the encoder. Times
    equal to six digits are a tie: the user keeps the most data parallelism (the least
    pp, then tp)."""

    def order(a: tuple) -> tuple:
        lay = a[2].layout
        return lay.cp, float(f"{a[0]:.6g}"), lay.pp, lay.tp

    def inherited(a: tuple) -> Plan | None:  # the stock plan, where it fits
        enc = dataclasses.replace(a[2], layout=dataclasses.replace(a[2].layout, pp=1, ep=1))
        plan = Plan("homogeneous", enc, a[2], a[1])
        return plan if price(plan, a[3]) else None

    stock = [a for a in alone if a[2].layout.fsdp == 1]
    zero1 = sorted([a for a in stock if a[2].zero1] or stock, key=order)  # no ZeRO-1 tried: all
    lean = [a for a in zero1 if a[2].recompute != "full"]
    cp = next((a[2].layout.cp for a in lean + zero1 if inherited(a)), None)
    for a in (a for a in zero1 if a[2].layout.cp == cp):
        if plan := inherited(a):
            return price(plan, a[3], simulate=True)
    return None


def _no_fit(cfg: Any, n: int, hw: HardwareProfile, lean: list[Estimate], kind: str) -> None:
    name = getattr(cfg, "name", "the model")
    if not lean:
        raise ValueError(f"{name}: no valid {kind} layout on {n} GPUs; use more GPUs")
    need, limit = lean[0].peak_memory_bytes / 2**30, hw.memory_bytes / 2**30
    raise ValueError(
        f"{name} fits no {kind} layout on {n} {hw.name} GPUs: the leanest needs {need:.1f} GiB "
        f"per GPU, {need - limit:.1f} GiB over the {limit:.1f} GiB limit; use more GPUs or "
        "a GPU with more memory"
    )
