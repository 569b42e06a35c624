"""`without_modules`: a schedule for a step in which some modules have nothing to do.

A step whose batch holds no image gives the vision encoder no work: nothing of its
output is read (Cornstarch drops such a node from its per-step plan). Rather than run
the encoder on masked slots, the step runs the schedule with the encoder's stages taken
out: their F and B, and every send and recv on an edge that touches them. Every other
stage keeps its own order, so its memory bound still holds, and the result is an
ordinary schedule that `check_schedule` proves valid like any generator's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

from .actions import Action, Edge
from .schedule import Schedule


def without_modules(schedule: Schedule, modules: Collection[str]) -> Schedule:
    """``schedule`` without the stages of ``modules`` (renumbered in order) and without
    every action on an edge from or into them.

    Args:
        schedule: A schedule.
        modules: Names of modules absent from this step (none: ``schedule`` itself).

    Returns:
        The schedule of the remaining stages, named ``"<name> without <modules>"``.

    Raises:
        ValueError: A name that is not a module of ``schedule``, or all of them.

    Example:
        >>> from hetjax.schedules import ModuleGraph, three_phase_for_graph
        >>> g = ModuleGraph({"vision": 1, "llm": 2}, [("vision", "llm")])
        >>> print(without_modules(three_phase_for_graph(g, 2), ["vision"]).to_text(
        ...     compute_only=True))
        0 llm[0/2]: F0 F1 B0 B1
        1 llm[1/2]: F0 B0 F1 B1
    """
    absent = set(modules)
    if not absent:
        return schedule
    unknown = sorted(absent - set(schedule.modules))
    if unknown:
        raise ValueError(
            f"without_modules names {unknown}, which are not modules of schedule "
            f"{schedule.name!r}; use some of {list(schedule.modules)}"
        )
    kept = [info for info in schedule.stages if info.module not in absent]
    if not kept:
        raise ValueError(f"without_modules removes every module of {schedule.name!r}")
    new_id = {info.stage: i for i, info in enumerate(kept)}

    def edge(e: Edge) -> Edge:
        return dataclasses.replace(e, src_stage=new_id[e.src_stage], dst_stage=new_id[e.dst_stage])

    edges = {e: edge(e) for e in schedule.edges if e.src_stage in new_id and e.dst_stage in new_id}

    def action(a: Action) -> Action:
        moved = None if a.edge is None else edges[a.edge]
        return dataclasses.replace(a, stage=new_id[a.stage], edge=moved)

    actions = tuple(
        tuple(action(a) for a in schedule.actions[info.stage] if a.edge is None or a.edge in edges)
        for info in kept
    )
    return dataclasses.replace(
        schedule,
        name=f"{schedule.name} without {', '.join(sorted(absent))}",
        stages=tuple(dataclasses.replace(info, stage=new_id[info.stage]) for info in kept),
        edges=tuple(edges.values()),
        actions=actions,
        max_live=tuple(schedule.max_live[info.stage] for info in kept),
    )
