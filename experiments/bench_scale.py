"""Scale-out: state bytes per device, FSDP collectives, encoder balance, frozen bf16.

    python -m experiments.bench_scale --json out.json [--quick] [--steps N] [--preset P]

Rows are :class:`hetjax.config.TrainConfig` variants run by :mod:`experiments.runner`'s
trainer of the ``small`` preset (``--preset tiny``: the same rows in minutes; ``--quick``,
for the test: ``tiny`` and fewer rows) on 8 simulated CPU devices, colocated, on
synthetic data with 0-6 images per sample (``data.synthetic_max_images=6``), global
batch 32 in one microbatch (``--quick``) or 64 in two. A row is a ``layout`` (module
layouts, ``vision:dp=8 llm:fsdp=4,tp=2``) and what it adds (``rebalance vision``,
``freeze vision bf16``). Keys of every row:

- ``state_bytes_per_device``: parameters + gradient accumulators + optimizer state of
  every stage on the busiest device (the arrays' shards, as placed).
  ``state_bytes_expected``: the same from the whole model: each parameter's bytes times
  4 where it trains (float32 parameter, gradient and AdamW's two moments) or 1 where it
  is frozen (as held), divided by the mesh degrees its logical axes map to
  (:data:`hetjax.meshes.rules.LOGICAL_AXIS_RULES`: ``embed`` -> fsdp, ``heads``/``mlp``/
  ``vocab`` -> tp, ``layers`` -> pp): whole / fsdp for the fsdp-sharded parts.
- ``peak_bytes_per_stage``: per stage, the largest footprint of its programs
  (:func:`hetjax.inspect.memory.peak_bytes`); ``step_time_s``: median wall time of steps
  2..``--steps``, each waited for in full.

Rows with fsdp (only where :class:`hetjax.Layout` has an fsdp degree) add:

- ``fsdp_collective_bytes``: per device and step, the bytes of the all-gathers and
  reduce-scatters over the fsdp axis alone in the compiled programs of the second step
  (:mod:`hetjax.inspect.hlo`; XLA:CPU writes a reduce-scatter as an all-reduce and a
  slice, read as an all-reduce: each counted at its full buffer).
- ``fsdp_collective_bytes_ideal``: what a correct FSDP moves (gathered weights are not
  kept across the forward and backward nor across microbatches: memory is what FSDP is
  for), per microbatch and fsdp-sharded weight: one gather for the forward; one again
  for the backward where the backward reads the weight (:func:`backward_reads`: a
  matmul's kernel or a norm's scale, whose input gradient it scales; not an embedding
  table, whose gradient is a scatter-add of the cotangents, nor an added bias, position
  or class embedding, whose gradient is the cotangent summed, nor the input projection
  of a part whose input needs no gradient, the encoder's patch embedding); and one
  reduce-scatter of its gradient where it trains. The gathered bytes are the whole
  weight over tp.
- ``step_time_ratio_vs_no_fsdp``: over the same layout with fsdp folded into dp.

Rebalance rows (``--rebalance vision``) add ``imbalance_before`` / ``imbalance_after``
(means over the timed steps of ``imbalance_without/vision`` and ``imbalance/vision``:
:mod:`hetjax.runtime.rebalance`) and ``rebalance_bytes_per_step``. The frozen row (the
encoder frozen in a bf16 run: held in bf16, no master, gradient or optimizer state) adds
``frozen_bytes_per_device`` and ``frozen_bytes_per_device_f32`` (the same leaves held in
float32).

Exits non-zero unless every row's state bytes are within 5% of the expected, fsdp
collective bytes within 10% of the ideal, and the rebalanced encoder's imbalance <= 1.1.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEVICES = 8
MAX_IMAGES = 6
SEQ_LEN = {"tiny": 128, "small": 448}  # fits 6 images' placeholders, prompt and answer
NO_FSDP = {"vision": "dp=8", "llm": "dp=4,tp=2"}
FSDP = (  # (layouts with fsdp, the same without: fsdp folded into dp)
    ({"vision": "dp=8", "llm": "fsdp=4,tp=2"}, NO_FSDP),
    ({"vision": "dp=2,fsdp=4", "llm": "fsdp=8"}, {"vision": "dp=8", "llm": "dp=8"}),
)
STATE_TOLERANCE, FSDP_TOLERANCE, IMBALANCE_GOAL = 0.05, 0.10, 1.1


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    json: str | None = None  # where to write the rows (a JSON list); None: print only
    quick: bool = False  # the tiny preset, fewer rows, 2 steps (for the test)
    steps: int = 3  # steps per row (the first compiles)
    preset: str = "small"  # the model of every row (--quick: tiny)


def fsdp_supported() -> bool:
    """Whether :class:`hetjax.Layout` has an fsdp degree (rows with it run only then)."""
    from hetjax import Layout, LayoutError

    try:
        return Layout.parse("fsdp=2").num_devices == 2
    except (LayoutError, TypeError, ValueError):
        return False


def layout_text(layouts: dict[str, str]) -> str:
    return " ".join(f"{m}:{t}" for m, t in layouts.items())


def row_configs(config: BenchConfig) -> list[tuple[str, Any]]:
    """(what the row adds, its config) of every row."""
    from experiments.runner import bench_config, layout_fields, variant

    preset = "tiny" if config.quick else config.preset
    microbatches = 1 if config.quick else 2

    def row(layouts: dict[str, str], **changes: Any) -> Any:
        base = bench_config(
            steps=min(config.steps, 2) if config.quick else config.steps,
            model={"preset": preset, "seq_len": SEQ_LEN[preset]},
            data={"global_batch": 32 * microbatches, "synthetic_max_images": MAX_IMAGES},
            parallel={"microbatches": microbatches, **layout_fields(layouts)},
        )
        return variant(base, **changes)

    # --quick folds the rebalance into the layout rows (a row reports the imbalance with
    # and without it): one compile of each layout fewer.
    plain = ("rebalance vision", {"rebalance": "vision"}) if config.quick else ("-", {})
    rows = [(plain[0], row(NO_FSDP, parallel=plain[1]))]
    if fsdp_supported():
        for with_fsdp, without in FSDP[: 1 if config.quick else None]:
            if without != NO_FSDP:
                rows.append((plain[0], row(without, parallel=plain[1])))
            rows.append((plain[0], row(with_fsdp, parallel=plain[1])))
    if not config.quick:
        rows.append(("rebalance vision", row(NO_FSDP, parallel={"rebalance": "vision"})))
    frozen = {"freeze": "vision", "dtype": "bfloat16"}
    rows.append(("freeze vision bf16", row(NO_FSDP, model=frozen)))
    return rows


def _split(names: tuple, layout: Any) -> int:
    """Devices one array with logical ``names`` is split over (each mesh axis once)."""
    from hetjax.meshes.rules import LOGICAL_AXIS_RULES

    axes: set[str] = set()
    for name in names:
        rule = LOGICAL_AXIS_RULES.get(name) if name else None
        axes.update((rule,) if isinstance(rule, str) else (rule or ()))
    return math.prod(getattr(layout, a) for a in axes)


ADDED = ("bias", "pos", "cls")  # parameters the forward adds: their gradient is the cotangent
LOOKED_UP = ("table",)  # embedding tables: their gradient scatter-adds the cotangents
INPUT_PROJECTION = ("pre", "proj", "kernel")  # an encoder's patch (or frame) embedding


def backward_reads(path: tuple[str, ...], input_grad: bool) -> bool:
    """Whether the backward of the part holding the parameter at ``path`` (its keys
    within the part, ``("blocks", "qkv", "kernel")``) reads the parameter: it does where
    the parameter scales what flows back (a matmul's kernel, a norm's scale) unless what
    it scales is the part's own input and that needs no gradient (``input_grad``: some
    part before it or upstream trains); an added or looked-up parameter's gradient never
    reads it (:data:`ADDED`, :data:`LOOKED_UP`)."""
    if path[-1] in ADDED + LOOKED_UP:
        return False
    return input_grad or tuple(path) != INPUT_PROJECTION


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter of the whole model, as the trainer holds it."""

    part: str
    module: str
    names: tuple  # logical axis names
    size: int  # elements
    itemsize: int  # bytes per element as held (bf16 where a frozen part is)
    trained: bool
    layout: Any  # its module's Layout
    backward_reads: bool = True  # its part's backward reads it (:func:`backward_reads`)

    def per_device(self, itemsize: int | None = None, *, gathered: bool = False) -> int:
        """Bytes per device by the layout's degrees (``gathered``: not split over fsdp)."""
        split = _split(self.names, self.layout)
        if gathered and "embed" in self.names:
            split //= getattr(self.layout, "fsdp", 1)
        return self.size * (itemsize or self.itemsize) // split


