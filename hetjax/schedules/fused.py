"""The homogeneous baseline's schedule: encoders fused into the LLM's first stage.

Stock Megatron gives the encoders the LLM's layout and runs them inside the LLM's first
pipeline stage: before stage 0's forward of microbatch m the encoders run their forward
of m, after its backward they run their backward of m. As data this is a schedule over
the flattened module graph (each encoder one stage, ``pp=1``) whose LLM stages follow the
linear 1F1B or GPipe order, and whose encoder stages copy stage 0's compute order. The
encoder stages share stage 0's device group, so the simulator never overlaps them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ._blocks import backward_block, forward_and_send, require_positive
from .actions import Action, Edge, transfer
from .gpipe import gpipe
from .graph import ModuleGraph
from .one_f_one_b import one_f_one_b
from .schedule import Schedule, StageInfo, build_schedule


def fused_encoders(
    graph: ModuleGraph, num_microbatches: int, *, order: Literal["1f1b", "gpipe"] = "1f1b"
) -> Schedule:
    """Encoders run inside the sink's first stage (the homogeneous baseline).

    Args:
        graph: Encoders (``pp=1`` each) that all feed the single sink module.
        num_microbatches: Microbatches per step (M).
        order: The sink's pipeline order.

    Returns:
        The schedule, named after ``order``.

    Raises:
        ValueError: An encoder with ``pp > 1``, or a graph that is not encoders -> sink.

    Example:
        >>> s = fused_encoders(ModuleGraph({"vision": 1, "llm": 2}, [("vision", "llm")]), 4)
        >>> s.name, [str(i) for i in s.stages]
        ('1f1b', ['vision[0/1]', 'llm[0/2]', 'llm[1/2]'])
    """
    require_positive("num_microbatches", num_microbatches)
    (sink,) = graph.sinks
    encoders = [m for m in graph.topological_order() if m != sink]
    for e in encoders:
        if graph.modules[e] != 1 or graph.successors(e) != (sink,):
            raise ValueError(
                f"fused encoders need every encoder to have pp=1 and feed {sink!r} only; "
                f"{e!r} has pp={graph.modules[e]} and feeds {graph.successors(e)}"
            )
    pp = graph.modules[sink]
    base = (one_f_one_b if order == "1f1b" else gpipe)(pp, num_microbatches, module=sink)
    k = len(encoders)
    group = (0,)  # encoders share the sink's first stage's devices
    stages = [StageInfo(i, e, 0, 1, devices=group) for i, e in enumerate(encoders)]
    stages += [StageInfo(k + s, sink, s, pp, devices=group if s == 0 else (s,)) for s in range(pp)]
    into = [Edge(e, i, sink, k) for i, e in enumerate(encoders)]
    edges = into + [Edge(sink, k + e.src_stage, sink, k + e.dst_stage) for e in base.edges]

    def shifted(a: Action) -> Action:
        edge = a.edge and Edge(sink, k + a.edge.src_stage, sink, k + a.edge.dst_stage)
        return dataclasses.replace(a, stage=a.stage + k, edge=edge)

    first: list[Action] = []
    for a in base.actions[0]:
        if a.kind == "F":
            first += [transfer("RECV_F", e, a.microbatch) for e in into]
        first.append(shifted(a))
        if a.kind == "B":
            first += [transfer("SEND_B", e, a.microbatch) for e in into]
    actions = (
        [[] for _ in encoders] + [first] + [[shifted(a) for a in acts] for acts in base.actions[1:]]
    )
    for i, info in enumerate(stages[:k]):
        for a in base.actions[0]:
            if a.kind == "F":
                actions[i] += forward_and_send(info, [into[i]], a.microbatch, 0)
            elif a.kind == "B":
                actions[i] += backward_block(info, [], [into[i]], a.microbatch, 0)
    max_live = [base.max_live[0]] * k + list(base.max_live)
    return build_schedule(base.name, num_microbatches, stages, edges, actions, max_live)
