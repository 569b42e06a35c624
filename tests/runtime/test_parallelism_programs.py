"""What the compiled stage programs communicate under TP, CP, ZeRO-1 and sequence parallelism.

Values are checked by ``test_parallelism_parity.py``; this file checks the collectives
and memory the paper's argument rests on, from the compiled program of every stage as
the executor reports it during one real step (``on_compile``, kept by a
:class:`hetjax.inspect.Recorder`), parsed by :mod:`hetjax.inspect` (loop trip counts
included):

(a) an encoder with its own ``dp=8`` layout runs forward and backward without any
    collective, while the homogeneous baseline's encoder, inheriting the LLM's ``tp=4``,
    all-reduces over tp in every layer;
(b) a ``cp=2`` LLM never gathers the full sequence of an activation: the K/V ring is
    collective-permutes of ``L / cp`` blocks, and nothing over ``cp`` is ``[b, L, D]``;
(c) the boundary into a ``cp > 1`` LLM delivers each cp rank only the image tokens of
    the positions it stores (routed), and an encoder inheriting ``cp`` splits its own
    tokens over cp and rings K/V;
(d) ZeRO-1 keeps ``1 / dp`` of the Adam moments per device and its DP reduction is a
    reduce-scatter (on XLA:CPU: the all-reduce + dynamic-slice it is made of);
(e) sequence parallelism removes the TP all-reduces of ``[b, L, D]`` activations and
    all-gathers of the sequence entering each TP region and reduce-scatters leaving it
    (Megatron's form).

XLA:CPU emits no ``reduce-scatter`` here (checked with this JAX): the SPMD partitioner's
all-reduce + dynamic-slice stays unfused (XLA:GPU's ``ReduceScatterCreator`` pass fuses
it), so the tests accept the unfused form where a reduce-scatter is meant.

Four executors on ``tiny`` (vision ``dp=8`` and LLM ``dp=2,tp=4`` colocated, the same
with ZeRO-1 and sequence parallelism - ZeRO-1 changes only reduce/update and sequence
parallelism only fwd/bwd, so one run serves both comparisons -, the homogeneous
baseline of that LLM, and LLM ``dp=2,cp=2,tp=2``), built lazily and cached per module;
all but the first encoder check are ``slow`` (CI runs them).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import hetjax
from hetjax import Layout
from hetjax.inspect import Collective, Recorder, collectives, varied_axes
from hetjax.ops.ring_attention import zigzag_permutation
from hetjax.ops.token_routing import Routed, owner_rank
from hetjax.runtime.feed import Feed
from models import tokenizer
from models.config import get_preset
from models.data import SyntheticConfig, SyntheticLlava
from models.mllm import MLLM

GLOBAL_BATCH = 8  # one microbatch; per LLM replica b = 8 / dp = 4 samples
OPTIMIZER = hetjax.AdamWConfig(total_steps=10, warmup_steps=0)
CFG = get_preset("tiny")
L, D = CFG.seq_len, CFG.llm.width  # LLM sequence and width
N = CFG.vision.num_tokens  # image tokens per sample

RUNS = {
    "het_tp4": ("colocated", "dp=2,tp=4", ()),
    "het_tp4_zero1_sp": ("colocated", "dp=2,tp=4", ("zero1", "sequence_parallel")),
    "hom_tp4": ("homogeneous", "dp=2,tp=4", ()),
    "het_cp2": ("colocated", "dp=2,cp=2,tp=2", ()),
    "het_cp4": ("colocated", "dp=2,cp=4", ()),
    "hom_cp2": ("homogeneous", "dp=2,cp=2,tp=2", ()),
}


@dataclasses.dataclass
class Run:
    ex: hetjax.Executor
    rec: Recorder  # attached at construction; one step was run

    def hlo(self, module: str, program: str, stage: int = 0) -> str:
        return self.rec.compiled[((module, stage), program)].as_text()

    def collectives(self, module: str, program: str, stage: int = 0) -> list[Collective]:
        mesh = self.ex.programs[(module, stage)].mesh
        return collectives(self.hlo(module, program, stage), mesh.size)

    def mesh(self, module: str, stage: int = 0):
        return self.ex.programs[(module, stage)].mesh


@pytest.fixture(scope="module")
def tiny():
    model = MLLM(CFG)
    data = SyntheticLlava(SyntheticConfig.for_model(CFG, seq_len=CFG.seq_len, seed=0))
    return model, model.init(jax.random.key(0)), data.batch(0, GLOBAL_BATCH)


def make_executor(
    tiny, mode: str, llm: str, options=(), *, vision: str = "dp=8", islands=None, observers=()
):
    model, params, _ = tiny
    layouts = {"vision": Layout.parse(vision), "llm": Layout.parse(llm)}
    plan = hetjax.plan_run(
        model.train_graph(layouts), num_devices=len(jax.devices()), mode=mode, islands=islands
    )
    return hetjax.Executor(
        plan,
        params,
        devices=jax.devices(),
        optimizer=OPTIMIZER,
        options=hetjax.ParallelOptions(**{o: True for o in options}),
        observers=observers,
    )


@pytest.fixture(scope="module")
def runs(tiny):
    """``runs(name)``: the executor of ``RUNS[name]`` after one recorded step (cached)."""
    cache: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in cache:
            mode, llm, options = RUNS[name]
            rec = Recorder()
            ex = make_executor(tiny, mode, llm, options, observers=[rec])
            jax.block_until_ready(ex.step(tiny[2]))
            cache[name] = Run(ex, rec)
        return cache[name]

    return get


def executions(items: list[Collective]) -> int:
    return sum(c.executions for c in items)


def is_full_sequence_activation(shape: tuple[int, ...], b: int) -> bool:
    """``[..., b, L, ...]`` with at least ``b * L * D`` elements: a whole-sequence
    activation of this replica's samples (not a ``[b, L]`` mask, not a weight)."""
    pairs = zip(shape, shape[1:], strict=False)
    return any(p == (b, L) for p in pairs) and int(np.prod(shape)) >= b * L * D


