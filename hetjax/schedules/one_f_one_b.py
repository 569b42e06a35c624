"""1F1B: Megatron's non-interleaved schedule, for a linear pipeline and for a module DAG.

Stage s of a P-stage pipeline runs ``min(P - s - 1, M)`` warm-up forwards, then
alternates one forward and one backward, then drains the remaining backwards. It bounds
live activations on stage s by ``min(P - s, M)`` instead of GPipe's M at the same bubble.

The graph-aware variant (the paper's non-colocated mode) flattens the module DAG into
global stages (`ModuleGraph.flatten`) and replaces ``s`` by the stage's position on the
longest PP-weighted path: warm-up = ``total - depth - 1``. A join (the LLM's first stage,
fed by several encoders) receives from every incoming edge before each forward and sends
a gradient back on each after each backward; a branch sends on every outgoing edge.
Encoders on parallel branches have their own stage lists, so they run concurrently.

Deadlock freedom: with buffered sends (`check_schedule`'s default) every graph tried -
chains, joins, branches, diamonds and thousands of random DAGs - checks clean. With
rendezvous sends (each transfer a blocking pair, e.g. one collective per transfer) chains
and encoders-into-LLM joins check clean, but an edge that skips over other modules, or
(with ``align="sink"``) a branch into consumers of unequal depth, needs the transfer to
be buffered and deadlocks; ``check_schedule(s, sends="rendezvous")`` reports it.
"""

from __future__ import annotations

from typing import Literal

from ._blocks import edges_by_stage, one_f_one_b_list, require_positive
from .graph import ModuleGraph
from .schedule import Schedule, build_schedule

Align = Literal["source", "sink"]


def warmup_counts(
    graph: ModuleGraph, num_microbatches: int, *, align: Align = "source"
) -> tuple[int, ...]:
    """Warm-up forwards per global stage: ``min(total - depth - 1, M)``.

    Args:
        graph: The module graph.
        num_microbatches: Microbatches per step (M).
        align: How a stage off the longest path is positioned; see
            `ModuleGraph.stage_depths`.

    Returns:
        One count per global stage of ``graph.flatten()``.

    Example:
        >>> warmup_counts(ModuleGraph({"llm": 4}), 8)
        (3, 2, 1, 0)
    """
    total = graph.total_stages()
    return tuple(
        min(total - depth - 1, num_microbatches) for depth in graph.stage_depths(align=align)
    )


def one_f_one_b(num_stages: int, num_microbatches: int, *, module: str = "model") -> Schedule:
    """Megatron's non-interleaved 1F1B schedule for a linear pipeline.

    Args:
        num_stages: Pipeline stages (P), all of one module.
        num_microbatches: Microbatches per step (M); M < P is allowed (every stage then
            warms up with all M forwards, like GPipe).
        module: Module name written on the stages.

    Returns:
        The schedule, named ``"1f1b"``, with ``max_live[s] == min(P - s, M)``.

    Raises:
        ValueError: If P or M is below 1.

    Example:
        >>> one_f_one_b(2, 3).to_text(compute_only=True)
        '0 model[0/2]: F0 F1 B0 F2 B1 B2\\n1 model[1/2]: F0 B0 F1 B1 F2 B2'
    """
    require_positive("num_stages", num_stages)
    require_positive("num_microbatches", num_microbatches)
    return _one_f_one_b(ModuleGraph({module: num_stages}), num_microbatches, "source", "1f1b")


def graph_one_f_one_b(
    graph: ModuleGraph, num_microbatches: int, *, align: Align = "source"
) -> Schedule:
    """Graph-aware 1F1B over a module DAG (non-colocated execution).

    Args:
        graph: The module graph, e.g. vision (pp=2) and audio (pp=1) feeding an LLM
            (pp=2): 4 global stages, warm-ups ``(3, 2, 3, 1, 0)`` with
            ``align="source"``, in the order vision[0], vision[1], audio[0], llm[0],
            llm[1].
        num_microbatches: Microbatches per step (M).
        align: ``"source"`` (default) places every stage right after its longest input
            path, as the reference does; ``"sink"`` places stages of a short branch as
            late as possible, which lowers their warm-up and activation memory without
            delaying the join. See `ModuleGraph.stage_depths`.

    Returns:
        The schedule, named ``"graph_1f1b"``, with ``max_live[s] == min(warmup + 1, M)``.

    Raises:
        ValueError: If M is below 1 or ``align`` is unknown.
    """
    require_positive("num_microbatches", num_microbatches)
    return _one_f_one_b(graph, num_microbatches, align, "graph_1f1b")


def _one_f_one_b(graph: ModuleGraph, num_mb: int, align: Align, name: str) -> Schedule:
    stages, edges = graph.flatten()
    warmups = warmup_counts(graph, num_mb, align=align)
    ins, outs = edges_by_stage(len(stages), edges)
    actions = [
        one_f_one_b_list(info, ins[info.stage], outs[info.stage], num_mb, warmups[info.stage])
        for info in stages
    ]
    # Live activations peak right after the first steady-state forward: warmup + 1,
    # unless every forward is a warm-up forward.
    max_live = [min(w + 1, num_mb) for w in warmups]
    return build_schedule(name, num_mb, stages, edges, actions, max_live)