def _leaves(tr: Any) -> list[Leaf]:
    import jax

    from hetjax.meshes.rules import is_logical_names

    out = []
    full, graph = tr.engine.full_params(), tr.graph
    for spec in graph.modules:
        # The first part's input has a gradient where something upstream trains.
        input_grad = any(graph.trains_upstream(l.src) for l in graph.links_into(spec.name))
        for part in spec.parts:
            axes = jax.tree.leaves(part.logical_axes(), is_leaf=is_logical_names)
            held = jax.tree_util.tree_leaves_with_path(full[part.name])
            trained = part.name not in spec.frozen
            for names, (path, a) in zip(axes, held, strict=True):
                keys = tuple(str(getattr(k, "key", k)) for k in path)
                reads = backward_reads(keys, input_grad)
                out.append(
                    Leaf(
                        part.name,
                        spec.name,
                        names,
                        a.size,
                        a.dtype.itemsize,
                        trained,
                        spec.layout,
                        reads,
                    )
                )
            input_grad = input_grad or trained
    return out


def state_bytes(ex: Any) -> int:
    """Parameters + gradient accumulators + optimizer state on the busiest device."""
    import jax

    from hetjax.inspect.memory import live_bytes_per_device

    held = []
    for key, prog in ex.programs.items():
        held += jax.tree.leaves((ex.state.params[key], ex.state.opt_state[key]))
        if prog.backward:  # accumulators by their shapes and shardings (none are live now)
            acc = jax.tree.leaves(prog.zeros.eval_shape())
            shardings = jax.tree.leaves(prog.acc_shardings)
            held += [
                jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
                for s, sharding in zip(acc, shardings, strict=True)
            ]
    return max(live_bytes_per_device(held).values())