# -- (a) encoder layouts ----------------------------------------------------------------------


def test_dp_only_encoder_runs_forward_and_backward_without_collectives(runs):
    run = runs("het_tp4")
    assert run.mesh("vision").shape["tp"] == 1 and run.mesh("llm").shape["tp"] == 4
    for program in ("fwd", "bwd"):
        assert run.collectives("vision", program) == [], program
    # Its only data-parallel traffic is the once-per-step gradient reduction.
    reduce = run.collectives("vision", "reduce")
    assert reduce and all(varied_axes(c, run.mesh("vision")) == {"dp"} for c in reduce)


@pytest.mark.slow
def test_encoder_inheriting_tp_all_reduces_over_tp_in_every_layer(runs):
    run = runs("hom_tp4")
    mesh = run.mesh("vision")
    assert mesh.shape["tp"] == 4  # the homogeneous baseline: vision inherits dp=2,tp=4
    depth = CFG.vision.depth
    for program in ("fwd", "bwd"):
        tp = [
            c
            for c in run.collectives("vision", program)
            if c.kind == "all-reduce" and "tp" in varied_axes(c, mesh)
        ]
        # Attention out and MLP down are row-parallel: an all-reduce each, per layer.
        assert executions(tp) >= 2 * depth, (program, [c.line for c in tp])


@pytest.mark.slow
def test_heterogeneous_encoder_moves_fewer_collective_bytes(runs):
    def total(run: Run) -> int:
        mesh = run.mesh("vision")
        return sum(
            c.nbytes * c.executions * run.rec.calls[(("vision", 0), p)] * mesh.size
            for p in ("fwd", "bwd", "reduce", "update")
            for c in run.collectives("vision", p)
        )

    assert total(runs("het_tp4")) < total(runs("hom_tp4"))


