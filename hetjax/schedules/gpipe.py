"""GPipe: every stage runs all forwards, then all backwards.

The simplest correct pipeline schedule and the memory worst case: each stage holds the
activations of all M microbatches before its first backward. It is kept as a baseline
for the simulator and as the shape of the colocated encoder phases (which run all
forwards, then all backwards, on purpose).

Backward order: microbatch order 0..M-1, as PyTorch's ``ScheduleGPipe`` does (GPipe's
paper does not fix it). With equal F and B times either order gives the same makespan,
2 (M + P - 1); forward order keeps stage s's gradient sends in the order the previous
stage expects them.
"""

from __future__ import annotations

from ._blocks import all_forward_all_backward, edges_by_stage, require_positive
from .graph import ModuleGraph
from .schedule import Schedule, build_schedule


def gpipe(num_stages: int, num_microbatches: int, *, module: str = "model") -> Schedule:
    """GPipe schedule for a linear pipeline of ``num_stages`` stages.

    Args:
        num_stages: Pipeline stages (P), all of one module.
        num_microbatches: Microbatches per step (M).
        module: Module name written on the stages.

    Returns:
        A schedule whose stage s runs ``RECV_F, F, SEND_F`` for each microbatch, then
        ``RECV_B, B, SEND_B`` for each; ``max_live`` is M on every stage.

    Raises:
        ValueError: If P or M is below 1.

    Example:
        >>> gpipe(2, 2).to_text(compute_only=True)
        '0 model[0/2]: F0 F1 B0 B1\\n1 model[1/2]: F0 F1 B0 B1'
    """
    require_positive("num_stages", num_stages)
    require_positive("num_microbatches", num_microbatches)
    return graph_gpipe(ModuleGraph({module: num_stages}), num_microbatches)


def graph_gpipe(graph: ModuleGraph, num_microbatches: int) -> Schedule:
    """GPipe over a module DAG: all forward blocks, then all backward blocks, per stage.

    Args:
        graph: The module graph; flattened with `ModuleGraph.flatten`.
        num_microbatches: Microbatches per step (M).

    Returns:
        The schedule; joins receive from every incoming edge, branches send on every
        outgoing edge, ``max_live`` is M everywhere.
    """
    require_positive("num_microbatches", num_microbatches)
    stages, edges = graph.flatten()
    ins, outs = edges_by_stage(len(stages), edges)
    actions = [
        all_forward_all_backward(info, ins[info.stage], outs[info.stage], num_microbatches)
        for info in stages
    ]
    return build_schedule(
        "gpipe",
        num_microbatches,
        stages,
        edges,
        actions,
        [num_microbatches] * len(stages),
    )