def fsdp_bytes(rec: Any, ex: Any) -> int:
    """Per device: bytes of the second step's gathers and reduce-scatters over fsdp alone."""
    from hetjax.inspect.hlo import collectives, varied_axes

    total = 0
    for (key, kind), calls in rec.calls.items():
        prog = ex.programs[key]
        if prog.mesh.shape.get("fsdp", 1) == 1:
            continue
        for c in collectives(rec.compiled[(key, kind)].as_text(), prog.mesh.size):
            if c.kind != "all-to-all" and varied_axes(c, prog.mesh) == {"fsdp"}:
                total += calls * c.nbytes * c.executions
    return total


def fsdp_ideal(leaves: list[Leaf], backward: set[str], microbatches: int) -> int:
    """The policy's gathers and reduce-scatters per device and step (module docstring)
    for the modules with a ``backward``."""
    total = 0
    for leaf in leaves:
        if "embed" in leaf.names and getattr(leaf.layout, "fsdp", 1) > 1:
            times = 1 + (leaf.module in backward and leaf.backward_reads) + leaf.trained
            total += microbatches * times * leaf.per_device(gathered=True)
    return total


def run(what: str, row: Any, devices: list) -> dict:
    """One row: trains ``row.steps`` steps, recording the second step's calls."""
    import jax

    from experiments import runner
    from hetjax.inspect import Recorder
    from hetjax.inspect.memory import peak_bytes

    rec = Recorder()
    tr = runner.trainer(row, devices=devices, observers=[rec])
    ex = tr.engine
    metrics, times = [], []
    for i, batch in enumerate(runner.batches(tr, row.steps)):
        t0 = time.perf_counter()
        m = jax.device_get(ex.step(batch))
        jax.block_until_ready(ex.params)
        if i == 0:
            rec.calls.clear()  # count the second step's calls only
            continue
        times.append(time.perf_counter() - t0)
        metrics.append(m)
        rec.pause()
    leaves = _leaves(tr)
    peaks: dict[str, int] = {}
    for (key, _), c in rec.compiled.items():
        name = f"{key[0]}/{key[1]}"
        peaks[name] = max(peaks.get(name, 0), peak_bytes(c))
    out = {
        "layout": layout_text(row.parallel.layouts),
        "adds": what,
        "state_bytes_per_device": state_bytes(ex),
        "state_bytes_expected": sum(l.per_device() * (4 if l.trained else 1) for l in leaves),
        "peak_bytes_per_stage": peaks,
        "step_time_s": statistics.median(times),
    }
    if any(getattr(m.layout, "fsdp", 1) > 1 for m in tr.graph.modules):
        backward = {k[0] for k, p in ex.programs.items() if p.backward}
        out["fsdp_collective_bytes"] = fsdp_bytes(rec, ex)
        out["fsdp_collective_bytes_ideal"] = fsdp_ideal(leaves, backward, tr.microbatches)
    if row.parallel.rebalance:
        mean = lambda key: statistics.mean(m[f"{key}/vision"] for m in metrics)  # noqa: E731
        out["imbalance_before"] = mean("imbalance_without")
        out["imbalance_after"] = mean("imbalance")
        out["rebalance_bytes_per_step"] = mean("rebalance_bytes")
    if row.model.freeze:
        frozen = [l for l in leaves if not l.trained]
        out["frozen_bytes_per_device"] = sum(l.per_device() for l in frozen)
        out["frozen_bytes_per_device_f32"] = sum(l.per_device(4) for l in frozen)
    return out