@pytest.mark.slow
def test_encoder_inheriting_cp_splits_its_tokens_and_rings_kv(runs):
    """``mode="homogeneous"`` gives encoders the LLM's layout including ``cp``: the
    encoder splits its ``N`` patch tokens over cp between blocks and its bidirectional
    attention passes ``N / cp`` K/V blocks around a ring (it is not replicated)."""
    run = runs("hom_cp2")
    mesh = run.mesh("vision")
    assert mesh.shape["cp"] == 2 and not run.ex.graph.module("vision").seq_inputs
    for program in ("fwd", "bwd"):
        ring = [
            c
            for c in run.collectives("vision", program)
            if c.kind == "collective-permute" and varied_axes(c, mesh) == {"cp"}
        ]
        assert executions(ring) >= CFG.vision.depth, program
        assert all(N // 2 in s and N not in s for c in ring for s in c.shapes), program


# -- (b) context parallelism ------------------------------------------------------------------


@pytest.mark.slow
def test_cp_llm_passes_kv_blocks_around_a_ring_and_never_gathers_the_sequence(runs):
    run = runs("het_cp2")
    mesh = run.mesh("llm")
    cp, b = mesh.shape["cp"], GLOBAL_BATCH // (mesh.shape["dp"] * mesh.shape["ep"])
    items = run.collectives("llm", "bwd")  # the loss stage: forward is recomputed in bwd
    over_cp = [c for c in items if "cp" in varied_axes(c, mesh)]

    ring = [c for c in over_cp if c.kind == "collective-permute"]
    assert ring, "no collective-permute over cp: the K/V ring is missing"
    for c in ring:
        assert varied_axes(c, mesh) == {"cp"}, c.line
        assert all(L // cp in s and L not in s for s in c.shapes), c.line  # L/cp blocks

    assert not [c.line for c in over_cp if c.kind == "all-gather"]
    full = [
        c.line
        for c in over_cp
        if c.kind != "collective-permute"
        and any(is_full_sequence_activation(s, b) for s in c.shapes)
    ]
    assert not full, full
    # Besides the ring, nothing non-scalar is all-reduced over cp in the backward: the LLM
    # runs per cp rank (StageProgram.cp_local, tp = 2 here), so its parameter gradients
    # stay per rank through the microbatches and the step's one reduce sums them over
    # dp x cp (a scalar: the summed loss).
    assert run.ex.programs[("llm", 0)].cp_local
    summed = [
        c.line
        for c in over_cp
        if c.kind == "all-reduce" and any(math.prod(s) > 1 for s in c.shapes)
    ]
    assert not summed, summed


# -- (c) the boundary into a cp > 1 LLM ------------------------------------------------------


def image_slots_per_cp_rank(tokens_BxL: np.ndarray, cp: int) -> np.ndarray:
    """``[B, cp]``: image placeholders among the positions each cp rank stores (zigzag)."""
    stored = tokens_BxL[:, zigzag_permutation(tokens_BxL.shape[1], cp)]
    is_slot = stored == tokenizer.PLACEHOLDERS["image"]
    return is_slot.reshape(len(stored), cp, -1).sum(-1)


def marked_tokens(mesh) -> jax.Array:
    """``[B, N, D]`` image tokens whose values name them (sample, index), batch-split."""
    marks = np.arange(GLOBAL_BATCH * N, dtype=np.float32).reshape(GLOBAL_BATCH, N, 1) + 1
    value = np.broadcast_to(marks, (GLOBAL_BATCH, N, D)).copy()
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, P(("dp", "ep"))))


def check_each_rank_got_its_own_positions(got, y, tokens_BxL, mesh) -> int:
    """Every cp rank's block of the routed ``got`` holds exactly the tokens of ``y`` whose
    placeholders it stores, in its storage order, then zero padding. Returns ``K``."""
    assert isinstance(got, Routed)
    got, cp = got.tokens, mesh.shape["cp"]
    k = got.shape[1] // cp
    dp = mesh.shape["dp"] * mesh.shape["ep"]
    assert got.sharding.spec == P(("dp", "fsdp", "ep"), "cp")
    assert got.sharding.shard_shape(got.shape) == (GLOBAL_BATCH // dp, k, D)
    values = np.asarray(y)[..., 0]
    owner = owner_rank(L, cp)
    coords = {d: idx for idx, d in np.ndenumerate(mesh.devices)}
    for shard in got.addressable_shards:
        r = coords[shard.device][mesh.axis_names.index("cp")]
        for i, row in enumerate(range(GLOBAL_BATCH)[shard.index[0]]):
            slots = np.flatnonzero(tokens_BxL[row] == tokenizer.PLACEHOLDERS["image"])
            mine = [values[row, j] for j, pos in enumerate(slots) if owner[pos] == r]
            want = np.zeros(k, np.float32)
            want[: len(mine)] = mine
            np.testing.assert_array_equal(np.asarray(shard.data)[i, :, 0], want)
    return k


def first_route(ex: hetjax.Executor, batch, pair: tuple[str, str]):
    """The token route the executor's feed builds for microbatch 0 of ``batch``."""
    cp = {m.name: m.layout.cp for m in ex.graph.modules}
    feed = Feed(batch, ex.microbatches, routed=ex.plan.routed, links=ex.links, cp=cp)
    return feed.route(pair, 0, N)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "k"), [("het_cp4", 8), ("het_cp2", N)])