def with_ratios(rows: list[dict]) -> list[dict]:
    """``rows`` with ``step_time_ratio_vs_no_fsdp`` in every fsdp row: its step time over
    its layout's without fsdp."""
    plain = {r["layout"]: r for r in rows if r["adds"] == rows[0]["adds"]}  # layout rows
    for with_fsdp, without in FSDP:
        row, base = plain.get(layout_text(with_fsdp)), plain.get(layout_text(without))
        if row is not None and base is not None:
            row["step_time_ratio_vs_no_fsdp"] = row["step_time_s"] / base["step_time_s"]
    return rows


def goals() -> list:
    """The conditions every row must meet."""
    from experiments.runner import Goal

    def off(r: dict, key: str, ideal: str) -> float:
        return r[key] / r[ideal] - 1

    return [
        Goal(
            lambda r: (
                abs(off(r, "state_bytes_per_device", "state_bytes_expected")) <= STATE_TOLERANCE
            ),
            lambda r: (
                f"{r['layout']} ({r['adds']}): {r['state_bytes_per_device']} B of state per "
                f"device, {off(r, 'state_bytes_per_device', 'state_bytes_expected'):+.1%} off "
                f"the expected {r['state_bytes_expected']}"
            ),
        ),
        Goal(
            lambda r: (
                "fsdp_collective_bytes" not in r
                or abs(off(r, "fsdp_collective_bytes", "fsdp_collective_bytes_ideal"))
                <= FSDP_TOLERANCE
            ),
            lambda r: (
                f"{r['layout']}: {r['fsdp_collective_bytes']} B of fsdp gathers and "
                f"reduce-scatters per device and step, "
                f"{off(r, 'fsdp_collective_bytes', 'fsdp_collective_bytes_ideal'):+.1%} off "
                f"the ideal {r['fsdp_collective_bytes_ideal']}"
            ),
        ),
        Goal(
            lambda r: r.get("imbalance_after", 1.0) <= IMBALANCE_GOAL,
            lambda r: (
                f"{r['layout']} (rebalance): image imbalance {r['imbalance_after']:.3f} > "
                f"{IMBALANCE_GOAL}"
            ),
        ),
    ]


def _mib(key: str):
    return lambda r: r[key] / 2**20 if key in r else float("nan")


COLUMNS = (
    ("layout", "<34", "layout"),
    ("adds", "<19", "adds"),
    ("state MiB/dev", "13.3f", _mib("state_bytes_per_device")),
    ("expected", "9.3f", _mib("state_bytes_expected")),
    ("max peak MiB", "12.2f", lambda r: max(r["peak_bytes_per_stage"].values()) / 2**20),
    ("step s", "7.3f", "step_time_s"),
    ("fsdp MiB", "9.3f", _mib("fsdp_collective_bytes")),
    ("ideal", "8.3f", _mib("fsdp_collective_bytes_ideal")),
    ("t/no-fsdp", "9.3f", lambda r: r.get("step_time_ratio_vs_no_fsdp", float("nan"))),
    ("imb before", "10.3f", lambda r: r.get("imbalance_before", float("nan"))),
    ("after", "6.3f", lambda r: r.get("imbalance_after", float("nan"))),
)


def main(config: BenchConfig) -> list[dict]:
    """Runs the rows, prints a table, writes JSON, checks the goals."""
    from experiments import runner

    devices = runner.start(DEVICES, steps=config.steps, cache="bench_scale")
    name = lambda item: f"{layout_text(item[1].parallel.layouts)} ({item[0]})"  # noqa: E731
    rows = with_ratios(runner.measured(row_configs(config), lambda i: run(*i, devices), name))
    runner.print_table(rows, COLUMNS)
    runner.finish_rows(rows, config.json, runner.missed(rows, goals()), "goal missed")
    return rows


if __name__ == "__main__":
    from experiments.runner import run_bench

    run_bench(
        main,
        BenchConfig,
        prog="bench_scale",
        doc=__doc__,
        quick="the tiny preset, one fsdp pair (for the test)",
        flags=lambda p, d: p.add_argument(
            "--preset", default=d.preset, choices=sorted(SEQ_LEN), help="the model of every row"
        ),
    )