def test_boundary_into_cp_llm_moves_only_each_ranks_own_positions(runs, tiny, name, k):
    """Colocated vision ``dp=8`` -> LLM ``dp=2,cp=4`` (or ``cp=2``): each image of ``tiny``
    (``N = 16`` tokens at positions 1..16 of ``L = 64``) spans zigzag chunks 0-2, so the
    cp=4 ranks need 7, 8, 1 and 0 of its tokens and each gets ``K = 8`` slots - its own
    tokens and zero padding, nothing of another rank's - instead of all 16. With cp=2 one
    rank needs 15, so ``K = N``: no saving, but still nothing of another rank's."""
    _, _, batch = tiny
    run = runs(name)
    ex, pair, mesh = run.ex, ("vision", "llm"), run.mesh("llm")
    needed = image_slots_per_cp_rank(batch["tokens"], mesh.shape["cp"])
    assert (needed.sum(1) == N).all()

    y = marked_tokens(ex.programs[("vision", 0)].mesh)
    route = first_route(ex, batch, pair)
    assert route.index is not None and route.send is None  # colocated: gather at source
    got = ex.links[pair].forward(y, route)
    assert check_each_rank_got_its_own_positions(got, y, batch["tokens"], mesh) == k
    assert k == min(N, -(-needed.max() // 2) * 2)  # quantum ceil(N / (4 cp)) = 2 or 1
    # The backward is the exact transpose: routed marks come back as the marks.
    np.testing.assert_array_equal(np.asarray(ex.links[pair].backward(got, route)), y)

    # Bytes into the LLM's devices: cp * K tokens per sample instead of cp * N.
    plan = ex.links[pair].routed_boundary.plan(got.tokens.shape, np.float32)
    whole = ex.links[pair].boundary.plan((GLOBAL_BATCH, N, D), np.float32)
    assert plan.local_collective_bytes <= whole.local_collective_bytes * k / N * 1.2


@pytest.mark.slow
def test_routing_refuses_a_sample_with_more_placeholders_than_tokens(runs, tiny):
    _, _, batch = tiny
    ex = runs("het_cp4").ex
    bad = dict(batch, tokens=batch["tokens"].copy())
    bad["tokens"][3, -1] = tokenizer.PLACEHOLDERS["image"]  # N + 1 image slots in sample 3
    with pytest.raises(ValueError) as excinfo:
        first_route(ex, bad, ("vision", "llm"))
    message = str(excinfo.value)
    assert "\n" not in message
    assert message.startswith(f"sample 3 has {N + 1} placeholders but the encoder gives {N}")


@pytest.mark.slow
def test_boundary_across_islands_crosses_once_then_exchanges(tiny):
    """Non-colocated vision ``dp=4`` island -> LLM ``cp=4`` island: the tokens cross split
    evenly over the 4 cp ranks (each token crosses once: ``N`` per sample, no broadcast
    inside the LLM island), then one all-to-all moves each to the rank that owns its
    position. Same result as the colocated routing."""
    _, _, batch = tiny
    islands = {"vision": 4, "llm": 4}
    ex = make_executor(tiny, "non-colocated", "cp=4", vision="dp=4", islands=islands)
    pair, mesh = ("vision", "llm"), ex.programs[("llm", 0)].mesh
    link = ex.links[pair]
    route = first_route(ex, batch, pair)
    assert route.send is not None and route.index is None
    y = marked_tokens(ex.programs[("vision", 0)].mesh)
    got = link.forward(y, route)
    assert check_each_rank_got_its_own_positions(got, y, batch["tokens"], mesh) == 8
    np.testing.assert_array_equal(np.asarray(link.backward(got, route)), y)

    nbytes = GLOBAL_BATCH * N * D * 4
    split = link.routed_boundary.plan((GLOBAL_BATCH, N, D), np.float32)
    assert split.cross_island_bytes == nbytes and split.local_collective_bytes == 0
    whole = link.boundary.plan((GLOBAL_BATCH, N, D), np.float32)
    assert whole.cross_island_bytes == nbytes and whole.local.nbytes == 3 * nbytes
    # The padded all-to-all never moves more than the broadcast it replaces ((cp - 1) N
    # per sample); here exactly as much: holder 0's 4 tokens all belong to rank 0, so
    # every block is padded to K2 = N / cp = 4.
    _, cp, _, k2 = route.send.shape
    assert k2 == N // cp
    assert GLOBAL_BATCH * cp * (cp - 1) * k2 * D * 4 <= whole.local.nbytes


# -- (d) ZeRO-1 ----------------------------------------------------------------------------


def bytes_per_device(tree) -> dict:
    out: dict = defaultdict(int)
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] += shard.data.nbytes
    return out


@pytest.mark.slow
def test_zero1_keeps_one_dp_th_of_the_optimizer_state_per_device(runs):
    off, on = runs("het_tp4"), runs("het_tp4_zero1_sp")
    for key in (("vision", 0), ("llm", 0)):
        mesh = on.ex.programs[key].mesh
        dp = mesh.shape["dp"] * mesh.shape["ep"]
        before = max(bytes_per_device(off.ex.opt_state[key]).values())
        after = max(bytes_per_device(on.ex.opt_state[key]).values())
        # Moments split over dp; the few leaves with no dimension divisible by dp (and the
        # step counters) stay whole, hence 0.9.
        assert before / after >= 0.9 * dp, (key, before, after, dp)
        # The compiled update holds the same state: its arguments shrink accordingly.
        mem = {
            name: run.rec.compiled[(key, "update")].memory_analysis()
            for name, run in (("off", off), ("on", on))
        }
        assert mem["on"].argument_size_in_bytes < mem["off"].argument_size_in_bytes / 1.5, key


@pytest.mark.slow
def test_zero1_reduce_scatters_the_gradients_over_dp(runs):
    off, on = runs("het_tp4"), runs("het_tp4_zero1_sp")
    for key in (("vision", 0), ("llm", 0)):
        mesh = on.ex.programs[key].mesh
        dp = mesh.shape["dp"] * mesh.shape["ep"]
        hlo = {n: r.rec.compiled[(key, "reduce")].as_text() for n, r in (("off", off), ("on", on))}
        kinds = {n: {c.kind for c in collectives(t, mesh.size)} for n, t in hlo.items()}
        assert "reduce-scatter" not in kinds["off"]
        if "reduce-scatter" not in kinds["on"]:  # XLA:CPU: all-reduce + dynamic-slice
            assert " dynamic-slice(" in hlo["on"] and " dynamic-slice(" not in hlo["off"], key
        # Either way each device keeps 1/dp of the reduced gradients.
        out = {
            n: r.rec.compiled[(key, "reduce")].memory_analysis().output_size_in_bytes
            for n, r in (("off", off), ("on", on))
        }
        assert out["off"] / out["on"] >= 0.9 * dp, (key, out)


# -- (e) sequence parallelism -------------------------------------------------------------


def tp_collectives(run: Run, kind: str) -> list[Collective]:
    mesh = run.mesh("llm")
    return [
        c for c in run.collectives("llm", "bwd") if c.kind == kind and "tp" in varied_axes(c, mesh)
    ]


def only_kept_split(hlo: str, name: str, tp: int) -> bool:
    """Whether every use of instruction ``name`` (through ``get-tuple-element``) outputs
    at most ``1 / tp`` of an element of its result - i.e. an all-reduce whose result is
    only ever sliced down to this rank's part: XLA:CPU's form of a reduce-scatter (the
    slices fuse into the consumers, so we look at the consumers' output sizes)."""
    lines = [line.split("=", 1) for line in hlo.splitlines() if "=" in line]

    def elements(rhs: str) -> int:  # of the first array shape, e.g. "f32[1,4,16,64]{...}"
        dims = re.match(r"\s*\(?\w+\[([\d,]*)\]", rhs).group(1)
        return int(np.prod([int(d) for d in dims.split(",") if d]))

    whole = next(elements(rhs) for lhs, rhs in lines if lhs.split()[-1] == name)
    frontier, uses = [name], 0
    while frontier:
        ref = re.compile(re.escape(frontier.pop()) + r"[,)\s]")
        for lhs, rhs in lines:
            if not ref.search(rhs):
                continue
            if "get-tuple-element(" in rhs:
                frontier.append(lhs.split()[-1])
                continue
            uses += 1
            if elements(rhs) * tp > whole:
                return False
    return uses > 0


@pytest.mark.slow
def test_sequence_parallel_reduce_scatters_and_gathers_activations(runs):
    """Megatron's sequence parallelism: around each TP region the sequence-split residual
    stream is all-gathered (``g``) and the row-parallel partial sums are reduce-scattered
    back onto the sequence (``g-bar``) - no full-sequence activation is all-reduced and
    kept whole. Plain TP all-reduces them instead."""
    plain, sp = runs("het_tp4"), runs("het_tp4_zero1_sp")
    b = GLOBAL_BATCH // plain.mesh("llm").shape["dp"]
    depth = CFG.llm.depth

    def activation(run, kind):
        return [
            c
            for c in tp_collectives(run, kind)
            if any(is_full_sequence_activation(s, b) for s in c.shapes)
        ]

    # Plain TP: the row-parallel outputs (attention out, MLP down) are all-reduced over tp
    # in every layer, in the recomputed forward and again for the input gradients.
    hlo, tp = plain.hlo("llm", "bwd"), plain.mesh("llm").shape["tp"]
    assert executions(activation(plain, "all-reduce")) >= 2 * depth
    split = [only_kept_split(hlo, c.line.split()[0], tp) for c in activation(plain, "all-reduce")]
    assert not any(split)
    assert not tp_collectives(plain, "all-gather")
    # Sequence parallel: the same sums become reduce-scatters (on XLA:CPU: all-reduce +
    # dynamic-slice), forward (2 per layer) and backward (2 per layer); the inputs of the
    # column-parallel matmuls are all-gathered, forward and backward.
    hlo = sp.hlo("llm", "bwd")
    scatters = activation(sp, "reduce-scatter")
    for c in activation(sp, "all-reduce"):
        assert only_kept_split(hlo, c.line.split()[0], tp), c.line
        scatters.append(c)
    assert executions(scatters) >= 4 * depth
    assert executions(activation(sp, "all-gather")) >= 4 * depth


@pytest.mark.slow
def test_sequence_parallel_gathers_activations_not_weights(runs):
    sp = runs("het_tp4_zero1_sp")
    params = sp.ex.params[("llm", 0)]
    full_weights = {tuple(a.shape[1:]) for a in jax.tree.leaves(params) if a.ndim == 3}
    gathered = [
        c.line for c in tp_collectives(sp, "all-gather") if any(s in full_weights for s in c.shapes)
    ]
    assert not gathered, gathered
